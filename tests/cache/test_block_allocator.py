"""Block allocator: all-or-nothing allocation, refcounts, double free, reuse. Every test runs
against the C core (cache_service/native) and the Python code, which must give the same answers."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cache_service import block_allocator, native
from cache_service.block_allocator import BULK, BlockAllocator
from cache_service.errors import AllocationError
from tests.native_required import SKIP_PREFIX


@pytest.fixture(autouse=True, params=["c", "python"])
def core(request, monkeypatch) -> str:
    """Which implementation every allocator of the test uses (`restore`'s too)."""
    if request.param == "c":
        if native.block_ops() is None:
            pytest.skip(f"{SKIP_PREFIX}: the cache manager's C core ({native.unavailable_reason()})")
    else:
        monkeypatch.setattr(block_allocator.native, "block_ops", lambda: None)
    return request.param


def test_the_core_asked_for_runs(core) -> None:
    assert BlockAllocator(4).native_core is (core == "c")


def test_allocate_all_or_nothing() -> None:
    alloc = BlockAllocator(4)
    assert alloc.can_allocate(4) and not alloc.can_allocate(5)
    with pytest.raises(AllocationError):
        alloc.allocate(5)
    assert alloc.num_free_blocks == 4  # the failed call took nothing
    blocks = alloc.allocate(3)
    assert sorted(blocks) == [0, 1, 2] and alloc.num_free_blocks == 1
    assert all(alloc.refcount(b) == 1 for b in blocks)
    alloc.check_integrity()


def test_double_free_rejected_and_nothing_applied() -> None:
    alloc = BlockAllocator(4)
    a, b = alloc.allocate(2)
    alloc.free([a])
    with pytest.raises(AllocationError, match="double free"):
        alloc.free([b, a])  # b is valid, a is already free: the whole call is refused
    assert alloc.refcount(b) == 1 and alloc.is_free(a)
    with pytest.raises(AllocationError):
        alloc.free([b, b])  # one reference, freed twice in one call
    assert alloc.refcount(b) == 1
    alloc.check_integrity()


def test_refcount_keeps_shared_block_until_last_holder() -> None:
    alloc = BlockAllocator(2)
    (block,) = alloc.allocate(1)
    alloc.incref([block])
    alloc.free([block])
    assert not alloc.is_free(block) and alloc.num_free_blocks == 1
    alloc.free([block])
    assert alloc.is_free(block) and alloc.num_free_blocks == 2
    with pytest.raises(AllocationError):
        alloc.incref([block])
    alloc.check_integrity()


def test_freed_blocks_are_reused_non_contiguously() -> None:
    alloc = BlockAllocator(6)
    blocks = alloc.allocate(6)
    alloc.free([blocks[1], blocks[4]])
    again = alloc.allocate(2)
    assert sorted(again) == sorted([blocks[1], blocks[4]])  # the holes, not a contiguous run
    assert not alloc.can_allocate(1)
    alloc.check_integrity()


def test_integrity_detects_corruption() -> None:
    alloc = BlockAllocator(3)
    alloc.allocate(1)
    alloc._free[alloc.num_free_blocks] = 2  # block 2 listed free twice
    alloc._nfree += 1
    with pytest.raises(Exception, match="twice"):
        alloc.check_integrity()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["allocate", "incref", "free"]), st.integers(0, 300),
                          st.integers(0, 2**16), st.booleans()), max_size=30))
def test_bulk_calls_agree_with_a_plain_model(ops: list[tuple[str, int, int, bool]]) -> None:
    """Calls on >= BULK blocks take the numpy path: same refcounts, free set and errors as a model."""
    alloc = BlockAllocator(300)
    refs: dict[int, int] = {}
    for kind, n, seed, repeat in ops:
        rng = random.Random(seed)
        if kind == "allocate":
            if n > 300 - len(refs):
                with pytest.raises(AllocationError):
                    alloc.allocate(n)
                continue
            got = alloc.allocate(n)
            assert len(set(got)) == n and not set(got) & set(refs)
            refs.update(dict.fromkeys(got, 1))
        else:
            pick = rng.sample(range(300), min(n, 300))  # may include free blocks
            if repeat and pick:
                pick += pick[: len(pick) // 2]
            if kind == "incref":
                if any(b not in refs for b in pick):
                    with pytest.raises(AllocationError):
                        alloc.incref(pick)
                else:
                    alloc.incref(pick)
                    for b in pick:
                        refs[b] += 1
            else:
                pick = [b for b in pick if b in refs] if seed % 3 else pick
                counts: dict[int, int] = {}
                for b in pick:
                    counts[b] = counts.get(b, 0) + 1
                if any(refs.get(b, 0) < c for b, c in counts.items()):
                    with pytest.raises(AllocationError):
                        alloc.free(pick)
                else:
                    alloc.free(pick)
                    for b, c in counts.items():
                        refs[b] -= c
                        if not refs[b]:
                            del refs[b]
        assert {b: alloc.refcount(b) for b in range(300) if alloc.refcount(b)} == refs
        assert sorted(alloc.free_block_ids()) == [b for b in range(300) if b not in refs]
        alloc.check_integrity()


def test_bulk_free_keeps_the_free_order_of_the_loop() -> None:
    alloc = BlockAllocator(BULK * 2)
    blocks = alloc.allocate(BULK * 2)
    order = blocks[::-1]
    alloc.free(order)
    assert alloc.free_block_ids() == order  # appended in the order given


def test_restored_allocator_bulk_calls_update_the_restored_refcounts() -> None:
    """`restore` (snapshots) must leave the numpy view the bulk paths write through on the
    restored refcounts, or a restored pool's first large allocation corrupts its accounting."""
    live = BlockAllocator(4 * BULK)
    held = live.allocate(10)
    restored = BlockAllocator.restore(4 * BULK, live.free_block_ids(), [live.refcount(b) for b in range(4 * BULK)])
    blocks = restored.allocate(2 * BULK)  # the bulk path
    assert all(restored.refcount(b) == 1 for b in blocks)
    restored.incref(blocks)
    assert all(restored.refcount(b) == 2 for b in blocks)
    restored.free(blocks)
    restored.free(blocks)
    restored.check_integrity()
    assert restored.num_free_blocks == 4 * BULK - len(held)


@pytest.mark.parametrize("many", [False, True])
def test_out_of_range_ids_change_nothing(many: bool) -> None:
    alloc = BlockAllocator(4 * BULK)
    blocks = alloc.allocate(2 * BULK if many else 4)
    free_before = alloc.free_block_ids()
    for call in (alloc.incref, alloc.free):
        for bad in ([*blocks, 4 * BULK], [blocks[0], -1], [blocks[0], 2**32 + blocks[1]]):
            with pytest.raises((IndexError, OverflowError)):
                call(bad)
            assert all(alloc.refcount(b) == 1 for b in blocks) and alloc.free_block_ids() == free_before
            alloc.check_integrity()


def test_a_refused_free_undoes_what_it_freed_before_the_bad_id() -> None:
    alloc = BlockAllocator(3 * BULK)
    blocks = alloc.allocate(2 * BULK)
    free_before = alloc.free_block_ids()
    with pytest.raises(AllocationError, match=f"double free of block {blocks[7]}"):
        alloc.free([*blocks, blocks[7]])  # every block reaches 0, then one of them once more
    assert alloc.free_block_ids() == free_before and all(alloc.refcount(b) == 1 for b in blocks)
    alloc.check_integrity()


@pytest.mark.parametrize("many", [False, True])
def test_a_refcount_never_wraps_to_free(many: bool) -> None:
    alloc = BlockAllocator(4 * BULK)
    blocks = alloc.allocate(2 * BULK if many else 4)
    alloc._refcount[blocks[-1]] = 2**32 - 2  # as if 4 billion holders
    with pytest.raises(OverflowError):
        alloc.incref([*blocks, blocks[-1]])  # the last one would reach 2**32
    assert all(alloc.refcount(b) == 1 for b in blocks[:-1]) and alloc.refcount(blocks[-1]) == 2**32 - 2
    alloc.incref([blocks[-1]])  # up to 2**32 - 1 is fine
    assert alloc.refcount(blocks[-1]) == 2**32 - 1
