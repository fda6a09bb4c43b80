"""create_attention_backend: name and device/dtype/package based selection."""

from __future__ import annotations

import pytest
import torch

import model_service.attention as attention
from model_service.attention import TorchAttentionBackend, create_attention_backend

ARGS = dict(num_q_heads=9, num_kv_heads=3, head_dim=64, block_size=16)


def test_auto_on_cpu_is_torch():
    backend = create_attention_backend("auto", **ARGS, dtype=torch.float32, device=torch.device("cpu"))
    assert isinstance(backend, TorchAttentionBackend)
    assert backend.name == "torch"
    assert (backend.num_q_heads, backend.num_kv_heads, backend.head_dim, backend.block_size) == (9, 3, 64, 16)


def test_torch_by_name_accepts_device_string():
    backend = create_attention_backend("torch", **ARGS, dtype=torch.float32, device="cpu")
    assert isinstance(backend, TorchAttentionBackend)
    assert backend.device == torch.device("cpu")


def test_kernels_choice_reaches_the_torch_backend():
    from model_service import native

    for name in ("auto", "torch"):
        auto = create_attention_backend(name, **ARGS, dtype=torch.float32, device="cpu")
        forced = create_attention_backend(name, **ARGS, dtype=torch.float32, device="cpu", kernels="torch")
        assert auto.native == native.available() and not forced.native
    with pytest.raises(ValueError, match="kernels"):
        create_attention_backend("auto", **ARGS, dtype=torch.float32, device="cpu", kernels="fastest")


def test_flashinfer_on_cpu_raises_value_error():
    with pytest.raises(ValueError, match="CUDA"):
        create_attention_backend("flashinfer", **ARGS, dtype=torch.float16, device=torch.device("cpu"))


def test_unknown_name_raises_value_error():
    with pytest.raises(ValueError, match="unknown attention backend"):
        create_attention_backend("xformers", **ARGS, dtype=torch.float32, device="cpu")


def test_flashinfer_float32_raises_value_error():
    with pytest.raises(ValueError, match="float16/bfloat16"):
        create_attention_backend("flashinfer", **ARGS, dtype=torch.float32, device=torch.device("cuda"))


def test_flashinfer_without_package_raises_value_error(monkeypatch):
    monkeypatch.setattr(attention, "flashinfer_available", lambda: False)
    with pytest.raises(ValueError, match="flashinfer-python"):
        create_attention_backend("flashinfer", **ARGS, dtype=torch.float16, device=torch.device("cuda"))


def test_auto_on_cuda_without_package_falls_back_to_torch(monkeypatch):
    # Constructing the torch backend touches no CUDA memory, so this runs on CPU-only machines.
    monkeypatch.setattr(attention, "flashinfer_available", lambda: False)
    backend = create_attention_backend("auto", **ARGS, dtype=torch.float16, device=torch.device("cuda"))
    assert isinstance(backend, TorchAttentionBackend)


def test_auto_on_cuda_float32_is_torch(monkeypatch):
    monkeypatch.setattr(attention, "flashinfer_available", lambda: True)
    backend = create_attention_backend("auto", **ARGS, dtype=torch.float32, device=torch.device("cuda"))
    assert isinstance(backend, TorchAttentionBackend)
