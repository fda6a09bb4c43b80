"""Block allocator: all-or-nothing allocation, refcounts, double free, reuse."""

from __future__ import annotations

import pytest

from cache_service.block_allocator import BlockAllocator
from cache_service.errors import AllocationError


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
    alloc._free.append(2)  # block 2 listed free twice
    with pytest.raises(Exception, match="twice"):
        alloc.check_integrity()
