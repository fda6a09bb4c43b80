"""Prometheus metrics of the router: served on --metrics-port and at /metrics of the HTTP door."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from common.metrics_server import MetricsServer
from router.policy import REASONS

_LATENCY_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0, 30.0)
_FORWARD_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2, 0.1)


class RouterMetrics(MetricsServer):
    """A private registry (tests may build several routers in one process)."""

    def __init__(self) -> None:
        super().__init__(CollectorRegistry())
        r = self.registry
        self.requests = Counter("radixkv_router_requests", "Generate attempts per replica, by outcome (a status name)",
                                ["replica", "code"], registry=r)
        self.decisions = Counter("radixkv_router_route_decisions", "Route decisions by reason (retry: one per "
                                 "further replica tried)", ["reason"], registry=r)
        for reason in REASONS:
            self.decisions.labels(reason)
        self.routing_seconds = Histogram("radixkv_router_routing_seconds",
                                         "Request arrival to the first replica call (tokenize + route)",
                                         buckets=_LATENCY_BUCKETS, registry=r)
        self.first_message_seconds = Histogram("radixkv_router_first_message_seconds",
                                               "Request arrival to the replica's first message (TTFT at the router)",
                                               buckets=_LATENCY_BUCKETS, registry=r)
        self.forward_seconds = Histogram("radixkv_router_forward_seconds",
                                         "Per streamed message: handing it on to the client (the per-token overhead)",
                                         buckets=_FORWARD_BUCKETS, registry=r)
        self.replicas_reachable = Gauge("radixkv_router_replicas_reachable", "Replicas answering health checks",
                                        registry=r)
        self.cache_manager_up = Gauge("radixkv_router_cache_manager_up",
                                      "1 while the cache manager answers, else 0 (routing falls back to load)",
                                      registry=r)
        self.cache_shards_missing = Counter(
            "radixkv_router_cache_shards_missing", "Cache-manager shards that failed or missed the deadline of a "
            "Route or Stats, and so dropped out of that decision (--cache-addr with several shards)", registry=r)
        self.untrusted_addrs = Counter(
            "radixkv_router_untrusted_addrs", "serving_addrs the cache manager listed (Stats) or offered (Route) "
            "outside the router's trust (--replica, --replica-dns, --replica-allow): skipped, never called",
            ["source"], registry=r)
        for source in ("stats", "route"):
            self.untrusted_addrs.labels(source)
        self.http_requests = Counter("radixkv_router_http_requests", "OpenAI HTTP requests by path and status",
                                     ["path", "status"], registry=r)

    def text(self) -> bytes:
        return generate_latest(self.registry)
