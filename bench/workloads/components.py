"""Components measured alone: the cache manager (bench.cache_bench: match+insert, eviction, Step
in-process vs over gRPC vs a bare echo, Route, the tree on issue 12's trace) and our ModelRunner's decode step vs the GEMMs it runs
(bench.model_bench phase 4). Neither needs the shared model service.
"""

from __future__ import annotations

from collections.abc import Callable

from bench import cache_bench
from bench.harness import Json
from bench.model_bench import bench_step
from bench.workloads.base import Context, Workload


def run_component(ctx: Context, label: str, run: Callable[..., Json]) -> Json:
    """A bench module's `run(quick, echo=...)` as a workload: its results and printed report."""
    lines: list[str] = []
    with ctx.progress.run(label, 0):
        results = run(ctx.quick, echo=lines.append)
    return {"config": {"quick": ctx.quick}, "results": results, "report": "\n".join(lines)}


def run_cache(ctx: Context, deadline: float) -> Json:
    return run_component(ctx, "cache_bench (in-process + gRPC Step, Route)", cache_bench.run)


def flat_cache(d: Json) -> Json:
    r = d["results"]
    by = {(s["step"], s["where"]): s for s in r["step"]}
    return {
        "cache_bench_match_insert_us": r["match_insert"]["us_per_op"],
        "cache_bench_step_admit_inprocess_p50_us": by[("admit+finish", "in-process")]["p50_us"],
        "cache_bench_step_admit_grpc_p50_us": by[("admit+finish", "gRPC")]["p50_us"],
        "cache_bench_step_admit_grpc_p99_us": by[("admit+finish", "gRPC")]["p99_us"],
        "cache_bench_step_extend_inprocess_p50_us": by[("extend", "in-process")]["p50_us"],
        "cache_bench_step_extend_grpc_p50_us": by[("extend", "gRPC")]["p50_us"],
        "cache_bench_grpc_over_inprocess_admit": r["grpc_over_inprocess_admit+finish"],
        "cache_bench_grpc_over_inprocess_extend": r["grpc_over_inprocess_extend"],
        "cache_bench_route_p50_us": r["route"]["route_us_p50"],
        "cache_bench_route_pools": r["route"]["pools"],
        "cache_step_grpc_p99_us": by[("all", "gRPC")]["p99_us"],
        "grpc_echo_p99_us": by[("all", "echo")]["p99_us"],
        "cache_step_over_echo_p99": r["step_over_echo_p99_all"],
        **flat_tree_trace(r["tree_trace"]),
    }


def flat_tree_trace(rows: list[Json]) -> Json:
    """tree_trace_p{16,1}_*: the current tree on issue 12's trace, the previous one as `_old_`,
    SGLang's as `_sglang_` (with `_over_sglang`, radixkv's ratio to it)."""
    out: Json = {}
    for row in rows:
        p = f"tree_trace_p{row['page_size']}"
        for name, infix in (("new", ""), ("new_hashed", "_hashed"), ("old", "_old")):
            r = row[name]
            out[f"{p}{infix}_req_s"] = r["req_s"]
            for kind in ("match", "insert", "evict"):
                out[f"{p}{infix}_{kind}_us"] = r[f"{kind}_us"]
        out[f"{p}_over_old"] = row["new_over_old"]
        out[f"{p}_hashed_over_old"] = row["new_hashed_over_old"]
        for peer, r in row.get("peers", {}).items():  # SGLang's tree, when it could be had
            out[f"{p}_{peer}_req_s"] = r["req_s"]
            out[f"{p}_over_{peer}"] = row[f"new_over_{peer}"]
    return out


def report_cache(d: Json) -> str:
    return "cache manager alone (bench.cache_bench)\n" + d["report"]


def run_step(ctx: Context, deadline: float) -> Json:
    n = 8 if ctx.quick else 20
    with ctx.progress.run("ModelRunner decode step vs GEMMs, batch 16", 0):
        out = bench_step(ctx.loaded, ctx.prompts, n, deadline, 16, 100)
    out.pop("profile_table", None)
    return out


def flat_step(d: Json) -> Json:
    return {"step_b16_ms": d["step_ms"]["median"], "step_b16_gemm_ms": d["runner_gemm_ms"]["median"],
            "step_over_runner_gemm": d["step_over_runner_gemm"], "step_over_gemm": d["step_over_gemm"]}


def report_step(d: Json) -> str:
    return (f"in-process decode step, batch {d['batch']}, contexts {d['context_tokens']}: "
            f"{d['step_ms']['median']:.1f} ms; its GEMMs {d['runner_gemm_ms']['median']:.1f} ms "
            f"(step/GEMM {d['step_over_runner_gemm']:.2f}x); the model's own F.linear GEMMs "
            f"{d['gemm_ms']['median']:.1f} ms")


CACHE = Workload(name="cache", help="the cache manager alone: bench.cache_bench (Step in-process vs gRPC ...)",
                 run=run_cache, flat=flat_cache, report=report_cache, cap_s=180.0, runs=lambda ctx: 1,
                 needs_services=False, needs_model=False)
STEP = Workload(name="step", help="in-process ModelRunner decode step vs its GEMMs (+ profile)",
                run=run_step, flat=flat_step, report=report_step, cap_s=60.0, runs=lambda ctx: 1,
                needs_services=False)
