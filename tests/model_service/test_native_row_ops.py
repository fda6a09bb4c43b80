"""The native row kernels against torch: argmax_rows (greedy sampling), write_kv (a step's K/V
into the paged caches), add_rms_norm (a residual add and LlamaRMSNorm, in torch's order) and rope."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from model_service import native
from model_service.decoder_forward import _rms_norm, torch_rope
from model_service.native import registry
from model_service.sampler import _argmax
from tests.native_required import needs_library

pytestmark = needs_library()  # each test checks its kernel against torch bit for bit

SPECIALS = (math.nan, math.inf, -math.inf, 0.0, -0.0, 1.0, 1.0)


@settings(max_examples=200, deadline=None)
@given(rows=st.integers(1, 9), n=st.integers(1, 200), pad=st.integers(0, 17), specials=st.integers(0, 6),
       levels=st.sampled_from([3, 1000]), seed=st.integers(0, 2**31 - 1))
def test_argmax_rows_is_torchs_argmax(rows, n, pad, specials, levels, seed):
    g = torch.Generator().manual_seed(seed)
    # Few distinct values force ties (the first index must win); rows are strided when pad > 0.
    x = torch.randint(-levels, levels, (rows, n + pad), generator=g).float()[:, :n]
    for _ in range(specials):
        r, i = torch.randint(rows, (1,), generator=g).item(), torch.randint(n, (1,), generator=g).item()
        x[r, i] = SPECIALS[torch.randint(len(SPECIALS), (1,), generator=g).item()]
    assert torch.equal(native.argmax_rows(x), x.argmax(dim=-1))


def test_argmax_rows_on_logits_sized_rows_and_the_sampler_uses_it():
    x = torch.randn(32, 49152, generator=torch.Generator().manual_seed(0))
    x[3, 100] = x[3, 40000] = x[3].max() + 1  # a tie: the first wins
    x[5] = -math.inf
    x[7, 123] = math.nan
    expected = x.argmax(dim=-1)
    assert torch.equal(native.argmax_rows(x), expected)
    assert torch.equal(_argmax(x), expected)
    assert torch.equal(_argmax(x.bfloat16()), x.bfloat16().argmax(dim=-1))


@pytest.mark.parametrize("bad, message", [
    (torch.zeros(3, 4, dtype=torch.float64), "float32"),
    (torch.zeros(12), "2-D"),
    (torch.zeros(4, 3).t(), "contiguous last dimension"),
    (torch.zeros(3, 0), "empty row"),
])
def test_argmax_rows_refuses_bad_input(bad, message):
    with pytest.raises(RuntimeError, match=message):
        native.argmax_rows(bad)


def _cases(dtype: torch.dtype, tokens: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    num_blocks, bs, hkv, d, hq = 9, 4, 3, 16, 6
    caches = [torch.randn(num_blocks, bs, hkv, d, generator=g).to(dtype) for _ in range(2)]
    qkv = torch.randn(tokens, hq + 2 * hkv, d, generator=g).to(dtype)  # the model's layout: k, v are views
    k, v = qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
    slots = torch.randperm(num_blocks * bs, generator=g)[:tokens]
    return caches, k, v, slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 7, 36])
def test_write_kv_is_index_copy(dtype, tokens):
    (k_cache, v_cache), k, v, slots = _cases(dtype, tokens, seed=tokens)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want_k.view(-1, 3, 16).index_copy_(0, slots, k)
    want_v.view(-1, 3, 16).index_copy_(0, slots, v)
    assert native.takes_kv_rows(k) and native.takes_kv_rows(v)
    native.write_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def test_write_kv_checks_every_slot_before_writing():
    (k_cache, v_cache), k, v, slots = _cases(torch.float32, 5, seed=1)
    before = k_cache.clone(), v_cache.clone()
    slots[-1] = 9 * 4  # one past the last slot
    with pytest.raises(RuntimeError, match="outside the cache"):
        native.write_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


@pytest.mark.parametrize("change, message", [
    (lambda k, v, kc, vc, s: (k, v.bfloat16(), kc, vc, s), "one dtype"),
    (lambda k, v, kc, vc, s: (k.transpose(1, 2), v.transpose(1, 2), kc, vc, s), "heads of"),
    (lambda k, v, kc, vc, s: (k, v, kc, vc, s.int()), "int64"),
    (lambda k, v, kc, vc, s: (k, v, kc, vc, s[:-1]), "int64"),
    (lambda k, v, kc, vc, s: (k, v, kc[:, :2], vc[:, :2], s), "contiguous"),
])
def test_write_kv_refuses_bad_input(change, message):
    (k_cache, v_cache), k, v, slots = _cases(torch.float32, 5, seed=2)
    with pytest.raises(RuntimeError, match=message):
        native.write_kv(*change(k, v, k_cache, v_cache, slots))


@settings(max_examples=150, deadline=None)
@given(rows=st.integers(0, 40), hidden=st.integers(1, 3000), residual=st.booleans(),
       scale=st.sampled_from([1e-20, 1e-3, 1.0, 30.0, 1e20]), eps=st.sampled_from([1e-5, 1e-6, 0.0]),
       seed=st.integers(0, 2**31 - 1), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_add_rms_norm_is_torchs_ops(rows, hidden, residual, scale, eps, seed, dtype):
    """Bit for bit `y += residual` and decoder_forward._rms_norm (LlamaRMSNorm's ops), in float32
    and bfloat16, over hidden sizes that take every branch of torch's sum order (scalar rows under
    8, cascade levels from 512, tails), and magnitudes that underflow or overflow the squares."""
    g = torch.Generator().manual_seed(seed)
    y = (torch.randn(rows, hidden, generator=g) * scale).to(dtype)  # [rows, hidden]
    res = (torch.randn(rows, hidden, generator=g) * scale).to(dtype) if residual else None
    weight = torch.randn(hidden, generator=g).to(dtype)
    want_sum = y + res if residual else y.clone()
    want = _rms_norm(want_sum.clone(), weight, eps)
    got = native.add_rms_norm(y, res, weight, eps)
    assert torch.equal(y, want_sum)
    assert torch.equal(got, want) or torch.equal(got.isnan(), want.isnan()) and torch.equal(
        got.nan_to_num(), want.nan_to_num())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_on_a_decode_and_a_prompt_of_the_bundled_size(dtype):
    g = torch.Generator().manual_seed(3)
    for rows in (1, 32, 1056):
        y, res = torch.randn(rows, 576, generator=g).to(dtype), torch.randn(rows, 576, generator=g).to(dtype)
        weight = torch.randn(576, generator=g).to(dtype)
        assert torch.equal(native.add_rms_norm(y.clone(), res, weight, 1e-5), _rms_norm(y + res, weight, 1e-5))
    shape = {} if dtype == torch.float32 else {"dtype": "bfloat16"}
    assert registry.active("rms_norm", hidden_size=576, eps=1e-5, **shape)


@pytest.mark.parametrize("change, message", [
    (lambda y, r, w: (y.double(), r, w), "float32 or bfloat16"),
    (lambda y, r, w: (y.bfloat16(), r, w), "one dtype"),
    (lambda y, r, w: (y.bfloat16(), r, w.bfloat16()), "residual"),
    (lambda y, r, w: (y.t(), r, w), "contiguous"),
    (lambda y, r, w: (y, r, w[:-1]), "weight"),
    (lambda y, r, w: (y, r[:, :-1].contiguous(), w), "residual"),
    (lambda y, r, w: (y[0], r, w), "contiguous"),
])
def test_add_rms_norm_refuses_bad_input(change, message):
    y, r, w = change(torch.randn(4, 8), torch.randn(4, 8), torch.randn(8))
    with pytest.raises(RuntimeError, match=message):
        native.add_rms_norm(y, r, w, 1e-5)


def _torch_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """decoder_forward's torch ops for RoPE (x [T, H, D], tables [T, D]), written out here."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return (x * cos.unsqueeze(1)).add_(swapped.mul_(signed_sin.unsqueeze(1)))


def test_decoder_forwards_torch_rope_is_those_ops_and_the_probe_passes():
    g = torch.Generator().manual_seed(5)
    x, cos, signed_sin = torch.randn(7, 5, 64, generator=g), torch.randn(7, 64, generator=g), torch.randn(7, 64, generator=g)
    assert torch.equal(torch_rope(x, cos, signed_sin), _torch_rope(x, cos, signed_sin))
    assert registry.active("rope", head_dim=64)


@settings(max_examples=120, deadline=None)
@given(tokens=st.integers(0, 40), heads=st.integers(1, 12), half=st.integers(1, 80), extra_heads=st.integers(0, 3),
       seed=st.integers(0, 2**31 - 1), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_rope_is_torchs_ops(tokens, heads, half, extra_heads, seed, dtype):
    """Bit for bit, in float32 and bfloat16, on a strided slice of a fused q/k/v-like tensor, for
    head_dims that take the vector path (half a multiple of 16) and the scalar one."""
    g = torch.Generator().manual_seed(seed)
    d = 2 * half
    fused = (torch.randn(tokens, heads + extra_heads, d, generator=g) * 10).to(dtype)  # [T, H + extra, D]
    x = fused[:, :heads]
    angles = torch.rand(tokens, half, generator=g) * 100
    cos = torch.cat((angles.cos(), angles.cos()), dim=-1).to(dtype)
    sin = torch.cat((angles.sin(), angles.sin()), dim=-1).to(dtype)
    signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
    got = native.rope(x, cos, signed_sin)
    assert got.is_contiguous() and torch.equal(got, _torch_rope(x, cos, signed_sin))


def test_rope_on_the_bundled_head_dim():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(32, 15, 64, generator=g)[:, :12]  # q and k heads of a fused q/k/v product
    cos, signed_sin = torch.randn(32, 64, generator=g), torch.randn(32, 64, generator=g)
    assert torch.equal(native.rope(x, cos, signed_sin), _torch_rope(x, cos, signed_sin))


@pytest.mark.parametrize("change, message", [
    (lambda x, c, s: (x.double(), c, s), "float32 or bfloat16"),
    (lambda x, c, s: (x.bfloat16(), c, s), "one dtype"),
    (lambda x, c, s: (x.transpose(1, 2), c, s), "contiguous last"),
    (lambda x, c, s: (x[..., :7], c[:, :7].contiguous(), s[:, :7].contiguous()), "even"),
    (lambda x, c, s: (x, c[:-1], s), "cos and signed_sin"),
    (lambda x, c, s: (x, c, s.t().contiguous().t()), "cos and signed_sin"),
])
def test_rope_refuses_bad_input(change, message):
    x, c, s = change(torch.randn(4, 3, 8), torch.randn(4, 8), torch.randn(4, 8))
    with pytest.raises(RuntimeError, match=message):
        native.rope(x, c, s)


def _torch_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """decoder_forward's torch ops for SwiGLU's activation, written out here."""
    return F.silu(gate).mul_(up)


@settings(max_examples=120, deadline=None)
@given(rows=st.integers(0, 24), n=st.integers(1, 200), scale=st.sampled_from([0.01, 1.0, 8.0, 100.0]),
       seed=st.integers(0, 2**31 - 1), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_silu_mul_is_torchs_ops(rows, n, scale, seed, dtype):
    """Bit for bit F.silu(gate).mul_(up), in float32 and bfloat16, on the two halves of a fused
    gate/up product (strided rows), for row lengths with and without a tail past torch's vectors,
    and magnitudes where exp under- or overflows."""
    g = torch.Generator().manual_seed(seed)
    fused = (torch.randn(rows, 2 * n, generator=g) * scale).to(dtype)  # [rows, 2n]
    gate, up = fused.chunk(2, dim=-1)
    got = native.silu_mul(gate, up)
    assert got.is_contiguous() and torch.equal(got, _torch_silu_mul(gate, up))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_on_the_bundled_size_and_the_probe_passes(dtype):
    g = torch.Generator().manual_seed(7)
    for rows in (1, 16, 512):
        gate, up = (torch.randn(rows, 3072, generator=g) * 4).to(dtype).chunk(2, dim=-1)
        assert torch.equal(native.silu_mul(gate, up), _torch_silu_mul(gate, up))
    shape = {} if dtype == torch.float32 else {"dtype": "bfloat16"}
    assert registry.active("silu_mul", intermediate_size=1536, **shape)


@pytest.mark.parametrize("change, message", [
    (lambda g, u: (g.double(), u.double()), "float32 or bfloat16"),
    (lambda g, u: (g, u.bfloat16()), "one dtype"),
    (lambda g, u: (g.t(), u.t()), "contiguous rows"),
    (lambda g, u: (g[:, :-1], u), "one shape"),
    (lambda g, u: (g[0], u[0]), "rows"),
])
def test_silu_mul_refuses_bad_input(change, message):
    gate, up = torch.randn(4, 16).chunk(2, dim=-1)
    with pytest.raises(RuntimeError, match=message):
        native.silu_mul(*change(gate, up))
