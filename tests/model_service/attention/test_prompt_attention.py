"""The native prompt-attention kernel: bitwise torch's causal SDPA call on every length it takes,
the length rule, its start-up probe, its argument checks and where the torch backend uses it."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
import torch.nn.functional as F

from model_service.attention.torch_backend import TorchAttentionBackend
from model_service.native import prompt_attention as pa
from model_service.native import registry
from tests.model_service.attention.paged_case import make_case
from tests.native_required import needs_library, skip_unless_native

needs_native = needs_library()  # (whether the kernel matches torch here is its probe, per shape: below)


def _prompt(length: int, hq: int, hkv: int, d: int, seed: int) -> tuple[torch.Tensor, ...]:
    """q [1, Hq, T, D], k, v [1, Hkv, T, D]: the transposed views of [T, H, D] rows the backend passes."""
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(length, h, d, generator=g).transpose(0, 1).unsqueeze(0) for h in (hq, hkv, hkv))


def _torch_call(q, k, v, scale):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def _bitwise_here(hq: int, hkv: int, d: int, scale: float) -> bool:
    return registry.active("prompt_attention", num_q_heads=hq, num_kv_heads=hkv, head_dim=d, scale=scale)


def test_length_rule():
    """Lengths torch's split would give MKL a product of < 4 query rows or < 12 keys keep torch's call."""
    assert not any(pa.takes_length(t) for t in range(1, 12))
    assert all(pa.takes_length(t) for t in range(12, 33))
    for bad in (33, 34, 35, 65, 193, 195, 257, 769, 771, 513, 1025, 1035, 1537):
        assert not pa.takes_length(bad), bad
    for good in (36, 64, 96, 196, 256, 512, 524, 772, 1024, 1036, 1056, 2048):
        assert pa.takes_length(good), good
    assert [pa.torch_query_split(t) for t in (100, 192, 767, 768)] == [32, 64, 64, 256]


@needs_native
@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 4, 128), (8, 2, 32), (6, 1, 192)])
def test_bitwise_torch_on_every_length_it_takes(heads):
    """Every length 12..140 and boundaries of torch's blocks up to 2100: the kernel's output equals
    torch's call bit for bit (where the start-up probe passes on this machine's MKL)."""
    hq, hkv, d = heads
    scale = d ** -0.5
    skip_unless_native("prompt_attention", num_q_heads=hq, num_kv_heads=hkv, head_dim=d, scale=scale)
    rng = random.Random(hash(heads) & 0xFFFF)
    edges = [e + o for e in (192, 256, 512, 768, 1024, 1536, 2048) for o in (-1, 0, 4, 12, 40)]
    lengths = [t for t in list(range(12, 141)) + edges + rng.sample(range(141, 2100), 12) if pa.takes_length(t)]
    if d != 64:
        lengths = lengths[::4]
    for length in lengths:
        q, k, v = _prompt(length, hq, hkv, d, seed=length)
        assert torch.equal(pa.prompt_attention(q, k, v, scale), _torch_call(q, k, v, scale)), length


@needs_native
def test_output_layout_and_thread_independence():
    q, k, v = _prompt(300, 9, 3, 64, seed=1)
    out = pa.prompt_attention(q, k, v, 0.125)
    assert out.shape == (1, 9, 300, 64) and out.transpose(1, 2).is_contiguous()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = pa.prompt_attention(q, k, v, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, out)  # rows are independent work items


@needs_native
def test_probe_is_cached_and_true_where_the_kernel_matches(monkeypatch: pytest.MonkeyPatch):
    expected = all(torch.equal(pa.prompt_attention(*_prompt(t, 9, 3, 64, seed=t), 0.125),
                               _torch_call(*_prompt(t, 9, 3, 64, seed=t), 0.125))
                   for t in pa.PROBE_LENGTHS if pa.takes_length(t))
    registry.clear_cache()
    assert _bitwise_here(9, 3, 64, 0.125) == expected
    assert registry.cache_key("prompt_attention", num_q_heads=9, num_kv_heads=3, head_dim=64,
                              scale=0.125) in registry._read_disk()  # probed once, then kept on disk
    calls = []
    monkeypatch.setitem(registry.KERNELS, "prompt_attention", dataclasses.replace(
        registry.KERNELS["prompt_attention"], probe=lambda **shape: calls.append(shape)))
    assert _bitwise_here(9, 3, 64, 0.125) == expected and not calls  # not per prompt
    registry._answers.clear()
    registry._memory.clear()
    assert _bitwise_here(9, 3, 64, 0.125) == expected and not calls  # a new process: from the file


@needs_native
@pytest.mark.parametrize("bad, message", [
    (lambda q, k, v: (q.double(), k.double(), v.double()), "float32"),
    (lambda q, k, v: (q, k[:, :, :-1], v[:, :, :-1]), "k must be"),
    (lambda q, k, v: (q, k, v[:, :2]), "shapes differ"),
    (lambda q, k, v: (q[..., :48].contiguous()[..., ::2], k, v), "contiguous"),
    (lambda q, k, v: (q[:, :8], k, v), "multiple of KV heads"),
    (lambda q, k, v: (torch.cat([q, q], 0), k, v), r"\[1, heads"),
])
def test_bad_arguments_raise_clear_errors(bad, message):
    q, k, v = _prompt(40, 9, 3, 64, seed=2)
    with pytest.raises(RuntimeError, match=message):
        pa.prompt_attention(*bad(q, k, v), 0.125)


@needs_native
def test_head_dim_limit():
    q, k, v = _prompt(40, 2, 2, 208, seed=3)
    with pytest.raises(RuntimeError, match="at most 192"):
        pa.prompt_attention(q, k, v, 0.1)
    assert not pa.supports(torch.float32, 2, 2, 208, torch.device("cpu"))
    assert not pa.supports(torch.bfloat16, 9, 3, 64, torch.device("cpu"))


@needs_native
@pytest.mark.parametrize("length", [300, 33])
def test_backend_fresh_prompt_is_torch_call_either_way(length):
    """A fresh float32 prompt through the backend: the prompt kernel where it takes the length
    (300), torch's call where not (33); both bitwise the torch-kernels backend."""
    backend = TorchAttentionBackend(9, 3, 64, 16, torch.float32, torch.device("cpu"))
    assert backend.prompt_kernel
    assert not TorchAttentionBackend(9, 3, 64, 16, torch.float32, torch.device("cpu"), kernels="torch").prompt_kernel
    assert backend._prompt_kernel_for(length, 0.125) == (pa.takes_length(length) and _bitwise_here(9, 3, 64, 0.125))
    case = make_case([length], [length], block_size=16, num_q_heads=9, num_kv_heads=3, head_dim=64, seed=5)
    outs = []
    for kernels in ("auto", "torch"):
        b = TorchAttentionBackend(9, 3, 64, 16, torch.float32, torch.device("cpu"), kernels=kernels)
        b.plan(case.layout)
        outs.append(b.forward(case.q, case.k, case.v, case.k_cache.clone(), case.v_cache.clone(), 0.125))
    assert torch.equal(outs[0], outs[1])
