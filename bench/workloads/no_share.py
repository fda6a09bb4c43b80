"""No sharing at all: 16 concurrent requests with random prompts (128-256 tokens), 64 tokens out.
radixkv with the prefix cache on (nothing can hit: every prompt is new) vs the cache defeated (a
distinct namespace per request), vs a transformers static batch of the same 16 prompts. In every
repetition (10) the two radixkv sides run back to back (which goes first alternates), then, in the
first 3, transformers (the baseline; the pairs are what needs the repetitions: one run's wall
varies by about 6% on 2 shared cores, so the median of 6 paired ratios still moved by 2-3%):
the pair compared for the overhead never has transformers' run between its two halves, and each
side goes first equally often (with the three rotating, cache-on had followed transformers' run in
3 repetitions of 5 and defeated in none).

Both radixkv configurations do the same cache bookkeeping (match, insert, evict: there is no switch
that turns the cache manager off), so `no_share_overhead_pct` (how much slower cache-on is than
defeated, median of the per-repetition ratios) should be ~0 within noise. What the cache manager
costs is the share of the wall time the engine spends in its Step RPCs
(`no_share_cache_rpc_share_pct`, from the model service's Prometheus histogram).
"""

from __future__ import annotations

import statistics
import time
import uuid

from bench.harness import (
    WARMUP_TOKENS,
    Json,
    TimingStreamer,
    alternate,
    dist,
    metrics_delta,
    repetitions,
    stream_concurrent,
    stream_stats,
    summary,
    table,
)
from bench.workloads.base import Context, Workload


def sizes(ctx: Context) -> Json:
    if ctx.quick:
        return {"concurrency": 4, "prompt_min": 32, "prompt_max": 64, "new_tokens": 16, "reps": 2, "hf_reps": 1}
    return {"concurrency": 16, "prompt_min": 128, "prompt_max": 256, "new_tokens": 64, "reps": 10, "hf_reps": 3}


def run(ctx: Context, deadline: float) -> Json:
    cfg = sizes(ctx)
    c, new = cfg["concurrency"], cfg["new_tokens"]
    samples: Json = {"on": [], "nocache": [], "hf": []}
    metrics: Json = {"on": [], "nocache": []}
    hits: list[float] = []
    ttft: Json = {"on": [], "nocache": []}
    state: Json = {}

    with ctx.progress.run("warm-up", 0):
        stream_concurrent(ctx.addr, [ctx.prompts.ids(32) for _ in range(2)], WARMUP_TOKENS)
        ctx.ref.generate([ctx.prompts.ids(32)], WARMUP_TOKENS)
    ctx.clear_cache()

    def ours(kind: str) -> None:
        namespaces = [f"ns-{uuid.uuid4().hex[:8]}-{i}" for i in range(c)] if kind == "nocache" else None
        before = ctx.scrape()
        with ctx.progress.run(f"radixkv {'cache on' if kind == 'on' else 'cache defeated'}", c * new) as tick:
            start = time.perf_counter()
            wall, results = stream_concurrent(ctx.addr, state["prompts"], new, namespaces=namespaces, on_tokens=tick)
        delta = metrics_delta(before, ctx.scrape())
        if delta:
            delta["cache_rpc_share_of_wall"] = delta["cache_rpc_total_s"] / wall
        metrics[kind].append(delta)
        stats = stream_stats(start, results)
        samples[kind].append(stats["completion_tokens"] / wall)
        ttft[kind] += [r.ttft for r in results]
        if kind == "on":
            hits.append(stats["hit_rate"])

    def theirs() -> None:
        with ctx.progress.run(f"transformers static {c}", c * new) as tick:
            wall, _ = ctx.ref.generate(state["prompts"], new, TimingStreamer(tick))
        samples["hf"].append(c * new / wall)

    for rep in repetitions(cfg["reps"], deadline):
        state["prompts"] = [ctx.prompts.ids(n) for n in ctx.prompts.lengths(c, cfg["prompt_min"], cfg["prompt_max"])]
        alternate(rep, lambda: ours("on"), lambda: ours("nocache"))
        if rep < cfg["hf_reps"]:
            theirs()
    # per repetition: how much longer cache-on took than defeated (same prompts, same work)
    overhead = [100 * (nc / on - 1) for on, nc in zip(samples["on"], samples["nocache"], strict=True)]
    shares = [m["cache_rpc_share_of_wall"] for m in metrics["on"] if m]
    return {
        "config": cfg,
        "radixkv_tok_s": summary(samples["on"]), "radixkv_nocache_tok_s": summary(samples["nocache"]),
        "hf_static_tok_s": summary(samples["hf"]),
        "overhead_pct_per_rep": overhead, "overhead_pct": statistics.median(overhead),
        "hit_rate": summary(hits), "ttft_s": {k: dist(v) for k, v in ttft.items()},
        "cache_rpc_share_pct": 100 * statistics.median(shares) if shares else None,
        "metrics": metrics,
    }


def flat(d: Json) -> Json:
    out = {"no_share_tok_s": d["radixkv_tok_s"]["median"], "no_share_nocache_tok_s": d["radixkv_nocache_tok_s"]["median"],
           "hf_no_share_tok_s": d["hf_static_tok_s"]["median"], "no_share_overhead_pct": d["overhead_pct"],
           "no_share_hit_rate": d["hit_rate"]["median"]}
    if d.get("cache_rpc_share_pct") is not None:
        out["no_share_cache_rpc_share_pct"] = d["cache_rpc_share_pct"]
        on = [m for m in d["metrics"]["on"] if m]
        if on:
            out["no_share_cache_rpcs_per_step"] = statistics.median(m["cache_rpcs_per_step"] for m in on)
    return out


def report(d: Json) -> str:
    c = d["config"]
    rows = [["radixkv, prefix cache on (no hit possible)", f"{d['radixkv_tok_s']['median']:.1f}",
             f"{d['ttft_s']['on']['p50']:.2f}"],
            ["radixkv, cache defeated", f"{d['radixkv_nocache_tok_s']['median']:.1f}",
             f"{d['ttft_s']['nocache']['p50']:.2f}"],
            [f"transformers static batch {c['concurrency']}", f"{d['hf_static_tok_s']['median']:.1f}", ""]]
    share = d.get("cache_rpc_share_pct")
    return (f"no sharing: {c['concurrency']} concurrent, prompts {c['prompt_min']}-{c['prompt_max']} tokens, "
            f"{c['new_tokens']} out; median of {d['radixkv_tok_s']['n']} reps\n"
            + table(rows, ["side", "tok/s", "TTFT p50 s"])
            + f"\ncache on vs defeated: {d['overhead_pct']:+.1f}% wall time (per rep: "
            + ", ".join(f"{v:+.1f}%" for v in d["overhead_pct_per_rep"]) + ")"
            + (f"; time in cache manager Step RPCs: {share:.1f}% of the wall" if share is not None else "")
            + f"; hit rate {100 * d['hit_rate']['median']:.1f}%")


NO_SHARE = Workload(name="no_share", help="16 concurrent random prompts: what the cache costs when nothing hits",
                    run=run, flat=flat, report=report, cap_s=240.0,
                    runs=lambda ctx: 1 + 2 * sizes(ctx)["reps"] + sizes(ctx)["hf_reps"])
