"""Fleet: the cache manager + two model replicas (`--num-threads 1` each) + the router
(`python -m router`), all real processes. A workload of 8 prefix groups x 8 requests (a 1024-token
shared prefix each, a 32-token question, 32 tokens out) arriving in a shuffled order (one request
every `gap_s`), the same prompts and order for every policy: kv (the cache manager's Route:
cached prefix + load) vs round-robin vs least-loaded. The replicas and the cache manager stay up;
between policies both pools are cleared (cache.proto Clear) and a fresh router is started.
Per policy: prefix hit rate (sum of usage.cached_prompt_tokens / prompt tokens), TTFT p50/p99
from each request's send, throughput (completion tokens / wall), requests per replica, and the
tokens that missed because they were cached on the other replica (usage.miss_other_replica_tokens).

Router proxy overhead per streamed token, measured two ways:
- paired (the headline): one request streamed directly from replica 0 and the same prompt,
  cached on replica 0, streamed through the kv router at the same time, so both decode in the
  same batch steps of the same replica; every routed token's arrival minus the arrival of the
  latest direct token before it is what the extra hop costs that token (step-time jitter, which
  is tens of ms on this machine, cancels out). The median over all tokens of all repetitions.
- sequential: batch-1 decode (64 tokens after a 16-token prompt) through the router vs direct,
  the two alternating; the difference of the medians of each run's p50 inter-token gap (kept for
  comparison: it carries the jitter of whole steps).
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import importlib
import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import grpc

from bench.harness import (
    BLOCK_SIZE,
    REPO,
    START_TIMEOUT_S,
    Json,
    Streamed,
    alternate,
    clear_pools,
    repetitions,
    stream_async,
    stream_concurrent,
    stream_stats,
    stream_sync,
    summary,
    table,
)
from bench.workloads.base import Context, Workload
from protos import model_pb2_grpc
from scripts.service_process import ServiceProcess

POLICIES = (("kv", "kv"), ("round-robin", "rr"), ("least-loaded", "ll"))


def router_missing() -> str | None:
    try:
        importlib.import_module("router.__main__")
    except Exception as error:  # not written yet, or broken: the rest of the suite runs anyway
        return f"router/ is not importable yet ({type(error).__name__}: {error}): fleet workload skipped"
    return None


def sizes(ctx: Context) -> Json:
    if ctx.quick:
        return {"groups": 2, "per_group": 4, "prefix": 256, "question": 16, "new_tokens": 8, "gap_s": 0.05,
                "replicas": 2, "overhead_reps": 2, "num_blocks": 1024}
    return {"groups": 8, "per_group": 8, "prefix": 1024, "question": 32, "new_tokens": 32, "gap_s": 0.1,
            "replicas": 2, "overhead_reps": 4, "num_blocks": 2048}


class Fleet:
    """Cache manager + replicas (started once) and a router per policy. `cache_args` /
    `replica_args`: further flags of the cache manager / of every replica (the pulls workload's)."""

    def __init__(self, ctx: Context, cfg: Json, cache_args: Sequence[str] = (), replica_args: Sequence[str] = ()) -> None:
        self.ctx, self.cfg = ctx, cfg
        self.cache_args, self.replica_args = list(cache_args), list(replica_args)
        self.log: collections.deque[str] = collections.deque(maxlen=300)
        self.cache: ServiceProcess | None = None
        self.replicas: list[ServiceProcess] = []
        self.router: ServiceProcess | None = None
        self.cache_addr = ""
        self.replica_addrs: list[str] = []

    def pids(self) -> list[int]:
        return [p.pid for p in (self.cache, *self.replicas, self.router) if p is not None and p.running()]

    def start(self) -> None:
        self.cache = ServiceProcess("cache_service", ["--host", "127.0.0.1", "--port", "0", "--log-level", "WARNING",
                                                      *self.cache_args], self.log.append, cwd=str(REPO))
        self.cache_addr = self.cache.wait_listening(60.0)
        self.cache.wait_serving(60.0)
        for i in range(self.cfg["replicas"]):
            self.replicas.append(ServiceProcess("model_service", [
                "--host", "127.0.0.1", "--port", "0", "--cache-addr", self.cache_addr, "--worker-id", f"fleet-{i}",
                "--num-threads", "1", "--num-blocks", str(self.cfg["num_blocks"]), "--block-size", str(BLOCK_SIZE),
                "--dtype", self.ctx.dtype, "--device", "cpu", "--attention", "torch", "--log-level", "WARNING",
                *self.replica_args], self.log.append, cwd=str(REPO)))
        for replica in self.replicas:
            self.replica_addrs.append(replica.wait_listening(START_TIMEOUT_S, watch=[self.cache]))
            replica.wait_serving(START_TIMEOUT_S, watch=[self.cache])

    def start_router(self, policy: str) -> str:
        args = ["--host", "127.0.0.1", "--port", "0", "--cache-addr", self.cache_addr, "--policy", policy,
                "--log-level", "WARNING"]
        for addr in self.replica_addrs:
            args += ["--replica", addr]
        self.router = ServiceProcess("router", args, self.log.append, cwd=str(REPO))
        addr = self.router.wait_listening(60.0, watch=[self.cache, *self.replicas])
        self.router.wait_serving(60.0, watch=[self.cache, *self.replicas])
        return addr

    def stop_router(self) -> None:
        if self.router is not None:
            self.router.stop(10.0)
        self.router = None

    def stop(self) -> None:
        self.stop_router()
        for p in (*self.replicas, self.cache):
            if p is not None:
                p.stop(10.0)
        self.replicas, self.cache = [], None

    @contextmanager
    def running(self) -> Iterator[Fleet]:
        """Started (its processes counted as the workload's by the load monitor) and stopped on the
        way out; an error raised inside carries the fleet's output."""
        self.ctx.extra_pids.clear()
        try:
            with self.ctx.progress.run("starting cache manager + replicas", 0):
                self.start()
            self.ctx.extra_pids.update(self.pids())
            yield self
        except Exception as error:
            error.add_note("--- fleet output ---\n" + "\n".join(self.log))
            raise
        finally:
            self.stop()
            self.ctx.extra_pids.clear()


def warm_up(ctx: Context, fleet: Fleet, cfg: Json) -> None:
    """One group of the workload's shape on each replica directly, then empty pools: the first
    policy measured must not be the one that pays each replica's first long prefill and batch
    (allocator growth, first-call kernel setup), which are tens of percent of a run's TTFT."""
    for addr in fleet.replica_addrs:
        prefix = ctx.prompts.ids(cfg["prefix"])
        group = [prefix + ctx.prompts.ids(cfg["question"]) for _ in range(cfg["per_group"])]
        stream_concurrent(addr, group[:1], 2)
        stream_concurrent(addr, group[1:], 4)
    clear_pools(fleet.cache_addr)


def policy_run(ctx: Context, fleet: Fleet, policy: str, prompts: list[list[int]], cfg: Json) -> Json:
    """The prompts through a fresh router of `policy`, the pools cleared first."""
    clear_pools(fleet.cache_addr)
    addr = fleet.start_router(policy)
    try:
        with grpc.insecure_channel(addr) as channel:  # warm-up through this router
            stream_sync(model_pb2_grpc.ModelServiceStub(channel), ctx.prompts.ids(16), 2)
        clear_pools(fleet.cache_addr)
        arrivals = [i * cfg["gap_s"] for i in range(len(prompts))]
        return routed_run(ctx, addr, prompts, cfg["new_tokens"], arrivals, f"fleet {policy}")
    finally:
        fleet.stop_router()


def routed_run(ctx: Context, addr: str, prompts: list[list[int]], new_tokens: int, arrivals: Sequence[float],
               label: str) -> Json:
    """Request i sent to `addr` (a router) `arrivals[i]` seconds after the start: stream_stats, the
    throughput (completion tokens / wall), requests per replica (Usage.served_by), prompt tokens
    that missed because another replica held them, and those pulled from another replica."""
    with ctx.progress.run(label, len(prompts) * new_tokens) as tick:
        start = time.perf_counter()
        wall, results = stream_concurrent(addr, prompts, new_tokens, arrivals_s=arrivals, on_tokens=tick)
    out = stream_stats(start, results)
    served = collections.Counter(r.usage.served_by or "?" for r in results)
    out.update(wall_s=wall, tok_s=out["completion_tokens"] / wall, requests_per_replica=dict(served),
               miss_other_replica_tokens=sum(r.usage.miss_other_replica_tokens for r in results),
               cached_peer_tokens=sum(r.usage.cached_peer_tokens for r in results),
               ttft_samples_s=[r.ttft for r in results])
    return out


def _paired_overhead(ctx: Context, router_addr: str, replica_addr: str, reps: int, deadline: float) -> Json:
    """Per-token cost of the router hop with step jitter cancelled (see the module docstring)."""
    deltas_ms: list[float] = []
    unpaired = 0

    async def pair(prompt: list[int]) -> tuple[Streamed, Streamed]:
        async with grpc.aio.insecure_channel(replica_addr) as dc, grpc.aio.insecure_channel(router_addr) as rc:
            direct, routed = model_pb2_grpc.ModelServiceStub(dc), model_pb2_grpc.ModelServiceStub(rc)
            await stream_async(direct, prompt, 1)  # its pages are now cached on replica 0: kv routes there
            return tuple(await asyncio.gather(stream_async(direct, prompt, 64), stream_async(routed, prompt, 64)))

    for rep in repetitions(reps, deadline):
        with ctx.progress.run(f"router overhead (paired) rep {rep + 1}", 0):
            direct, routed = asyncio.run(pair(ctx.prompts.ids(8 * BLOCK_SIZE)))
        if routed.usage.served_by != replica_addr:
            unpaired += 1  # the router sent it elsewhere: no common steps to compare
            continue
        step_s = statistics.median(g for g in direct.gaps() if g > 0)
        for t in routed.times:
            i = bisect.bisect_right(direct.times, t) - 1
            if i >= 0 and t - direct.times[i] < step_s / 2:  # the same step's direct token
                deltas_ms.append(1e3 * (t - direct.times[i]))
    return {"paired_tokens": len(deltas_ms), "unpaired_reps": unpaired,
            "paired_overhead_ms": summary(deltas_ms) if deltas_ms else None,
            "paired_overhead_p50_ms": statistics.median(deltas_ms) if deltas_ms else None}


def _router_overhead(ctx: Context, fleet: Fleet, reps: int, deadline: float) -> Json:
    addr = fleet.start_router("round-robin")
    direct_gap: list[float] = []
    routed_gap: list[float] = []
    direct_ttft: list[float] = []
    routed_ttft: list[float] = []
    try:
        with grpc.insecure_channel(addr) as rc, grpc.insecure_channel(fleet.replica_addrs[0]) as dc:
            routed, direct = model_pb2_grpc.ModelServiceStub(rc), model_pb2_grpc.ModelServiceStub(dc)
            stream_sync(routed, ctx.prompts.ids(16), 4)
            stream_sync(direct, ctx.prompts.ids(16), 4)

            def one(stub, gaps: list[float], ttfts: list[float]) -> None:
                s = stream_sync(stub, ctx.prompts.ids(16), 64)
                gaps.append(1e3 * statistics.median(s.gaps()))
                ttfts.append(s.ttft)

            for rep in repetitions(reps, deadline):
                with ctx.progress.run(f"router overhead rep {rep + 1}", 0):
                    alternate(rep, lambda: one(direct, direct_gap, direct_ttft),
                              lambda: one(routed, routed_gap, routed_ttft))
    finally:
        fleet.stop_router()
    addr = fleet.start_router("kv")
    try:
        paired = _paired_overhead(ctx, addr, fleet.replica_addrs[0], reps, deadline)
    finally:
        fleet.stop_router()
    return {"direct_inter_token_p50_ms": summary(direct_gap), "router_inter_token_p50_ms": summary(routed_gap),
            "direct_ttft_s": summary(direct_ttft), "router_ttft_s": summary(routed_ttft),
            "sequential_overhead_per_token_ms": statistics.median(routed_gap) - statistics.median(direct_gap),
            "overhead_per_token_ms": paired["paired_overhead_p50_ms"], "paired": paired,
            "overhead_ttft_ms": 1e3 * (statistics.median(routed_ttft) - statistics.median(direct_ttft))}


def group_prompts(ctx: Context, cfg: Json) -> list[list[int]]:
    """`groups` prefixes x `per_group` questions each, shuffled (seeded)."""
    prompts = []
    for _ in range(cfg["groups"]):
        prefix = ctx.prompts.ids(cfg["prefix"])
        prompts += [prefix + ctx.prompts.ids(cfg["question"]) for _ in range(cfg["per_group"])]
    order = ctx.prompts.permutation(len(prompts))
    return [prompts[i] for i in order]


def run(ctx: Context, deadline: float) -> Json:
    cfg = sizes(ctx)
    g, n = cfg["groups"], cfg["per_group"]
    prompts = group_prompts(ctx, cfg)
    ideal = g * (n - 1) * (cfg["prefix"] // BLOCK_SIZE) * BLOCK_SIZE / sum(len(p) for p in prompts)
    detail: Json = {"config": {**cfg, "requests": len(prompts), "order": "shuffled (seeded)",
                               "replica_threads": 1}, "ideal_hit_rate": ideal, "policies": {}}
    with Fleet(ctx, cfg).running() as fleet:
        with ctx.progress.run("warming up the replicas", 0):
            warm_up(ctx, fleet, cfg)
        for policy, _ in POLICIES:
            detail["policies"][policy] = policy_run(ctx, fleet, policy, prompts, cfg)
        detail["router_overhead"] = _router_overhead(ctx, fleet, cfg["overhead_reps"], deadline)
    return detail


def flat(d: Json) -> Json:
    out: Json = {"fleet_ideal_hit_rate": d["ideal_hit_rate"]}
    for policy, tag in POLICIES:
        p = d["policies"].get(policy)
        if p is None:
            continue
        out.update({f"fleet_{tag}_hit_rate": p["hit_rate"], f"fleet_{tag}_ttft_p50_s": p["ttft_s"]["p50"],
                    f"fleet_{tag}_ttft_p99_s": p["ttft_s"]["p99"], f"fleet_{tag}_tok_s": p["tok_s"],
                    f"fleet_{tag}_wall_s": p["wall_s"]})
    if "router_overhead" in d:
        out["router_overhead_per_token_ms"] = d["router_overhead"]["overhead_per_token_ms"]
        out["router_overhead_ttft_ms"] = d["router_overhead"]["overhead_ttft_ms"]
        out["router_overhead_sequential_per_token_ms"] = d["router_overhead"].get("sequential_overhead_per_token_ms")
    return out


def report(d: Json) -> str:
    c = d["config"]
    rows = []
    for policy, _ in POLICIES:
        p = d["policies"].get(policy)
        if p is None:
            continue
        rows.append([policy, f"{100 * p['hit_rate']:.0f}%", f"{p['ttft_s']['p50']:.2f} / {p['ttft_s']['p99']:.2f}",
                     f"{p['tok_s']:.1f}", f"{p['wall_s']:.1f}", str(p["miss_other_replica_tokens"]),
                     " ".join(str(v) for _, v in sorted(p["requests_per_replica"].items()))])
    text = (f"fleet: {c['replicas']} replicas x 1 thread + router; {c['groups']} groups x {c['per_group']} requests, "
            f"{c['prefix']}-token prefix + {c['question']}, {c['new_tokens']} out, shuffled, one every {c['gap_s']} s "
            f"(ideal hit rate {100 * d['ideal_hit_rate']:.0f}%)\n"
            + table(rows, ["policy", "hit", "TTFT p50/p99 s", "tok/s", "wall s", "missed: other replica",
                           "requests/replica"]))
    if "router_overhead" in d:
        o = d["router_overhead"]
        paired = o["overhead_per_token_ms"]
        text += ("\nrouter proxy overhead per token, paired in the same steps: "
                 + (f"p50 {paired:.2f} ms over {o['paired']['paired_tokens']} tokens" if paired is not None
                    else "no paired tokens")
                 + f"\nsequential batch-1 decode: inter-token p50 {o['router_inter_token_p50_ms']['median']:.1f}"
                 f" ms via router vs {o['direct_inter_token_p50_ms']['median']:.1f} ms direct "
                 f"({o['sequential_overhead_per_token_ms']:+.2f} ms/token); TTFT {o['overhead_ttft_ms']:+.1f} ms")
    return text


FLEET = Workload(name="fleet", help="2 replicas + router: kv vs round-robin vs least-loaded routing",
                 run=run, flat=flat, report=report, cap_s=480.0,
                 runs=lambda ctx: 2 + len(POLICIES) + 2 * sizes(ctx)["overhead_reps"],
                 needs_services=False, needs_model=False, available=router_missing)
