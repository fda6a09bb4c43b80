"""The durable cache manager (`--state-dir`): what the journal costs and what a restart keeps.

1. Step p50/p99 over loopback gRPC with and without `--state-dir` (two servers, calls alternating
   between them so both see the same machine load; the 16-request workload of bench.cache_bench).
2. Restart-to-serving after `kill -9` with ~100k cached blocks: once replaying the journal (no
   snapshot since the blocks were cached), once from the snapshot the first restart wrote; from
   process start to the first answered Stats, and the server's own recovery time.
3. Hit rate of a repeated shared-prefix workload before vs after a `kill -9` + restart + re-attach
   (same incarnation), and for contrast after a restart without `--state-dir`.

    python -m bench.journal_bench [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable

import grpc

from bench.cache_bench import BS, pct, start_server, step_workload, to_proto, tokens
from protos import cache_pb2 as pb
from protos import cache_pb2_grpc


def _register(stub: cache_pb2_grpc.CacheManagerStub, num_blocks: int, incarnation: str = "bench-1",
              worker: str = "bench") -> pb.RegisterPoolResponse:
    return stub.RegisterPool(pb.RegisterPoolRequest(worker_id=worker, num_blocks=num_blocks, block_size=BS,
                                                    incarnation=incarnation), timeout=30)


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _summary(times: list[float]) -> dict:
    return {"n": len(times), "p50_us": statistics.median(times) * 1e6, "p99_us": pct(times, 0.99) * 1e6}


def bench_step_overhead(num_steps: int, state_dir: str) -> dict:
    """Step latency with and without the journal, calls alternating between the two servers."""
    steps = step_workload(num_steps, 16, 1024)
    plain, plain_port = start_server("cache_service", "--log-level", "WARNING")
    durable, durable_port = start_server("cache_service", "--log-level", "WARNING", "--state-dir", state_dir)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{plain_port}") as c1, \
                grpc.insecure_channel(f"127.0.0.1:{durable_port}") as c2:
            stubs = {"without": cache_pb2_grpc.CacheManagerStub(c1), "with": cache_pb2_grpc.CacheManagerStub(c2)}
            regs = {k: _register(s, 1 << 16) for k, s in stubs.items()}
            requests = {k: [to_proto(s, regs[k].pool_id, regs[k].epoch) for s in steps] for k in stubs}
            for k, stub in stubs.items():  # warm up
                for _ in range(20):
                    stub.Heartbeat(pb.HeartbeatRequest(pool_id=regs[k].pool_id, epoch=regs[k].epoch), timeout=10)
            times: dict[str, list[float]] = {"with": [], "without": []}
            for i in range(num_steps):
                order = ("with", "without") if i % 2 else ("without", "with")
                for k in order:
                    times[k].append(_timed(lambda k=k, i=i: stubs[k].Step(requests[k][i], timeout=10)))
            durability = stubs["with"].Stats(pb.StatsRequest(), timeout=10).durability
    finally:
        for p in (plain, durable):
            p.terminate()
            p.wait(timeout=10)
    out = {k: _summary(v) for k, v in times.items()}
    out["p50_ratio"] = out["with"]["p50_us"] / out["without"]["p50_us"]
    out["p99_ratio"] = out["with"]["p99_us"] / out["without"]["p99_us"]
    out["journal_bytes_per_step"] = durability.journal_bytes / max(1, durability.journal_records)
    out["max_fsync_ms"] = durability.max_fsync_seconds * 1e3
    return out


def _fill(stub: cache_pb2_grpc.CacheManagerStub, reg: pb.RegisterPoolResponse, num_blocks: int) -> int:
    """Cache ~num_blocks blocks: batches of 16 admitted-and-finished 1024-token prompts."""
    rng = random.Random(3)
    cached = rid = 0
    while cached < num_blocks:
        admits = []
        for _ in range(16):
            rid += 1
            admits.append(pb.Admit(request_id=f"f{rid}", token_ids=tokens(rng, 1024)))
        reply = stub.Step(pb.StepRequest(pool_id=reg.pool_id, epoch=reg.epoch, admits=admits), timeout=30)
        finishes = [pb.Finish(request_id=a.request_id, num_computed_tokens=1024, block_table=a.block_table)
                    for a in reply.admits]
        stub.Step(pb.StepRequest(pool_id=reg.pool_id, epoch=reg.epoch, finishes=finishes), timeout=30)
        cached += 16 * 1024 // BS
    return cached


def _restart(state_dir: str, port: int = 0) -> tuple[object, int, float]:
    """Start a cache manager on the state dir; returns it, its port and seconds to a first Stats."""
    started = time.perf_counter()
    extra = ["--state-dir", state_dir, "--log-level", "WARNING"]
    proc, bound = start_server("cache_service", *extra) if not port else start_server(
        "cache_service", "--port", str(port), *extra)
    with grpc.insecure_channel(f"127.0.0.1:{bound}") as channel:
        cache_pb2_grpc.CacheManagerStub(channel).Stats(pb.StatsRequest(), timeout=120)
    return proc, bound, time.perf_counter() - started


def bench_restart(num_blocks: int, state_dir: str) -> dict:
    proc, port = start_server("cache_service", "--log-level", "WARNING", "--state-dir", state_dir,
                              "--snapshot-mb", "100000")
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = cache_pb2_grpc.CacheManagerStub(channel)
            reg = _register(stub, num_blocks + 4096)
            cached = _fill(stub, reg, num_blocks)
    finally:
        proc.kill()
        proc.wait(timeout=10)
    out: dict = {"cached_blocks": cached}
    for phase in ("replay", "snapshot"):
        proc, port, seconds = _restart(state_dir)
        try:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                reply = cache_pb2_grpc.CacheManagerStub(channel).Stats(pb.StatsRequest(), timeout=30)
        finally:
            proc.kill()
            proc.wait(timeout=10)
        out[phase] = {"restart_to_serving_s": seconds, "recovery_s": reply.durability.recovery_seconds,
                      "restored_cached_blocks": reply.durability.num_restored_cached_blocks,
                      "replayed_records": reply.durability.num_replayed_records}
    out["snapshot_bytes"] = os.path.getsize(os.path.join(state_dir, "snapshot.bin"))
    return out


def _round(stub: cache_pb2_grpc.CacheManagerStub, reg: pb.RegisterPoolResponse, prompts: list[list[int]],
           tag: str) -> float:
    """Admit and finish every prompt (8 at a time); returns the share of prompt tokens that hit."""
    hit = total = 0
    for start in range(0, len(prompts), 8):
        admits = [pb.Admit(request_id=f"{tag}{start + i}", token_ids=p) for i, p in enumerate(prompts[start:start + 8])]
        reply = stub.Step(pb.StepRequest(pool_id=reg.pool_id, epoch=reg.epoch, admits=admits), timeout=30)
        hit += sum(a.cached_tokens for a in reply.admits)
        total += sum(len(p) for p in prompts[start:start + 8])
        finishes = [pb.Finish(request_id=a.request_id, num_computed_tokens=len(p), block_table=a.block_table)
                    for a, p in zip(reply.admits, prompts[start:start + 8], strict=True)]
        stub.Step(pb.StepRequest(pool_id=reg.pool_id, epoch=reg.epoch, finishes=finishes), timeout=30)
    return hit / total


def bench_hit_rate(state_dir: str) -> dict:
    """8 shared 512-token system prompts x 8 questions, repeated; hit rate per round."""
    rng = random.Random(4)
    stems = [tokens(rng, 512) for _ in range(8)]
    prompts = [stem + tokens(rng, 64) for stem in stems for _ in range(8)]
    out: dict = {}
    for durable in (True, False):
        extra = ["--state-dir", os.path.join(state_dir, "hit")] if durable else []
        proc, port = start_server("cache_service", "--log-level", "WARNING", *extra)
        try:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = cache_pb2_grpc.CacheManagerStub(channel)
                reg = _register(stub, 8192)
                _round(stub, reg, prompts, "warm")
                before = _round(stub, reg, prompts, "before")
        finally:
            proc.kill()
            proc.wait(timeout=10)
        proc, port = start_server("cache_service", "--log-level", "WARNING", "--port", str(port), *extra)
        try:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = cache_pb2_grpc.CacheManagerStub(channel)
                reg = _register(stub, 8192)  # the same incarnation: re-attach when the pool was kept
                after = _round(stub, reg, prompts, "after")
        finally:
            proc.terminate()
            proc.wait(timeout=10)
        key = "with_state_dir" if durable else "without_state_dir"
        out[key] = {"hit_rate_before": before, "hit_rate_after": after, "reattached": reg.restored}
    return out


def run(quick: bool, echo: Callable[[str], object] = print) -> dict:
    tmp = tempfile.mkdtemp(prefix="radixkv-journal-bench-")
    try:
        step = bench_step_overhead(300 if quick else 2000, os.path.join(tmp, "step"))
        echo(f"Step p50 {step['without']['p50_us']:.0f} us without the journal, {step['with']['p50_us']:.0f} us with "
             f"({step['p50_ratio']:.3f}x); p99 {step['without']['p99_us']:.0f} / {step['with']['p99_us']:.0f} us")
        restart = bench_restart(20_000 if quick else 100_000, os.path.join(tmp, "restart"))
        echo(f"restart with {restart['cached_blocks']} cached blocks: {restart['replay']['restart_to_serving_s']:.2f} s "
             f"replaying the journal, {restart['snapshot']['restart_to_serving_s']:.2f} s from the snapshot")
        hits = bench_hit_rate(tmp)
        echo(f"hit rate before/after a restart: with --state-dir {hits['with_state_dir']['hit_rate_before']:.3f} / "
             f"{hits['with_state_dir']['hit_rate_after']:.3f}, without {hits['without_state_dir']['hit_rate_before']:.3f}"
             f" / {hits['without_state_dir']['hit_rate_after']:.3f}")
        return {"step": step, "restart": restart, "hit_rate": hits}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    print(json.dumps(run(args.quick), indent=2))


if __name__ == "__main__":
    main()
