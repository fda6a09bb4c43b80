"""PNG plots of a results.json (matplotlib, Agg backend): `python -m bench --plots-only` redraws them.

throughput_vs_concurrency.png  radixkv aggregate tok/s at 1/4/16/32 concurrent vs transformers static batches
ttft_hit_vs_miss.png           TTFT of a 1024-token prompt, miss vs hit (vs transformers), and the per-request
                               TTFT distribution of the shared-prefix workload, cache on vs defeated
shared_prefix_time_split.png   wall time split prefill / decode per side (radixkv, transformers, ...)
fleet_policies.png             hit rate, TTFT p50/p99 and throughput per routing policy
"""

from __future__ import annotations

import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from bench.harness import Json  # noqa: E402

OURS, THEIRS, OTHER, GREY = "#1f77b4", "#d62728", "#2ca02c", "#7f7f7f"


def _detail(results: Json, name: str) -> Json | None:
    entry = (results.get("workloads") or {}).get(name)
    return entry["detail"] if entry else None


def _subtitle(results: Json) -> str:
    m = results.get("machine") or {}
    text = (f"{results.get('mode')} run, {results.get('dtype')}, {results.get('torch_threads')} threads, "
            f"{m.get('cpu_model', '?')} ({m.get('logical_cores', '?')} cores)")
    if results.get("contended"):
        text += f" - CONTENDED (others used up to {results.get('foreign_cpu_cores_max') or 0:.2f} cores)"
    return text


def _finish(fig, results: Json, path: Path) -> Path:
    fig.text(0.5, 0.005, _subtitle(results), ha="center", va="bottom", fontsize=7, color=GREY)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def throughput_vs_concurrency(results: Json, out: Path) -> Path | None:
    d = _detail(results, "concurrency")
    if not d:
        return None
    levels = sorted(d["levels"], key=int)
    x = [int(c) for c in levels]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, label, color in (("ours_tok_s", "radixkv (concurrent requests)", OURS),
                              ("transformers_tok_s", "transformers static batch", THEIRS)):
        med = [d["levels"][c][key]["median"] for c in levels]
        low = [m - d["levels"][c][key]["min"] for m, c in zip(med, levels, strict=True)]
        high = [d["levels"][c][key]["max"] - m for m, c in zip(med, levels, strict=True)]
        ax.errorbar(x, med, yerr=[low, high], marker="o", capsize=3, label=label, color=color)
    cfg = d["config"]
    ax.set_xscale("log", base=2)
    ax.set_xticks(x, [str(v) for v in x])
    ax.set_xlabel("concurrent requests / static batch size")
    ax.set_ylabel("aggregate output tok/s (median, min-max)")
    ax.set_title(f"Throughput vs concurrency (prompts 32-64 tokens, {cfg['new_tokens']} out, greedy)")
    ax.grid(alpha=0.3)
    ax.legend()
    return _finish(fig, results, out / "throughput_vs_concurrency.png")


def _ecdf(ax, values: list[float], label: str, color: str) -> None:
    values = sorted(values)
    ax.step([values[0], *values], [0.0, *((i + 1) / len(values) for i in range(len(values)))], where="post",
            label=label, color=color)


def ttft_hit_vs_miss(results: Json, out: Path) -> Path | None:
    lat, sp = _detail(results, "latency"), _detail(results, "shared_prefix")
    if not lat and not sp:
        return None
    panels = [p for p in (lat, sp) if p]
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    axes = list(axes[0])
    if lat:
        ax = axes.pop(0)
        t = lat["ttft"]
        data = [t["ours_miss_s"]["samples"], t["ours_hit_s"]["samples"], t["transformers_s"]["samples"]]
        labels = ["radixkv miss\n(1024 new)", "radixkv hit\n(1024 cached + 32)", "transformers\n(1024)"]
        colors = [OURS, OTHER, THEIRS]
        for i, (vals, color) in enumerate(zip(data, colors, strict=True)):
            ax.scatter([i] * len(vals), vals, color=color, alpha=0.7, zorder=3)
            ax.hlines(statistics.median(vals), i - 0.25, i + 0.25, color=color, lw=2)
        ax.set_xticks(range(3), labels)
        ax.set_yscale("log")
        ax.set_ylabel("time to first token, s (log; dots: repetitions, bar: median)")
        ax.set_title(f"TTFT, one request: hit {t['hit_speedup_over_miss']:.1f}x faster than miss")
        ax.grid(alpha=0.3, axis="y")
    if sp:
        ax = axes.pop(0)
        for key, label, color in (("radixkv", "radixkv, prefix cache on", OURS),
                                  ("radixkv_nocache", "radixkv, cache defeated", GREY)):
            if key in sp and sp[key].get("ttft_samples_s"):
                _ecdf(ax, sp[key]["ttft_samples_s"], f"{label} (hit {100 * sp[key]['hit_rate']:.0f}%)", color)
        hf = sp.get("hf_static", {}).get("ttft_from_start_s")
        if hf and hf.get("n"):
            ax.axvline(hf["p50"], color=THEIRS, ls="--", label="transformers static, p50 (group after group)")
        c = sp["config"]
        ax.set_xlabel("time to first token from submission, s")
        ax.set_ylabel("share of requests")
        ax.set_title(f"Shared prefix {c['groups']}x{c['per_group']}: TTFT distribution (all sent at once)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    return _finish(fig, results, out / "ttft_hit_vs_miss.png")


def _split_rows(d: Json) -> list[tuple[str, float, float]]:
    rows = []
    for key, label in (("radixkv", "radixkv cache on"), ("radixkv_nocache", "radixkv cache defeated"),
                       ("hf_static", "transformers static"), ("hf_cb", "transformers continuous"),
                       ("radixkv_onednn", "radixkv fp32 oneDNN GEMMs"), ("radixkv_bf16", "radixkv bfloat16")):
        v = d.get(key)
        if not v or "error" in v:
            continue
        split = v.get("split") or {"prefill_s": v.get("prefill_s"), "decode_s": v.get("decode_s")}
        if split.get("prefill_s") is None:
            continue
        if key == "hf_static" and v.get("batches_run") != v.get("batches_total"):
            label += f" ({v['batches_run']}/{v['batches_total']} groups)"
        rows.append((label, split["prefill_s"], split["decode_s"]))
    for dtype, v in (d.get("vllm") or {}).items():
        if isinstance(v, dict) and "wall_s" in v:  # no split where vLLM does not report TTFTs: total only
            split = v.get("split") or {"prefill_s": 0.0, "decode_s": None}
            rows.append((f"vLLM CPU {dtype}" + ("" if v.get("split") else " (total only)"), split["prefill_s"],
                         split["decode_s"] if split["decode_s"] is not None else v["wall_s"]))
    return rows


def shared_prefix_time_split(results: Json, out: Path) -> Path | None:
    panels = [(n, d) for n in ("shared_prefix", "shared_prefix_large") if (d := _detail(results, n))]
    if not panels:
        return None
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 2.2 + 1.4 * len(panels) * 2), squeeze=False)
    for ax, (_, d) in zip(axes[:, 0], panels, strict=True):
        rows = _split_rows(d)
        labels = [r[0] for r in rows]
        y = range(len(rows))
        ax.barh(y, [r[1] for r in rows], color=OTHER, label="prefill")
        ax.barh(y, [r[2] for r in rows], left=[r[1] for r in rows], label="decode",
                color=[GREY if r[0].endswith("(total only)") else OURS for r in rows])
        for i, (_, p, dec) in enumerate(rows):
            ax.text(p + dec, i, f" {p + dec:.1f} s", va="center", fontsize=8)
        ax.set_yticks(list(y), labels)
        ax.invert_yaxis()
        c = d["config"]
        ax.set_title(f"Shared prefix {c['groups']} groups x {c['per_group']} ({c['prefix']}-token prefix, "
                     f"{c['new_tokens']} out): wall time split", fontsize=10)
        ax.set_xlabel("seconds (radixkv/continuous: prefill = until every request has its first token; "
                      "static: sum over groups)", fontsize=8)
        ax.legend(fontsize=8, loc="lower right")
        ax.grid(alpha=0.3, axis="x")
    return _finish(fig, results, out / "shared_prefix_time_split.png")


def fleet_policies(results: Json, out: Path) -> Path | None:
    d = _detail(results, "fleet")
    if not d or not d.get("policies"):
        return None
    names = list(d["policies"])
    pol = [d["policies"][n] for n in names]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    ax = axes[0]
    ax.bar(names, [100 * p["hit_rate"] for p in pol], color=OURS)
    ax.axhline(100 * d["ideal_hit_rate"], color=GREY, ls="--", label="ideal")
    ax.set_ylabel("prefix hit rate, %")
    ax.set_title("Prefix hit rate")
    ax.legend(fontsize=8)
    ax = axes[1]
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], [p["ttft_s"]["p50"] for p in pol], width=0.4, label="p50", color=OURS)
    ax.bar([i + 0.2 for i in x], [p["ttft_s"]["p99"] for p in pol], width=0.4, label="p99", color=THEIRS)
    ax.set_xticks(list(x), names)
    ax.set_ylabel("TTFT, s")
    ax.set_title("Time to first token")
    ax.legend(fontsize=8)
    ax = axes[2]
    ax.bar(names, [p["tok_s"] for p in pol], color=OTHER)
    ax.set_ylabel("output tok/s")
    ax.set_title("Throughput")
    for a in axes:
        a.grid(alpha=0.3, axis="y")
    c = d["config"]
    fig.suptitle(f"Fleet: {c['replicas']} replicas x 1 thread + router; {c['groups']} groups x {c['per_group']} "
                 f"({c['prefix']}-token prefix), shuffled arrivals", fontsize=10)
    return _finish(fig, results, out / "fleet_policies.png")


def make_plots(results: Json, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [fn(results, out) for fn in (throughput_vs_concurrency, ttft_hit_vs_miss, shared_prefix_time_split,
                                         fleet_policies)]
    return [p for p in paths if p is not None]
