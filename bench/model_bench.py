"""Model service benchmark against transformers: `python -m bench.model_bench` (~3-4 min on a quiet 2-core box).

Every number is a ratio to transformers measured on the same machine in the same run, with the
same model (the bundled SmolLM2-135M), dtype (fp32), prompts (token ids, so lengths are exact),
threads (--threads, default 2, both sides) and greedy decoding. Our side runs the real services
(`python -m cache_service`, `python -m model_service`) as child processes and is measured from a
gRPC client; transformers runs in this process. The two never run at the same time (the services
idle while transformers runs); the two sides alternate within each repetition (who goes first
swaps every repetition), warm-up runs are excluded, and the median of N repetitions is reported,
next to the ratio of the best samples (best-of-N). Prompts are fresh token ids in every
repetition (both sides get the same ones), so our prefix cache only helps where a hit is meant.

1. TTFT of a 1024-token prompt: ours on a cache miss (fresh prompt) and on a hit (the same
   1024-token prefix plus 32 new tokens), client-side time to the first streamed message,
   vs transformers `generate(max_new_tokens=1)`. Hit/miss speedup (target >= 10x).
2. Batch-1 decode tok/s, 64 new tokens after a 16-token prompt, ignore_eos: ours over gRPC vs
   transformers `generate()` (target >= 1.0x). Decode rate = (n - 1) / (last token - first token),
   from per-token arrival times (a streamer on the transformers side); end-to-end rate too.
3. Aggregate tok/s of 16 concurrent requests (prompts of 32-64 tokens, 64 new tokens each):
   completion tokens / wall time, vs transformers static batch-16 `generate()` on the same prompts
   (left padding + attention_mask) (target >= 1.1x).
4. In-process decode step at batch 16 with ~100-token contexts through our `ModelRunner` (on a
   copy of the model) vs the time of GEMMs alone with [16, in_features] inputs: the model's own
   nn.Linear layers (lm_head included, as transformers runs them) and the GEMMs our runner
   actually runs (after it fuses sibling projections, with its short-input GEMM). Step/GEMM ratio, non-GEMM overhead, and a
   torch.profiler top-10 of the step by self CPU time.

Noise: other processes may share the cores. For every phase the JSON records the 1-minute load
average and the CPU time used by processes other than ours (this one + the two services) or
stolen by the hypervisor; the report warns when it is high. With 2 OpenMP threads on 2 shared
cores, each parallel op can wait a scheduler time slice for a descheduled thread, so contention
slows both sides by up to ~10x and unevenly: compare `--threads 1` runs on a busy box.
Results: a table on stdout and `bench/results/model_bench.json`.
Its helpers live in bench/harness.py; the suite (`python -m bench`) reuses phases 1-4.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

import grpc
import torch
import torch.nn.functional as F
import transformers
from torch.profiler import ProfilerActivity, profile

from bench.harness import (
    BLOCK_SIZE,
    CONTENDED_CORES,
    MIN_REPS,
    NUM_BLOCKS,
    REPO,
    WARMUP_TOKENS,
    Json,
    LoadMonitor,
    Progress,
    Prompts,
    Reference,
    Services,
    TimingStreamer,
    alternate,
    dist,
    repetitions,
    stream_concurrent,
    stream_sync,
    summary,
    table,
)
from model_service.attention import create_attention_backend
from model_service.kv_cache import KVCache, KVCacheSpec
from model_service.linear import PlannedProduct
from model_service.model_loader import LoadedModel, load_model
from model_service.model_runner import ModelRunner, SequenceChunk
from protos import model_pb2_grpc
from scripts.service_process import ServiceError

RESULTS = REPO / "bench" / "results" / "model_bench.json"
# Share of --budget-s per phase (startup takes the rest).
PHASE_SHARE = {"ttft": 0.2, "decode_b1": 0.25, "decode_b16": 0.35, "step": 0.1}


# ---------------------------------------------------------------------- phases 1-3


def bench_ttft(stub: model_pb2_grpc.ModelServiceStub, ref: Reference, prompts: Prompts, reps: int,
               deadline: float) -> Json:
    prefix_len, suffix_len = 1024, 32
    miss: list[float] = []
    hit: list[float] = []
    theirs: list[float] = []
    cached: list[int] = []
    server_ttft: dict[str, list[float]] = {"miss": [], "hit": []}

    def ours(record: bool) -> None:
        prefix = prompts.ids(prefix_len)
        first = stream_sync(stub, prefix, 1)  # cache miss: a prefix never seen
        time.sleep(0.1)  # let the finish (insert into the tree) reach the cache service
        second = stream_sync(stub, prefix + prompts.ids(suffix_len), 1)  # hit: 1024 cached + 32 new
        if first.usage.cached_prompt_tokens != 0:
            raise RuntimeError(f"the miss request hit the cache ({first.usage.cached_prompt_tokens} tokens)")
        if record:
            miss.append(first.ttft)
            hit.append(second.ttft)
            cached.append(second.usage.cached_prompt_tokens)
            server_ttft["miss"].append(first.usage.time_to_first_token)
            server_ttft["hit"].append(second.usage.time_to_first_token)

    def reference(record: bool) -> None:
        wall, _ = ref.generate([prompts.ids(prefix_len)], 1)
        if record:
            theirs.append(wall)

    ours(False)
    reference(False)
    for rep in repetitions(reps, deadline):
        alternate(rep, lambda: ours(True), lambda: reference(True))
    m, h, t = statistics.median(miss), statistics.median(hit), statistics.median(theirs)
    return {
        "prompt_tokens": prefix_len, "hit_new_tokens": suffix_len,
        "ours_miss_s": summary(miss), "ours_hit_s": summary(hit), "transformers_s": summary(theirs),
        "ours_server_ttft_s": {k: summary(v) for k, v in server_ttft.items()},
        "hit_cached_tokens": cached,
        "hit_speedup_over_miss": m / h,
        "miss_speedup_over_transformers": t / m,
        "hit_speedup_over_transformers": t / h,
    }


def bench_decode_b1(stub: model_pb2_grpc.ModelServiceStub, ref: Reference, prompts: Prompts, reps: int,
                    deadline: float, new_tokens: int) -> Json:
    prompt_len = 16
    ours_rate: list[float] = []
    ours_e2e: list[float] = []
    theirs_rate: list[float] = []
    theirs_e2e: list[float] = []
    identical: list[bool] = []
    prompt: list[int] = []
    our_tokens: list[int] = []
    their_tokens: list[int] = []

    def ours(record: bool) -> None:
        nonlocal our_tokens
        result = stream_sync(stub, prompt, new_tokens if record else WARMUP_TOKENS)
        our_tokens = result.token_ids
        if record:
            ours_rate.append(result.decode_tok_s())
            ours_e2e.append(result.e2e_tok_s())

    def reference(record: bool) -> None:
        nonlocal their_tokens
        streamer = TimingStreamer()
        wall, (generated,) = ref.generate([prompt], new_tokens if record else WARMUP_TOKENS, streamer)
        their_tokens = generated
        if record:
            times = streamer.times
            theirs_rate.append((len(times) - 1) / (times[-1] - times[0]))
            theirs_e2e.append(new_tokens / wall)

    prompt = prompts.ids(prompt_len)
    ours(False)  # warm-up
    reference(False)
    for rep in repetitions(reps, deadline):
        prompt = prompts.ids(prompt_len)
        alternate(rep, lambda: ours(True), lambda: reference(True))
        identical.append(our_tokens == their_tokens)
    return {
        "prompt_tokens": prompt_len, "new_tokens": new_tokens,
        "ours_decode_tok_s": summary(ours_rate), "transformers_decode_tok_s": summary(theirs_rate),
        "ours_e2e_tok_s": summary(ours_e2e), "transformers_e2e_tok_s": summary(theirs_e2e),
        "speedup": statistics.median(ours_rate) / statistics.median(theirs_rate),
        "e2e_speedup": statistics.median(ours_e2e) / statistics.median(theirs_e2e),
        "greedy_tokens_identical": identical,
    }


def bench_batch(addr: str, ref: Reference, prompts: Prompts, reps: int, deadline: float, batch: int,
                new_tokens: int, progress: Progress | None = None) -> Json:
    """`batch` concurrent requests (prompts of 32-64 tokens) vs a static batch of the same prompts:
    aggregate tok/s, and from our streams TTFT and inter-token latency distributions (all reps)."""
    progress = progress or Progress(enabled=False)
    ours_tok_s: list[float] = []
    theirs_tok_s: list[float] = []
    inter_token_ms: list[float] = []
    all_ttft: list[float] = []
    all_gaps_ms: list[float] = []
    identical: list[float] = []
    batch_prompts: list[list[int]] = []
    our_tokens: list[list[int]] = []
    their_tokens: list[list[int]] = []

    def ours(record: bool) -> None:
        nonlocal our_tokens
        n = new_tokens if record else WARMUP_TOKENS
        with progress.run(f"radixkv x{batch}" + ("" if record else " (warm-up)"), batch * n) as tick:
            wall, results = stream_concurrent(addr, batch_prompts, n, on_tokens=tick)
        our_tokens = [r.token_ids for r in results]
        if record:
            ours_tok_s.append(sum(len(r.times) for r in results) / wall)
            gaps = [g for r in results for g in r.gaps()]
            inter_token_ms.append(1e3 * statistics.median(gaps))
            all_gaps_ms.extend(1e3 * g for g in gaps)
            all_ttft.extend(r.ttft for r in results)

    def reference(record: bool) -> None:
        nonlocal their_tokens
        n = new_tokens if record else WARMUP_TOKENS
        with progress.run(f"transformers static {batch}" + ("" if record else " (warm-up)"), batch * n) as tick:
            wall, their_tokens = ref.generate(batch_prompts, n, TimingStreamer(tick))
        if record:
            theirs_tok_s.append(batch * new_tokens / wall)

    batch_prompts = [prompts.ids(n) for n in prompts.lengths(batch, 32, 64)]
    ours(False)  # warm-up
    reference(False)
    for rep in repetitions(reps, deadline):
        batch_prompts = [prompts.ids(n) for n in prompts.lengths(batch, 32, 64)]
        alternate(rep, lambda: ours(True), lambda: reference(True))
        identical.append(sum(a == b for a, b in zip(our_tokens, their_tokens, strict=True)) / batch)
    return {
        "batch": batch, "prompt_tokens": "32-64", "new_tokens": new_tokens,
        "ours_tok_s": summary(ours_tok_s), "transformers_tok_s": summary(theirs_tok_s),
        "ours_server_step_ms_from_inter_token_gap": summary(inter_token_ms),
        "ours_ttft_s": dist(all_ttft), "ours_inter_token_ms": dist(all_gaps_ms),
        "speedup": statistics.median(ours_tok_s) / statistics.median(theirs_tok_s),
        "greedy_sequences_identical_fraction": identical,
    }


# ---------------------------------------------------------------------- phase 4: step vs GEMM


GEMM_OPS = {"aten::mm", "aten::addmm", "aten::bmm"}
ATTENTION_MARKERS = ("scaled_dot_product", "index_select", "index_copy", "index_fill")


GemmList = list[tuple[torch.Tensor, torch.Tensor | None]]  # (weight [out, in], bias)


def gemm_weights(model: torch.nn.Module) -> GemmList:
    """The weights of every GEMM a forward pass runs: plain nn.Linear layers plus any fused group
    (modules standing in for several projections hold the concatenated weight as `group.weight`)."""
    weights: GemmList = [(m.weight, m.bias) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    groups = {id(m.group): m.group for m in model.modules()
              if isinstance(getattr(getattr(m, "group", None), "weight", None), torch.Tensor)}
    weights += [(g.weight, getattr(g, "bias", None)) for g in groups.values()]
    return weights


def gemm_timer(weights: GemmList, batch: int) -> Callable[[], float]:
    """Times F.linear over every weight with a [batch, in_features] input."""
    inputs = {w.shape[1]: torch.randn(batch, w.shape[1]) for w, _ in weights}

    @torch.inference_mode()
    def run() -> float:
        start = time.perf_counter()
        for weight, bias in weights:
            F.linear(inputs[weight.shape[1]], weight, bias)
        return time.perf_counter() - start

    return run


def product_timer(products: list[PlannedProduct], batch: int) -> Callable[[], float]:
    """Times the runner's planned products (model_service/linear) with a [batch, in_features] input."""
    inputs = {p.weight.shape[1]: torch.randn(batch, p.weight.shape[1]) for p in products}

    @torch.inference_mode()
    def run() -> float:
        start = time.perf_counter()
        for product in products:
            product(inputs[product.weight.shape[1]])
        return time.perf_counter() - start

    return run


def bench_step(loaded: LoadedModel, prompts: Prompts, reps: int, deadline: float, batch: int,
               context: int) -> Json:
    """Our ModelRunner's decode step at `batch` x ~`context` tokens vs the model's GEMMs alone."""
    model = copy.deepcopy(loaded.model)  # ModelRunner rewires the model; the reference stays untouched
    cfg = model.config
    device = torch.device("cpu")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    steps_total = 3 + reps + 5  # warm-up + timed + profiled
    blocks_per_seq = -(-(context + steps_total + 1) // BLOCK_SIZE)
    spec = KVCacheSpec(cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim, BLOCK_SIZE, torch.float32)
    kv_cache = KVCache(spec, batch * blocks_per_seq, device)
    backend = create_attention_backend("torch", cfg.num_attention_heads, cfg.num_key_value_heads, head_dim,
                                       BLOCK_SIZE, torch.float32, device)
    model_gemms = gemm_weights(model)  # the model's own projections, as transformers runs them
    runner = ModelRunner(model, kv_cache, backend, device)  # paged attention (+ whatever it fuses)
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(batch)]
    runner.execute([SequenceChunk(prompts.ids(context), 0, t, True) for t in tables])  # prefill
    position = context

    def step() -> float:
        nonlocal position
        chunks = [SequenceChunk(prompts.ids(1), position, t, True) for t in tables]
        start = time.perf_counter()
        logits = runner.execute(chunks).sampled
        logits.argmax(-1)  # greedy sampling, as the engine does
        position += 1
        return time.perf_counter() - start

    timers = {"step": step, "gemm": gemm_timer(model_gemms, batch),
              "gemm_runner": product_timer(runner.linears.products, batch)}
    for _ in range(3):
        for fn in timers.values():
            fn()
    samples: dict[str, list[float]] = {name: [] for name in timers}
    names = list(timers)
    for rep in repetitions(reps, deadline):
        for i in range(len(names)):  # rotate the order every repetition
            name = names[(rep + i) % len(names)]
            samples[name].append(1e3 * timers[name]())

    profiled_steps = 5
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(profiled_steps):
            step()
        profiled_wall = (time.perf_counter() - start) / profiled_steps
    averages = prof.key_averages()
    top = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)[:10]
    top_rows = [{"op": e.key, "calls_per_step": e.count / profiled_steps,
                 "self_cpu_ms_per_step": e.self_cpu_time_total / 1e3 / profiled_steps,
                 "cpu_total_ms_per_step": e.cpu_time_total / 1e3 / profiled_steps} for e in top]
    buckets = {"gemm": 0.0, "kv_write_gather_attention": 0.0, "other_aten_ops": 0.0}
    for e in averages:
        ms = e.self_cpu_time_total / 1e3 / profiled_steps
        if e.key in GEMM_OPS:
            buckets["gemm"] += ms
        elif any(marker in e.key for marker in ATTENTION_MARKERS):
            buckets["kv_write_gather_attention"] += ms
        elif e.key.startswith("aten::"):
            buckets["other_aten_ops"] += ms
    buckets["outside_aten_ops (python, dispatch, profiler)"] = 1e3 * profiled_wall - sum(buckets.values())
    step_ms, gemm_ms = statistics.median(samples["step"]), statistics.median(samples["gemm"])
    runner_gemm_ms = statistics.median(samples["gemm_runner"])
    return {
        "batch": batch, "context_tokens": f"{context + 1}-{position}",
        "num_gemms_model": len(model_gemms), "num_gemms_runner": len(runner.linears.products),
        "step_ms": summary(samples["step"]), "gemm_ms": summary(samples["gemm"]),
        "runner_gemm_ms": summary(samples["gemm_runner"]),
        "step_over_gemm": step_ms / gemm_ms, "non_gemm_overhead_ms": step_ms - gemm_ms,
        "step_over_runner_gemm": step_ms / runner_gemm_ms, "non_runner_gemm_overhead_ms": step_ms - runner_gemm_ms,
        "profiled_step_ms": 1e3 * profiled_wall,
        "profile_breakdown_ms_per_step": buckets,
        "profile_top10_self_cpu": top_rows,
        "profile_table": averages.table(sort_by="self_cpu_time_total", row_limit=10),
    }


# ---------------------------------------------------------------------- report


def verdict(value: float, target: float) -> str:
    return f">= {target:g}x {'ok' if value >= target else 'MISSED'}"


def best_ratios(results: Json) -> Json:
    """Ratios of the best samples (fastest time, highest rate) of each side: under sporadic
    interference from other processes the best of N is closer to the machine's clean figure."""
    t, d, b, s = results["ttft"], results["decode_b1"], results["decode_b16"], results["step"]
    return {
        "hit_speedup_over_miss": t["ours_miss_s"]["min"] / t["ours_hit_s"]["min"],
        "miss_speedup_over_transformers": t["transformers_s"]["min"] / t["ours_miss_s"]["min"],
        "hit_speedup_over_transformers": t["transformers_s"]["min"] / t["ours_hit_s"]["min"],
        "decode_b1_speedup": d["ours_decode_tok_s"]["max"] / d["transformers_decode_tok_s"]["max"],
        "decode_b1_e2e_speedup": d["ours_e2e_tok_s"]["max"] / d["transformers_e2e_tok_s"]["max"],
        "batch_speedup": b["ours_tok_s"]["max"] / b["transformers_tok_s"]["max"],
        "step_over_gemm": s["step_ms"]["min"] / s["gemm_ms"]["min"],
        "step_over_runner_gemm": s["step_ms"]["min"] / s["runner_gemm_ms"]["min"],
    }


def report(results: Json) -> str:
    t, d, b, s = results["ttft"], results["decode_b1"], results["decode_b16"], results["step"]
    best = results["best_of_n_ratios"]
    med = statistics.median
    rows = [
        ["TTFT 1024 tok, miss (s)", f"{t['ours_miss_s']['median']:.3f}", f"{t['transformers_s']['median']:.3f}",
         f"{t['miss_speedup_over_transformers']:.2f}x", f"{best['miss_speedup_over_transformers']:.2f}x", ""],
        ["TTFT 1024 cached + 32 new, hit (s)", f"{t['ours_hit_s']['median']:.3f}",
         f"{t['transformers_s']['median']:.3f}", f"{t['hit_speedup_over_transformers']:.1f}x",
         f"{best['hit_speedup_over_transformers']:.1f}x", ""],
        ["  hit speedup over our miss", f"{t['hit_speedup_over_miss']:.1f}x", "", "",
         f"{best['hit_speedup_over_miss']:.1f}x", verdict(t["hit_speedup_over_miss"], 10)],
        ["decode batch 1 (tok/s)", f"{d['ours_decode_tok_s']['median']:.1f}",
         f"{d['transformers_decode_tok_s']['median']:.1f}", f"{d['speedup']:.2f}x",
         f"{best['decode_b1_speedup']:.2f}x", verdict(d["speedup"], 1.0)],
        ["  batch 1 end to end incl. prefill (tok/s)", f"{d['ours_e2e_tok_s']['median']:.1f}",
         f"{d['transformers_e2e_tok_s']['median']:.1f}", f"{d['e2e_speedup']:.2f}x",
         f"{best['decode_b1_e2e_speedup']:.2f}x", ""],
        [f"aggregate, {b['batch']} concurrent (tok/s)", f"{b['ours_tok_s']['median']:.1f}",
         f"{b['transformers_tok_s']['median']:.1f}", f"{b['speedup']:.2f}x", f"{best['batch_speedup']:.2f}x",
         verdict(b["speedup"], 1.1)],
    ]
    out = [table(rows, ["measure (median)", "radixkv", "transformers", "ours vs theirs", "best-of-N",
                        "target (median)"])]
    out.append(f"(repetitions: TTFT {t['ours_miss_s']['n']}, batch 1 {d['ours_decode_tok_s']['n']}, "
               f"batch {b['batch']} {b['ours_tok_s']['n']}; hit cached tokens {sorted(set(t['hit_cached_tokens']))}; "
               f"greedy tokens identical at batch 1: {sum(d['greedy_tokens_identical'])}/"
               f"{len(d['greedy_tokens_identical'])}, at batch {b['batch']}: "
               f"{100 * med(b['greedy_sequences_identical_fraction']):.0f}% of sequences)")
    out.append(f"server-reported TTFT: miss {t['ours_server_ttft_s']['miss']['median']:.3f} s, "
               f"hit {t['ours_server_ttft_s']['hit']['median']:.3f} s; "
               f"server decode step at batch {b['batch']} (median client inter-token gap): "
               f"{b['ours_server_step_ms_from_inter_token_gap']['median']:.1f} ms")
    out.append("")
    step_rows = [
        [f"decode step, batch {s['batch']}, ctx {s['context_tokens']}", f"{s['step_ms']['median']:.1f}", ""],
        [f"model's GEMMs ({s['num_gemms_model']} F.linear, same shapes)", f"{s['gemm_ms']['median']:.1f}",
         f"step/GEMM {s['step_over_gemm']:.2f}x (best-of-N {best['step_over_gemm']:.2f}x), "
         f"non-GEMM {s['non_gemm_overhead_ms']:.1f} ms"],
        [f"GEMMs our step runs ({s['num_gemms_runner']}, fused siblings, short-input GEMM)",
         f"{s['runner_gemm_ms']['median']:.1f}",
         f"step/GEMM {s['step_over_runner_gemm']:.2f}x (best-of-N {best['step_over_runner_gemm']:.2f}x), "
         f"non-GEMM {s['non_runner_gemm_overhead_ms']:.1f} ms"],
    ]
    out.append(table(step_rows, ["in-process ModelRunner (median)", "ms", ""]))
    out.append(f"\nprofile of {s['profiled_step_ms']:.1f} ms/step under torch.profiler, per step:")
    out += [f"  {k:<48} {v:7.1f} ms" for k, v in s["profile_breakdown_ms_per_step"].items()]
    out.append("\ntop 10 ops by self CPU time (5 profiled steps):")
    out.append(s["profile_table"])
    out.append(f"load (1-min average before/after; cores used by other processes; threads {results['meta']['threads']}):")
    for name, p in results["load"].items():
        foreign = (f", others used {p['foreign_cpu_cores']:.2f} cores (hypervisor steal {p['steal_cpu_cores']:.2f})"
                   if "foreign_cpu_cores" in p else "")
        out.append(f"  {name:<12} {p['wall_s']:6.1f} s, load {p['load1_before']:.2f} -> {p['load1_after']:.2f}{foreign}")
    if results["meta"]["contended"]:
        threads = results["meta"]["threads"]
        why = (f"with {threads} threads per side on shared cores, OpenMP regions wait for descheduled threads "
               "(up to ~10x slower, unevenly for the two sides); try --threads 1" if threads > 1
               else "both sides lose time to them, not necessarily equally")
        out.append(f"WARNING: other processes used more than {CONTENDED_CORES} cores during measurements: "
                   f"absolute numbers are below a quiet machine's and ratios may be skewed ({why}). "
                   "Rerun on a quiet machine for clean figures.")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (smoke run)")
    parser.add_argument("--reps", type=int, default=None, help="repetitions per measurement (default 5; quick 2)")
    parser.add_argument("--threads", type=int, default=2,
                        help="torch threads, here and in the services (OMP_NUM_THREADS); default 2")
    parser.add_argument("--budget-s", type=float, default=300.0,
                        help=f"time budget: a phase past its share stops repeating after {MIN_REPS} reps")
    args = parser.parse_args()
    reps = args.reps or (2 if args.quick else 5)
    batch_reps = max(MIN_REPS, reps - 2)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # inherited by the services: same threads both sides
    os.environ["RADIXKV_PROBE_MEMO"] = "off"  # every start times its own kernels (linear/probe_memo.py)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()

    def deadline(phase: str) -> float:
        return time.perf_counter() + PHASE_SHARE[phase] * args.budget_s

    prompts = Prompts(seed=20240611)
    services = Services()
    monitor = LoadMonitor(lambda: [os.getpid(), *services.pids()])
    results: Json = {
        "meta": {"python": platform.python_version(), "torch": torch.__version__,
                 "transformers": transformers.__version__, "threads": args.threads,
                 "cpu_count": os.cpu_count(), "dtype": "float32", "block_size": BLOCK_SIZE,
                 "num_blocks": NUM_BLOCKS, "reps": reps, "batch_reps": batch_reps, "budget_s": args.budget_s},
    }
    try:
        print("starting cache_service and model_service; loading the reference model ...", flush=True)
        with monitor.phase("startup"):
            services.start()
            loaded = load_model(None, torch.float32, torch.device("cpu"))
            addr = services.wait()
        results["meta"]["model"] = loaded.name
        ref = Reference(loaded)
        with grpc.insecure_channel(addr) as channel:
            stub = model_pb2_grpc.ModelServiceStub(channel)
            print(f"1. TTFT, 1024-token prompt: miss / hit vs transformers ({reps} reps) ...", flush=True)
            with monitor.phase("ttft"):
                results["ttft"] = bench_ttft(stub, ref, prompts, reps, deadline("ttft"))
            print(f"2. batch-1 decode, 64 tokens ({reps} reps) ...", flush=True)
            with monitor.phase("decode_b1"):
                results["decode_b1"] = bench_decode_b1(stub, ref, prompts, reps, deadline("decode_b1"), 64)
        print(f"3. 16 concurrent requests vs static batch 16 ({batch_reps} reps) ...", flush=True)
        with monitor.phase("decode_b16"):
            results["decode_b16"] = bench_batch(addr, ref, prompts, batch_reps, deadline("decode_b16"), 16, 64)
    except ServiceError as error:
        print(f"model_bench: {error}\n--- service output ---\n" + "\n".join(services.log), file=sys.stderr)
        raise SystemExit(1) from error
    finally:
        services.stop()
    print(f"4. in-process decode step vs GEMMs, batch 16 ({reps * 4} reps) + profile ...", flush=True)
    with monitor.phase("step"):
        results["step"] = bench_step(loaded, prompts, reps * 4, deadline("step"), 16, 100)
    results["best_of_n_ratios"] = best_ratios(results)
    results["load"] = monitor.phases
    results["meta"]["total_s"] = time.perf_counter() - started
    foreign = [p.get("foreign_cpu_cores", 0.0) for name, p in monitor.phases.items() if name != "startup"]
    results["meta"]["contended"] = bool(foreign) and max(foreign) > CONTENDED_CORES

    print("\n" + report(results))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2))
    print(f"\nresults written to {RESULTS.relative_to(REPO)} (total {results['meta']['total_s']:.0f} s)")


if __name__ == "__main__":
    main()
