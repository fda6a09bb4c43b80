"""One cache-manager process under a simulated fleet of GPU-class replicas (issue 32).

`python -m bench.fleet_scale` (a few minutes). The cache manager runs alone on CPU 0; the load
generator, a separate process on CPU 1, plays N replicas (and their router's Route calls) the way
the model service and the router talk to the cache manager:

- every replica plans a scheduler step every `step_ms` (GPU-class: 20 ms) and sends one batched
  Step for it, on its StepStream as the model service does (`--unary`: a call each): up to `batch` running requests decoding one token per step (an Extend whenever a
  request crosses into a new block, with `lookahead` tokens of lookahead), up to
  `admits_per_step` new prompts (packed, 1-2k tokens, ~70% of them a prefix shared fleet-wide),
  a Commit of each prompt the step after its admission (its prefill is done), and a Finish with
  the output tokens when a request has produced its 200-500 tokens;
- every new prompt is routed first: the router asks Route for it, on its RouteStream through the
  router's own client (router/upstream.py; token ids, request id, reserve_ms and max_candidates as
  the router's defaults) while the replica goes on stepping, and
  the replica may admit it once that Route answered (a step later at the earliest);
- pools are sized so that they fill: in the measured window every new block is an eviction.

A step that waits past its slot for the reply delays the replica's next one (its GPU idles):
"GPU time lost" is that delay over the window. Latencies are those the client sees. The knee is
the largest fleet whose Step p99 stays under `P99_TARGET_MS` with every asked Step served.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field

import grpc
import numpy as np

from bench.cache_bench import pct, start_server, table
from common.shards import shard_for
from protos import cache_pb2 as pb
from protos import cache_pb2_grpc
from router.cache_shards import ShardedCache
from router.core import CoreConfig
from router.errors import UpstreamError
from router.upstream import CacheManagerClient

P99_TARGET_MS = 10.0
VOCAB = 49152
FINGERPRINT = "fleet-scale-sim"


@dataclass(slots=True)
class SimConfig:
    """What one simulated replica does (defaults: issue 32's GPU-class replica)."""

    step_ms: float = 20.0
    batch: int = 64
    block_size: int = 16
    lookahead: int = 2
    admits_per_step: int = 4
    prompt_tokens: tuple[int, int] = (1024, 2048)
    shared_fraction: float = 0.7  # of each prompt: a prefix of one of `num_docs` shared documents
    num_docs: int = 32
    output_tokens: tuple[int, int] = (200, 500)
    num_blocks: int = 10240
    route: bool = True
    step_stream: bool = True  # Steps over one StepStream per replica, as the model service sends them
    route_stream: bool = True  # Routes over the router's RouteStream, as the router asks them
    reserve_ms: int = CoreConfig().reserve_ms  # as the router asks
    route_candidates: int = CoreConfig().route_candidates


@dataclass(slots=True)
class SimRequest:
    rid: str
    packed: bytes  # the prompt, 4 bytes per token
    prompt: np.ndarray
    num_outputs: int
    outputs: list[int]
    num_blocks: int = 0
    generated: int = 0
    committed: bool = False
    resumed: bool = False
    arrived: bool = True  # at the replica: its Route (the router's, before it sends it there) answered


@dataclass(slots=True)
class LevelStats:
    steps_served: int = 0
    step_ms: list[float] = field(default_factory=list)
    route_ms: list[float] = field(default_factory=list)
    stalled_s: float = 0.0
    admitted: int = 0
    no_space: int = 0
    preempted: int = 0
    errors: int = 0


class Workload:
    """Prompts shared fleet-wide: `num_docs` documents, each prompt a prefix of one plus its own tail."""

    def __init__(self, cfg: SimConfig, seed: int) -> None:
        self.cfg = cfg
        self.rng = np.random.default_rng(seed)
        self.docs = [self.rng.integers(0, VOCAB, cfg.prompt_tokens[1], dtype=np.uint32) for _ in range(cfg.num_docs)]
        self.serial = 0

    def request(self, prefix: str, first: bool = False) -> SimRequest:
        """A new prompt. `first`: one of a replica's first batch, with an output length drawn from
        [1, max], so the fleet starts near its steady mix of young and old requests."""
        cfg, rng = self.cfg, self.rng
        n = int(rng.integers(cfg.prompt_tokens[0], cfg.prompt_tokens[1] + 1))
        shared = int(n * cfg.shared_fraction)
        doc = self.docs[int(rng.integers(cfg.num_docs))]
        prompt = np.concatenate([doc[:shared], rng.integers(0, VOCAB, n - shared, dtype=np.uint32)])
        outs = int(rng.integers(1 if first else cfg.output_tokens[0], cfg.output_tokens[1] + 1))
        self.serial += 1
        return SimRequest(f"{prefix}-{self.serial}", prompt.astype("<u4").tobytes(), prompt, outs,
                          rng.integers(0, VOCAB, outs, dtype=np.uint32).tolist())


class Replica:
    """One simulated model replica: its running requests and the Step it sends each step."""

    def __init__(self, name: str, cfg: SimConfig, work: Workload, stub, route: Callable[[pb.RouteRequest], Awaitable],
                 stats: LevelStats) -> None:
        """`stub`: its shard's CacheManager stub; `route`: Route as the router asks it (every shard)."""
        self.name, self.cfg, self.work, self.stub, self.route, self.stats = name, cfg, work, stub, route, stats
        self.pool_id, self.epoch = "", 0
        self.running: dict[str, SimRequest] = {}
        self.waiting: list[SimRequest] = []
        self.prefilled: list[SimRequest] = []  # admitted last step: commit now, decode from now
        self.preempted: list[tuple[pb.Finish, SimRequest]] = []  # released in the next Step, admitted after it
        self.measuring = False
        self.num_requests = 0
        self.routing: set[asyncio.Task] = set()  # Route calls in flight

    async def register(self) -> None:
        reply = await self.stub.RegisterPool(pb.RegisterPoolRequest(
            worker_id=self.name, num_blocks=self.cfg.num_blocks, block_size=self.cfg.block_size,
            model_fingerprint=FINGERPRINT, vocab_size=VOCAB, serving_addr=f"{self.name}:50052"), timeout=30)
        self.pool_id, self.epoch = reply.pool_id, reply.epoch

    async def fill(self) -> None:
        """Fill the pool's cache before the clock starts (prompts admitted and finished at once,
        untimed) until under a tenth of its blocks are free: from then on new blocks are evictions."""
        cfg = self.cfg
        while True:
            batch = [self.work.request(self.name) for _ in range(8)]
            step = pb.StepRequest(pool_id=self.pool_id, epoch=self.epoch)
            for req in batch:
                step.admits.add(request_id=req.rid, packed_token_ids=req.packed)
            reply = await self.stub.Step(step, timeout=30)
            done = pb.StepRequest(pool_id=self.pool_id, epoch=self.epoch)
            for req, result in zip(batch, reply.admits, strict=True):
                if result.status == pb.ADMIT_STATUS_ADMITTED:
                    done.finishes.add(request_id=req.rid, num_computed_tokens=len(req.prompt))
            reply = await self.stub.Step(done, timeout=30)
            if reply.num_free_blocks < cfg.num_blocks // 10:
                return

    async def _route(self, req: SimRequest) -> None:
        """The router's Route for a new prompt; the prompt reaches the replica when it answers."""
        t0 = time.perf_counter()
        try:
            await self.route(pb.RouteRequest(
                packed_token_ids=req.packed, model_fingerprint=FINGERPRINT, request_id=req.rid,
                reserve_ms=self.cfg.reserve_ms, max_candidates=self.cfg.route_candidates))
        except (grpc.aio.AioRpcError, UpstreamError):
            self.stats.errors += self.measuring
        else:
            if self.measuring:
                self.stats.route_ms.append(1e3 * (time.perf_counter() - t0))
        finally:
            req.arrived = True

    def _plan(self) -> tuple[pb.StepRequest, list[SimRequest]]:
        """The next step's Step: commits of last step's prompts, decode (extends, finishes), admits."""
        cfg, bs = self.cfg, self.cfg.block_size
        step = pb.StepRequest(pool_id=self.pool_id, epoch=self.epoch)
        for req in self.prefilled:
            req.committed = True
        finished = []
        for req in list(self.running.values()):
            if not req.committed:
                continue
            req.generated += 1
            total = len(req.prompt) + req.generated
            if req.generated >= req.num_outputs:
                step.finishes.add(request_id=req.rid, output_token_ids=req.outputs[:req.generated],
                                  num_computed_tokens=total - 1)
                finished.append(req)
            elif total + cfg.lookahead > req.num_blocks * bs:
                step.extends.add(request_id=req.rid, num_tokens=total + 1, num_lookahead_tokens=cfg.lookahead)
        for req in finished:
            del self.running[req.rid]
        for req in self.prefilled:  # a request that finishes in its first decode step is not committed too
            if req.rid in self.running:
                step.commits.add(request_id=req.rid, num_computed_tokens=len(req.prompt))
        self.prefilled = []
        room = min(cfg.admits_per_step, cfg.batch - len(self.running))
        # New prompts are routed a step ahead of their admission (the router's Route, concurrent
        # with the replica's steps: a slow Route delays its prompt, not the replica's step).
        while len(self.waiting) < room + cfg.admits_per_step:
            req = self.work.request(self.name, first=self.num_requests < cfg.batch)
            self.num_requests += 1
            self.waiting.append(req)
            if cfg.route:
                req.arrived = False
                task = asyncio.create_task(self._route(req))
                self.routing.add(task)
                task.add_done_callback(self.routing.discard)
        admits = [req for req in self.waiting if req.arrived][:room]
        # Preempted requests are released in this Step and wait from the next one on (an id may
        # appear once in a Step: not released and re-admitted together).
        step.releases.extend(release for release, _ in self.preempted)
        self.waiting[:0] = [req for _, req in self.preempted]
        self.preempted = []
        for req in admits:
            step.admits.add(request_id=req.rid, packed_token_ids=req.packed, num_lookahead_tokens=cfg.lookahead,
                            resumed=req.resumed)
        load = step.load
        load.num_running_requests = len(self.running)
        load.num_waiting_requests = len(self.waiting)
        return step, admits

    def _apply(self, reply: pb.StepResponse, admits: list[SimRequest]) -> None:
        """Take the reply in; the requests it could not extend are preempted (released next Step)."""
        by_id = {req.rid: req for req in admits}
        for result in reply.admits:
            req = by_id[result.request_id]
            if result.status != pb.ADMIT_STATUS_ADMITTED:
                self.stats.no_space += self.measuring
                continue
            self.waiting.remove(req)
            req.num_blocks = len(result.block_table)
            self.running[req.rid] = req
            self.prefilled.append(req)
            self.stats.admitted += self.measuring
        for result in reply.extends:
            req = self.running[result.request_id]
            if result.ok:
                req.num_blocks += len(result.new_block_ids)
                continue
            del self.running[req.rid]
            self.preempted.append((pb.Finish(request_id=req.rid, output_token_ids=req.outputs[:req.generated],
                                             num_computed_tokens=len(req.prompt) + req.generated - 1), req))
            req.generated, req.committed, req.resumed, req.num_blocks = 0, False, True, 0
            self.stats.preempted += self.measuring

    async def run(self, start: float, end: float) -> None:
        stream = self.stub.StepStream() if self.cfg.step_stream else None
        try:
            await self._run(start, end, stream)
        finally:
            if stream is not None:
                stream.cancel()
            for task in list(self.routing):
                task.cancel()

    async def _step(self, step: pb.StepRequest, stream) -> pb.StepResponse:
        if stream is None:
            return await self.stub.Step(step, timeout=30)
        await stream.write(step)
        reply = await stream.read()
        if reply is grpc.aio.EOF:  # the server ended the stream: its status says why
            raise RuntimeError(f"the Step stream ended: {(await stream.code()).name}: {await stream.details()}")
        return reply

    async def _run(self, start: float, end: float, stream) -> None:
        period = self.cfg.step_ms / 1e3
        slot = start
        while True:
            now = time.perf_counter()
            if now >= end:
                return
            if slot > now:
                await asyncio.sleep(slot - now)
            step, admits = self._plan()
            t0 = time.perf_counter()
            try:
                reply = await self._step(step, stream)
            except grpc.aio.AioRpcError as err:
                self.stats.errors += 1
                if stream is not None or err.code() in (grpc.StatusCode.FAILED_PRECONDITION,
                                                         grpc.StatusCode.NOT_FOUND):
                    raise  # a refused message ends its stream: the replica would re-register
                continue
            done = time.perf_counter()
            self._apply(reply, admits)
            if self.measuring:
                self.stats.step_ms.append(1e3 * (done - t0))
                self.stats.steps_served += 1
            slot += period
            if done > slot:  # the reply came after the step's slot: the GPU waited for it
                if self.measuring:
                    self.stats.stalled_s += done - slot
                slot = done


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (/proc/<pid>/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def drive(addresses: list[str], replicas: int, warmup_s: float, measure_s: float, cfg: SimConfig,
                server_pids: list[int], seed: int = 0) -> dict:
    """The load generator's side of one fleet size: register, warm up (pools fill), measure.
    Several addresses: cache-manager shards, each replica on its own (common/shards.py), Route
    asked of all of them and merged as the router does (router/cache_shards.py)."""
    stats = LevelStats()
    work = Workload(cfg, seed)
    per_shard = max(1, (replicas // len(addresses) + 7) // 8)
    channels = {addr: [grpc.aio.insecure_channel(addr) for _ in range(per_shard)] for addr in addresses}
    router_view = ShardedCache([CacheManagerClient(addr, route_stream=cfg.route_stream) for addr in addresses])
    try:
        fleet = []
        for i in range(replicas):
            name = f"sim-{i}"
            shard = channels[shard_for(name, addresses)]
            stub = cache_pb2_grpc.CacheManagerStub(shard[i % len(shard)])
            fleet.append(Replica(name, cfg, work, stub, lambda request: router_view.route(request, 10.0), stats))
        for replica in fleet:
            await replica.register()
        await asyncio.gather(*(replica.fill() for replica in fleet))
        gc.collect()
        gc.freeze()  # the generator's own collections stay out of its latency numbers
        start = time.perf_counter() + 0.05
        period = cfg.step_ms / 1e3
        end = start + warmup_s + measure_s
        tasks = [asyncio.create_task(r.run(start + period * i / replicas, end)) for i, r in enumerate(fleet)]
        await asyncio.sleep(max(0.0, start + warmup_s - time.perf_counter()))
        for replica in fleet:
            replica.measuring = True
        cpu0, own0, t0 = sum(map(cpu_seconds, server_pids)), time.process_time(), time.perf_counter()
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
        cpu1, own1 = sum(map(cpu_seconds, server_pids)), time.process_time()
    finally:
        await router_view.close()
        for shard in channels.values():
            for channel in shard:
                await channel.close()
    steps = stats.step_ms
    return {
        "replicas": replicas, "shards": len(addresses), "measured_s": round(wall, 2),
        "steps_asked_per_s": round(replicas * 1e3 / cfg.step_ms, 1),
        "steps_served_per_s": round(stats.steps_served / wall, 1),
        "step_p50_ms": round(pct(steps, 0.5), 3), "step_p99_ms": round(pct(steps, 0.99), 3),
        "step_p999_ms": round(pct(steps, 0.999), 3), "step_max_ms": round(max(steps, default=float("nan")), 3),
        "route_p50_ms": round(pct(stats.route_ms, 0.5), 3), "route_p99_ms": round(pct(stats.route_ms, 0.99), 3),
        "routes_per_s": round(len(stats.route_ms) / wall, 1),
        "gpu_time_lost": round(stats.stalled_s / (replicas * wall), 4),
        "server_cpu": round((cpu1 - cpu0) / wall, 3), "generator_cpu": round((own1 - own0) / wall, 3),
        "admitted_per_s": round(stats.admitted / wall, 1), "no_space": stats.no_space, "preempted": stats.preempted,
        "errors": stats.errors,
    }


def run_level(replicas: int, warmup_s: float, measure_s: float, cfg: SimConfig, shards: int = 1) -> dict:
    """Fresh cache managers, each pinned to a CPU of its own, and the load generator (a child
    process) on the next CPU: CPU 0 and 1 for one shard on a 2-core machine."""
    cpus = sorted(os.sched_getaffinity(0))
    servers = [start_server("cache_service", "--log-level", "WARNING", "--lease-seconds", "60",
                            "--max-pools", "4096", "--max-cache-memory-mib", "65536") for _ in range(shards)]
    generator_cpu = cpus[shards % len(cpus)]
    try:
        for i, (proc, _) in enumerate(servers):
            os.sched_setaffinity(proc.pid, {cpus[i % len(cpus)]})
        addresses = ",".join(f"127.0.0.1:{port}" for _, port in servers)
        pids = ",".join(str(proc.pid) for proc, _ in servers)
        child = subprocess.run(
            [sys.executable, "-m", "bench.fleet_scale", "--child", addresses, "--replicas", str(replicas),
             "--warmup", str(warmup_s), "--seconds", str(measure_s), "--server-pids", pids,
             "--config", json.dumps(asdict(cfg))],
            capture_output=True, text=True, timeout=warmup_s + measure_s + 120,
            preexec_fn=lambda: os.sched_setaffinity(0, {generator_cpu}))
        if child.returncode != 0:
            raise RuntimeError(f"load generator failed: {child.stderr[-2000:]}")
        return json.loads(child.stdout.strip().splitlines()[-1])
    finally:
        for proc, _ in servers:
            proc.terminate()
            proc.wait(timeout=30)


def knee(rows: list[dict]) -> int:
    """The largest fleet (of those run, in order) with Step p99 under target and every Step served."""
    best = 0
    for row in rows:
        if row["step_p99_ms"] < P99_TARGET_MS and row["steps_served_per_s"] >= 0.98 * row["steps_asked_per_s"]:
            best = max(best, row["replicas"])
    return best


COLUMNS = [("replicas", "replicas", ""), ("steps_asked_per_s", "Steps/s asked", ",.0f"),
           ("steps_served_per_s", "served", ",.0f"), ("step_p50_ms", "p50 ms", ".2f"),
           ("step_p99_ms", "p99 ms", ".2f"), ("step_p999_ms", "p99.9 ms", ".2f"), ("route_p99_ms", "Route p99", ".2f"),
           ("gpu_time_lost", "GPU lost", ".1%"), ("server_cpu", "server CPU", ".0%"),
           ("generator_cpu", "generator CPU", ".0%")]


def series(sizes: Sequence[int], warmup: float, seconds: float, cfg: SimConfig, shards: int,
           echo: Callable[[str], object]) -> list[dict]:
    """Fleet sizes in turn, each against fresh cache managers; stops once far past the knee."""
    rows: list[dict] = []
    for n in sizes:
        rows.append(run_level(n, warmup, seconds, cfg, shards))
        echo(table(rows[-1:], COLUMNS) if len(rows) == 1 else table(rows[-1:], COLUMNS).splitlines()[-1])
        if rows[-1]["steps_served_per_s"] < 0.8 * rows[-1]["steps_asked_per_s"]:
            break  # far past the knee: larger fleets only take longer to say the same
    return rows


def run(quick: bool, echo: Callable[[str], object] = print, sizes: Sequence[int] | None = None,
        shards: int = 1, streams: bool = True) -> dict:
    """One shard's series; then (one shard, streams, not quick) the same with unary Step and Route
    calls at 16-32 replicas, for comparison; then two shards' when the machine has a CPU for each and
    one for the load generator (the two-shard target: 1.8x one shard's knee). Tables go to `echo`."""
    cfg = SimConfig(step_stream=streams, route_stream=streams)
    sizes = list(sizes or ((8, 16, 32) if quick else (8, 12, 16, 24, 32, 48, 64)))
    warmup, seconds = (4.0, 6.0) if quick else (8.0, 15.0)
    from bench.harness import machine_info  # torch and transformers: the generator's child needs neither

    cpus = len(os.sched_getaffinity(0))
    echo(f"== fleet scale: {shards} cache manager shard(s), one CPU each, replicas of {cfg.batch} requests "
         f"stepping every {cfg.step_ms:.0f} ms, Route per new prompt (CPU: {machine_info(0)['cpu_label']}, {cpus} cores)")
    rows = series(sizes, warmup, seconds, cfg, shards, echo)
    result: dict = {"config": asdict(cfg), "shards": shards, "rows": rows, "knee_replicas": knee(rows),
                    "p99_target_ms": P99_TARGET_MS}
    echo(f"knee: {result['knee_replicas']} replicas with Step p99 < {P99_TARGET_MS:.0f} ms (target: 48 on one shard)")
    if shards == 1:  # the handlers' own cost, without gRPC: far steadier than the latencies above
        from bench import fleet_handlers

        n = 16 if quick else 48
        result["handlers"] = handlers = fleet_handlers.run(n, measure_s=4.0 if quick else 10.0)
        echo(f"in-process handlers at {n} replicas (bench.fleet_handlers): Step {handlers['step_us']:.0f} µs x "
             f"{handlers['steps_per_s']:,.0f}/s, Route {handlers['route_us']:.0f} µs x {handlers['routes_per_s']:,.0f}/s, "
             f"{handlers['handler_cpu']:.0%} of a core")
    if shards == 1 and streams and not quick:
        echo("== the same with a unary call per Step and per Route (before StepStream and RouteStream)")
        unary = series([n for n in sizes if 16 <= n <= 32], warmup, seconds,
                       SimConfig(step_stream=False, route_stream=False), 1, echo)
        result["unary_steps"] = {"rows": unary, "knee_replicas": knee(unary)}
        echo(f"unary calls: knee {knee(unary)} replicas")
    if shards == 1 and cpus >= 3:
        echo("== two shards, a CPU each, the load generator on a third")
        two = series([n * 2 for n in sizes], warmup, seconds, cfg, 2, echo)
        result["two_shards"] = {"rows": two, "knee_replicas": knee(two)}
        if result["knee_replicas"]:
            result["two_shards"]["knee_over_one"] = knee(two) / result["knee_replicas"]
        echo(f"two shards: knee {knee(two)} replicas (target: 1.8x one shard's)")
    elif shards == 1:
        result["two_shards"] = {"skipped": f"two shards and the load generator need 3 CPUs; this machine has {cpus}"}
        echo(f"two shards: skipped ({result['two_shards']['skipped']})")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--replicas", type=int, default=8, help=argparse.SUPPRESS)
    parser.add_argument("--warmup", type=float, default=8.0, help=argparse.SUPPRESS)
    parser.add_argument("--seconds", type=float, default=15.0, help=argparse.SUPPRESS)
    parser.add_argument("--shards", type=int, default=1, help="cache-manager shards (one CPU each, and one for "
                        "the load generator)")
    parser.add_argument("--unary", action="store_true", help="a unary call per Step and per Route, not a message "
                        "on StepStream and RouteStream (what replicas and routers sent before them)")
    parser.add_argument("--server-pids", default="", help=argparse.SUPPRESS)
    parser.add_argument("--config", default="{}", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        raw = json.loads(args.config)
        cfg = SimConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()})
        row = asyncio.run(drive(args.child.split(","), args.replicas, args.warmup, args.seconds, cfg,
                                [int(pid) for pid in args.server_pids.split(",")]))
        print(json.dumps(row))
        return
    print(json.dumps(run(args.quick, sizes=args.sizes, shards=args.shards, streams=not args.unary),
                     indent=2))


if __name__ == "__main__":
    main()
