"""Block (page) allocator: a free list plus a reference count per block."""

from __future__ import annotations

from array import array
from collections.abc import Iterable

from cache_service.errors import AllocationError, IntegrityError


class BlockAllocator:
    """Hands out block ids in `[0, num_blocks)`.

    A block is free exactly when its refcount is 0. `allocate` gives each block one reference;
    `incref` adds holders (a request reading a cached page); `free` drops one reference and puts
    the block back on the free list when the last one goes. Freeing a free block raises.
    Allocation is all-or-nothing. Freed blocks are reused first (LIFO), in any order.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        # Reversed so that a fresh allocator hands out 0, 1, 2, ... (pop from the end).
        self._free = array("I", range(num_blocks - 1, -1, -1))
        self._refcount = array("I", bytes(4 * num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take `n` free blocks (refcount 1 each). Raises AllocationError when fewer are free."""
        if not self.can_allocate(n):
            raise AllocationError(f"cannot allocate {n} blocks, {len(self._free)} free")
        if n == 0:
            return []
        blocks = self._free[-n:].tolist()
        del self._free[-n:]
        blocks.reverse()
        refcount = self._refcount
        for b in blocks:
            refcount[b] = 1
        return blocks

    def incref(self, block_ids: Iterable[int]) -> None:
        """Add a reference to blocks that are in use."""
        refcount = self._refcount
        for b in block_ids:
            if refcount[b] == 0:
                raise AllocationError(f"incref of free block {b}")
            refcount[b] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference per listed block; blocks reaching 0 return to the free list.

        All or nothing: if any block would be freed more often than it is referenced (a double
        free), AllocationError is raised and no refcount changes.
        """
        blocks = list(block_ids)
        refcount = self._refcount
        if len(set(blocks)) == len(blocks):
            for b in blocks:
                if refcount[b] == 0:
                    raise AllocationError(f"double free of block {b}")
        else:
            counts: dict[int, int] = {}
            for b in blocks:
                counts[b] = counts.get(b, 0) + 1
            for b, c in counts.items():
                if refcount[b] < c:
                    raise AllocationError(f"double free of block {b}")
        free_list = self._free
        for b in blocks:
            rc = refcount[b] - 1
            refcount[b] = rc
            if rc == 0:
                free_list.append(b)

    def refcount(self, block_id: int) -> int:
        return self._refcount[block_id]

    def is_free(self, block_id: int) -> bool:
        return self._refcount[block_id] == 0

    def free_block_ids(self) -> list[int]:
        return self._free.tolist()

    def check_integrity(self) -> None:
        """Free list has no duplicates and holds exactly the blocks with refcount 0."""
        free = self._free.tolist()
        free_set = set(free)
        if len(free_set) != len(free):
            raise IntegrityError("a block is on the free list twice")
        for b in range(self.num_blocks):
            if (self._refcount[b] == 0) != (b in free_set):
                raise IntegrityError(f"block {b}: refcount {self._refcount[b]} but free={b in free_set}")
