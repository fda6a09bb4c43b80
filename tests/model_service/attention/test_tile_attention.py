"""The AMX tile path of radixkv's native attention (tile_attention.cpp): bfloat16 calls with 16 or
more queries per head, against a float64 reference and against the row kernels.

Runs where the CPU has AMX (and the library was built with it); skipped elsewhere, where
test_native_attention.py covers the row kernels that take these calls instead.
"""

from __future__ import annotations

import math

import pytest
import torch

from model_service import native
from tests.model_service.attention.test_native_attention import layout, on_one_and_two_threads, reference

pytestmark = pytest.mark.skipif(not native.available() or native.attention_tiles_min_queries(64) is None,
                                reason="native attention tiles: no AMX here (or the library is not built)")

# bfloat16 inputs, float32 sums, P rounded to bfloat16 before P.V (up to 2^-9 of the largest |V|,
# about 4 here), the result rounded once.
BF16_TOLERANCE = dict(rtol=2 ** -7, atol=2 ** -7)


def _inputs(batch, hq, hkv, queries, keys, head_dim, seed, strided=False):
    gen = torch.Generator().manual_seed(seed)
    q = layout(torch.randn(batch, hq, queries, head_dim, generator=gen).bfloat16(), strided)
    k = layout(torch.randn(batch, hkv, keys, head_dim, generator=gen).bfloat16(), strided)
    v = layout(torch.randn(batch, hkv, keys, head_dim, generator=gen).bfloat16(), strided)
    return q, k, v


def test_tiles_take_bf16_calls_of_16_queries_and_head_dims_of_32():
    least = native.attention_tiles_min_queries(64)
    assert least == 16
    assert native.attention_tiles_min_queries(128) == 16 and native.attention_tiles_min_queries(256) == 16
    assert native.attention_tiles_min_queries(48) is None and native.attention_tiles_min_queries(80) is None
    with native.without_attention_tiles():
        assert native.attention_tiles_min_queries(64) is None
    assert native.attention_tiles_min_queries(64) == 16  # back on after the block


@pytest.mark.parametrize("length", [16, 17, 63, 64, 65, 130, 300, 513])
@pytest.mark.parametrize("heads", [(9, 3), (4, 4), (8, 1)])
def test_fresh_causal_prompts_match_the_reference(length, heads):
    """A prompt attending its own keys: blocks of 64 keys cut anywhere by the causal edge, the r
    query heads of a KV head folded into rows (a 16-row tile can span two heads)."""
    hq, hkv = heads
    q, k, v = _inputs(1, hq, hkv, length, length, 64, seed=length)
    lens, offsets = torch.tensor([length]), torch.tensor([0])
    out, lse = native.attend(q, k, v, lens, offsets, 0.125)
    ref_out, ref_lse = reference(q, k, v, lens, offsets, 0.125)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.double(), ref_out, **BF16_TOLERANCE)
    with native.without_attention_tiles():
        rows, _ = native.attend(q, k, v, lens, offsets, 0.125)
    torch.testing.assert_close(out.double(), rows.double(), **BF16_TOLERANCE)


@pytest.mark.parametrize("head_dim", [32, 64, 128, 256])
@pytest.mark.parametrize("causal", [True, False])
def test_chunks_after_cached_prefixes_match_the_reference(head_dim, causal):
    """Several sequences of unequal context (padding past each one's keys holds NaN), strided
    K/V as gathered blocks lay them out, queries at each sequence's end or not causal at all."""
    batch, queries, keys = 3, 40, 200
    q, k, v = _inputs(batch, 6, 2, queries, keys, head_dim, seed=head_dim, strided=True)
    lens = torch.tensor([200, 77, 41])
    for b, n in enumerate(lens.tolist()):
        k[b, :, n:] = float("nan")
        v[b, :, n:] = float("nan")
    offsets = (lens - queries).clamp(min=0) if causal else None
    out, lse = native.attend(q, k, v, lens, offsets, 1 / math.sqrt(head_dim))
    assert not out.isnan().any() and not lse.isnan().any()
    ref_out, ref_lse = reference(q, k.nan_to_num(), v.nan_to_num(), lens, offsets, 1 / math.sqrt(head_dim))
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.double(), ref_out, **BF16_TOLERANCE)


def test_head_dims_the_tiles_do_not_take_stay_on_the_row_kernels():
    q, k, v = _inputs(2, 4, 2, 32, 90, 48, seed=3)
    lens, offsets = torch.tensor([90, 60]), torch.tensor([58, 28])
    out, _ = native.attend(q, k, v, lens, offsets, 48 ** -0.5)
    with native.without_attention_tiles():
        rows, _ = native.attend(q, k, v, lens, offsets, 48 ** -0.5)
    assert torch.equal(out, rows)


def test_tiles_differ_from_the_row_kernels_only_in_rounding():
    """The tiles are what runs (their sums are in another order than the row kernels')."""
    q, k, v = _inputs(1, 9, 3, 256, 256, 64, seed=4)
    lens, offsets = torch.tensor([256]), torch.tensor([0])
    tiles, _ = native.attend(q, k, v, lens, offsets, 0.125)
    with native.without_attention_tiles():
        rows, _ = native.attend(q, k, v, lens, offsets, 0.125)
    assert not torch.equal(tiles, rows)
    torch.testing.assert_close(tiles.double(), rows.double(), **BF16_TOLERANCE)


def test_every_thread_count_gives_the_same_bits():
    q, k, v = _inputs(2, 9, 3, 100, 400, 64, seed=5)
    lens, offsets = torch.tensor([400, 250]), torch.tensor([300, 150])
    (one, lse_one), (two, lse_two) = on_one_and_two_threads(lambda: native.attend(q, k, v, lens, offsets, 0.125))
    assert torch.equal(one, two) and torch.equal(lse_one, lse_two)  # items are independent


def test_a_larger_call_after_a_smaller_one_reuses_nothing_stale():
    """The packed K/V buffer is kept per thread and grown: a later call must see only its own keys."""
    small = _inputs(1, 9, 3, 20, 50, 64, seed=6)
    large = _inputs(2, 9, 3, 64, 700, 64, seed=7)
    for q, k, v in (small, large, small):
        lens = torch.full((q.shape[0],), k.shape[2])
        offsets = lens - q.shape[2]
        out, _ = native.attend(q, k, v, lens, offsets, 0.125)
        ref_out, _ = reference(q, k, v, lens, offsets, 0.125)
        torch.testing.assert_close(out.double(), ref_out, **BF16_TOLERANCE)
