"""The registry's page index: for the pools of each model and page size, which pool holds which
pages on device and which it was promised by Route (cache_service/page_index.py).

Route and the miss breakdown read a prompt's holders here in one walk of its page hash chain,
instead of walking every pool's tree. Each pool joins when the registry takes it in (its pages so
far are added) and leaves when it is retired.

Each group also keeps its pools in the order of their load (load_order.py), the ones that may
lower a Route's prefill term other than by device and promised pages (`special`: lower tiers,
peer pulls), and the deadlines of their routed prompts in one heap, so that Route ends the
promises whose time is up without a look at every pool.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from typing import NamedTuple

from cache_service.errors import IntegrityError
from cache_service.load_order import LoadOrder
from cache_service.page_index import PageHolder, PageIndex
from cache_service.pool import Pool


class PoolBits(NamedTuple):
    device: PageHolder  # the pool's tree
    routed: PageHolder  # prompts routed to the pool and not cached there yet


class HeldPages(NamedTuple):
    """Leading pages of one prompt per pool id (pools with none are left out)."""

    device: dict[str, int]
    routed: dict[str, int]


class ModelPages:
    """The pools of one model fingerprint and page size, and their page index."""

    def __init__(self, model_fingerprint: str, page_size: int) -> None:
        self.model_fingerprint = model_fingerprint
        self.page_size = page_size
        self.index = PageIndex()
        self.pools: dict[str, Pool] = {}
        self._bits: dict[str, PoolBits] = {}
        self._owners: dict[int, tuple[str, bool]] = {}  # bit -> (pool id, device?)
        self.device_bits = 0  # the bits of every pool's tree
        # The most and the fewest blocks a pool of the group has (lease running or not): bounds on
        # what a Route may carry, kept as pools join and leave (routing.check_route_size is exact).
        self.max_blocks = 0
        self.min_blocks = 0
        self.order = LoadOrder()
        self.special: set[str] = set()  # pools with lower tiers or peer pulls (`note_special`)
        self._deadlines: list[tuple[float, str]] = []  # lazy: (time, pool id) of routed deadlines

    def join(self, pool: Pool) -> None:
        """Take `pool` in with the pages it holds now (again: nothing; a pool of the same id that
        was not retired first leaves)."""
        old = self.pools.get(pool.pool_id)
        if old is pool:
            return
        if old is not None:
            self.leave(old)
        bits = PoolBits(self.index.holder(), self.index.holder())
        self._bits[pool.pool_id] = bits
        self._owners[bits.device.bit] = (pool.pool_id, True)
        self._owners[bits.routed.bit] = (pool.pool_id, False)
        self.pools[pool.pool_id] = pool
        self.device_bits |= bits.device.bit
        pool.tree.set_listener(bits.device)
        routed = pool.routing.routed
        routed.set_listener(bits.routed)
        self.max_blocks = max(self.max_blocks, pool.num_blocks)
        self.min_blocks = min(self.min_blocks, pool.num_blocks) if len(self.pools) > 1 else pool.num_blocks
        self.order.add(pool)
        pool.on_load_change = self.order.update
        routed.on_queue_change = lambda: self.order.update(pool)
        pool_id = pool.pool_id
        routed.on_deadline = lambda when: heapq.heappush(self._deadlines, (when, pool_id))
        for when in routed.deadlines():  # restored ones
            heapq.heappush(self._deadlines, (when, pool_id))
        self.note_special(pool)

    def leave(self, pool: Pool) -> None:
        bits = self._bits.pop(pool.pool_id)
        del self.pools[pool.pool_id]
        self.device_bits &= ~bits.device.bit
        pool.tree.set_listener(None)
        routed = pool.routing.routed
        routed.set_listener(None)
        self.order.remove(pool.pool_id)
        pool.on_load_change = routed.on_queue_change = routed.on_deadline = None
        self.special.discard(pool.pool_id)
        for holder in bits:
            del self._owners[holder.bit]
            self.index.release(holder)
        self.max_blocks = max((p.num_blocks for p in self.pools.values()), default=0)
        self.min_blocks = min((p.num_blocks for p in self.pools.values()), default=0)

    def note_special(self, pool: Pool) -> None:
        """Whether `pool` has lower tiers or a peer-pull endpoint (at join, and when a re-attach
        changes its endpoint)."""
        if pool.tiers is not None or pool.pulls.enabled:
            self.special.add(pool.pool_id)
        else:
            self.special.discard(pool.pool_id)

    def expire_due(self, now: float) -> None:
        """End the routed prompts and reservations whose time has come, in the pools that have one."""
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            _, pool_id = heapq.heappop(heap)
            pool = self.pools.get(pool_id)
            if pool is not None and pool.routing.routed.next_deadline <= now:
                pool.expire_routed(now)
        # Only Route adds deadlines, and each is popped here once due: the heap holds those of
        # the last routed TTL (routed.DEFAULT_ROUTED_TTL_SECONDS, or a longer reservation).

    def depth_bits(self, namespace: str, hashes: Iterable[int]) -> dict[int, int]:
        """{holder bit: leading pages of the chain it holds} (PageIndex.depths); `bits(pool_id)`
        names a pool's two holders."""
        return self.index.depths(namespace, hashes)

    def bits(self, pool_id: str) -> PoolBits:
        return self._bits[pool_id]

    def held(self, namespace: str, hashes: Iterable[int], mask: int = -1) -> HeldPages:
        """Leading pages of the chain `hashes` each pool holds and was promised (see PageIndex.depths)."""
        device: dict[str, int] = {}
        routed: dict[str, int] = {}
        owners = self._owners
        for bit, pages in self.index.depths(namespace, hashes, mask).items():
            pool_id, on_device = owners[bit]
            (device if on_device else routed)[pool_id] = pages
        return HeldPages(device, routed)

    def deepest_other(self, pool_id: str, namespace: str, hashes: Iterable[int], now: float, skip: int = 0) -> int:
        """The most leading pages of a chain the tree of a live pool (lease running at `now`)
        other than `pool_id` holds, of the pools that hold page `skip`: `hashes` is the chain
        from that page on (0: the whole chain)."""
        mask = self.device_bits & ~self._bits[pool_id].device.bit
        best = 0
        for bit, pages in self.index.depths(namespace, hashes, mask).items():
            if pages > best and now < self.pools[self._owners[bit][0]].lease_deadline:
                best = pages
        return skip + best if best else 0

    def check_integrity(self) -> None:
        """The index equals one rebuilt from the pools' trees and routed prompts."""
        rebuilt = PageIndex()
        for pool_id, bits in self._bits.items():
            pool = self.pools[pool_id]
            device, routed = PageHolder(rebuilt, bits.device.bit), PageHolder(rebuilt, bits.routed.bit)
            for node in pool.tree.iter_nodes():
                device.added(node.namespace, node.hashes)
            for namespace, hashes in pool.routing.routed.promised().items():
                routed.added(namespace, hashes)
        if rebuilt.snapshot() != self.index.snapshot():
            raise IntegrityError(f"page index of model {self.model_fingerprint!r} differs from its pools")
        if not self.order.check(self.pools):
            raise IntegrityError(f"load order of model {self.model_fingerprint!r} differs from its pools' loads")


class FleetPages:
    """Every ModelPages of a registry, by (model fingerprint, page size)."""

    def __init__(self) -> None:
        self.models: dict[tuple[str, int], ModelPages] = {}

    def of_pool(self, pool: Pool) -> ModelPages:
        key = (pool.model_fingerprint, pool.block_size)
        model = self.models.get(key)
        if model is None:
            model = self.models[key] = ModelPages(*key)
        return model

    def leave(self, pool: Pool) -> None:
        key = (pool.model_fingerprint, pool.block_size)
        model = self.models[key]
        model.leave(pool)
        if not model.pools:
            del self.models[key]

    def of_model(self, model_fingerprint: str) -> list[ModelPages]:
        """The groups of a model (every group when `model_fingerprint` is empty)."""
        return [m for (fp, _), m in self.models.items() if not model_fingerprint or fp == model_fingerprint]

    def check_integrity(self) -> None:
        for model in self.models.values():
            model.check_integrity()
