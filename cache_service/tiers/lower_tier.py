"""One lower tier (host or disk) of a pool: its slot allocator and the tree of the prefixes whose
pages it holds.

A tier holds whole prefixes, as the device tree does: a page is in the tier's tree only with
every page before it, so a tier hit is a prefix of the prompt and needs no other tier. The tree
is a RadixTree whose "blocks" are slot ids (one page each); its LRU leaves leave the tier first.
Slots are in one of three places: free, owned by the tree (the page is held: its copy completed),
or pending (reserved for a copy ordered but not reported complete yet):
`free + tree + pending == num_slots`.
"""

from __future__ import annotations

from dataclasses import dataclass

from cache_service.block_allocator import BlockAllocator
from cache_service.errors import IntegrityError
from cache_service.radix_tree import EvictedNode, RadixTree, TreeNode
from cache_service.schema import TierStats
from common.token_bytes import TOKEN_BYTES

TIER_DEVICE = 0
TIER_HOST = 1
TIER_DISK = 2
TIER_NAMES = {TIER_DEVICE: "device", TIER_HOST: "host", TIER_DISK: "disk"}


@dataclass(slots=True)
class TierCounters:
    """What Stats and metrics report of a tier (cache.proto TierStats)."""

    hit_tokens: int = 0  # first-admission prompt tokens ordered loaded from the tier
    num_loaded_pages: int = 0
    num_offloaded_pages: int = 0  # copies into the tier reported complete
    num_failed_pages: int = 0  # copies into or out of the tier reported failed
    num_evicted_pages: int = 0  # pages that left the tier (to the next one, or gone)


class LowerTier:
    """Slots + prefix tree of one tier. Not thread-safe (the pool's thread only)."""

    def __init__(self, tier: int, num_slots: int, page_size: int) -> None:
        self.tier = tier
        self.name = TIER_NAMES[tier]
        self.num_slots = num_slots
        self.allocator = BlockAllocator(num_slots)
        self.tree = RadixTree(page_size)
        self.num_pending = 0
        self.counters = TierCounters()

    def peek_pages(self, key: bytes, namespace: str) -> int:
        """Leading whole pages of `key` (encoded tokens) the tier holds: read-only."""
        return self.tree.peek_key(key, namespace) // self.tree.page_size

    def reserve(self, n: int, keep: TreeNode | None) -> tuple[list[int], list[EvictedNode]]:
        """Up to `n` slots for copies into the tier (pending until `commit`/`release`), evicting its
        least recently used unlocked pages when short. `keep`: a node whose path must stay (the
        prefix the copies extend). Returns the slots and the evicted nodes (their slots are free)."""
        self.tree.inc_lock_ref(keep)
        try:
            short = n - self.allocator.num_free_blocks
            evicted: list[EvictedNode] = []
            if short > 0:
                evicted = self.tree.evict(min(short, self.tree.evictable_size))
                self._let_go(evicted)
        finally:
            self.tree.dec_lock_ref(keep)
        slots = self.allocator.allocate(min(n, self.allocator.num_free_blocks))
        self.num_pending += len(slots)
        return slots, evicted

    def release(self, slots: list[int]) -> None:
        """Pending slots whose copy failed or is no longer wanted go back to the free list."""
        if slots:
            self.allocator.free(slots)
            self.num_pending -= len(slots)

    def commit(self, key: bytes, first_page: int, slots: list[int], namespace: str) -> TreeNode | None:
        """Pending `slots` now hold pages [first_page, first_page + len(slots)) of `key`: insert them.

        Their prefix [0, first_page) must still be held (else every slot is released: a page
        without its prefix is unreachable); pages some other copy put there first are released
        as duplicates. Returns the new leaf, if any (for events)."""
        ps = self.tree.page_size
        end = first_page + len(slots)
        if not slots:
            return None
        if self.peek_pages(key[: first_page * ps * TOKEN_BYTES], namespace) < first_page:
            self.release(slots)
            return None
        result = self.tree.insert(key[: end * ps * TOKEN_BYTES], [0] * first_page + slots, namespace)
        existing = result.num_existing_pages
        self.num_pending -= len(slots)
        if existing > first_page:  # duplicates: their slots are not the tree's
            self.allocator.free(slots[: existing - first_page])
        return result.new_node

    def drop_from(self, key: bytes, page: int, namespace: str) -> list[EvictedNode]:
        """Page `page` of `key` and every page held after it leave the tier (found bad by a load);
        returns the removed nodes (nothing when they are locked or already gone)."""
        page_bytes = self.tree.page_size * TOKEN_BYTES
        match = self.tree.match_prefix(key[: page * page_bytes], namespace)  # splits there
        if match.last_node is None or match.num_tokens != page * self.tree.page_size:
            return []
        child = match.last_node.children.get(key[page * page_bytes : (page + 1) * page_bytes])
        removed = self.tree.remove_subtree(child) if child is not None else []
        self._let_go(removed)
        return removed

    def _let_go(self, nodes: list[EvictedNode]) -> None:
        """Nodes out of the tree: their slots are free again."""
        slots = [s for node in nodes for s in node.block_ids]
        self.allocator.free(slots)
        self.counters.num_evicted_pages += len(slots)

    def stats(self) -> TierStats:
        c = self.counters
        return TierStats(self.num_slots, self.tree.total_size, self.num_pending, c.hit_tokens, c.num_loaded_pages,
                         c.num_offloaded_pages, c.num_failed_pages, c.num_evicted_pages)

    def check_integrity(self) -> None:
        """free + tree + pending == num_slots, and the tree and allocator agree."""
        self.allocator.check_integrity()
        owned = self.tree.check_integrity()
        free = set(self.allocator.free_block_ids())
        if free & set(owned):
            raise IntegrityError(f"{self.name} tier: a slot is both free and held")
        if len(free) + len(owned) + self.num_pending != self.num_slots:
            raise IntegrityError(f"{self.name} tier: free {len(free)} + held {len(owned)} + pending "
                                 f"{self.num_pending} != {self.num_slots}")
