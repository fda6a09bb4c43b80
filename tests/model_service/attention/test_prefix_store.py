"""Cascade prefixes kept across decode steps (PrefixKVStore): same results as gathering them
every step, and never a stale copy after the prefix blocks change."""

from __future__ import annotations

import dataclasses
import math

import torch

from model_service.attention.base import BatchLayout
from model_service.attention.prefix_store import PrefixKVStore
from tests.model_service.attention.paged_case import PagedCase, reference_attention
from tests.model_service.attention.test_cascade import (
    SMOLLM2,
    backend_for,
    check_against_reference,
    shared_case,
)

BS = 4
SCALE = 1.0 / math.sqrt(SMOLLM2["head_dim"])
# Two groups (3 and 2 shared blocks) and an unshared sequence; every context has room in its
# last block for three more tokens (the steps below decode up to three).
GROUPS = [(3, [3 * BS + 1, 3 * BS + 5]), (2, [2 * BS + 1, 2 * BS + 5, 2 * BS + 9])]
UNSHARED = [6 * BS + 1]


def next_step(case: PagedCase, gen: torch.Generator) -> PagedCase:
    """The decode step after `case` (one new token per sequence, in the same last block)."""
    hq, hkv, d = case.q.shape[1], case.k.shape[1], case.k.shape[2]
    seq_lens = [s + 1 for s in case.seq_lens]
    tables = case.layout.block_tables.long()
    pos = torch.tensor(case.seq_lens)  # [n] the new token's position
    slots = tables[torch.arange(len(seq_lens)), pos // BS] * BS + pos % BS
    n = len(seq_lens)
    q, k, v = (torch.randn(n, h, d, generator=gen).to(case.q.dtype) for h in (hq, hkv, hkv))
    layout = BatchLayout(
        query_start_loc=torch.arange(n + 1, dtype=torch.int32), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=case.layout.block_tables, slot_mapping=slots, max_query_len=1, max_seq_len=max(seq_lens),
        query_lens_cpu=[1] * n, seq_lens_cpu=seq_lens)
    return dataclasses.replace(
        case, layout=layout, q=q, k=k, v=v, query_lens=[1] * n, seq_lens=seq_lens,
        full_k=[torch.cat([f, k[i:i + 1]]) for i, f in enumerate(case.full_k)],
        full_v=[torch.cat([f, v[i:i + 1]]) for i, f in enumerate(case.full_v)])


def decode_steps(num_steps: int, *, store_bytes: int, overwrite_at: int | None = None, seed: int = 0,
                 dtype: torch.dtype = torch.float32, backend=None):
    """Runs `num_steps` decode steps over one cache with one backend (default: a float32 one with
    this store budget); returns the outputs and the backend. `overwrite_at`: before that step, a
    shared prefix block is overwritten in place (what a reused block would hold)."""
    case = shared_case(GROUPS, block_size=BS, unshared=UNSHARED, seed=seed, dtype=dtype)
    for s in case.seq_lens:
        assert s % BS + num_steps <= BS, "the steps must stay within each sequence's last block"
    if backend is None:
        backend = backend_for(SMOLLM2, BS, cascade="always", prefix_store_bytes=store_bytes)
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    gen = torch.Generator().manual_seed(seed + 100)
    outs = []
    for step in range(num_steps):
        if step == overwrite_at:
            shared_block = int(case.layout.block_tables[_member_of_group(case, 0), 0])
            new_k = torch.randn(BS, *k_cache.shape[2:], generator=gen).to(dtype)
            k_cache[shared_block] = new_k
            for i in _members(case, shared_block):  # the members' contexts change with it
                case.full_k[i][:BS] = new_k
        backend.plan(case.layout)
        out = backend.forward(case.q, case.k, case.v, k_cache, v_cache, SCALE)
        if dtype == torch.float32:
            check_against_reference(case, out, SCALE)
        else:
            torch.testing.assert_close(out.double(), reference_attention(case, SCALE), rtol=2 ** -7, atol=2 ** -7)
        outs.append(out)
        case = next_step(case, gen)
    return outs, backend


def _members(case: PagedCase, block: int) -> list[int]:
    return [i for i in range(len(case.seq_lens)) if int(case.layout.block_tables[i, 0]) == block]


def _member_of_group(case: PagedCase, group_index: int) -> int:
    # The first sequence whose first block is shared with another one.
    firsts = case.layout.block_tables[:, 0].tolist()
    shared = [i for i, b in enumerate(firsts) if firsts.count(b) > 1]
    return shared[group_index]


def test_kept_prefixes_give_the_same_bits_as_gathering_every_step():
    kept, backend = decode_steps(3, store_bytes=1 << 30)
    gathered, plain = decode_steps(3, store_bytes=0)
    for a, b in zip(kept, gathered, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert backend.prefix_store.misses == 1 and backend.prefix_store.hits == 2  # one layer, 3 steps
    assert plain.prefix_store.hits == 0 and plain.prefix_store.num_bytes == 0


def test_a_prefix_block_written_in_place_is_gathered_again():
    """The cache written outside the backend (the version counter moves): the copy is dropped."""
    _, backend = decode_steps(3, store_bytes=1 << 30, overwrite_at=1)  # reference checked per step
    assert backend.prefix_store.misses == 2 and backend.prefix_store.hits == 1


def test_a_step_writing_into_a_prefix_block_drops_the_copies():
    store = PrefixKVStore()
    k_cache, v_cache = torch.zeros(8, BS, 1, 2), torch.zeros(8, BS, 1, 2)
    key, blocks = ((2,), (5, 3)), torch.tensor([5, 3])
    store.begin_step(key, blocks, torch.tensor([0, 1]), BS)
    k, v = store.allocate(k_cache, v_cache, (1, 1, 2 * BS, 2))
    store.keep(k_cache, v_cache, k, v)
    store.begin_step(key, blocks, torch.tensor([4 * BS + 1]), BS)  # block 4: not a prefix block
    assert store.lookup(k_cache, v_cache) is not None
    store.begin_step(key, blocks, torch.tensor([3 * BS + 2]), BS)  # block 3 is
    assert store.lookup(k_cache, v_cache) is None and store.num_bytes == 0
    store.keep(k_cache, v_cache, k, v)
    store.begin_step(((2,), (5, 4)), torch.tensor([5, 4]), torch.tensor([0]), BS)  # other prefixes
    assert store.lookup(k_cache, v_cache) is None and store.num_bytes == 0


def test_the_byte_bound_is_kept():
    store = PrefixKVStore(max_bytes=2 * 16 * 4)  # room for one [2, 1, 4, 2] float32 K and V pair
    caches = [(torch.zeros(8, BS, 1, 2), torch.zeros(8, BS, 1, 2)) for _ in range(2)]
    store.begin_step(((1,), (1,)), torch.tensor([1]), torch.tensor([0]), BS)
    first = store.allocate(*caches[0], (2, 1, 4, 2))
    assert first is not None
    store.keep(*caches[0], *first)
    assert store.allocate(*caches[1], (2, 1, 4, 2)) is None
    assert store.num_bytes == store.max_bytes


def test_inference_mode_caches_are_not_kept():
    """Their writes cannot be tracked, so nothing is kept; results are still right."""
    case = shared_case(GROUPS, block_size=BS, unshared=UNSHARED)
    backend = backend_for(SMOLLM2, BS, cascade="always")
    with torch.inference_mode():
        k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
        for _ in range(2):
            backend.plan(case.layout)
            out = backend.forward(case.q, case.k, case.v, k_cache, v_cache, SCALE)
    check_against_reference(case, out, SCALE)
    assert backend.prefix_store.hits == 0 and backend.prefix_store.num_bytes == 0


def test_layers_keep_their_own_copies():
    """Each layer's cache has its own copy; a step later every layer is served from it."""
    case = shared_case(GROUPS, block_size=BS, unshared=UNSHARED)
    backend = backend_for(SMOLLM2, BS, cascade="always")
    layers, gen = 3, torch.Generator().manual_seed(7)
    caches = [(torch.randn(case.k_cache.shape, generator=gen), torch.randn(case.v_cache.shape, generator=gen))
              for _ in range(layers)]
    for k_cache, v_cache in caches:  # each layer's cache holds the case's prefixes
        k_cache.copy_(case.k_cache)
        v_cache.copy_(case.v_cache)
    for _ in range(2):
        backend.plan(case.layout)
        outs = [backend.forward(case.q, case.k, case.v, k, v, SCALE) for k, v in caches]
        for out in outs:
            torch.testing.assert_close(out.double(), reference_attention(case, SCALE), rtol=1e-5, atol=2e-6)
    assert backend.prefix_store.misses == layers and backend.prefix_store.hits == layers
