"""Concurrency sweep 1 / 4 / 16 / 32: that many requests at once (prompts of 32-64 random tokens,
64 tokens out, fresh prompts every repetition) vs a transformers static batch of the same prompts
(left padding + attention mask), the two alternating (bench.model_bench.bench_batch): aggregate
tok/s, and from our streams TTFT and inter-token latency p50/p99 (all repetitions pooled).
"""

from __future__ import annotations

import time

from bench.harness import Json, table
from bench.model_bench import bench_batch
from bench.workloads.base import Context, Workload


def sizes(ctx: Context) -> Json:
    if ctx.quick:
        return {"levels": [1, 4], "new_tokens": 16, "reps": 2}
    return {"levels": [1, 4, 16, 32], "new_tokens": 64, "reps": 3}


def run(ctx: Context, deadline: float) -> Json:
    cfg = sizes(ctx)
    levels: Json = {}
    total = len(cfg["levels"])
    for i, c in enumerate(cfg["levels"]):
        ctx.clear_cache()
        # each level gets an equal share of what is left of the cap
        share = max(0.0, deadline - time.perf_counter()) / (total - i)
        levels[str(c)] = bench_batch(ctx.addr, ctx.ref, ctx.prompts, cfg["reps"], time.perf_counter() + share, c,
                                     cfg["new_tokens"], ctx.progress)
    return {"config": cfg, "levels": levels}


def flat(d: Json) -> Json:
    out: Json = {}
    for c, v in d["levels"].items():
        out[f"throughput_c{c}_tok_s"] = v["ours_tok_s"]["median"]
        out[f"hf_static_b{c}_tok_s"] = v["transformers_tok_s"]["median"]
        out[f"ttft_c{c}_p50_s"] = v["ours_ttft_s"]["p50"]
        out[f"ttft_c{c}_p99_s"] = v["ours_ttft_s"]["p99"]
        out[f"itl_c{c}_p50_ms"] = v["ours_inter_token_ms"]["p50"]
        out[f"itl_c{c}_p99_ms"] = v["ours_inter_token_ms"]["p99"]
        out[f"concurrency_c{c}_greedy_agreement"] = min(v["greedy_sequences_identical_fraction"])
    return out


def report(d: Json) -> str:
    rows = []
    for c, v in d["levels"].items():
        rows.append([c, f"{v['ours_tok_s']['median']:.1f}", f"{v['transformers_tok_s']['median']:.1f}",
                     f"{v['speedup']:.2f}x", f"{v['ours_ttft_s']['p50']:.3f} / {v['ours_ttft_s']['p99']:.3f}",
                     f"{v['ours_inter_token_ms']['p50']:.0f} / {v['ours_inter_token_ms']['p99']:.0f}",
                     f"{100 * min(v['greedy_sequences_identical_fraction']):.0f}%", str(v["ours_tok_s"]["n"])])
    return (f"concurrency sweep: prompts 32-64 tokens, {d['config']['new_tokens']} out\n"
            + table(rows, ["concurrent", "radixkv tok/s", "HF static tok/s", "ratio", "TTFT p50/p99 s",
                           "ITL p50/p99 ms", "greedy = HF", "reps"]))


CONCURRENCY = Workload(name="concurrency", help="1/4/16/32 concurrent requests vs transformers static batches",
                       run=run, flat=flat, report=report, cap_s=420.0,
                       runs=lambda ctx: len(sizes(ctx)["levels"]) * 2 * (1 + sizes(ctx)["reps"]))
