"""Cache service benchmark: `python -m bench.cache_bench` (a minute or two).

1. In-process match+insert ops/s for 1k-token prompts on a tree holding 10k cached sequences.
2. Eviction cost per call as the tree grows (1k, 10k, 50k leaves) next to a full leaf scan.
3. Step RPC latency (p50/p99) on loopback for 16-request batches, server in a subprocess, next
   to a bare grpc.aio echo of each Step request's bytes (bench/grpc_echo.py), calls interleaved.
4. The same Step sequence in-process vs over gRPC (ratio).
5. Route over a fleet of 64 pools x 10k cached sequences, in-process (p50 per call).
6. The tree on issue 12's fixed trace (testing/tree_trace.py), current vs previous tree and SGLang
   0.5.23's Rust tree (bench/sglang_tree.py), in lockstep, page 16 and 1.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import re
import selectors
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

import grpc
import numpy as np

from bench.grpc_echo import METHOD as ECHO_METHOD
from bench.sglang_tree import SGLANG_VERSION, SglangTreeDriver, load_sglang_tree
from cache_service import native
from cache_service.pool import Pool
from cache_service.pool_registry import PoolRegistry
from cache_service.radix_tree import RadixTree
from cache_service.registry_limits import RegistryLimits
from cache_service.routing import RouteQuery
from cache_service.schema import Admit, Extend, Finish, StepInput
from common.token_bytes import encode_tokens
from protos import cache_pb2 as pb
from protos import cache_pb2_grpc
from testing.tree_trace import make_trace, run_trace

REPO = Path(__file__).resolve().parents[1]
BS = 16
VOCAB = 32000


def tokens(rng: random.Random, n: int) -> list[int]:
    return np.random.default_rng(rng.getrandbits(64)).integers(0, VOCAB, n).tolist()


def pct(values: Sequence[float], q: float) -> float:
    """The q-quantile (0..1) by rank, no interpolation; nan for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# ---------------------------------------------------------------------- 1. match + insert


def bench_match_insert(num_sequences: int, prompt_len: int, num_ops: int) -> dict:
    """Tree of `num_sequences` cached prompts (100 shared 512-token stems + unique tails).

    Each op matches a 1k-token prompt and inserts it (as a finished request would): half are
    fully cached prompts, half share a stem and bring a new tail (split + new leaf).
    """
    rng = random.Random(0)
    stems = [tokens(rng, prompt_len // 2) for _ in range(100)]
    tree = RadixTree(BS)
    next_block = 0
    cached = []
    t0 = time.perf_counter()
    for i in range(num_sequences):
        prompt = stems[i % len(stems)] + tokens(rng, prompt_len - prompt_len // 2)
        n_pages = prompt_len // BS
        tree.insert(prompt, range(next_block, next_block + n_pages))
        next_block += n_pages
        cached.append(prompt)
    build_s = time.perf_counter() - t0
    queries = []
    for i in range(num_ops):
        if i % 2:
            queries.append(cached[rng.randrange(len(cached))])
        else:
            queries.append(stems[rng.randrange(len(stems))] + tokens(rng, prompt_len - prompt_len // 2))
    t0 = time.perf_counter()
    for prompt in queries:
        match = tree.match_prefix(prompt)
        n_pages = len(prompt) // BS
        tree.insert(prompt, match.block_ids + list(range(next_block, next_block + n_pages - len(match.block_ids))))
        next_block += n_pages
    elapsed = time.perf_counter() - t0
    return {
        "cached_sequences": num_sequences,
        "prompt_tokens": prompt_len,
        "tree_nodes": tree.num_nodes,
        "build_s": build_s,
        "ops": num_ops,
        "ops_per_s": num_ops / elapsed,
        "us_per_op": elapsed / num_ops * 1e6,
    }


# ---------------------------------------------------------------------- 2. eviction cost


def bench_evict(num_leaves: int, num_calls: int) -> dict:
    """Per-call cost of evict(1) with `num_leaves` unlocked leaves, touches in between."""
    rng = random.Random(1)
    tree = RadixTree(BS)
    stems = [tokens(rng, BS) for _ in range(64)]
    prompts = []
    for i in range(num_leaves):
        prompt = stems[i % len(stems)] + tokens(rng, BS)
        tree.insert(prompt, [2 * i, 2 * i + 1])
        prompts.append(prompt)
    block = 2 * num_leaves
    times = []
    for _ in range(num_calls):
        for _ in range(4):  # recent hits leave stale heap entries behind
            tree.match_prefix(prompts[rng.randrange(len(prompts))])
        t0 = time.perf_counter()
        tree.evict(1)
        times.append(time.perf_counter() - t0)
        # Keep the tree at size: a new leaf replaces the evicted one.
        prompt = stems[rng.randrange(len(stems))] + tokens(rng, BS)
        tree.insert(prompt, [block, block + 1])
        block += 2
        prompts.append(prompt)
    # Baseline: what one full scan of the leaves (the naive policy) costs at this size.
    scan_times = []
    for _ in range(5):
        t0 = time.perf_counter()
        leaves = [n for n in tree.iter_nodes() if not n.children and not n.lock_ref]
        min(leaves, key=lambda n: n.last_access)
        scan_times.append(time.perf_counter() - t0)
    return {
        "leaves": num_leaves,
        "evict_us_p50": statistics.median(times) * 1e6,
        "evict_us_mean": statistics.fmean(times) * 1e6,
        "evict_us_p99": pct(times, 0.99) * 1e6,
        "full_scan_us": statistics.median(scan_times) * 1e6,
    }


# ---------------------------------------------------------------------- 3./4. Step


def step_workload(num_steps: int, batch: int, prompt_len: int) -> list[StepInput]:
    """Steady state of a 16-request scheduler: every step finishes the previous batch and admits
    a new one (1k-token prompts sharing a 512-token stem), alternating with decode-like steps
    that extend every running request by a block."""
    rng = random.Random(2)
    stems = [tokens(rng, prompt_len // 2) for _ in range(8)]
    steps: list[StepInput] = []
    running: list[tuple[str, int]] = []
    rid = 0
    for s in range(num_steps):
        if s % 2 == 0:
            finishes = [Finish(r, [1] * 8, n) for r, n in running]
            running = []
            admits = []
            for _ in range(batch):
                rid += 1
                prompt = stems[rng.randrange(len(stems))] + tokens(rng, prompt_len - prompt_len // 2)
                admits.append(Admit(f"r{rid}", prompt, "", 1))
                running.append((f"r{rid}", prompt_len))
            steps.append(StepInput(finishes=finishes, admits=admits))
        else:
            running = [(r, n + 8) for r, n in running]
            steps.append(StepInput(extends=[Extend(r, n + BS) for r, n in running]))
    return steps


def to_proto(step: StepInput, pool_id: str, epoch: int) -> pb.StepRequest:
    """The StepRequest the model service would send (model_service/cache_client.py): prompts as
    packed_token_ids."""
    return pb.StepRequest(
        pool_id=pool_id,
        epoch=epoch,
        finishes=[
            pb.Finish(request_id=f.request_id, output_token_ids=f.output_token_ids,
                      num_computed_tokens=f.num_computed_tokens)
            for f in step.finishes
        ],
        extends=[pb.Extend(request_id=e.request_id, num_tokens=e.num_tokens) for e in step.extends],
        admits=[
            pb.Admit(request_id=a.request_id, packed_token_ids=encode_tokens(a.token_ids),
                     num_lookahead_tokens=a.num_lookahead_tokens)
            for a in step.admits
        ],
    )


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def summarize(kind: str, where: str, times: list[float]) -> dict:
    return {
        "step": kind, "where": where, "n": len(times),
        "p50_us": statistics.median(times) * 1e6, "p99_us": pct(times, 0.99) * 1e6,
        "mean_us": statistics.fmean(times) * 1e6,
    }


def bench_step_inprocess(steps: list[StepInput], num_blocks: int) -> list[dict]:
    pool = Pool("bench", 1, num_blocks, BS)
    times: dict[str, list[float]] = {"admit+finish": [], "extend": []}
    for step in steps:
        kind = "extend" if step.extends else "admit+finish"
        times[kind].append(timed(lambda s=step: pool.step(s)))
    pool.check_integrity()
    return [summarize(k, "in-process", v) for k, v in times.items()]


def start_server(module: str = "cache_service", *extra: str) -> tuple[subprocess.Popen, int]:
    """`python -m module --port 0 --host 127.0.0.1 ...` in a subprocess; returns it and its port."""
    proc = subprocess.Popen(
        [sys.executable, "-m", module, "--port", "0", "--host", "127.0.0.1", *extra],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
    )
    deadline, buffer = time.monotonic() + 30, b""
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if sel.select(timeout=1.0):
                chunk = os.read(proc.stdout.fileno(), 4096)
                if not chunk:
                    break
                buffer += chunk
                found = re.search(rb"listening on \S+:(\d+)", buffer)
                if found:
                    return proc, int(found.group(1))
    proc.kill()
    raise RuntimeError(f"{module} server did not start: {buffer!r}")


def bench_step_grpc(steps: list[StepInput], num_blocks: int) -> list[dict]:
    """Step over loopback gRPC; each call is followed by an echo of the same request bytes to a bare
    grpc.aio server (same client, same payload), so both distributions see the same load."""
    proc, port = start_server("cache_service", "--log-level", "WARNING")
    echo_proc, echo_port = start_server("bench.grpc_echo")
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel, \
                grpc.insecure_channel(f"127.0.0.1:{echo_port}") as echo_channel:
            echo = echo_channel.unary_unary(ECHO_METHOD)  # bytes in, bytes out
            stub = cache_pb2_grpc.CacheManagerStub(channel)
            reg = stub.RegisterPool(
                pb.RegisterPoolRequest(worker_id="bench", num_blocks=num_blocks, block_size=BS), timeout=10
            )
            requests = [to_proto(s, reg.pool_id, reg.epoch) for s in steps]
            payloads = [r.SerializeToString() for r in requests]
            for _ in range(20):  # warm the channels up
                stub.Heartbeat(pb.HeartbeatRequest(pool_id=reg.pool_id, epoch=reg.epoch), timeout=10)
                echo(payloads[0], timeout=10)
            times: dict[str, list[float]] = {"admit+finish": [], "extend": []}
            echo_times: dict[str, list[float]] = {"admit+finish": [], "extend": []}
            for step, request, payload in zip(steps, requests, payloads, strict=True):
                kind = "extend" if step.extends else "admit+finish"
                times[kind].append(timed(lambda r=request: stub.Step(r, timeout=10)))
                echo_times[kind].append(timed(lambda p=payload: echo(p, timeout=10)))
            empty = [timed(lambda: stub.Heartbeat(
                pb.HeartbeatRequest(pool_id=reg.pool_id, epoch=reg.epoch), timeout=10)) for _ in range(300)]
    finally:
        for p in (proc, echo_proc):
            p.terminate()
            p.wait(timeout=10)
    return ([summarize(k, "gRPC", v) for k, v in times.items()]
            + [summarize(k, "echo", v) for k, v in echo_times.items()]
            + [summarize("all", "gRPC", [t for v in times.values() for t in v]),
               summarize("all", "echo", [t for v in echo_times.values() for t in v]),
               summarize("heartbeat (empty)", "gRPC", empty)])


# ---------------------------------------------------------------------- main


# ---------------------------------------------------------------------- 5. route


def bench_route(num_pools: int, num_sequences: int, num_calls: int) -> dict:
    """Route p50 over `num_pools` pools, each caching `num_sequences` 512-token sequences
    (100 shared 256-token stems + unique tails); queries are 1k-token prompts on a stem."""
    rng = random.Random(5)
    stems = [tokens(rng, 256) for _ in range(100)]
    registry = PoolRegistry(lease_seconds=3600, limits=RegistryLimits.unlimited())  # 64 pools of 1M blocks
    started = time.perf_counter()
    for p in range(num_pools):
        pool = registry.register(f"replica-{p}", 1 << 20, BS, "fp", 0, f"10.0.0.{p}:50052")
        block = 0
        for i in range(num_sequences):
            seq = stems[(i + p) % 100] + tokens(rng, 256)
            pool.tree.insert(seq, list(range(block, block + len(seq) // BS)))
            block += len(seq) // BS
    build_s = time.perf_counter() - started
    queries = [stems[rng.randrange(100)] + tokens(rng, 768) for _ in range(num_calls)]
    times = []
    for i, q in enumerate(queries):
        query = RouteQuery(token_ids=tuple(q), model_fingerprint="fp", request_id=f"q{i}")
        times.append(timed(lambda query=query: registry.route(query)))
    return {"pools": num_pools, "sequences_per_pool": num_sequences, "build_s": build_s, "calls": num_calls,
            "route_us_p50": 1e6 * statistics.median(times), "route_us_p99": 1e6 * pct(times, 0.99)}


def bench_tree_trace(quick: bool, peer: ModuleType | None) -> list[dict]:
    """Page sizes 16 and 1; quick: 2,500 requests on a 1M-slot pool (still evicting). `peer`:
    SGLang's tree extension (bench/sglang_tree.py), run in the same lockstep."""
    num_requests, pool_tokens = (2_500, 1_000_000) if quick else (10_000, 2_000_000)
    trace = make_trace(num_requests)
    peers = [] if peer is None else [lambda ps, pool: SglangTreeDriver(peer, ps, pool)]
    rows = [run_trace(ps, trace, pool_tokens, peers=peers) for ps in (16, 1)]
    gc.collect()
    return rows


def table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """Right-aligned text table; columns are (key, title, format spec)."""
    cells = [[f"{row[key]:{fmt}}" for key, _, fmt in columns] for row in rows]
    widths = [max([len(title)] + [len(r[i]) for r in cells]) for i, (_, title, _) in enumerate(columns)]
    lines = [" | ".join(title.rjust(w) for (_, title, _), w in zip(columns, widths, strict=True))]
    lines.append("-+-".join("-" * w for w in widths))
    lines += [" | ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(lines)


def run(quick: bool, echo: Callable[[str], object] = print) -> dict:
    """Every phase; tables go to `echo`. Returns the results (what main writes as JSON)."""
    q = quick
    results: dict[str, object] = {}

    echo("== 1. match + insert, in-process (1k-token prompts, block_size 16)")
    mi = bench_match_insert(1000 if q else 10_000, 1024, 500 if q else 2000)
    results["match_insert"] = mi
    echo(table([mi], [("cached_sequences", "cached seqs", ""), ("tree_nodes", "tree nodes", ""),
                      ("build_s", "build s", ".2f"), ("ops_per_s", "match+insert ops/s", ",.0f"),
                      ("us_per_op", "us/op", ".1f")]))

    echo("\n== 2. eviction cost per evict(1) call as the tree grows")
    ev = [bench_evict(n, 500 if q else 2000) for n in ((1000, 10_000) if q else (1000, 10_000, 50_000))]
    results["evict"] = ev
    echo(table(ev, [("leaves", "leaves", ","), ("evict_us_p50", "evict p50 us", ".1f"),
                    ("evict_us_mean", "evict mean us", ".1f"), ("evict_us_p99", "evict p99 us", ".1f"),
                    ("full_scan_us", "one full leaf scan us", ",.0f")]))

    echo("\n== 3./4. Step, 16-request batches (admit+finish of 1k-token prompts; decode extends)")
    steps = step_workload(200 if q else 1000, 16, 1024)
    num_blocks = 4096
    local = bench_step_inprocess(steps, num_blocks)
    remote = bench_step_grpc(steps, num_blocks)
    results["step"] = local + remote
    echo(table(local + remote, [("step", "step kind", ""), ("where", "where", ""), ("n", "n", ""),
                                ("p50_us", "p50 us", ",.0f"), ("p99_us", "p99 us", ",.0f"),
                                ("mean_us", "mean us", ",.0f")]))
    by = {(r["step"], r["where"]): r for r in local + remote}
    for kind in ("admit+finish", "extend"):
        ratio = by[(kind, "gRPC")]["p50_us"] / by[(kind, "in-process")]["p50_us"]
        results[f"grpc_over_inprocess_{kind}"] = ratio
        echo(f"gRPC / in-process p50 for {kind}: {ratio:.1f}x")
    for kind in ("all", "admit+finish", "extend"):
        ratio = by[(kind, "gRPC")]["p99_us"] / by[(kind, "echo")]["p99_us"]
        results[f"step_over_echo_p99_{kind}"] = ratio
        echo(f"Step / bare grpc.aio echo of the same bytes, p99, {kind}: {ratio:.2f}x (target <= 2)")

    echo("\n== 5. Route over a fleet (in-process; target p50 < 1 ms at 64 pools x 10k sequences)")
    rt = bench_route(8 if q else 64, 1000 if q else 10_000, 200 if q else 2000)
    results["route"] = rt
    echo(table([rt], [("pools", "pools", ""), ("sequences_per_pool", "seqs/pool", ","),
                      ("build_s", "build s", ".1f"), ("route_us_p50", "route p50 us", ",.0f"),
                      ("route_us_p99", "route p99 us", ",.0f")]))

    no_core = native.unavailable_reason()
    results["allocator_core"] = "C" if no_core is None else "Python"
    echo("\n== 6. tree on issue 12's trace: 100 x 512-token prefixes, 10k requests of 1,024 tokens, 2M slots; "
         f"block allocator: {'C core' if no_core is None else f'Python code ({no_core})'}")
    peer = load_sglang_tree()
    if isinstance(peer, str):
        echo(f"SGLang's tree is not run: {peer}")
        peer = None
    tt = bench_tree_trace(q, peer)
    results["tree_trace"] = tt
    rows = [{"ps": r["page_size"], "tree": name, **r[name]} for r in tt for name in ("new", "new_hashed", "old")]
    rows += [{"ps": r["page_size"], "tree": f"{name} {SGLANG_VERSION}", **summary}
             for r in tt for name, summary in r["peers"].items()]
    echo(table(rows, [("ps", "page", ""), ("tree", "tree", ""), ("req_s", "req/s", ",.0f"),
                      ("match_us", "match us", ".1f"), ("insert_us", "insert us", ".1f"),
                      ("evict_us", "evict us", ".1f"), ("hit_rate", "hit rate", ".3f")]))
    for r in tt:
        versus = (f"; radixkv / SGLang {SGLANG_VERSION}'s Rust tree {r['new_over_sglang']:.2f}x "
                  f"(target {2 if r['page_size'] > 1 else 1.5}x)" if "new_over_sglang" in r else "")
        echo(f"page {r['page_size']}: current / previous tree {r['new_over_old']:.2f}x "
             f"(with page hashes read {r['new_hashed_over_old']:.2f}x){versus}")

    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes (smoke run)")
    args = parser.parse_args()
    results = run(args.quick)
    out = REPO / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "cache_bench.json").write_text(json.dumps(results, indent=2))
    print(f"\nresults written to {out / 'cache_bench.json'}")


if __name__ == "__main__":
    main()
