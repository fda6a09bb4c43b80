"""Paged attention backends: the interface, the torch reference and FlashInfer, and a factory."""

from __future__ import annotations

import torch

from model_service.attention.base import AttentionBackend, BatchLayout
from model_service.attention.torch_backend import KERNEL_MODES, TorchAttentionBackend

BACKEND_NAMES = ("auto", "torch", "flashinfer")

__all__ = ["BACKEND_NAMES", "KERNEL_MODES", "AttentionBackend", "BatchLayout", "TorchAttentionBackend",
           "create_attention_backend", "flashinfer_available"]


def flashinfer_available() -> bool:
    """True when the `flashinfer` package imports (it is only useful with CUDA)."""
    try:
        import flashinfer  # noqa: F401
    except Exception:  # ImportError, or a broken CUDA install raising at import
        return False
    return True


def create_attention_backend(name: str, num_q_heads: int, num_kv_heads: int, head_dim: int,
                             block_size: int, dtype: torch.dtype,
                             device: torch.device | str, *, kernels: str = "auto") -> AttentionBackend:
    """Create the attention backend `name` ("auto", "torch" or "flashinfer").

    "auto" picks flashinfer on a CUDA device when the package imports and the dtype is
    float16/bfloat16 (FlashInfer has no float32 kernels), else torch. Asking for flashinfer
    without CUDA, without the package, or with another dtype raises ValueError. `kernels` is the
    torch backend's (TorchAttentionBackend: "auto" uses model_service/native where it runs).
    """
    from model_service.attention.flashinfer_backend import SUPPORTED_DTYPES, FlashInferAttentionBackend

    device = torch.device(device)
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}")
    args = (num_q_heads, num_kv_heads, head_dim, block_size, dtype, device)
    if kernels not in KERNEL_MODES:
        raise ValueError(f"kernels must be one of {', '.join(KERNEL_MODES)}, got {kernels!r}")
    if name == "torch":
        return TorchAttentionBackend(*args, kernels=kernels)
    flashinfer_ok = device.type == "cuda" and dtype in SUPPORTED_DTYPES and flashinfer_available()
    if name == "auto":
        return FlashInferAttentionBackend(*args) if flashinfer_ok else TorchAttentionBackend(*args, kernels=kernels)
    if device.type != "cuda":
        raise ValueError(f"attention backend 'flashinfer' needs a CUDA device, got {device.type!r}; "
                         "use 'torch' or 'auto'")
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"attention backend 'flashinfer' supports float16/bfloat16, got {dtype}; "
                         "use 'torch' or 'auto'")
    if not flashinfer_ok:
        raise ValueError("attention backend 'flashinfer' needs the 'flashinfer-python' package "
                         "(pip install 'radixkv[gpu]'); use 'torch' or 'auto'")
    return FlashInferAttentionBackend(*args)
