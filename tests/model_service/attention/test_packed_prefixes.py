"""bf16 cascade prefixes kept packed for the AMX tiles, prefix by prefix (PackedPrefixes): the
same bits as packing every step, kept while groups come and go, never stale after a write.
Skipped where attention does not run on AMX tiles."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from model_service import native
from model_service.attention.base import BatchLayout
from model_service.attention.packed_prefixes import PackedPrefixes
from model_service.attention.torch_backend import TorchAttentionBackend
from tests.model_service.attention.paged_case import PagedCase, reference_attention
from tests.model_service.attention.test_cascade import SMOLLM2, shared_case
from tests.model_service.attention.test_prefix_store import BS, GROUPS, UNSHARED, decode_steps

SCALE = 1.0 / math.sqrt(SMOLLM2["head_dim"])
HKV, D = SMOLLM2["num_kv_heads"], SMOLLM2["head_dim"]


@pytest.fixture(autouse=True)
def tiles() -> None:
    if not native.available() or not native.cascade_on_tiles(D):
        pytest.skip("native attention tiles: no AMX here (or the library is not built)")


def _backend(store_bytes: int = 1 << 30) -> TorchAttentionBackend:
    return TorchAttentionBackend(SMOLLM2["num_q_heads"], HKV, D, BS, torch.bfloat16, torch.device("cpu"),
                                 cascade="always", prefix_store_bytes=store_bytes)


def test_kept_prefixes_give_the_same_bits_as_packing_every_step():
    kept, backend = decode_steps(3, store_bytes=1 << 30, dtype=torch.bfloat16, backend=_backend())
    packed_each_step, plain = decode_steps(3, store_bytes=0, dtype=torch.bfloat16, backend=_backend(0))
    for a, b in zip(kept, packed_each_step, strict=True):
        assert torch.equal(a, b)
    store = backend.packed_prefixes
    assert store.misses == len(GROUPS) and store.hits == 2 * len(GROUPS)  # one layer, 3 steps
    assert plain.packed_prefixes.hits == 0 and plain.packed_prefixes.num_bytes == 0
    assert backend.prefix_store.num_bytes == 0  # the K/V store is not used beside it


def test_a_prefix_block_written_in_place_is_packed_again():
    _, backend = decode_steps(3, store_bytes=1 << 30, overwrite_at=1, dtype=torch.bfloat16, backend=_backend())
    store = backend.packed_prefixes
    # Step 1 overwrote a block of group 0's prefix outside the backend: the layer's copies go.
    assert store.misses == 2 * len(GROUPS) and store.hits == len(GROUPS)


def _decode_subset(case: PagedCase, keep: list[int]) -> PagedCase:
    """The same decode step (one new token per sequence) for the sequences `keep` only."""
    idx = torch.tensor(keep)
    seq_lens = [case.seq_lens[i] for i in keep]
    layout = BatchLayout(
        query_start_loc=torch.arange(len(keep) + 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=case.layout.block_tables[idx],
        slot_mapping=case.layout.slot_mapping[idx], max_query_len=1, max_seq_len=max(seq_lens),
        query_lens_cpu=[1] * len(keep), seq_lens_cpu=seq_lens)
    return dataclasses.replace(case, layout=layout, q=case.q[idx], k=case.k[idx], v=case.v[idx],
                               full_k=[case.full_k[i] for i in keep], full_v=[case.full_v[i] for i in keep],
                               query_lens=[1] * len(keep), seq_lens=seq_lens)


def test_a_group_keeps_its_prefix_when_the_other_groups_change():
    """The step's groups change (a group's members leave, then come back): the prefixes that
    stay are not packed again (the K/V store, keyed by the step's whole set, regathers them)."""
    case = shared_case(GROUPS, block_size=BS, unshared=UNSHARED, seed=1, dtype=torch.bfloat16)
    firsts = case.layout.block_tables[:, 0].tolist()
    shared = sorted({b for b in firsts if firsts.count(b) > 1})
    one_group = [i for i, b in enumerate(firsts) if b == shared[0] or firsts.count(b) == 1]
    backend = _backend()
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    for step in (case, _decode_subset(case, one_group), case):
        backend.plan(step.layout)
        out = backend.forward(step.q, step.k, step.v, k_cache, v_cache, SCALE)
        torch.testing.assert_close(out.double(), reference_attention(step, SCALE), rtol=2 ** -7, atol=2 ** -7)
    store = backend.packed_prefixes
    assert len(shared) == len(GROUPS)
    assert store.misses == len(GROUPS) and store.hits == 1 + len(GROUPS)


def _packed(store: PackedPrefixes, caches, prefixes, length: int = 2 * BS):
    """store.tiles for `prefixes` of `length` tokens each, gathering random K/V for the missing."""
    def gather(missing):
        return tuple(torch.randn(len(missing), HKV, length, D).bfloat16() for _ in range(2))
    store.before_write(*caches)
    store.after_write(*caches)
    return store.tiles(*caches, prefixes, torch.full((len(prefixes),), length), gather)


def _caches():
    return torch.zeros(16, BS, HKV, D, dtype=torch.bfloat16), torch.zeros(16, BS, HKV, D, dtype=torch.bfloat16)


def test_a_step_writing_a_kept_prefix_block_drops_it_even_when_not_read():
    store, caches = PackedPrefixes(BS), _caches()
    store.begin_step(torch.tensor([0]))
    _packed(store, caches, [(5, 3), (7, 8)])
    assert store.num_bytes > 0 and store.misses == 2
    store.begin_step(torch.tensor([4 * BS + 1]))  # block 4: in no prefix
    _packed(store, caches, [(5, 3)])
    assert store.hits == 1
    store.begin_step(torch.tensor([8 * BS + 2]))  # block 8: (7, 8), not read in this step
    _packed(store, caches, [(7, 8)])
    assert store.misses == 3 and store.hits == 1


def test_writes_by_anything_else_drop_the_layers_copies():
    store, caches = PackedPrefixes(BS), _caches()
    store.begin_step(torch.tensor([0]))
    _packed(store, caches, [(5, 3)])
    caches[0][9].fill_(1.0)  # another writer: the version counter moves
    store.begin_step(torch.tensor([0]))
    _packed(store, caches, [(5, 3)])
    assert store.misses == 2 and store.hits == 0


def test_the_byte_bound_drops_the_prefixes_read_longest_ago():
    caches = _caches()
    one = PackedPrefixes(BS)
    one.begin_step(torch.tensor([0]))
    size = _packed(one, caches, [(1,)])[0].numel() * 4
    store = PackedPrefixes(BS, max_bytes=2 * size)
    store.begin_step(torch.tensor([0]))
    _packed(store, caches, [(1,), (2,)])
    store.begin_step(torch.tensor([0]))
    _packed(store, caches, [(2,)])  # (1,) is now the one read longest ago
    store.begin_step(torch.tensor([0]))
    _packed(store, caches, [(3,)])
    assert store.num_bytes == 2 * size
    store.begin_step(torch.tensor([0]))
    _packed(store, caches, [(2,), (3,)])
    assert store.hits == 3 and store.misses == 3  # (1,) went, (2,) and (3,) stayed
    store.begin_step(torch.tensor([0]))
    _packed(store, caches, [(2,), (3,), (4,)])  # no room without dropping one this step reads
    assert store.num_bytes == 2 * size and store.misses == 4


def test_inference_mode_caches_keep_nothing():
    store = PackedPrefixes(BS)
    with torch.inference_mode():
        caches = _caches()
        store.begin_step(torch.tensor([0]))
        tiles = _packed(store, caches, [(5, 3)])
    assert len(tiles) == 1 and store.num_bytes == 0


def test_chunks_after_a_cached_prefix_attend_over_it_packed_and_share_it_with_the_cascade():
    """A mixed bf16 step: a decode group, a chunk after exactly that group's prefix (packed once
    for both), a chunk after a prefix of its own, and chunks that keep the gathered path (a fresh
    prompt, a prefix under PACKED_EXTEND_MIN_BLOCKS blocks, one that ends inside a block); every
    token is dense attention within bf16 rounding, and again a step later from the kept copies."""
    from model_service.attention.torch_backend import PACKED_EXTEND_MIN_BLOCKS
    from tests.model_service.attention.paged_case import make_case

    bs = 16
    big, small = PACKED_EXTEND_MIN_BLOCKS + 1, PACKED_EXTEND_MIN_BLOCKS
    seqs = [  # (seq_len, query_len, group)
        (big * bs + 3, 1, 0), (big * bs + 9, 1, 0), (big * bs + 20, 20, 0),
        (small * bs + 7, 7, 1),
        (30, 30, -1), ((small - 2) * bs + 8, 8, -1), (small * bs + 10, 5, -1), (50, 1, -1)]
    case = make_case([s for s, _, _ in seqs], [q for _, q, _ in seqs], block_size=bs, dtype=torch.bfloat16,
                     group_of=[g for _, _, g in seqs], shared_blocks=[big, small], seed=3, **SMOLLM2)
    backend = TorchAttentionBackend(SMOLLM2["num_q_heads"], HKV, D, bs, torch.bfloat16, torch.device("cpu"),
                                    cascade="always")
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    for _ in range(2):
        backend.plan(case.layout)
        assert backend._packed_extends is not None and len(backend._packed_extends.prefix_blocks) == 2
        out = backend.forward(case.q, case.k, case.v, k_cache, v_cache, SCALE)
        torch.testing.assert_close(out.double(), reference_attention(case, SCALE), rtol=2 ** -7, atol=2 ** -7)
    store = backend.packed_prefixes
    assert store.misses == 2 and store.hits == 1 + 3  # step 1: group 0's prefix packed once for both
    with native.without_attention_tiles():  # the gathered paths: the same answer
        backend.plan(case.layout)
        assert backend._packed_extends is None
        out = backend.forward(case.q, case.k, case.v, k_cache, v_cache, SCALE)
    torch.testing.assert_close(out.double(), reference_attention(case, SCALE), rtol=2 ** -7, atol=2 ** -7)


def test_a_prefix_asked_twice_in_a_step_is_packed_once_and_counted_once():
    """Two cache hits of one prefix in a step: one packing, one copy in the budget, and the
    budget back to nothing once the copy is dropped (no bytes counted that nothing holds)."""
    store, caches = PackedPrefixes(BS), _caches()
    store.begin_step(torch.tensor([0]))
    first, second = _packed(store, caches, [(5, 3), (5, 3)])
    assert first is second and store.misses == 1 and store.hits == 1
    assert store.num_bytes == first.numel() * first.element_size() == first.untyped_storage().nbytes()
    store.begin_step(torch.tensor([3 * BS]))  # block 3 written: the copy goes
    assert store.num_bytes == 0
