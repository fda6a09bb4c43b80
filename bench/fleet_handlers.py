"""The cache manager's Step and Route handlers under fleet_scale's load, in-process (issue 32).

`python -m bench.fleet_handlers [replicas] [seconds]`. The simulated replicas of bench.fleet_scale
(their Workload and Replica) call the servicer's handlers directly instead of through gRPC: each
request is serialized and parsed as on the wire, then the handler (proto -> core -> proto) is
timed alone. With no transport and no second process, the per-call costs move far less between
runs than fleet_scale's latencies on a busy 2-core machine, so they are what to compare when the
Step or Route path changes (an old checkout and a new one in turns). The cycle collector is set
up as the server sets it up (cache_service/collector.py).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import time
from collections.abc import Callable

from bench.fleet_scale import LevelStats, Replica, SimConfig, Workload
from cache_service.collector import keep_full_collections_rare
from cache_service.events import EventLog
from cache_service.pool_registry import PoolRegistry
from cache_service.registry_limits import RegistryLimits
from cache_service.servicer import CacheManagerServicer
from protos import cache_pb2 as pb


class _Timed:
    """Seconds and calls of one handler while measuring."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        self.on = False
        self.durations: list[float] = []  # each call's, for the tail (amortized upkeep shows there)

    def __call__(self, handler: Callable, request):
        if not self.on:
            return handler(request)
        start = time.perf_counter()
        try:
            return handler(request)
        finally:
            took = time.perf_counter() - start
            self.seconds += took
            self.calls += 1
            self.durations.append(took)

    def tail_us(self) -> dict[str, float]:
        """p99, p99.9 and the longest call, in µs."""
        d = sorted(self.durations) or [0.0]
        return {"p99": round(1e6 * d[int(0.99 * (len(d) - 1))], 1),
                "p999": round(1e6 * d[int(0.999 * (len(d) - 1))], 1), "max": round(1e6 * d[-1], 1)}


class _InProcessStub:
    """The CacheManager stub a simulated replica uses, calling the servicer in this process."""

    def __init__(self, registry: PoolRegistry, servicer: CacheManagerServicer, steps: _Timed) -> None:
        self.registry, self.servicer, self.steps = registry, servicer, steps

    async def RegisterPool(self, request: pb.RegisterPoolRequest, timeout: float | None = None):
        pool = self.registry.register(request.worker_id, request.num_blocks, request.block_size,
                                      request.model_fingerprint, request.vocab_size, request.serving_addr)
        return pb.RegisterPoolResponse(pool_id=pool.pool_id, epoch=pool.epoch)

    async def Step(self, request: pb.StepRequest, timeout: float | None = None):
        parsed = pb.StepRequest.FromString(request.SerializeToString())  # as it arrives
        return self.steps(lambda r: self.servicer._step(r, "stream"), parsed)


async def _drive(replicas: int, warmup_s: float, measure_s: float, cfg: SimConfig) -> dict:
    registry = PoolRegistry(lease_seconds=600, events=EventLog(), limits=RegistryLimits.unlimited())
    servicer = CacheManagerServicer(registry)
    steps, routes = _Timed(), _Timed()

    async def route(request: pb.RouteRequest):
        parsed = pb.RouteRequest.FromString(request.SerializeToString())
        return routes(lambda r: servicer._route(r, "stream"), parsed)

    stats, work = LevelStats(), Workload(cfg, 0)
    stub = _InProcessStub(registry, servicer, steps)
    fleet = [Replica(f"sim-{i}", cfg, work, stub, route, stats) for i in range(replicas)]
    for replica in fleet:
        await replica.register()
    await asyncio.gather(*(replica.fill() for replica in fleet))
    gc.collect()
    gc.freeze()
    collector = asyncio.create_task(keep_full_collections_rare())
    period = cfg.step_ms / 1e3
    start = time.perf_counter() + 0.05
    end = start + warmup_s + measure_s
    tasks = [asyncio.create_task(r.run(start + period * i / replicas, end)) for i, r in enumerate(fleet)]
    await asyncio.sleep(max(0.0, start + warmup_s - time.perf_counter()))
    steps.on = routes.on = True
    t0 = time.perf_counter()
    await asyncio.gather(*tasks)
    wall = time.perf_counter() - t0
    collector.cancel()
    return {
        "replicas": replicas, "measured_s": round(wall, 2),
        "steps_per_s": round(steps.calls / wall, 1), "routes_per_s": round(routes.calls / wall, 1),
        "step_us": round(1e6 * steps.seconds / max(steps.calls, 1), 1),
        "route_us": round(1e6 * routes.seconds / max(routes.calls, 1), 1),
        "handler_cpu": round((steps.seconds + routes.seconds) / wall, 3),
        "step_tail_us": steps.tail_us(), "route_tail_us": routes.tail_us(),
    }


def run(replicas: int = 48, warmup_s: float = 3.0, measure_s: float = 10.0) -> dict:
    """One in-process run at `replicas` (issue 32's replica: SimConfig's defaults; each Step a call
    of the stub, which hands it to the handler StepStream uses)."""
    return asyncio.run(_drive(replicas, warmup_s, measure_s, SimConfig(step_stream=False)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("replicas", type=int, nargs="?", default=48)
    parser.add_argument("seconds", type=float, nargs="?", default=10.0)
    args = parser.parse_args()
    print(json.dumps(run(args.replicas, measure_s=args.seconds), indent=2))


if __name__ == "__main__":
    main()
