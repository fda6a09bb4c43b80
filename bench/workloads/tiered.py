"""Tiered KV cache (issue 29): host-memory and disk tiers below a replica's device pool.

Every configuration runs on its own cache manager + model replica (real processes, started once,
`--num-threads` as the suite's), all with the same small device pool (`--num-blocks`):
- off: no tier below the device pool;
- host: `--host-cache-gib` large enough for the whole working set, `--offload-policy evict`;
- host_wt: the same host tier with `--offload-policy write-through` (what the default policy is
  chosen by: its multi-turn and all-miss rows next to host's);
- disk: `--disk-cache-dir` (a fresh 0700 temp folder) + `--disk-cache-gib`, no host tier, evict.

Four measurements, in this order:
1. multi-turn over the device pool: C conversations of T turns, each turn's prompt the whole
   history so far (earlier prompts + the replica's own greedy answers) + a new user message of
   random token ids (no chat template); first messages of different lengths. The turns go round
   robin over the conversations (turn 1 of every conversation, then turn 2, ...), `concurrency`
   in flight at once, a conversation's next turn sent once its previous answer has arrived. The
   device pool is a quarter (or less) of the working set (the conversations' final histories), so
   between two turns of a conversation the others' turns evict its pages from the device pool:
   with no tier every turn recomputes its whole history. Per configuration: throughput
   (completion tokens / wall, and prompt + completion tokens / wall), mean TTFT, prefix hit rate
   (sum of Usage.cached_prompt_tokens / prompt tokens over every turn, turn 1 included) and its
   split by tier (Usage.cached_{device,host,disk}_tokens). One run per configuration in full mode
   (the tier-off run alone is ~1.5 minutes on 2 quiet cores); each replica is warmed up first.
2. 1024-token prompt, TTFT: on the host replica a prompt never seen (miss), the same prompt again
   (device hit), then again after the pool was cleared (cache.proto Clear: with the evict policy
   the device pages are copied to the host tier first; a short request makes the replica step
   until the cache manager reports no copy pending) (host-tier hit); on the disk replica a new
   prompt (miss), cleared, again (disk-tier hit). Ratios hit / miss of the same replica.
3. restart from disk: on the disk replica a new 1024-token prompt (miss), pushed down to disk,
   then the replica and its cache manager stopped (SIGTERM) and started afresh on the same disk
   folder, one 8-token warm-up request, and the same prompt again: its TTFT / the miss, and
   Usage.cached_disk_tokens.
4. all-miss: distinct random prompts (no two share a page) all at once, on each configuration,
   the order rotating every repetition (the pool keeps evicting earlier repetitions' pages, so the
   tiers do their offloads); throughput loss of each tiered configuration vs off, per repetition,
   median.
Greedy outputs: every configuration's answers in 1. and 4. are compared token for token with
the tier-off replica's; in 2. and 3. every repeat's answer with its miss's and each miss's with
transformers' (the same prompts, one batch, fp32).
"""

from __future__ import annotations

import asyncio
import collections
import math
import shutil
import statistics
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict

from bench.harness import (
    BLOCK_SIZE,
    REPO,
    START_TIMEOUT_S,
    Json,
    Streamed,
    clear_pools,
    identical_fraction,
    kernels_line,
    machine_info,
    rotate,
    stream_async,
    stream_concurrent,
    stream_record,
    stream_sync,
    summary,
    table,
)
from bench.workloads.base import Context, Workload
from protos import cache_pb2, cache_pb2_grpc, model_pb2_grpc
from scripts.service_process import ServiceProcess

# host_wt: the host tier with --offload-policy write-through (the others: evict), for choosing the default
CONFIGS = ("off", "host", "host_wt", "disk")
WITH_TIERS = ("host", "host_wt", "disk")
POLICY = "evict"
PUSH_DOWN_TIMEOUT_S = 30.0
TIER_FLAGS = ("--host-cache-gib", "--disk-cache-dir", "--disk-cache-gib", "--offload-policy")


def flags_missing() -> str | None:
    """A reason to skip (the model service has no tier flags yet), or None."""
    try:
        from model_service.__main__ import build_parser

        known = {o for a in build_parser()._actions for o in a.option_strings}
    except Exception as error:  # a broken import must not stop the rest of the suite
        return f"model_service's parser did not load ({type(error).__name__}: {error}): tiered workload skipped"
    missing = [f for f in TIER_FLAGS if f not in known]
    return f"model_service has no {', '.join(missing)} yet: tiered workload skipped" if missing else None


def sizes(ctx: Context) -> Json:
    if ctx.quick:
        return {"conversations": 12, "turns": 4, "first_message": (240, 320), "message": 16, "answer": 8,
                "concurrency": 2, "multiturn_reps": 1, "multiturn_configs": CONFIGS, "prompt": 256,
                "ttft_reps": 1, "ttft_answer": 8, "all_miss_requests": 4, "all_miss_prompt": (64, 128),
                "all_miss_answer": 8, "all_miss_reps": 2}
    # one multi-turn run per configuration: the tier-off one alone is ~1.5 minutes on 2 quiet cores
    return {"conversations": 24, "turns": 6, "first_message": (600, 1000), "message": 32, "answer": 16,
            "concurrency": 4, "multiturn_reps": 1, "multiturn_configs": CONFIGS, "prompt": 1024,
            "ttft_reps": 3, "ttft_answer": 16, "all_miss_requests": 12, "all_miss_prompt": (128, 256),
            "all_miss_answer": 32, "all_miss_reps": 8}


def blocks(tokens: int) -> int:
    return -(-tokens // BLOCK_SIZE)


def page_bytes(ctx: Context) -> int:
    """KV bytes of one page (block) of the model in the run's dtype."""
    cfg = ctx.loaded.model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    itemsize = 4 if ctx.dtype == "float32" else 2
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * BLOCK_SIZE * itemsize


def plan(ctx: Context, cfg: Json, firsts: Sequence[int]) -> Json:
    """Pool and tier sizes from the conversations' sizes: the device pool a quarter of the working
    set (and no smaller than the requests in flight need), each tier the working set x 1.5."""
    T, M, A = cfg["turns"], cfg["message"], cfg["answer"]
    finals = [f + (T - 1) * (M + A) + A for f in firsts]  # history after the last answer
    working_set = sum(blocks(n) for n in finals)
    in_flight = cfg["concurrency"] * (blocks(max(finals)) + 4)  # + lookahead
    num_blocks = max(working_set // 4, in_flight, blocks(cfg["prompt"] + cfg["ttft_answer"]) + 8,
                     cfg["all_miss_requests"] * (blocks(cfg["all_miss_prompt"][1] + cfg["all_miss_answer"]) + 4))
    tier_gib = math.ceil(1.5 * working_set * page_bytes(ctx) / 2**30 * 100) / 100
    return {"working_set_blocks": working_set, "working_set_tokens": sum(finals), "num_blocks": num_blocks,
            "working_set_over_pool": working_set / num_blocks, "in_flight_blocks": in_flight,
            "page_bytes": page_bytes(ctx), "tier_gib": tier_gib, "offload_policy": POLICY}


# ---------------------------------------------------------------------- the services


class Replica:
    """One configuration: its own cache manager + model service, restartable (same arguments)."""

    def __init__(self, ctx: Context, name: str, num_blocks: int, tier_args: list[str]) -> None:
        self.ctx, self.name, self.num_blocks, self.tier_args = ctx, name, num_blocks, tier_args
        self.worker_id = f"tiered-{name}"
        self.log: collections.deque[str] = collections.deque(maxlen=400)
        self.cache: ServiceProcess | None = None
        self.model: ServiceProcess | None = None
        self.addr = self.cache_addr = ""
        self._channel: grpc.Channel | None = None  # kept open: a new connection per request would add to TTFT

    def launch(self) -> None:
        """Starts both processes; the model service is still loading (`wait`)."""
        self.log.clear()
        self.cache = ServiceProcess("cache_service", ["--host", "127.0.0.1", "--port", "0", "--log-level", "WARNING"],
                                    self.log.append, cwd=str(REPO))
        self.cache_addr = self.cache.wait_listening(60.0)
        self.cache.wait_serving(60.0)
        self.model = ServiceProcess("model_service", [
            "--host", "127.0.0.1", "--port", "0", "--cache-addr", self.cache_addr, "--worker-id", self.worker_id,
            "--num-threads", str(self.ctx.threads), "--num-blocks", str(self.num_blocks),
            "--block-size", str(BLOCK_SIZE), "--dtype", self.ctx.dtype, "--device", "cpu", "--attention", "torch",
            "--log-level", "INFO", *self.tier_args], self.log.append, cwd=str(REPO))

    def wait(self) -> None:
        assert self.model is not None and self.cache is not None
        self.addr = self.model.wait_listening(START_TIMEOUT_S, watch=[self.cache])
        self.model.wait_serving(START_TIMEOUT_S, watch=[self.cache])

    def stop(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        for p in (self.model, self.cache):
            if p is not None:
                p.stop(30.0)  # a graceful stop: the disk tier writes what it holds
        self.model = self.cache = None

    def pids(self) -> list[int]:
        return [p.pid for p in (self.cache, self.model) if p is not None and p.running()]

    def kernels(self) -> str:
        return kernels_line(self.log)

    def tier_lines(self) -> list[str]:
        """The model service's start-up line about its tiers."""
        return [line for line in self.log if "KV tiers" in line][:2]

    def stats(self, wait_s: float = 30.0) -> cache_pb2.PoolStats:
        """The pool's Stats (a replica just started registers its pool shortly after it serves)."""
        deadline = time.perf_counter() + wait_s
        with grpc.insecure_channel(self.cache_addr) as channel:
            stub = cache_pb2_grpc.CacheManagerStub(channel)
            while True:
                for pool in stub.Stats(cache_pb2.StatsRequest(), timeout=30).pools:
                    if pool.worker_id == self.worker_id:
                        return pool
                if time.perf_counter() > deadline:
                    raise RuntimeError(f"the cache manager of {self.name} has no pool {self.worker_id}")
                time.sleep(0.1)

    def tier_stats(self) -> Json:
        s = self.stats()
        out: Json = {"num_evicted_blocks": s.num_evicted_blocks, "hit_tokens": s.hit_tokens,
                     "queried_tokens": s.queried_tokens}
        for tier in ("host_tier", "disk_tier"):
            if s.HasField(tier):
                out[tier] = MessageToDict(getattr(s, tier), preserving_proto_field_name=True)
        return out

    def generate(self, ids: list[int], max_tokens: int) -> Streamed:
        if self._channel is None:
            self._channel = grpc.insecure_channel(self.addr)
            grpc.channel_ready_future(self._channel).result(timeout=30)
        return stream_sync(model_pb2_grpc.ModelServiceStub(self._channel), ids, max_tokens)

    def push_down(self) -> Json:
        """Clear the device pool (its pages are copied to the first lower tier), then step the
        replica with short requests (shorter than a page: they cache nothing) until the cache
        manager reports no copy pending: copies are ordered in Step replies and count once the
        replica reports them done in a later Step."""
        began = time.perf_counter()
        evicted = clear_pools(self.cache_addr, [self.worker_id])
        flushes = 0
        while True:
            self.generate(self.ctx.prompts.ids(BLOCK_SIZE // 2), 2)
            flushes += 1
            s = self.stats()
            pending = sum(getattr(s, t).num_pending_pages for t in ("host_tier", "disk_tier") if s.HasField(t))
            if (pending == 0 and flushes >= 2) or time.perf_counter() - began > PUSH_DOWN_TIMEOUT_S:
                break
            time.sleep(0.05)
        return {"evicted_blocks": evicted, "flush_requests": flushes, "pending_pages": pending,
                "seconds": time.perf_counter() - began}


def start_all(replicas: Sequence[Replica]) -> None:
    """Start them side by side (loading the model is most of it)."""
    for r in replicas:
        r.launch()
    for r in replicas:
        r.wait()


# ---------------------------------------------------------------------- 1. multi-turn


def usage_sums(streams: Sequence[Streamed]) -> Json:
    u = [s.usage for s in streams]
    prompt = sum(x.prompt_tokens for x in u)
    out = {"prompt_tokens": prompt, "completion_tokens": sum(len(s.times) for s in streams),
           "cached_tokens": sum(x.cached_prompt_tokens for x in u)}
    for tier in ("device", "host", "disk"):
        out[f"cached_{tier}_tokens"] = sum(getattr(x, f"cached_{tier}_tokens") for x in u)
    out["hit_rate"] = out["cached_tokens"] / prompt if prompt else float("nan")
    for tier in ("device", "host", "disk"):
        out[f"hit_rate_{tier}"] = out[f"cached_{tier}_tokens"] / prompt if prompt else float("nan")
    out["preemptions"] = sum(x.num_preemptions for x in u)
    return out


def conversations(addr: str, messages: list[list[list[int]]], answer: int, concurrency: int,
                  tick) -> tuple[float, list[list[Streamed]]]:
    """Round robin over the conversations (all turn-1 requests, then all turn-2 ...), `concurrency`
    requests in flight; a turn waits for its conversation's previous answer."""
    C, T = len(messages), len(messages[0])
    order = [(c, t) for t in range(T) for c in range(C)]

    async def run() -> tuple[float, list[list[Streamed]]]:
        done = [[asyncio.Event() for _ in range(T)] for _ in range(C)]
        results: list[list[Any]] = [[None] * T for _ in range(C)]
        history: list[list[int]] = [[] for _ in range(C)]
        queue = collections.deque(order)

        async def worker(stub: model_pb2_grpc.ModelServiceStub) -> None:
            while queue:
                c, t = queue.popleft()
                if t:
                    await done[c][t - 1].wait()
                prompt = history[c] + messages[c][t]
                s = await stream_async(stub, prompt, answer, on_tokens=tick)
                results[c][t] = s
                history[c] = prompt + s.token_ids
                done[c][t].set()

        async with grpc.aio.insecure_channel(addr) as channel:
            stub = model_pb2_grpc.ModelServiceStub(channel)
            await channel.channel_ready()
            start = time.perf_counter()
            await asyncio.gather(*(worker(stub) for _ in range(concurrency)))
            return time.perf_counter() - start, results

    return asyncio.run(run())


def multiturn(ctx: Context, replicas: dict[str, Replica], cfg: Json, firsts: Sequence[int], deadline: float) -> Json:
    C, T, A = cfg["conversations"], cfg["turns"], cfg["answer"]
    runs: dict[str, list[Json]] = {name: [] for name in replicas}
    answers: dict[str, list[list[int]]] = {}
    agree: dict[str, list[float]] = {name: [] for name in WITH_TIERS if name in replicas}
    state: Json = {}

    def one(name: str) -> None:
        r = replicas[name]
        clear_pools(r.cache_addr, [r.worker_id])
        before = r.tier_stats()
        with ctx.progress.run(f"multi-turn, tier {name}", C * T * A) as tick:
            wall, convs = conversations(r.addr, state["messages"], A, cfg["concurrency"], tick)
        flat = [s for conv in convs for s in conv]
        out = usage_sums(flat)
        later = usage_sums([s for conv in convs for s in conv[1:]])  # turns 2.. (turn 1 misses everywhere)
        out.update(wall_s=wall, tok_s=out["completion_tokens"] / wall,
                   total_tok_s=(out["prompt_tokens"] + out["completion_tokens"]) / wall,
                   ttft_mean_s=statistics.fmean(s.ttft for s in flat),
                   ttft_p50_s=statistics.median(s.ttft for s in flat),
                   ttft_mean_later_turns_s=statistics.fmean(s.ttft for conv in convs for s in conv[1:]),
                   ttft_mean_per_turn_s=[statistics.fmean(conv[t].ttft for conv in convs) for t in range(T)],
                   ttft_max_s=max(s.ttft for s in flat),
                   decode_mean_s=statistics.fmean(s.decode_s for s in flat),
                   hit_rate_later_turns=later["hit_rate"],
                   device_hit_rate_later_turns=later["hit_rate_device"],
                   tier_stats_before=before, tier_stats_after=r.tier_stats())
        runs[name].append(out)
        answers[name] = [s.token_ids for s in flat]

    order = list(replicas)
    for rep in range(cfg["multiturn_reps"]):
        if rep and time.perf_counter() > deadline:
            break
        # fresh conversations every repetition (the tiers still hold the last ones), same lengths
        state["messages"] = [[ctx.prompts.ids(f if t == 0 else cfg["message"]) for t in range(T)] for f in firsts]
        rotate(rep, [lambda n=n: one(n) for n in order])
        for name in agree:
            agree[name].append(identical_fraction(answers[name], answers["off"]))
    detail: Json = {"runs": runs}
    med = {name: {k: statistics.median(x[k] for x in v) for k in ("tok_s", "total_tok_s", "ttft_mean_s",
                                                                     "hit_rate", "hit_rate_device", "hit_rate_host",
                                                                     "hit_rate_disk", "wall_s")}
           for name, v in runs.items()}
    detail["median"] = med
    for name in WITH_TIERS:
        if name in med:
            detail[f"{name}_vs_off"] = {"tok_s": med[name]["tok_s"] / med["off"]["tok_s"],
                                        "total_tok_s": med[name]["total_tok_s"] / med["off"]["total_tok_s"],
                                        "ttft_mean": med[name]["ttft_mean_s"] / med["off"]["ttft_mean_s"]}
            detail[f"{name}_greedy_identical_to_off"] = min(agree[name])
    return detail


# ---------------------------------------------------------------------- 2./3. single-prompt TTFT


def ttft(ctx: Context, replicas: dict[str, Replica], cfg: Json, deadline: float) -> tuple[Json, list[Json]]:
    """Returns (detail, [(prompt, miss answer)] for the transformers check)."""
    n, A = cfg["prompt"], cfg["ttft_answer"]
    reps: list[Json] = []
    checks: list[Json] = []
    for rep in range(cfg["ttft_reps"]):
        if rep >= 1 and time.perf_counter() > deadline:
            break
        out: Json = {}
        with ctx.progress.run(f"TTFT miss / device / host hit, rep {rep + 1}", 0):
            host = replicas["host"]
            prompt = ctx.prompts.ids(n)
            out["miss"] = stream_record(host.generate(prompt, A))
            time.sleep(0.1)  # the finish reaches the cache manager with the replica's next Step
            out["device_hit"] = stream_record(host.generate(prompt, A))
            out["host_push_down"] = host.push_down()
            out["host_hit"] = stream_record(host.generate(prompt, A))
            if rep == 0:  # the transformers check: one prompt per replica is enough
                checks.append({"prompt": prompt, "answer": out["miss"]["token_ids"]})
        if "disk" in replicas:
            with ctx.progress.run(f"TTFT miss / disk hit, rep {rep + 1}", 0):
                disk = replicas["disk"]
                prompt = ctx.prompts.ids(n)
                out["disk_miss"] = stream_record(disk.generate(prompt, A))
                time.sleep(0.1)
                out["disk_push_down"] = disk.push_down()
                out["disk_hit"] = stream_record(disk.generate(prompt, A))
                if rep == 0:
                    checks.append({"prompt": prompt, "answer": out["disk_miss"]["token_ids"]})
        reps.append(out)
    detail: Json = {"reps": reps}

    def med(key: str, field: str = "ttft_s") -> float:
        return statistics.median(r[key][field] for r in reps if key in r)

    detail["ttft_s"] = {k: med(k) for k in ("miss", "device_hit", "host_hit", "disk_miss", "disk_hit")
                        if any(k in r for r in reps)}
    detail["host_hit_vs_miss"] = statistics.median(r["host_hit"]["ttft_s"] / r["miss"]["ttft_s"] for r in reps)
    detail["device_hit_vs_miss"] = statistics.median(r["device_hit"]["ttft_s"] / r["miss"]["ttft_s"] for r in reps)
    if "disk_hit" in reps[0]:
        detail["disk_hit_vs_miss"] = statistics.median(r["disk_hit"]["ttft_s"] / r["disk_miss"]["ttft_s"]
                                                       for r in reps)
    detail["cached_tokens"] = {k: [{t: r[k][f"cached_{t}_tokens"] for t in ("device", "host", "disk")} for r in reps]
                               for k in ("device_hit", "host_hit", "disk_hit") if k in reps[0]}
    same = [r[k]["token_ids"] == r[m]["token_ids"] for r in reps
            for k, m in (("device_hit", "miss"), ("host_hit", "miss"), ("disk_hit", "disk_miss")) if k in r]
    detail["repeats_identical_to_miss"] = sum(same) / len(same)
    return detail, checks


def restart(ctx: Context, disk: Replica, cfg: Json) -> tuple[Json, Json]:
    n, A = cfg["prompt"], cfg["ttft_answer"]
    prompt = ctx.prompts.ids(n)
    with ctx.progress.run("restart from disk", 0):
        miss = disk.generate(prompt, A)
        time.sleep(0.1)
        pushed = disk.push_down()
        before = disk.tier_stats()
        disk.stop()
        began = time.perf_counter()
        start_all([disk])
        started = time.perf_counter() - began
        ctx.extra_pids.update(disk.pids())
        after_start = disk.tier_stats()
        disk.generate(ctx.prompts.ids(BLOCK_SIZE // 2), 2)  # warm-up: first-request costs of a fresh process
        again = disk.generate(prompt, A)
    out = {"miss": stream_record(miss), "push_down": pushed, "tier_stats_before_stop": before,
           "tier_stats_after_restart": after_start, "restart_s": started, "repeat": stream_record(again),
           "repeat_vs_miss": again.ttft / miss.ttft, "cached_disk_tokens": again.usage.cached_disk_tokens,
           "repeat_identical_to_miss": again.token_ids == miss.token_ids}
    return out, {"prompt": prompt, "answer": miss.token_ids}


# ---------------------------------------------------------------------- 4. all-miss


def all_miss(ctx: Context, replicas: dict[str, Replica], cfg: Json, deadline: float) -> Json:
    A, k = cfg["all_miss_answer"], cfg["all_miss_requests"]
    tok_s: dict[str, list[float]] = {name: [] for name in replicas}
    hits: dict[str, list[int]] = {name: [] for name in replicas}
    agree: dict[str, list[float]] = {name: [] for name in WITH_TIERS if name in replicas}
    state: Json = {}

    def one(name: str) -> None:
        with ctx.progress.run(f"all-miss, tier {name}", k * A) as tick:
            wall, results = stream_concurrent(replicas[name].addr, state["prompts"], A, on_tokens=tick)
        tok_s[name].append(sum(len(r.times) for r in results) / wall)
        hits[name].append(sum(r.usage.cached_prompt_tokens for r in results))
        state[name] = [r.token_ids for r in results]

    order = list(replicas)
    for rep in range(cfg["all_miss_reps"]):
        if rep >= 2 and time.perf_counter() > deadline:
            break
        state["prompts"] = [ctx.prompts.ids(m) for m in ctx.prompts.lengths(k, *cfg["all_miss_prompt"])]
        rotate(rep, [lambda n=n: one(n) for n in order])
        for name in agree:
            agree[name].append(identical_fraction(state[name], state["off"]))
    out: Json = {"tok_s": {name: summary(v) for name, v in tok_s.items()}, "cached_tokens": hits,
                 "greedy_identical_to_off": agree}
    for name in agree:
        paired = [100 * (1 - on / off) for on, off in zip(tok_s[name], tok_s["off"], strict=True)]
        out[f"{name}_loss_pct"] = statistics.median(paired)
        out[f"{name}_loss_pct_samples"] = paired
    return out


# ---------------------------------------------------------------------- the workload


def run(ctx: Context, deadline: float) -> Json:
    cfg = sizes(ctx)
    began = time.perf_counter()
    firsts = ctx.prompts.lengths(cfg["conversations"], *cfg["first_message"])
    sized = plan(ctx, cfg, firsts)
    disk_dir = tempfile.mkdtemp(prefix="radixkv-tiered-")  # 0700
    gib = f"{sized['tier_gib']:g}"
    replicas = {
        "off": Replica(ctx, "off", sized["num_blocks"], []),
        "host": Replica(ctx, "host", sized["num_blocks"], ["--host-cache-gib", gib, "--offload-policy", POLICY]),
        "host_wt": Replica(ctx, "host_wt", sized["num_blocks"], ["--host-cache-gib", gib,
                                                                  "--offload-policy", "write-through"]),
        "disk": Replica(ctx, "disk", sized["num_blocks"], ["--disk-cache-dir", disk_dir, "--disk-cache-gib", gib,
                                                            "--offload-policy", POLICY]),
    }
    info = machine_info(ctx.threads)
    detail: Json = {"config": {**cfg, **sized, "first_message_lengths": firsts,
                               "last_turn_prompt_tokens_max": max(firsts) + (cfg["turns"] - 1) * (cfg["message"]
                                                                                                 + cfg["answer"])},
                    "machine": {"cpu_model": info["cpu_model"], "cpu_isa": info["cpu_isa"],
                                "logical_cores": info["logical_cores"]}}
    ctx.progress.write(f"tiered: {info['cpu_model']}; device pool {sized['num_blocks']} blocks, working set "
                       f"{sized['working_set_blocks']} blocks = {sized['working_set_over_pool']:.1f}x the pool; "
                       f"tiers {sized['tier_gib']:g} GiB each")
    ctx.extra_pids.clear()
    all_replicas = list(replicas.values())
    detail["phase_s"] = phases = {}
    mark = [time.perf_counter()]

    def phase(name: str) -> None:
        now = time.perf_counter()
        phases[name] = now - mark[0]
        mark[0] = now
    try:
        with ctx.progress.run(f"starting {len(all_replicas)} cache managers + replicas", 0):
            start_all(all_replicas)
        ctx.extra_pids.update(p for r in all_replicas for p in r.pids())
        detail["kernels"] = {name: r.kernels() for name, r in replicas.items()}
        detail["tier_log"] = {name: r.tier_lines() for name, r in replicas.items()}
        ctx.progress.write("tiered: " + (detail["kernels"]["off"] or "(no start-up line with the kernels)"))
        with ctx.progress.run("warm-up", 0):
            warm = ctx.prompts.ids(max(firsts))
            for r in all_replicas:
                r.generate(warm, 2)
                r.generate(ctx.prompts.ids(BLOCK_SIZE // 2), 2)
        phase("start + warm-up")
        budget = max(0.0, deadline - time.perf_counter())
        detail["multiturn"] = multiturn(ctx, {n: replicas[n] for n in cfg["multiturn_configs"]}, cfg, firsts,
                                        time.perf_counter() + 0.5 * budget)
        phase("multiturn")
        detail["ttft"], checks = ttft(ctx, replicas, cfg, time.perf_counter() + 0.1 * budget)
        phase("ttft")
        detail["all_miss"] = all_miss(ctx, replicas, cfg, time.perf_counter() + 0.2 * budget)
        phase("all_miss")
        detail["restart"], check = restart(ctx, replicas["disk"], cfg)
        phase("restart")
        checks.append(check)
        ctx.extra_pids.clear()
        with ctx.progress.run("transformers on the 1024-token prompts", 0):
            _, theirs = ctx.ref.generate([c["prompt"] for c in checks], cfg["ttft_answer"])
        detail["ttft_miss_identical_to_transformers"] = identical_fraction([c["answer"] for c in checks], theirs)
        phase("transformers")
    except Exception as error:
        error.add_note("--- tiered services output (last lines) ---\n"
                       + "\n".join(f"[{r.name}] {line}" for r in all_replicas for line in list(r.log)[-40:]))
        raise
    finally:
        for r in all_replicas:
            r.stop()
        ctx.extra_pids.clear()
        shutil.rmtree(disk_dir, ignore_errors=True)
    detail["wall_s"] = time.perf_counter() - began
    return detail


def greedy_all(d: Json) -> float:
    """The smallest share of identical greedy outputs over every comparison made."""
    values = [d["multiturn"].get(f"{n}_greedy_identical_to_off") for n in WITH_TIERS]
    values += [min(v) for v in d["all_miss"]["greedy_identical_to_off"].values() if v]
    values += [d["ttft"]["repeats_identical_to_miss"], float(d["restart"]["repeat_identical_to_miss"]),
               d.get("ttft_miss_identical_to_transformers")]
    values = [v for v in values if v is not None]
    return min(values) if values else float("nan")


def flat(d: Json) -> Json:
    mt, t, am, rs = d["multiturn"], d["ttft"], d["all_miss"], d["restart"]
    out: Json = {"tiered_working_set_over_pool": d["config"]["working_set_over_pool"],
                 "tiered_prompt_tokens": d["config"]["prompt"]}
    for name in CONFIGS:
        m = mt["median"].get(name)
        if m is None:
            continue
        out.update({f"tiered_{name}_tok_s": m["tok_s"], f"tiered_{name}_total_tok_s": m["total_tok_s"],
                    f"tiered_{name}_ttft_mean_s": m["ttft_mean_s"], f"tiered_{name}_hit_rate": m["hit_rate"],
                    f"tiered_{name}_hit_rate_host": m["hit_rate_host"], f"tiered_{name}_hit_rate_disk": m["hit_rate_disk"]})
    for name in WITH_TIERS:
        if f"{name}_vs_off" in mt:
            out[f"tiered_{name}_vs_off_tok_s"] = mt[f"{name}_vs_off"]["tok_s"]
            out[f"tiered_{name}_vs_off_ttft"] = mt[f"{name}_vs_off"]["ttft_mean"]
        if f"{name}_loss_pct" in am:
            out[f"tiered_all_miss_{name}_loss_pct"] = am[f"{name}_loss_pct"]
    out.update({"tiered_ttft_miss_s": t["ttft_s"]["miss"], "tiered_ttft_device_hit_s": t["ttft_s"]["device_hit"],
                "tiered_ttft_host_hit_s": t["ttft_s"]["host_hit"], "tiered_host_hit_vs_miss": t["host_hit_vs_miss"],
                "tiered_disk_hit_vs_miss": t.get("disk_hit_vs_miss"), "tiered_restart_vs_miss": rs["repeat_vs_miss"],
                "tiered_restart_cached_disk_tokens": rs["cached_disk_tokens"],
                "tiered_greedy_identical": greedy_all(d)})
    return out


def _pct(v: Any) -> str:
    return "" if v is None else f"{100 * v:.0f}%"


def report(d: Json) -> str:
    c, mt, t, am, rs = d["config"], d["multiturn"], d["ttft"], d["all_miss"], d["restart"]
    lines = [f"tiered KV cache: {d['machine']['cpu_model']}; {d['kernels'].get('off', '')}",
             f"multi-turn: {c['conversations']} conversations x {c['turns']} turns (first message "
             f"{c['first_message'][0]}-{c['first_message'][1]} tokens, then {c['message']}, answers {c['answer']}), "
             f"round robin, {c['concurrency']} in flight; device pool {c['num_blocks']} blocks, working set "
             f"{c['working_set_blocks']} blocks = {c['working_set_over_pool']:.1f}x the pool; tiers {c['tier_gib']:g} GiB, "
             f"offload policy {c['offload_policy']}"]
    rows = []
    for name in CONFIGS:
        m = mt["median"].get(name)
        if m is None:
            continue
        vs = mt.get(f"{name}_vs_off")
        rows.append([name, f"{m['tok_s']:.1f}", f"{m['total_tok_s']:.0f}", f"{m['ttft_mean_s']:.2f}",
                     _pct(m["hit_rate"]), f"{_pct(m['hit_rate_device'])} / {_pct(m['hit_rate_host'])} / "
                     f"{_pct(m['hit_rate_disk'])}", f"{m['wall_s']:.1f}",
                     f"{vs['tok_s']:.2f}x / {vs['ttft_mean']:.2f}x" if vs else ""])
    lines.append(table(rows, ["tier", "tok/s", "total tok/s", "mean TTFT s", "hit", "device / host / disk",
                              "wall s", "vs off: tok/s / TTFT"]))
    s = t["ttft_s"]
    lines.append(f"{c['prompt']}-token prompt TTFT (median of {len(t['reps'])}): miss {s['miss']:.3f} s, device hit "
                 f"{s['device_hit']:.3f} s ({t['device_hit_vs_miss']:.2f}x), host-tier hit {s['host_hit']:.3f} s "
                 f"({t['host_hit_vs_miss']:.2f}x, target <= 0.1x)"
                 + (f", disk-tier hit {s['disk_hit']:.3f} s ({t['disk_hit_vs_miss']:.2f}x of the disk replica's miss "
                    f"{s['disk_miss']:.3f} s, target <= 0.2x)" if "disk_hit" in s else ""))
    lines.append(f"restart from disk: replica + cache manager restarted in {rs['restart_s']:.1f} s; the repeat: TTFT "
                 f"{rs['repeat']['ttft_s']:.3f} s vs miss {rs['miss']['ttft_s']:.3f} s = {rs['repeat_vs_miss']:.2f}x "
                 f"(target <= 0.2x), cached_disk_tokens {rs['cached_disk_tokens']}")
    loss = ", ".join(f"{n} {am[f'{n}_loss_pct']:+.1f}%" for n in WITH_TIERS if f"{n}_loss_pct" in am)
    lines.append(f"all-miss ({c['all_miss_requests']} distinct prompts of {c['all_miss_prompt'][0]}-"
                 f"{c['all_miss_prompt'][1]} tokens at once, {c['all_miss_answer']} out): tok/s off "
                 f"{am['tok_s']['off']['median']:.1f}; throughput loss with tiers (median of "
                 f"{am['tok_s']['off']['n']} paired reps): {loss} (target <= 3%)")
    lines.append("phases: " + ", ".join(f"{k} {v:.0f} s" for k, v in d.get("phase_s", {}).items()))
    lines.append(f"greedy output identical (tiers vs off, repeats vs miss, miss vs transformers): "
                 f"{100 * greedy_all(d):.0f}% (smallest share)")
    return "\n".join(lines)


TIERED = Workload(
    name="tiered", help="host / disk KV tiers below a small device pool: multi-turn, TTFT, restart, all-miss",
    run=run, flat=flat, report=report, cap_s=480.0,
    runs=lambda ctx: 4 + len(sizes(ctx)["multiturn_configs"]) * sizes(ctx)["multiturn_reps"]
    + len(CONFIGS) * sizes(ctx)["all_miss_reps"]
    + 2 * sizes(ctx)["ttft_reps"],
    needs_services=False, needs_model=True, available=flags_missing)
