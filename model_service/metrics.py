"""Prometheus metrics of the model service (served on --metrics-port)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from common.metrics_server import MetricsServer

if TYPE_CHECKING:
    from model_service.linear import LinearPlan

_WAIT_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10)
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class ModelMetrics(MetricsServer):
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        super().__init__(registry or CollectorRegistry())
        r = self.registry
        self.requests = Counter("radixkv_model_requests", "Generate requests finished, by reason",
                                ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("radixkv_model_prompt_tokens", "Prompt tokens admitted", registry=r)
        self.cached_prompt_tokens = Counter("radixkv_model_prefix_cache_hit_tokens",
                                            "Prompt tokens served from the prefix cache", registry=r)
        self.generated_tokens = Counter("radixkv_model_generated_tokens", "Tokens generated", registry=r)
        self.preemptions = Counter("radixkv_model_preemptions", "Requests preempted (recomputed later)",
                                   registry=r)
        self.waiting = Gauge("radixkv_model_waiting_requests", "Requests waiting for admission", registry=r)
        self.running = Gauge("radixkv_model_running_requests", "Requests running", registry=r)
        self.live_request_ids = Gauge("radixkv_model_live_request_ids",
                                      "Request ids held by live requests (submitted, not finished)", registry=r)
        self.ttft = Histogram("radixkv_model_time_to_first_token_seconds", "Time to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.inter_token = Histogram("radixkv_model_inter_token_latency_seconds", "Time between tokens",
                                     buckets=_LATENCY_BUCKETS, registry=r)
        self.step_time = Histogram("radixkv_model_step_seconds", "Model forward time per scheduler step",
                                   buckets=_LATENCY_BUCKETS, registry=r)
        self.cache_rpc = Histogram("radixkv_model_cache_rpc_seconds", "Cache manager Step RPC latency",
                                   buckets=_LATENCY_BUCKETS, registry=r)
        self.steps = Counter("radixkv_model_steps", "Engine steps that ran a forward pass", registry=r)
        self.cache_waits = Counter("radixkv_model_cache_waits",
                                   "Engine steps that blocked waiting for a cache Step reply", registry=r)
        self.cache_wait = Histogram("radixkv_cache_wait_seconds",
                                    "How long the engine blocked waiting for a cache Step reply",
                                    buckets=_WAIT_BUCKETS, registry=r)
        self.cache_reconnects = Counter("radixkv_model_cache_pool_lost",
                                        "Times the cache pool was lost and re-registered", registry=r)
        self.linear_plan = Gauge("radixkv_model_linear_plan_weights",
                                 "Linear-layer weights whose load-time plan sends inputs of `rows` rows to `path` "
                                 "(verified: bit-identical to F.linear for that shape, checked at load)",
                                 ["shape", "dtype", "mode", "rows", "path", "verified"], registry=r)

        self.tier_pages = Counter("radixkv_model_tier_pages",
                                  "KV pages copied between tiers, by direction (offload: down a tier, load: into "
                                  "the KV pool), tier and outcome", ["direction", "tier", "outcome"], registry=r)
        self.tier_load_seconds = Histogram("radixkv_model_tier_load_seconds",
                                           "Time to load one admission's pages from a tier into the KV pool",
                                           ["tier"], buckets=_WAIT_BUCKETS, registry=r)
        self.tier_cached_tokens = Counter("radixkv_model_tier_hit_tokens",
                                          "First-admission prompt tokens loaded from a lower tier", ["tier"],
                                          registry=r)
        self.tier_slots = Gauge("radixkv_model_tier_slots", "Slots (pages) of each lower tier", ["tier"], registry=r)
        self.tier_load_cost = Gauge("radixkv_model_tier_load_cost",
                                    "Measured cost of loading a token from the tier, as a share of computing it",
                                    ["tier"], registry=r)

        self.pull_pages = Counter("radixkv_model_pull_pages", "KV pages pulled from other replicas, by outcome "
                                  "(failed: computed instead)", ["outcome"], registry=r)
        self.pull_bytes = Counter("radixkv_model_pull_bytes", "Bytes of KV received from other replicas", registry=r)
        self.pull_seconds = Histogram("radixkv_model_pull_seconds", "Time of one pull from another replica",
                                      buckets=_WAIT_BUCKETS, registry=r)
        self.pull_fallbacks = Counter("radixkv_model_pull_fallbacks",
                                      "Pulls that came up short and were computed instead, by reason", ["reason"],
                                      registry=r)
        self.peer_load_cost = Gauge("radixkv_model_peer_load_cost",
                                    "Measured cost of pulling a token from another replica, as a share of computing it",
                                    registry=r)
        self.pull_cached_tokens = Counter("radixkv_model_peer_hit_tokens",
                                          "First-admission prompt tokens pulled from another replica", registry=r)
        self.pull_served_pages = Counter("radixkv_model_pull_served_pages",
                                         "KV pages this replica sent to replicas pulling them", registry=r)
        self.pull_served_bytes = Counter("radixkv_model_pull_served_bytes",
                                         "Bytes of KV this replica sent to replicas pulling them", registry=r)

    def set_linear_plan(self, plans: Iterable[LinearPlan]) -> None:
        """Exports the load-time plan of every linear weight (one series per shape and row range)."""
        self.linear_plan.clear()
        for plan in plans:
            for r in plan.ranges:
                self.linear_plan.labels(f"{plan.shape[0]}x{plan.shape[1]}", plan.dtype, plan.mode, r.rows(), r.path,
                                        "yes" if r.verified else "no").inc()

    def observe_cache_wait(self, seconds: float) -> None:
        """The engine blocked `seconds` on a cache Step reply."""
        self.cache_waits.inc()
        self.cache_wait.observe(seconds)
