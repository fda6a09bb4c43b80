"""Single-request latency (bench.model_bench phases 1-2, reused as they are):
TTFT of a 1024-token prompt, ours on a cache miss (a fresh prompt) and on a hit (the same 1024
tokens + 32 new), client-side time to the first streamed message, vs transformers
generate(max_new_tokens=1); batch-1 decode tok/s (64 tokens after a 16-token prompt; decode rate =
(n - 1) / (last token - first token)) vs transformers generate() timed by a streamer. The two
sides alternate within each repetition; medians of the repetitions.
"""

from __future__ import annotations

import time

import grpc

from bench.harness import Json, table
from bench.model_bench import bench_decode_b1, bench_ttft
from bench.workloads.base import Context, Workload
from protos import model_pb2_grpc


def reps(ctx: Context) -> int:
    return 2 if ctx.quick else 5


def run(ctx: Context, deadline: float) -> Json:
    n = reps(ctx)
    out: Json = {"config": {"reps": n, "prompt_tokens": 1024, "hit_new_tokens": 32, "decode_new_tokens": 64}}
    half = time.perf_counter() + 0.4 * max(0.0, deadline - time.perf_counter())
    ctx.clear_cache()
    with grpc.insecure_channel(ctx.addr) as channel:
        stub = model_pb2_grpc.ModelServiceStub(channel)
        with ctx.progress.run("TTFT miss / hit / transformers", 0):
            out["ttft"] = bench_ttft(stub, ctx.ref, ctx.prompts, n, half)
        with ctx.progress.run("batch-1 decode", 0):
            out["decode_b1"] = bench_decode_b1(stub, ctx.ref, ctx.prompts, n, deadline, 64)
    return out


def flat(d: Json) -> Json:
    t, b = d["ttft"], d["decode_b1"]
    return {"ttft_miss_s": t["ours_miss_s"]["median"], "ttft_hit_s": t["ours_hit_s"]["median"],
            "hf_ttft_s": t["transformers_s"]["median"], "ttft_hit_speedup": t["hit_speedup_over_miss"],
            "decode_b1_tok_s": b["ours_decode_tok_s"]["median"], "hf_decode_b1_tok_s": b["transformers_decode_tok_s"]["median"],
            "decode_b1_e2e_tok_s": b["ours_e2e_tok_s"]["median"],
            "hf_decode_b1_e2e_tok_s": b["transformers_e2e_tok_s"]["median"],
            "decode_b1_greedy_agreement": sum(b["greedy_tokens_identical"]) / len(b["greedy_tokens_identical"])}


def report(d: Json) -> str:
    t, b = d["ttft"], d["decode_b1"]
    rows = [["TTFT 1024 tokens, miss (s)", f"{t['ours_miss_s']['median']:.3f}", f"{t['transformers_s']['median']:.3f}",
             f"{t['miss_speedup_over_transformers']:.2f}x"],
            ["TTFT 1024 cached + 32 new, hit (s)", f"{t['ours_hit_s']['median']:.3f}", "",
             f"{t['hit_speedup_over_miss']:.1f}x over our miss"],
            ["decode batch 1 (tok/s)", f"{b['ours_decode_tok_s']['median']:.1f}",
             f"{b['transformers_decode_tok_s']['median']:.1f}", f"{b['speedup']:.2f}x"]]
    return (f"single-request latency (median of {t['ours_miss_s']['n']} / {b['ours_decode_tok_s']['n']} reps)\n"
            + table(rows, ["measure", "radixkv", "transformers", "ratio"])
            + f"\nbatch-1 greedy tokens identical: {sum(b['greedy_tokens_identical'])}/{len(b['greedy_tokens_identical'])}")


LATENCY = Workload(name="latency", help="TTFT of a 1024-token prompt (miss vs hit), batch-1 decode",
                   run=run, flat=flat, report=report, cap_s=180.0, runs=lambda ctx: 2)
