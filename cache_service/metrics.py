"""Prometheus metrics of the cache service (served only when --metrics-port is given).

Per-pool numbers are read from the pools at scrape time by a custom collector, so the hot path
pays nothing for them. The scrape runs on prometheus-client's HTTP thread: it only reads ints
and copies the pool dict, which is safe under the GIL.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from cache_service.durable import DurableState
from cache_service.pool_registry import PoolRegistry
from common.metrics_server import MetricsServer

# Counters of a lower tier (cache.proto TierStats): metric name, help, TierStats field.
_TIER_COUNTERS = [
    ("tier_hit_tokens", "First-admission prompt tokens ordered loaded from the tier", "hit_tokens"),
    ("tier_loaded_pages", "Pages ordered loaded from the tier into the pool's blocks", "num_loaded_pages"),
    ("tier_offloaded_pages", "Pages copied into the tier (copies reported complete)", "num_offloaded_pages"),
    ("tier_failed_pages", "Pages whose copy into or out of the tier was reported failed", "num_failed_pages"),
    ("tier_evicted_pages", "Pages that left the tier (to the next one down, or dropped)", "num_evicted_pages"),
]
# Peer pulls of a pool (cache.proto PullStats, docs/kv-pulls.md): metric name, help, PullStats field.
_PULL_COUNTERS = [
    ("pulls", "Pulls of pages from other replicas ordered for this pool's admissions", "num_pulls"),
    ("pulled_pages", "Pages ordered pulled from other replicas", "num_pulled_pages"),
    ("pull_failed_pages", "Pages whose pull was reported failed or not reported (computed instead)",
     "num_failed_pages"),
    ("peer_hit_tokens", "First-admission prompt tokens ordered pulled from other replicas", "peer_hit_tokens"),
    ("served_pulls", "Pulls of this pool's pages by other replicas", "num_served_pulls"),
    ("expired_pull_pins", "Pins of this pool's pages that ended because their puller never reported",
     "num_expired_pins"),
]


class PoolCollector(Collector):
    """Block accounting, token hit counters and request counters of every live pool, and the
    slots and copy counters of each pool's lower tiers (docs/tiers.md) and its peer pulls
    (docs/kv-pulls.md)."""

    def __init__(self, pools: PoolRegistry) -> None:
        self._pools = pools

    def collect(self) -> Iterator[Metric]:
        pools = list(self._pools.pools.values())
        blocks = GaugeMetricFamily(
            "radixkv_cache_blocks", "KV blocks by state (free, cached, locked, evictable, private)",
            labels=["pool", "state"],
        )
        total = GaugeMetricFamily("radixkv_cache_blocks_total", "KV blocks in the pool", labels=["pool"])
        running = GaugeMetricFamily("radixkv_cache_running_requests", "Requests holding blocks", labels=["pool"])
        hit_rate = GaugeMetricFamily("radixkv_cache_hit_rate", "hit_tokens / queried_tokens", labels=["pool"])
        counters = {
            name: CounterMetricFamily(f"radixkv_cache_{name}", doc, labels=["pool"])
            for name, doc in [
                ("queried_tokens", "Prompt tokens looked up by admissions"),
                ("hit_tokens", "Prompt tokens found cached by admissions"),
                ("evicted_blocks", "Blocks evicted from the tree"),
                ("requests_admitted", "Requests admitted"),
                ("requests_finished", "Requests finished"),
                ("requests_released", "Requests released (preempted)"),
                ("miss_other_namespace_tokens", "Prompt tokens of first admissions that missed but were "
                 "cached in the pool under another namespace (aggregate only: never told to a caller)"),
            ]
        }
        tier_slots = GaugeMetricFamily("radixkv_cache_tier_slots", "Slots (one page each) of a pool's lower tier",
                                       labels=["pool", "tier"])
        tier_pages = GaugeMetricFamily(
            "radixkv_cache_tier_pages", "Slots of a pool's lower tier by state (cached: the page's copy "
            "completed; pending: reserved for a copy not reported yet; free)", labels=["pool", "tier", "state"])
        tier_counters = {name: CounterMetricFamily(f"radixkv_cache_{name}", doc, labels=["pool", "tier"])
                         for name, doc, _ in _TIER_COUNTERS}
        pull_counters = {name: CounterMetricFamily(f"radixkv_cache_{name}", doc, labels=["pool"])
                         for name, doc, _ in _PULL_COUNTERS}
        pinned = GaugeMetricFamily("radixkv_cache_pull_pinned_pages", "Pages of the pool pinned for pulls now",
                                   labels=["pool"])
        for pool in pools:
            s = pool.stats()
            pid = s.pool_id
            for tier, t in (("host", s.host_tier), ("disk", s.disk_tier)):
                if t is None:
                    continue
                tier_slots.add_metric([pid, tier], t.num_slots)
                for state, value in [("cached", t.num_cached_pages), ("pending", t.num_pending_pages),
                                     ("free", t.num_slots - t.num_cached_pages - t.num_pending_pages)]:
                    tier_pages.add_metric([pid, tier, state], value)
                for name, _, attr in _TIER_COUNTERS:
                    tier_counters[name].add_metric([pid, tier], getattr(t, attr))
            if s.pulls is not None:
                pinned.add_metric([pid], s.pulls.num_pinned_pages)
                for name, _, attr in _PULL_COUNTERS:
                    pull_counters[name].add_metric([pid], getattr(s.pulls, attr))
            for state, value in [
                ("free", s.num_free_blocks),
                ("cached", s.num_cached_blocks),
                ("locked", s.num_locked_blocks),
                ("evictable", s.num_evictable_blocks),
                ("private", s.num_private_blocks),
            ]:
                blocks.add_metric([pid, state], value)
            total.add_metric([pid], s.num_blocks)
            running.add_metric([pid], s.num_running_requests)
            hit_rate.add_metric([pid], s.hit_rate)
            for name, value in [
                ("queried_tokens", s.queried_tokens),
                ("hit_tokens", s.hit_tokens),
                ("evicted_blocks", s.num_evicted_blocks),
                ("requests_admitted", s.num_admitted),
                ("requests_finished", s.num_finished),
                ("requests_released", s.num_released),
                ("miss_other_namespace_tokens", pool.miss_other_namespace_tokens),
            ]:
                counters[name].add_metric([pid], value)
        yield from (blocks, total, running, hit_rate, *counters.values(), tier_slots, tier_pages,
                    *tier_counters.values(), pinned, *pull_counters.values())


class DurabilityCollector(Collector):
    """Journal size, fsync latency and what the last start restored (--state-dir only)."""

    def __init__(self, durable: DurableState) -> None:
        self._durable = durable

    def collect(self) -> Iterator[Metric]:
        s = self._durable.current_stats()
        for name, doc, value in [
            ("journal_bytes", "Bytes in the current journal file", s.journal_bytes),
            ("journal_last_fsync_seconds", "Duration of the last journal fsync", s.last_fsync_seconds),
            ("journal_max_fsync_seconds", "Longest journal fsync", s.max_fsync_seconds),
            ("restored_pools", "Pools rebuilt from the state dir at the last start", s.num_restored_pools),
            ("restored_cached_blocks", "Cached blocks rebuilt from the state dir at the last start",
             s.num_restored_cached_blocks),
            ("recovery_seconds", "Time the last start took to rebuild the pools", s.recovery_seconds),
        ]:
            yield GaugeMetricFamily(f"radixkv_cache_{name}", doc, value=value)
        yield CounterMetricFamily("radixkv_cache_snapshots", "Snapshots written", value=s.num_snapshots)


class Metrics(MetricsServer):
    """A private registry (several servers may live in one test process) and RPC metrics."""

    def __init__(self, pools: PoolRegistry, durable: DurableState | None = None) -> None:
        super().__init__(CollectorRegistry())
        if durable is not None:
            self.registry.register(DurabilityCollector(durable))
        self.step_latency = Histogram(
            "radixkv_cache_step_seconds", "Step RPC handling time in the server",
            buckets=(5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25),
            registry=self.registry,
        )
        self.steps = Counter(
            "radixkv_cache_steps", "Steps served, by transport: a unary Step call or a StepStream message",
            ["transport"], registry=self.registry,
        )
        self.routes = Counter(
            "radixkv_cache_routes", "Routes asked, by transport: a unary Route call or a RouteStream message",
            ["transport"], registry=self.registry,
        )
        self.rpc_errors = Counter(
            "radixkv_cache_rpc_errors", "RPCs answered with an error status", ["method", "code"],
            registry=self.registry,
        )
        self.registry.register(PoolCollector(pools))
