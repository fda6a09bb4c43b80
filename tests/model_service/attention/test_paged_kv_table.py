"""build_paged_kv_table: FlashInfer's CSR page table from a BatchLayout (runs on CPU)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from model_service.attention.flashinfer_backend import build_paged_kv_table
from model_service.attention.indexing import segments
from tests.model_service.attention.paged_case import make_case


def check_table(seq_lens, query_lens, block_size):
    case = make_case(seq_lens, query_lens, block_size=block_size, num_q_heads=2, num_kv_heads=1, head_dim=4)
    layout = case.layout
    t = build_paged_kv_table(layout, block_size)
    for name, arr in t._asdict().items():
        assert arr.dtype == torch.int32, f"{name} must be int32"
        assert arr.is_contiguous(), name
    batch = len(seq_lens)
    assert t.qo_indptr.tolist() == layout.query_start_loc.tolist()
    assert t.kv_indptr.shape == (batch + 1,) and int(t.kv_indptr[0]) == 0
    pages = (t.kv_indptr[1:] - t.kv_indptr[:-1]).long()
    assert ((t.kv_last_page_len >= 1) & (t.kv_last_page_len <= block_size)).all()
    # Pages and last-page length describe exactly seq_len tokens.
    assert ((pages - 1) * block_size + t.kv_last_page_len).tolist() == list(seq_lens)
    # Each sequence's pages are its block table's first entries, in order.
    for i in range(batch):
        got = t.kv_indices[t.kv_indptr[i]:t.kv_indptr[i + 1]].tolist()
        assert got == layout.block_tables[i, :int(pages[i])].tolist()
    # The append coordinates land every new token in its slot.
    assert t.batch_indices.shape == t.positions.shape == (layout.num_tokens,)
    b = t.batch_indices.long()
    pos = t.positions.long()
    page = t.kv_indices.long()[t.kv_indptr.long()[b] + pos // block_size]
    assert torch.equal(page * block_size + pos % block_size, layout.slot_mapping)
    # ... and they are the last query_len positions of each context, like flashinfer's helper.
    expected = torch.cat([torch.arange(s - q, s) for s, q in zip(seq_lens, query_lens, strict=True)])
    assert torch.equal(pos, expected)


@pytest.mark.parametrize("block_size", [16, 5, 1])
def test_mixed_step(block_size):
    check_table([40, 17, 9, 80, 3, 16, 1], [1, 12, 1, 7, 3, 1, 1], block_size)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(seqs=st.lists(st.tuples(st.integers(0, 70), st.integers(1, 20)), min_size=1, max_size=6),
       block_size=st.sampled_from([1, 2, 5, 16]))
def test_random_steps(seqs, block_size):
    check_table([p + q for p, q in seqs], [q for _, q in seqs], block_size)


def test_rejects_too_narrow_block_table():
    case = make_case([40], [40], block_size=16, num_q_heads=2, num_kv_heads=1, head_dim=4)
    case.layout.block_tables = case.layout.block_tables[:, :2]
    with pytest.raises(ValueError, match="blocks"):
        build_paged_kv_table(case.layout, 16)


def test_segments_matches_repeat_interleave():
    lengths = torch.tensor([3, 0, 2, 1, 0, 4])
    seg, offset = segments(lengths)
    assert torch.equal(seg, torch.repeat_interleave(torch.arange(6), lengths))
    assert offset.tolist() == [0, 1, 2, 0, 1, 0, 0, 1, 2, 3]
    empty_seg, empty_off = segments(torch.zeros(0, dtype=torch.long))
    assert empty_seg.numel() == empty_off.numel() == 0
