"""radixkv benchmark suite: `python -m bench` (`make bench`; `make bench-quick` for a smoke run).

Spawns the real services itself (cache_service + model_service as child processes; for the fleet
and pulls workloads two replicas and the router too) and runs every workload against its baselines in the
same run, on the same weights (the bundled SmolLM2-135M) and dtype, with the same greedy decoding:
transformers' static-batch generate() and its continuous batching in this process, vLLM's CPU
backend in a subprocess when .venv-vllm has it (`make bench-peers`). The sides take turns, never
run at the same time, and the machine's load is recorded per workload (2 shared cores make
contention change numbers several-fold). See bench/README.md for the workloads and results.json.

    python -m bench [--quick] [--only shared_prefix,multiturn] [--skip fleet] [--dtype bfloat16]
                    [--threads 2] [--all-baselines] [--out bench/results.json] [--plots bench/plots]
    python -m bench --list          # the workloads
    python -m bench --plots-only    # redraw plots and the summary from an existing results.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from bench.harness import (
    REPO,
    Json,
    LoadMonitor,
    Progress,
    Prompts,
    Reference,
    Services,
    contended,
    machine_info,
    psutil,
    table,
)
from bench.workloads import WORKLOADS, Context
from model_service.model_loader import load_model
from model_service.server import DTYPES
from scripts.service_process import ServiceError

RESULTS = REPO / "bench" / "results.json"
PLOTS = REPO / "bench" / "plots"
SCHEMA_VERSION = 1
SUITE_NUM_BLOCKS = 4096  # 64k tokens of KV (3 GiB in fp32): the defeated 4 x 8 shared prefix fits whole
QUICK_NUM_BLOCKS = 1024
QUICK_CAP_SCALE = 0.5


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small sizes and few repetitions (smoke run, a few minutes)")
    p.add_argument("--only", default="", help="comma-separated workloads to run (default: all; see --list)")
    p.add_argument("--skip", default="", help="comma-separated workloads not to run")
    p.add_argument("--list", action="store_true", help="list the workloads and exit")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="weights and KV dtype, ours and transformers' alike (default float32)")
    p.add_argument("--threads", type=int, default=2,
                   help="torch threads, here and in the model service (OMP_NUM_THREADS); default 2")
    p.add_argument("--all-baselines", action="store_true",
                   help="also run the slow baselines of shared_prefix_large (cache defeated, continuous batching)")
    p.add_argument("--cap-scale", type=float, default=1.0, help="multiply every workload's time cap")
    p.add_argument("--seed", type=int, default=20240611, help="seed of the random prompts")
    p.add_argument("--out", type=Path, default=RESULTS, help=f"results JSON (default {RESULTS.relative_to(REPO)})")
    p.add_argument("--plots", type=Path, default=PLOTS, help=f"plot folder (default {PLOTS.relative_to(REPO)})")
    p.add_argument("--no-plots", action="store_true", help="do not draw plots")
    p.add_argument("--plots-only", action="store_true", help="redraw plots and the summary from --out and exit")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p.parse_args(argv)


def select(args: argparse.Namespace) -> list[str]:
    names = list(WORKLOADS)
    only = [n.strip() for n in args.only.split(",") if n.strip()]
    skip = [n.strip() for n in args.skip.split(",") if n.strip()]
    unknown = [n for n in only + skip if n not in WORKLOADS]
    if unknown:
        raise SystemExit(f"unknown workload(s): {', '.join(unknown)}; known: {', '.join(names)}")
    if only:
        names = [n for n in names if n in only]
    return [n for n in names if n not in skip]


# ---------------------------------------------------------------------- results.json


def json_safe(value: Any) -> Any:
    """NaN/inf -> null, tuples -> lists: strict JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def load_previous(path: Path, mode: str, dtype: str, threads: int) -> Json:
    """The results a run with the same mode, dtype and threads left (so `--only` runs add up);
    anything else starts afresh."""
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if (old.get("schema_version"), old.get("mode"), old.get("dtype"), old.get("torch_threads")) != (
            SCHEMA_VERSION, mode, dtype, threads):
        return {}
    return old


def assemble(results: Json) -> Json:
    """Top-level keys derived from the workloads' details (and the machine), refreshed on every save."""
    base = {k: results[k] for k in ("schema_version", "mode", "dtype", "torch_threads", "machine", "run", "runs",
                                    "workloads", "skipped", "failed") if k in results}
    # the runs (`--only` runs add up) whose workloads are still in this file, and the current one
    used = {e.get("run_started_at") for e in base.get("workloads", {}).values()} | {base.get("run", {}).get("started_at")}
    base["runs"] = {k: v for k, v in base.get("runs", {}).items() if k in used}
    flat: Json = {}
    for name, entry in base.get("workloads", {}).items():
        if name in WORKLOADS:
            try:
                flat.update(WORKLOADS[name].flat(entry["detail"]))
            except (KeyError, TypeError, ValueError, ZeroDivisionError) as error:
                flat[f"{name}_flat_error"] = f"{type(error).__name__}: {error}"
    loads = {name: e["load"] for name, e in base.get("workloads", {}).items() if "load" in e}
    machine = base.get("machine", {})
    out: Json = {
        "schema_version": SCHEMA_VERSION, "mode": base.get("mode"), "dtype": base.get("dtype"),
        "torch_threads": base.get("torch_threads"), "cpu_model": machine.get("cpu_model"),
        "logical_cores": machine.get("logical_cores"),
        "load1_max": max((p.get("load1_after", 0.0) for p in loads.values()), default=None),
        "foreign_cpu_cores_max": max((p.get("foreign_cpu_cores", 0.0) for p in loads.values()), default=None),
        "contended": contended(loads),
        **flat,
    }
    out.update(base)
    out["load"] = loads
    return out


def save(path: Path, results: Json) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(json_safe(assemble(results)), indent=2, sort_keys=False))
    os.replace(tmp, path)


# ---------------------------------------------------------------------- summary table


def _f(value: Any, fmt: str) -> str:
    return "" if value is None or (isinstance(value, float) and not math.isfinite(value)) else format(value, fmt)


def summary_table(r: Json) -> str:
    """The headline numbers of every workload measured, one line each."""
    rows: list[list[str]] = []

    def add(measure: str, ours: Any, theirs: Any = None, others: str = "", fmt: str = ".1f",
            lower_is_better: bool = False) -> None:
        if ours is None and theirs is None:
            return
        ratio = ""
        if isinstance(ours, (int, float)) and isinstance(theirs, (int, float)) and ours and theirs:
            ratio = f"{(theirs / ours if lower_is_better else ours / theirs):.2f}x"
        rows.append([measure, _f(ours, fmt), _f(theirs, fmt), ratio, others])

    def vllm(prefix: str) -> str:
        parts = [f"vLLM fp32 {r[f'vllm_{prefix}_tok_s']:.1f}" if f"vllm_{prefix}_tok_s" in r else "",
                 f"ours/vLLM fp32 {r[f'{prefix}_vs_vllm']:.2f}x (median of turns)" if f"{prefix}_vs_vllm" in r else "",
                 f"vLLM bf16 {r[f'vllm_bf16_{prefix}_tok_s']:.1f}" if f"vllm_bf16_{prefix}_tok_s" in r else "",
                 f"ours bf16/vLLM bf16 {r[f'{prefix}_bf16_vs_vllm_bf16']:.2f}x"
                 if f"{prefix}_bf16_vs_vllm_bf16" in r else ""]
        return ", ".join(p for p in parts if p)

    for prefix, label in (("shared_prefix", "shared prefix"), ("shared_prefix_large", "shared prefix, large")):
        if f"{prefix}_tok_s" not in r:
            continue
        others = [f"cache defeated {_f(r.get(f'{prefix}_nocache_tok_s'), '.1f')}" if f"{prefix}_nocache_tok_s" in r
                  else "", f"HF continuous {_f(r.get(f'hf_cb_{prefix}_tok_s'), '.1f')}"
                  if r.get(f"hf_cb_{prefix}_tok_s") is not None else "", vllm(prefix)]
        add(f"{label} tok/s (vs HF static)", r[f"{prefix}_tok_s"], r.get(f"hf_{prefix}_tok_s"),
            ", ".join(o for o in others if o))
        add(f"  hit rate % (ideal {_f(100 * r[f'{prefix}_ideal_hit_rate'], '.0f')}%)",
            100 * r[f"{prefix}_hit_rate"], None, "", ".0f")
        add("  greedy = transformers (%)", 100 * r[f"{prefix}_greedy_agreement"], None, "", ".0f")
    add("multi-turn tok/s", r.get("multiturn_tok_s"), r.get("hf_multiturn_tok_s"),
        f"hit rate {_f(100 * r['multiturn_hit_rate'], '.0f')}%" if "multiturn_hit_rate" in r else "")
    add("no sharing, cache on tok/s", r.get("no_share_tok_s"), r.get("hf_no_share_tok_s"),
        f"defeated {_f(r.get('no_share_nocache_tok_s'), '.1f')}, overhead {_f(r.get('no_share_overhead_pct'), '+.1f')}%,"
        f" Step RPCs {_f(r.get('no_share_cache_rpc_share_pct'), '.1f')}% of wall" if "no_share_tok_s" in r else "")
    for c in ("1", "4", "16", "32"):
        add(f"{c} concurrent tok/s (vs HF static {c})", r.get(f"throughput_c{c}_tok_s"), r.get(f"hf_static_b{c}_tok_s"),
            f"TTFT p50/p99 {_f(r.get(f'ttft_c{c}_p50_s'), '.2f')}/{_f(r.get(f'ttft_c{c}_p99_s'), '.2f')} s, ITL "
            f"p50/p99 {_f(r.get(f'itl_c{c}_p50_ms'), '.0f')}/{_f(r.get(f'itl_c{c}_p99_ms'), '.0f')} ms"
            if f"throughput_c{c}_tok_s" in r else "")
    add("TTFT 1024 tokens, miss s", r.get("ttft_miss_s"), r.get("hf_ttft_s"), "", ".3f", lower_is_better=True)
    add("TTFT 1024 cached + 32, hit s", r.get("ttft_hit_s"), None,
        f"{_f(r.get('ttft_hit_speedup'), '.1f')}x faster than the miss" if "ttft_hit_s" in r else "", ".3f")
    add("decode batch 1 tok/s", r.get("decode_b1_tok_s"), r.get("hf_decode_b1_tok_s"))
    add("cache RPCs per step (shared prefix)", r.get("cache_rpcs_per_step"), None,
        f"Step RPC p50 {_f(r.get('cache_step_rpc_p50_ms'), '.1f')} / p99 {_f(r.get('cache_step_rpc_p99_ms'), '.1f')} ms"
        " (histogram buckets)" if "cache_rpcs_per_step" in r else "", ".2f")
    add("cache manager Step, 16 admits, gRPC p50 us", r.get("cache_bench_step_admit_grpc_p50_us"), None,
        f"in-process {_f(r.get('cache_bench_step_admit_inprocess_p50_us'), ',.0f')} us"
        if "cache_bench_step_admit_grpc_p50_us" in r else "", ",.0f")
    add("decode step batch 16 ms (in-process)", r.get("step_b16_ms"), None,
        f"its GEMMs {_f(r.get('step_b16_gemm_ms'), '.1f')} ms" if "step_b16_ms" in r else "")
    for tag, policy in (("kv", "kv"), ("rr", "round-robin"), ("ll", "least-loaded")):
        if f"fleet_{tag}_hit_rate" in r:
            add(f"fleet {policy}: hit % / TTFT p50 s / tok/s", 100 * r[f"fleet_{tag}_hit_rate"], None,
                f"TTFT p50 {r[f'fleet_{tag}_ttft_p50_s']:.2f} s, p99 {r[f'fleet_{tag}_ttft_p99_s']:.2f} s, "
                f"{r[f'fleet_{tag}_tok_s']:.1f} tok/s", ".0f")
    add("router overhead per streamed token ms", r.get("router_overhead_per_token_ms"), None, "", "+.2f")
    if "tiered_host_tok_s" in r:
        add(f"tiered multi-turn (working set {_f(r.get('tiered_working_set_over_pool'), '.1f')}x the pool): "
            "host tier on tok/s", r["tiered_host_tok_s"], None,
            f"off {_f(r.get('tiered_off_tok_s'), '.1f')} tok/s: {_f(r.get('tiered_host_vs_off_tok_s'), '.2f')}x "
            f"(target >= 2x), mean TTFT {_f(r.get('tiered_host_vs_off_ttft'), '.2f')}x (<= 0.5x), hit rate "
            f"{_f(100 * r['tiered_host_hit_rate'], '.0f')}% (>= 80%)"
            + (f"; write-through {r['tiered_host_wt_vs_off_tok_s']:.2f}x" if "tiered_host_wt_vs_off_tok_s" in r else "")
            + (f"; disk tier only {r['tiered_disk_vs_off_tok_s']:.2f}x" if "tiered_disk_vs_off_tok_s" in r else ""))
    if "tiered_host_hit_vs_miss" in r:
        add(f"tiered {r.get('tiered_prompt_tokens')}-token TTFT: host-tier hit / miss", r["tiered_host_hit_vs_miss"], None,
            f"target <= 0.1x; disk-tier hit {_f(r.get('tiered_disk_hit_vs_miss'), '.2f')}x (<= 0.2x); restarted on "
            f"its disk {_f(r.get('tiered_restart_vs_miss'), '.2f')}x (<= 0.2x, "
            f"{r.get('tiered_restart_cached_disk_tokens')} disk tokens); all-miss loss host "
            f"{_f(r.get('tiered_all_miss_host_loss_pct'), '+.1f')}% / write-through "
            f"{_f(r.get('tiered_all_miss_host_wt_loss_pct'), '+.1f')}% / disk "
            f"{_f(r.get('tiered_all_miss_disk_loss_pct'), '+.1f')}%"
            f" (<= 3%); greedy identical {_f(100 * (r.get('tiered_greedy_identical') or 0), '.0f')}%", ".2f")
    if "pulls_forced_ttft" in r:
        add("peer pulls: 1040-token prompt cached on A, sent to B: TTFT pulled / cold", r["pulls_forced_ttft"], None,
            f"target <= 0.2x; cold {_f(r.get('pulls_forced_cold_ttft_s'), '.3f')} s, pulled "
            f"{_f(r.get('pulls_forced_pulled_ttft_s'), '.3f')} s; B's tokens = A's "
            f"{'yes' if r.get('pulls_forced_identical') else 'NO'}; cached_peer_tokens {r.get('pulls_forced_peer_tokens')}",
            ".2f")
    if "pulls_hot_prefix_tok_s_ratio" in r:
        add("peer pulls: hot prefix through the kv router, tok/s on / off", r["pulls_hot_prefix_tok_s_ratio"], None,
            f"target >= 1.5x; {_f(r.get('pulls_hot_prefix_on_tok_s'), '.1f')} vs "
            f"{_f(r.get('pulls_hot_prefix_off_tok_s'), '.1f')} tok/s; TTFT p90 on / off "
            f"{_f(r.get('pulls_hot_prefix_ttft_p90_ratio'), '.2f')}x (<= 0.5x); requests A / B on "
            f"{r.get('pulls_hot_prefix_on_requests_a')} / {r.get('pulls_hot_prefix_on_requests_b')}, off "
            f"{r.get('pulls_hot_prefix_off_requests_a')} / {r.get('pulls_hot_prefix_off_requests_b')}; "
            f"cached_peer_tokens {r.get('pulls_hot_prefix_on_cached_peer_tokens')}", ".2f")
    if "pulls_fleet_tok_s_ratio" in r:
        add("peer pulls: fleet workload through the kv router, tok/s on / off", r["pulls_fleet_tok_s_ratio"], None,
            "target: no worse (within noise); median of the turns", ".2f")
    if "structured_tok_s" in r:
        add("structured: JSON schema tok/s (vs unconstrained)", r["structured_tok_s"], None,
            f"unconstrained {_f(r.get('structured_free_tok_s'), '.1f')} tok/s: {_f(r.get('structured_vs_free'), '.2f')}x "
            f"(target >= 0.9x); checks {'ok' if r.get('structured_checks_ok') else 'FAILED'}")
    if "parallel_n8_tok_s" in r:
        add("parallel sampling: one request n=8 tok/s (vs 8 at once)", r["parallel_n8_tok_s"], None,
            f"8 separate requests {_f(r.get('parallel_separate_tok_s'), '.1f')} tok/s: "
            f"{_f(r.get('parallel_n8_vs_separate'), '.2f')}x (target >= 1.0x); prompt tokens computed "
            f"{_f(r.get('parallel_n8_prompt_tokens_computed'), '.0f')} vs "
            f"{_f(r.get('parallel_separate_prompt_tokens_computed'), '.0f')}; choice i = seed + i "
            f"{_f(100 * (r.get('parallel_identical_share') or 0), '.0f')}%")
    for dataset, label in (("shared", "4 prefixes x 8, 1024 + 32"), ("random", "random 512, no sharing")):
        for tag in ("fp32", "bf16"):
            p = f"serve_{dataset}_{tag}"
            if f"{p}_tok_s" in r:
                add(f"serve (HTTP, vllm bench serve) {label}, {tag} tok/s", r[f"{p}_tok_s"], None,
                    f"vLLM server {_f(r.get(f'vllm_{p}_tok_s'), '.1f')} tok/s: ours/vLLM "
                    f"{_f(r.get(f'{p}_vs_vllm'), '.2f')}x (median of turns), TTFT "
                    f"{_f(r.get(f'{p}_ttft_vs_vllm'), '.2f')}x, TPOT {_f(r.get(f'{p}_tpot_vs_vllm'), '.2f')}x; "
                    f"checks {'ok' if r.get(f'{p}_checks_ok') else 'FAILED'}, 1 SSE event/token "
                    f"{_f(100 * (r.get(f'{p}_per_token_events_share') or 0), '.0f')}%")
    text = table(rows, ["measure", "radixkv", "transformers", "radixkv speedup", "other baselines / notes"]) if rows else ""
    notes = [f"skipped {k}: {v}" for k, v in (r.get("skipped") or {}).items()]
    notes += [f"FAILED {k}: {v.splitlines()[0] if isinstance(v, str) else v}" for k, v in (r.get("failed") or {}).items()]
    if r.get("contended"):
        notes.append(f"WARNING: other processes used up to {r['foreign_cpu_cores_max']:.2f} cores during the run "
                     "(load average up to {:.1f}): absolute numbers are below a quiet machine's and ratios may be "
                     "skewed.".format(r.get("load1_max") or 0.0))
    return "\n".join([text, *notes])


# ---------------------------------------------------------------------- main


def _pid_tree(pids: set[int]) -> list[int]:
    out = []
    for pid in list(pids):
        out.append(pid)
        if psutil is not None:
            try:
                out += [c.pid for c in psutil.Process(pid).children(recursive=True)]
            except psutil.Error:
                pass
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list:
        for w in WORKLOADS.values():
            reason = w.available()
            print(f"{w.name:<20} {w.help}" + (f"  [unavailable: {reason}]" if reason else ""))
        return 0
    if args.plots_only:
        results = json.loads(args.out.read_text())
        print(summary_table(results))
        if not args.no_plots:
            from bench.plots import make_plots
            for path in make_plots(results, args.plots):
                print(f"plot: {path}")
        return 0

    names = select(args)
    mode = "quick" if args.quick else "full"
    progress = Progress(enabled=not args.no_progress)
    results = load_previous(args.out, mode, args.dtype, args.threads)
    results.update(schema_version=SCHEMA_VERSION, mode=mode, dtype=args.dtype, torch_threads=args.threads)
    results.setdefault("workloads", {})
    results.setdefault("skipped", {})
    results.setdefault("failed", {})
    started_at = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    results["machine"] = machine_info(args.threads)
    results["run"] = {"started_at": started_at, "argv": sys.argv[1:] if argv is None else argv, "selected": names}
    results.setdefault("runs", {})[started_at] = {"argv": results["run"]["argv"], "machine": results["machine"]}

    runnable = []
    for name in names:
        reason = WORKLOADS[name].available()
        if reason:
            progress.write(f"skipping {name}: {reason}")
            results["skipped"][name] = reason
        else:
            runnable.append(name)
    if not runnable:
        save(args.out, results)
        print(summary_table(assemble(results)))
        return 0

    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # inherited by the services: same threads both sides
    os.environ["RADIXKV_PROBE_MEMO"] = "off"  # every start times its own kernels (linear/probe_memo.py)
    torch.set_num_threads(args.threads)
    needs_services = any(WORKLOADS[n].needs_services for n in runnable)
    needs_model = any(WORKLOADS[n].needs_model or WORKLOADS[n].needs_services for n in runnable)
    services = (Services(num_blocks=QUICK_NUM_BLOCKS if args.quick else SUITE_NUM_BLOCKS, dtype=args.dtype,
                         metrics=True, worker_id="bench-suite") if needs_services else None)
    extra_pids: set[int] = set()
    monitor = LoadMonitor(lambda: [os.getpid(), *(services.pids() if services else []), *_pid_tree(extra_pids)])
    suite_start = time.perf_counter()
    exit_code = 0
    try:
        progress.write(f"radixkv bench ({mode}, {args.dtype}, {args.threads} threads): {', '.join(runnable)}")
        progress.write(", ".join(what for what, needed in (("starting cache_service and model_service", services),
                                                           ("loading the reference model", needs_model)) if needed)
                       + " ...")
        loaded = None
        with monitor.phase("startup"):
            if services:
                services.start()
            if needs_model:
                loaded = load_model(None, DTYPES[args.dtype], torch.device("cpu"))
                results["machine"]["model"] = loaded.name
            addr = services.wait() if services else ""
        ctx = Context(quick=args.quick, dtype=args.dtype, threads=args.threads, all_baselines=args.all_baselines,
                      prompts=Prompts(args.seed), progress=progress, monitor=monitor, loaded=loaded,
                      ref=Reference(loaded) if loaded else None, services=services, addr=addr, extra_pids=extra_pids)
        for i, name in enumerate(runnable):
            w = WORKLOADS[name]
            if services is not None and not any(WORKLOADS[n].needs_services for n in runnable[i:]):
                services.stop()  # free its memory and cores for what is left (the fleet starts its own)
                ctx.services, services = None, None
            cap = w.cap_s * args.cap_scale * (QUICK_CAP_SCALE if args.quick else 1.0)
            began = time.perf_counter()
            try:
                with progress.workload(name, w.runs(ctx)), monitor.phase(name):
                    detail = w.run(ctx, ctx.deadline(cap))
            except Exception as error:  # one workload failing does not lose the others
                text = "".join(traceback.format_exception(error))
                if services is not None and isinstance(error, ServiceError):
                    text += "\n--- service output ---\n" + "\n".join(services.log)
                progress.write(f"\n!! {name} failed: {type(error).__name__}: {error}")
                results["failed"][name] = text
                results["workloads"].pop(name, None)
                exit_code = 1
                save(args.out, results)
                continue
            results["failed"].pop(name, None)
            results["skipped"].pop(name, None)
            results["workloads"][name] = {
                "measured_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                "run_started_at": started_at, "wall_s": time.perf_counter() - began, "cap_s": cap,
                "load": monitor.phases[name], "detail": detail}
            progress.write("\n" + w.report(detail))
            p = monitor.phases[name]
            if "foreign_cpu_cores" in p:
                progress.write(f"(load {p['load1_before']:.2f} -> {p['load1_after']:.2f}; other processes used "
                               f"{p['foreign_cpu_cores']:.2f} cores; {p['wall_s']:.0f} s)")
            save(args.out, results)
    finally:
        if services is not None:
            services.stop()
    results["run"]["total_s"] = time.perf_counter() - suite_start
    save(args.out, results)
    final = json.loads(args.out.read_text())
    print("\n== summary (" + ("QUICK smoke run: sizes are small, numbers mean little" if args.quick else
                               f"{args.dtype}, {args.threads} threads, {final['cpu_model']}") + ")")
    print(summary_table(final))
    if not args.no_plots:
        try:
            from bench.plots import make_plots
            for path in make_plots(final, args.plots):
                print(f"plot: {path.relative_to(REPO) if path.is_relative_to(REPO) else path}")
        except ImportError as error:
            print(f"no plots: {error} (pip install matplotlib)")
    print(f"results written to {args.out} (total {results['run']['total_s']:.0f} s)")
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
