"""Block (page) allocator: a free list plus a reference count per block.

Both live in uint32 arrays: the refcounts, and a free list of fixed capacity (one slot per block)
of which the first `num_free_blocks` entries are free. Bulk calls run in the C core where it is
built (cache_service/native: a few nanoseconds per id), else through numpy views for long id
lists and Python loops for short ones; all three give the same answers.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable

import numpy as np

from cache_service import native
from cache_service.errors import AllocationError, IntegrityError

# Calls on at least this many blocks go through numpy views of the same arrays (page size 1
# moves hundreds of blocks per call); fewer are cheaper as plain Python loops.
BULK = 128
MAX_REFCOUNT = 2**32 - 1  # refcounts are uint32: one more would wrap a held block to "free"
REFCOUNT_OVERFLOW = "incref: a block's refcount would exceed 2**32 - 1"


class BlockAllocator:
    """Hands out block ids in `[0, num_blocks)`.

    A block is free exactly when its refcount is 0. `allocate` gives each block one reference;
    `incref` adds holders (a request reading a cached page); `free` drops one reference and puts
    the block back on the free list when the last one goes. Freeing a free block raises.
    Allocation is all-or-nothing. Freed blocks are reused first (LIFO), in any order.
    Block ids must be in range (as every id the allocator handed out is).
    `native_core`: run the bulk calls in the C core (None: where it is built; True: it must be).
    """

    def __init__(self, num_blocks: int, native_core: bool | None = None) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ops = native.block_ops() if native_core is None or native_core else None
        if native_core and self._ops is None:
            raise RuntimeError(f"the cache manager's C core is unavailable: {native.unavailable_reason()}")
        # Reversed so that a fresh allocator hands out 0, 1, 2, ... (taken from the end).
        self._free = array("I", range(num_blocks - 1, -1, -1))  # fixed size: never resize (a view)
        self._nfree = num_blocks
        self._refcount = array("I", bytes(4 * num_blocks))
        self._rc = np.frombuffer(self._refcount, dtype=np.uint32)  # a view: never resize _refcount
        self._free_view = np.frombuffer(self._free, dtype=np.uint32)

    @classmethod
    def restore(cls, num_blocks: int, free_list: list[int], refcounts: list[int]) -> BlockAllocator:
        """An allocator with exactly this free list (in order) and these refcounts (snapshots).

        Raises IntegrityError unless the free list holds exactly the blocks with refcount 0.
        """
        allocator = cls(num_blocks)
        if (len(refcounts) != num_blocks or len(free_list) > num_blocks
                or any(not 0 <= b < num_blocks for b in free_list)):
            raise IntegrityError("restored allocator state does not fit num_blocks")
        allocator._free_view[:len(free_list)] = free_list
        allocator._nfree = len(free_list)
        allocator._rc[:] = refcounts  # in place: `_rc` must stay a view of `_refcount`
        allocator.check_integrity()
        return allocator

    @property
    def native_core(self) -> bool:
        """Whether this allocator's bulk calls run in the C core."""
        return self._ops is not None

    @property
    def num_free_blocks(self) -> int:
        return self._nfree

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= self._nfree

    def allocate(self, n: int) -> list[int]:
        """Take `n` free blocks (refcount 1 each). Raises AllocationError when fewer are free."""
        if not self.can_allocate(n):
            raise AllocationError(f"cannot allocate {n} blocks, {self._nfree} free")
        if n == 0:
            return []
        nfree = self._nfree
        if self._ops is not None:
            blocks = self._ops.take(self._refcount, self._free, nfree, n)
            self._nfree = nfree - n
            return blocks
        taken = self._free[nfree - n:nfree]
        self._nfree = nfree - n
        taken.reverse()
        if n >= BULK:
            self._rc[np.frombuffer(taken, dtype=np.uint32)] = 1
            return taken.tolist()
        blocks = taken.tolist()
        refcount = self._refcount
        for b in blocks:
            refcount[b] = 1
        return blocks

    def incref(self, block_ids: Iterable[int]) -> None:
        """Add a reference to blocks that are in use; all or nothing (a free block raises)."""
        if not isinstance(block_ids, list | tuple | array):
            block_ids = list(block_ids)
        if self._ops is not None:
            bad = self._ops.incref(self._refcount, block_ids)
            if bad >= 0:
                raise AllocationError(f"incref of free block {block_ids[bad]}")
            return
        self._check_range(block_ids)
        if len(block_ids) >= BULK:
            idx = np.frombuffer(array("I", block_ids), dtype=np.uint32)
            rc = self._rc[idx]
            if not rc.all():
                raise AllocationError(f"incref of free block {idx[rc == 0][0]}")
            if int(rc.max()) + len(block_ids) > MAX_REFCOUNT:  # rare: only then count the repeats
                distinct, counts = np.unique(idx, return_counts=True)
                if int((self._rc[distinct].astype(np.int64) + counts).max()) > MAX_REFCOUNT:
                    raise OverflowError(REFCOUNT_OVERFLOW)
            ordered = np.sort(idx)
            if (ordered[1:] == ordered[:-1]).any():
                np.add.at(self._rc, idx, 1)  # repeated ids: unbuffered (slower) add
            else:
                self._rc[idx] = rc + 1
            return
        refcount = self._refcount
        for i, b in enumerate(block_ids):
            rc = refcount[b]
            if rc == 0 or rc == MAX_REFCOUNT:
                for done in block_ids[:i]:  # undo: all or nothing
                    refcount[done] -= 1
                if rc:
                    raise OverflowError(REFCOUNT_OVERFLOW)
                raise AllocationError(f"incref of free block {b}")
            refcount[b] = rc + 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference per listed block; blocks reaching 0 return to the free list.

        All or nothing: if any block would be freed more often than it is referenced (a double
        free), AllocationError is raised and no refcount changes.
        """
        blocks = block_ids if isinstance(block_ids, list | tuple) else list(block_ids)
        if self._ops is not None:
            nfree = self._ops.release(self._refcount, self._free, self._nfree, blocks)
            if nfree < 0:
                raise AllocationError(f"double free of block {blocks[-nfree - 1]}")
            self._nfree = nfree
            return
        self._check_range(blocks)
        if len(blocks) >= BULK and self._free_bulk(blocks):
            return
        refcount = self._refcount
        free_list = self._free
        nfree = self._nfree
        for i, b in enumerate(blocks):
            rc = refcount[b]
            if rc == 0:  # freed more often than referenced (repeats included): undo it all
                for done in blocks[:i]:
                    refcount[done] += 1
                raise AllocationError(f"double free of block {b}")
            refcount[b] = rc - 1
            if rc == 1:
                free_list[nfree] = b
                nfree += 1
        self._nfree = nfree

    def _check_range(self, block_ids: list[int] | tuple[int, ...] | array) -> None:
        """IndexError, before anything changes, for an id outside [0, num_blocks) (as the C core)."""
        if block_ids:
            low, high = min(block_ids), max(block_ids)
            if low < 0 or high >= self.num_blocks:
                bad = low if low < 0 else high
                raise IndexError(f"block id {bad} out of range [0, {self.num_blocks})")

    def _free_bulk(self, blocks: list[int]) -> bool:
        """`free` of distinct blocks with numpy; False (nothing done) when some block repeats."""
        idx = np.frombuffer(array("I", blocks), dtype=np.uint32)
        ordered = np.sort(idx)
        if (ordered[1:] == ordered[:-1]).any():
            return False
        rc = self._rc[idx]
        if not rc.all():
            raise AllocationError(f"double free of block {idx[rc == 0][0]}")
        self._rc[idx] = rc - 1
        freed = idx[rc == 1]  # in the order given, as the loop would
        self._free_view[self._nfree:self._nfree + len(freed)] = freed
        self._nfree += len(freed)
        return True

    def refcount(self, block_id: int) -> int:
        return self._refcount[block_id]

    def is_free(self, block_id: int) -> bool:
        return self._refcount[block_id] == 0

    def free_block_ids(self) -> list[int]:
        return self._free[:self._nfree].tolist()

    def check_integrity(self) -> None:
        """Free list has no duplicates and holds exactly the blocks with refcount 0."""
        free = self.free_block_ids()
        free_set = set(free)
        if len(free_set) != len(free):
            raise IntegrityError("a block is on the free list twice")
        for b in range(self.num_blocks):
            if (self._refcount[b] == 0) != (b in free_set):
                raise IntegrityError(f"block {b}: refcount {self._refcount[b]} but free={b in free_set}")
