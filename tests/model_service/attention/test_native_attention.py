"""radixkv's native AVX-512 attention kernel (model_service/native) against a float64 reference.

Skipped only on CPUs without AVX-512; on one with it, a missing or broken build fails here
(`make install` builds the library).
"""

from __future__ import annotations

import contextlib
import math
import shutil
import subprocess

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from model_service import native
from model_service.attention.torch_backend import TorchAttentionBackend
from tests.model_service.attention.paged_case import make_case, reference_attention

pytestmark = pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX512", "AMX"),
                                reason="native kernels: this CPU has no AVX-512")


def test_library_is_built_and_loads():
    assert native.unavailable_reason() is None
    native.has_bf16_dot_products()  # answers either way


@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs objdump (binutils)")
def test_kernels_prefetch_the_next_keys():
    """The decode and cascade key loops ask for the next keys ahead, and the blocked linear's
    micro-kernels for the weights ahead (GCC once dropped every _mm_prefetch from the key loops
    without a word; cold K/V then took ~1.6x as long)."""
    from model_service.native.build import library_path

    listing = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(library_path())],
                             capture_output=True, text=True, check=True).stdout
    kernels = ("rows_over_keys", "small_over_keys", "5micro")
    prefetching = {kernel for function in listing.split("\n\n") if "prefetcht" in function  # into L1 or L2
                   for kernel in kernels if kernel in function.split(">:", 1)[0]}  # mangled names
    assert prefetching == set(kernels)


def test_bf16_dot_product_switch_restores_the_setting():
    with native.without_bf16_dot_products():
        assert not torch.ops.radixkv.set_bf16_dot_products(False)
    assert torch.ops.radixkv.set_bf16_dot_products(True)  # back on after the block


def reference(q, k, v, kv_lens, offsets, scale):
    """Dense float64 softmax attention with per-sequence key limits (and causal offsets)."""
    b, hq, m, _ = q.shape
    r = hq // k.shape[1]
    kk, vv = k.double().repeat_interleave(r, 1), v.double().repeat_interleave(r, 1)
    scores = torch.einsum("bhmd,bhld->bhml", q.double(), kk) * scale
    limit = kv_lens[:, None].expand(b, m)
    if offsets is not None:
        limit = torch.minimum(limit, offsets[:, None] + torch.arange(m)[None, :] + 1)
    visible = torch.arange(k.shape[2])[None, None, :] < limit[:, :, None]  # [B, M, L]
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    return torch.einsum("bhml,bhld->bhmd", torch.softmax(scores, -1), vv), torch.logsumexp(scores, -1)


def layout(t: torch.Tensor, strided: bool) -> torch.Tensor:
    """t [B, H, L, D] as is, or as a strided view of a [B, L, H, D] buffer (how gathered blocks look)."""
    return t.transpose(1, 2).contiguous().transpose(1, 2) if strided else t


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    batch=st.integers(1, 4),
    heads=st.sampled_from([(9, 3), (4, 4), (8, 1), (6, 2), (3, 3)]),
    head_dim=st.sampled_from([16, 32, 64, 128]),
    num_queries=st.integers(1, 70),
    num_keys=st.integers(1, 200),
    causal=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    strided=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_matches_float64_reference(batch, heads, head_dim, num_queries, num_keys, causal, dtype, strided, seed):
    """Any batch, GQA/MHA/MQA, head size, query rows (1..70: 1 to 4 row vectors per work item),
    keys (1..200: several chunks of 64), ragged lengths, causal offsets, strided K/V."""
    gen = torch.Generator().manual_seed(seed)
    hq, hkv = heads
    q = torch.randn(batch, hq, num_queries, head_dim, generator=gen).to(dtype)
    k = layout(torch.randn(batch, hkv, num_keys, head_dim, generator=gen).to(dtype), strided)
    v = layout(torch.randn(batch, hkv, num_keys, head_dim, generator=gen).to(dtype), strided)
    kv_lens = torch.randint(1, num_keys + 1, (batch,), generator=gen)
    kv_lens[0] = num_keys
    offsets = None
    if causal:  # the queries are the last ones of the visible keys, or earlier (a padded query block)
        offsets = (kv_lens - num_queries + torch.randint(-3, 1, (batch,), generator=gen)).clamp(min=0)
    scale = 1.0 / math.sqrt(head_dim)
    ref_out, ref_lse = reference(q, k, v, kv_lens, offsets, scale)
    # bfloat16: AMX tiles (16+ queries) and AVX512-BF16 dot products where the CPU has them, the
    # dot products alone, and the float32-FMA path always
    paths = [contextlib.nullcontext()]
    if dtype == torch.bfloat16:
        paths += [native.without_attention_tiles(), native.without_bf16_dot_products()]
    for path in paths:
        with path:
            out, lse = native.attend(q, k, v, kv_lens, offsets, scale)
        assert out.shape == q.shape and out.dtype == dtype and out.is_contiguous()
        assert lse.shape == q.shape[:3] and lse.dtype == torch.float32
        torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)
        if dtype == torch.float32:
            torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=2e-6)
        else:  # float32 sums (P rounded to bfloat16 before P.V, as torch does), the result rounded once:
            # P's rounding moves a result by up to 2^-9 of the largest |V| (about 4 here), P.V's order
            # decides which way a probability rounds, so the kernels may differ by that much
            torch.testing.assert_close(out.double(), ref_out, rtol=2 ** -7, atol=2 ** -7)


def test_keys_past_the_lengths_are_never_read():
    """K/V past kv_lens (stale slots) may hold NaN: masked keys must not enter any product."""
    k, v = torch.randn(3, 3, 150, 64), torch.randn(3, 3, 150, 64)
    kv_lens = torch.tensor([150, 70, 1])
    for b, n in enumerate(kv_lens.tolist()):
        k[b, :, n:] = float("nan")
        v[b, :, n:] = float("nan")
    # 1 query x 3 heads: keys in the lanes (decode items); 5 x 3: query rows in the lanes.
    for q, offsets in ((torch.randn(3, 9, 1, 64), None), (torch.randn(3, 9, 5, 64), None),
                       (torch.randn(3, 9, 5, 64), (kv_lens - 5).clamp(min=0))):
        out, lse = native.attend(q, k, v, kv_lens, offsets, 0.125)
        assert not out.isnan().any() and not lse.isnan().any()
        ref_out, _ = reference(q, k.nan_to_num(), v.nan_to_num(), kv_lens, offsets, 0.125)
        torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=2e-6)


def test_lse_merges_two_key_sets_exactly():
    """The cascade's use: attention over keys [0, 100) from the parts [0, 60) and [60, 100)."""
    q, k, v = torch.randn(2, 3, 24, 64), torch.randn(2, 3, 100, 64), torch.randn(2, 3, 100, 64)
    whole, _ = native.attend(q, k, v, torch.tensor([100, 100]), None, 0.125)
    o1, l1 = native.attend(q, k[:, :, :60], v[:, :, :60], torch.tensor([60, 60]), None, 0.125)
    o2, l2 = native.attend(q, k[:, :, 60:], v[:, :, 60:], torch.tensor([40, 40]), None, 0.125)
    w = torch.sigmoid(l1 - l2).unsqueeze(-1)
    torch.testing.assert_close(o2 + w * (o1 - o2), whole, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("bad, message", [
    (dict(kv_lens=torch.tensor([0, 5])), "kv_lens"),
    (dict(kv_lens=torch.tensor([5, 11])), "kv_lens"),
    (dict(kv_lens=torch.tensor([5, 5], dtype=torch.int32)), "kv_lens"),
    (dict(offsets=torch.tensor([-1, 0])), "causal_offsets"),
    (dict(k=torch.randn(3, 2, 10, 32), v=torch.randn(3, 2, 10, 32)), "k must be"),
    (dict(q=torch.randn(2, 3, 4, 32).bfloat16()), "dtypes differ"),
    (dict(q=torch.randn(2, 4, 4, 8), k=torch.randn(2, 2, 10, 8), v=torch.randn(2, 2, 10, 8)), "head_dim"),
    (dict(q=torch.randn(2, 3, 4, 32)), "multiple of KV heads"),
    (dict(v=torch.randn(2, 2, 9, 32)), "shapes differ"),
])
def test_bad_arguments_raise_clear_errors(bad, message):
    args = dict(q=torch.randn(2, 4, 4, 32), k=torch.randn(2, 2, 10, 32), v=torch.randn(2, 2, 10, 32),
                kv_lens=torch.tensor([10, 3]), offsets=None)
    args.update(bad)
    with pytest.raises(RuntimeError, match=message):
        native.attend(args["q"], args["k"], args["v"], args["kv_lens"], args["offsets"], 0.1)


def on_one_and_two_threads(call):
    """call() on torch's threads set to 1, then to 2 (restored after): both results."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = call()
        torch.set_num_threads(2)
        return one, call()
    finally:
        torch.set_num_threads(threads)


def test_uses_every_thread_and_gives_the_same_result():
    q, k, v = torch.randn(1, 9, 300, 64), torch.randn(1, 3, 300, 64), torch.randn(1, 3, 300, 64)
    lens, offsets = torch.tensor([300]), torch.tensor([0])
    (one, _), (two, _) = on_one_and_two_threads(lambda: native.attend(q, k, v, lens, offsets, 0.125))
    assert torch.equal(one, two)  # work items are independent: no cross-thread reduction


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backend_takes_the_native_kernels_where_planned(dtype):
    """kernels="auto" attends extends and cascades natively (float32 single prompts keep torch's
    bitwise call); the result is the dense reference either way."""
    assert TorchAttentionBackend(9, 3, 64, 16, dtype, torch.device("cpu")).native
    assert not TorchAttentionBackend(9, 3, 64, 16, dtype, torch.device("cpu"), kernels="torch").native
    assert not TorchAttentionBackend(9, 3, 64, 16, torch.float16, torch.device("cpu")).native
    with pytest.raises(ValueError, match="kernels"):
        TorchAttentionBackend(9, 3, 64, 16, dtype, torch.device("cpu"), kernels="fast")
    case = make_case([200, 50, 260, 70], [200, 1, 140, 17], block_size=16, num_q_heads=9, num_kv_heads=3,
                     head_dim=64, seed=4, dtype=dtype)
    outs = {}
    for kernels in ("auto", "torch"):
        backend = TorchAttentionBackend(9, 3, 64, 16, dtype, torch.device("cpu"), kernels=kernels)
        k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
        backend.plan(case.layout)
        outs[kernels] = backend.forward(case.q, case.k, case.v, k_cache, v_cache, 0.125)
    tol = dict(rtol=1e-5, atol=2e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    ref = reference_attention(case, 0.125)
    for out in outs.values():
        torch.testing.assert_close(out.double(), ref, **tol)
    if dtype == torch.float32:  # the single prompt (no cached prefix) is torch's call in both
        rows = slice(0, 200)
        assert torch.equal(outs["auto"][rows], outs["torch"][rows])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(9, 3), (8, 1), (4, 4)])
@pytest.mark.parametrize("d", [64, 128, 32])  # 64 and 128: decode_keys.h; others the generic loop
def test_paged_decode_reads_the_cache_in_place_exactly_as_a_gather(dtype, heads, d):
    """attend_paged over shuffled blocks and unaligned starts = attend over the gathered copy, bit for bit."""
    hq, hkv = heads
    gen = torch.Generator().manual_seed(hq)
    num_blocks, bs, batch = 40, 16, 6
    k_cache = torch.randn(num_blocks, bs, hkv, d, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, bs, hkv, d, generator=gen).to(dtype)
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:9] for _ in range(batch)])
    starts = torch.tensor([0, 16, 32, 5, 0, 100])
    lens = torch.tensor([144, 40, 1, 100, 77, 3])
    q = torch.randn(batch, hq, 1, d, generator=gen).to(dtype)
    out, lse = native.attend_paged(q, k_cache, v_cache, tables, starts, lens, 0.125)
    keys = torch.zeros(batch, hkv, int(lens.max()), d, dtype=dtype)
    values = torch.zeros_like(keys)
    for b in range(batch):
        for j in range(int(lens[b])):
            token = int(starts[b]) + j
            keys[b, :, j] = k_cache[tables[b, token // bs], token % bs]
            values[b, :, j] = v_cache[tables[b, token // bs], token % bs]
    want_out, want_lse = native.attend(q, keys, values, lens, None, 0.125)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    ref_out, _ = reference(q, keys, values, lens, None, 0.125)
    tol = dict(rtol=1e-5, atol=2e-6) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=2 ** -8)
    torch.testing.assert_close(out.double(), ref_out, **tol)


def test_paged_decode_refuses_blocks_outside_the_cache():
    k_cache = v_cache = torch.randn(8, 16, 2, 32)
    q = torch.randn(2, 4, 1, 32)
    tables, starts, lens = torch.tensor([[0, 1], [2, 3]]), torch.tensor([0, 3]), torch.tensor([20, 5])
    native.attend_paged(q, k_cache, v_cache, tables, starts, lens, 0.1)  # fine
    for bad_tables, bad_lens, message in ((torch.tensor([[0, 8], [2, 3]]), lens, "block 8"),
                                          (torch.tensor([[0, -1], [2, 3]]), lens, "block -1"),
                                          (tables, torch.tensor([33, 5]), "block column 2"),
                                          (tables, torch.tensor([0, 5]), "kv_lens")):
        with pytest.raises(RuntimeError, match=message):
            native.attend_paged(q, k_cache, v_cache, bad_tables, starts, bad_lens, 0.1)
    with pytest.raises(RuntimeError, match="at most 8"):
        native.attend_paged(torch.randn(2, 4, 5, 32), k_cache, v_cache, tables, starts, lens, 0.1)
