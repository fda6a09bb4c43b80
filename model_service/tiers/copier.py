"""Performs the tier copies a cache Step reply orders (cache.proto TierCopy) on this replica's KV.

Order (cache.proto "Ordering contract"): the reply's offloads in list order, then each admission's
loads, all before the forward pass that writes any block the reply handed out. Each copy's outcome
(leading pages done) goes back in a later Step. A load that fails part-way loads only its
leading pages; the rest of the prompt is computed, as on a miss.

Writes to the disk tier run on its writer thread: their pages are read (from the KV pool or the
host tier) into a ring of staging rows before the copy returns, which is all the ordering needs,
and the file writes and checksums overlap the next forward passes. Their outcomes ride with the
next Step the engine makes anyway, or one of their own when it is idle (`on_write_done` wakes it)
or they waited MAX_OUTCOME_DELAY_SECONDS: no cache RPC only for them while decode steps need none.

It also measures what a load costs next to computing (model_service/copy_costs.py), sent with
every Step as the replica's host_load_cost / disk_load_cost, so Route prices tier hits, and the
cache manager stops loading from a tier that is slower than recomputing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future

from model_service.copy_costs import CopyCosts
from model_service.kv_cache import KVCache
from model_service.metrics import ModelMetrics
from model_service.tiers.disk_tier import DiskTier, PageInfo
from model_service.tiers.host_tier import HostTier
from protos import cache_pb2

log = logging.getLogger(__name__)

POLICIES = {"evict": cache_pb2.OFFLOAD_POLICY_EVICT, "write-through": cache_pb2.OFFLOAD_POLICY_WRITE_THROUGH}
TIER_NAMES = {cache_pb2.TIER_DEVICE: "device", cache_pb2.TIER_HOST: "host", cache_pb2.TIER_DISK: "disk"}
# While the engine is busy, finished disk writes wait for a Step it makes anyway, at most this long
# (their pages are held, hittable, only once reported).
MAX_OUTCOME_DELAY_SECONDS = 0.25


class TierCopier:
    """The replica's lower tiers and the copies between them and the KV pool (engine thread only)."""

    def __init__(self, kv: KVCache, host: HostTier | None, disk: DiskTier | None, policy: str = "evict",
                 metrics: ModelMetrics | None = None, costs: CopyCosts | None = None) -> None:
        if policy not in POLICIES:
            raise ValueError(f"offload policy must be one of {', '.join(POLICIES)}")
        self.kv = kv
        self.host = host
        self.disk = disk
        self.policy = policy
        self.metrics = metrics
        self.page_tokens = kv.block_size
        self.on_write_done: Callable[[], None] = lambda: None
        # Disk writes in flight: (copy id, pages, future of the pages written).
        self._writes: list[tuple[int, int, Future[int]]] = []
        self._finished_seen_at: float | None = None  # when finished writes were first left waiting
        self.costs = costs if costs is not None else CopyCosts()  # what a load costs next to computing
        if metrics is not None:
            for tier, store in ((cache_pb2.TIER_HOST, host), (cache_pb2.TIER_DISK, disk)):
                if store is not None:
                    metrics.tier_slots.labels(TIER_NAMES[tier]).set(store.num_slots)

    def tier_config(self) -> cache_pb2.TierConfig:
        """What RegisterPool says of the tiers, with what the disk tier holds (from an earlier run too)."""
        runs = [cache_pb2.DiskRun(namespace=r.namespace, packed_token_ids=r.token_bytes, slots=r.slots)
                for r in (self.disk.runs() if self.disk is not None else [])]
        return cache_pb2.TierConfig(num_host_slots=self.host.num_slots if self.host is not None else 0,
                                    num_disk_slots=self.disk.num_slots if self.disk is not None else 0,
                                    offload_policy=POLICIES[self.policy], disk_runs=runs)

    # ------------------------------------------------------------------ copies

    def run_offloads(self, copies: Sequence[cache_pb2.TierCopy]) -> list[cache_pb2.CopyOutcome]:
        """Performs the offloads, in order; returns the outcomes known now (disk writes report
        theirs through `finished_outcomes` once on file)."""
        outcomes = []
        for copy in copies:
            if copy.dst_tier == cache_pb2.TIER_DISK and self.disk is not None:
                future = self._write_to_disk(copy)
                if future is not None:
                    future.add_done_callback(lambda _f: self.on_write_done())
                    self._writes.append((copy.copy_id, len(copy.src), future))
                    continue
                outcomes.append(self._outcome(copy.copy_id, len(copy.src), 0, "offload", copy.dst_tier))
                continue
            outcomes.append(self._outcome(copy.copy_id, len(copy.src), self._offload(copy), "offload",
                                          copy.dst_tier))
        return outcomes

    def finished_outcomes(self, urgent: bool = True) -> list[cache_pb2.CopyOutcome]:
        """Outcomes of the disk writes finished since the last call. Not `urgent` (the Step would
        be made for them alone): none until some waited MAX_OUTCOME_DELAY_SECONDS."""
        if not any(w[2].done() for w in self._writes):
            return []
        if not urgent:
            now = time.monotonic()
            if self._finished_seen_at is None:
                self._finished_seen_at = now
            if now - self._finished_seen_at < MAX_OUTCOME_DELAY_SECONDS:
                return []
        self._finished_seen_at = None
        done, self._writes = [w for w in self._writes if w[2].done()], [w for w in self._writes if not w[2].done()]
        outcomes = []
        for copy_id, pages, future in done:
            try:
                written = future.result()
            except Exception:  # a failed write loses its pages, never the replica
                log.exception("disk tier write %d failed", copy_id)
                written = 0
            outcomes.append(self._outcome(copy_id, pages, written, "offload", cache_pb2.TIER_DISK))
        return outcomes

    def has_finished(self) -> bool:
        """Whether a disk write finished whose outcome was not taken yet."""
        return any(w[2].done() for w in self._writes)

    def reset(self) -> None:
        """The cache pool was lost: finish the disk writes in flight (so the disk is what the next
        registration announces) and forget their outcomes (of copies the next pool never ordered)."""
        for _, _, future in self._writes:
            try:
                future.result()
            except Exception:
                pass
        self._writes = []
        self._finished_seen_at = None

    def _write_to_disk(self, copy: cache_pb2.TierCopy) -> Future[int] | None:
        assert self.disk is not None
        src, dst = list(copy.src), list(copy.dst)
        try:
            pages = self._pages(copy)
            if copy.src_tier == cache_pb2.TIER_DEVICE:
                return self.disk.write_from_device_async(self.kv, src, dst, pages)
            if copy.src_tier == cache_pb2.TIER_HOST and self.host is not None:
                return self.disk.write_from_host_async(self.host, src, dst, pages)
        except Exception:
            log.exception("tier copy %d failed", copy.copy_id)
        return None

    def run_loads(self, copies: Sequence[cache_pb2.TierCopy]) -> tuple[list[cache_pb2.CopyOutcome], int, int]:
        """One admission's loads (host first, then disk): (outcomes, host tokens loaded, disk tokens
        loaded). Pages after the first that failed are not loaded (the prefix must be whole)."""
        outcomes, loaded = [], {cache_pb2.TIER_HOST: 0, cache_pb2.TIER_DISK: 0}
        whole = True
        for copy in copies:
            started = time.perf_counter()
            done = self._load(copy) if whole else 0
            elapsed = time.perf_counter() - started
            outcomes.append(self._outcome(copy.copy_id, len(copy.src), done, "load", copy.src_tier))
            if done:
                self._observe_load(copy.src_tier, elapsed, done * self.page_tokens)
            loaded[copy.src_tier] = loaded.get(copy.src_tier, 0) + done * self.page_tokens
            whole = whole and done == len(copy.src)
        return outcomes, loaded[cache_pb2.TIER_HOST], loaded[cache_pb2.TIER_DISK]

    def _offload(self, copy: cache_pb2.TierCopy) -> int:
        src, dst = list(copy.src), list(copy.dst)
        try:
            if copy.dst_tier == cache_pb2.TIER_HOST and copy.src_tier == cache_pb2.TIER_DEVICE and self.host:
                self.host.store(self.kv, src, dst)
                return len(src)
        except Exception:  # a failed copy loses its pages, never the replica
            log.exception("tier copy %d failed", copy.copy_id)
            return 0
        log.warning("tier copy %d from %s to %s: no such tier here", copy.copy_id, TIER_NAMES.get(copy.src_tier),
                    TIER_NAMES.get(copy.dst_tier))
        return 0

    def _load(self, copy: cache_pb2.TierCopy) -> int:
        src, dst = list(copy.src), list(copy.dst)
        try:
            if copy.src_tier == cache_pb2.TIER_HOST and self.host is not None:
                self.host.load(self.kv, src, dst)
                return len(src)
            if copy.src_tier == cache_pb2.TIER_DISK and self.disk is not None:
                expected = [(copy.namespace, h) for h in copy.page_hashes]
                return self.disk.load_to_device(self.kv, src, dst, expected)
        except Exception:
            log.exception("tier load %d failed", copy.copy_id)
            return 0
        return 0

    def _pages(self, copy: cache_pb2.TierCopy) -> list[PageInfo]:
        size = self.page_tokens * 4
        hashes = list(copy.page_hashes)
        tokens = copy.packed_token_ids
        return [PageInfo(copy.namespace, copy.parent_hash if i == 0 else hashes[i - 1], h,
                         tokens[i * size:(i + 1) * size]) for i, h in enumerate(hashes)]

    def _outcome(self, copy_id: int, pages: int, done: int, direction: str, tier: int) -> cache_pb2.CopyOutcome:
        if self.metrics is not None:
            name = TIER_NAMES.get(tier, "?")
            if done:
                self.metrics.tier_pages.labels(direction, name, "ok").inc(done)
            if done < pages:
                self.metrics.tier_pages.labels(direction, name, "failed").inc(pages - done)
        return cache_pb2.CopyOutcome(copy_id=copy_id, num_pages_copied=done)

    # ------------------------------------------------------------------ cost

    def _observe_load(self, tier: int, seconds: float, tokens: int) -> None:
        self.costs.observe_copy(TIER_NAMES[tier], seconds, tokens)
        if self.metrics is not None:
            self.metrics.tier_load_seconds.labels(TIER_NAMES[tier]).observe(seconds)

    def load_costs(self) -> tuple[float, float]:
        """(host, disk): seconds per loaded token / seconds per computed token (0: not measured yet)."""
        costs = []
        for tier in (cache_pb2.TIER_HOST, cache_pb2.TIER_DISK):
            cost = self.costs.cost(TIER_NAMES[tier])
            costs.append(cost)
            if self.metrics is not None and cost:
                self.metrics.tier_load_cost.labels(TIER_NAMES[tier]).set(cost)
        return costs[0], costs[1]

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()
