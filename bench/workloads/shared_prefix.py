"""Shared prefix: G groups x N requests, each group sharing a 1024-token prefix (random token ids),
a 32-token question each, 64 output tokens (greedy, ignore_eos), all G*N sent at once.

Sides, in this order:
  radixkv, prefix cache on           every request streamed at once over gRPC; takes turns with vLLM
                                     in the same dtype (3 runs each, who goes first alternating)
  transformers static batching       generate() with left padding, one group (batch N) at a time
  radixkv, cache defeated            a distinct `namespace` per request: nothing can hit
  transformers continuous batching   the manager behind model.generate_batch(), block sharing on
  radixkv bf16, prefix cache on      (fp32 runs, 4x8 only) a second pair of services, --dtype bfloat16;
                                     takes turns with vLLM bf16 (3 runs each)
  radixkv fp32 oneDNN, cache on      (fp32 runs, 4x8 only) another pair, --fp32-gemm onednn (not bitwise HF)
  vLLM CPU (fp32, bf16)              when .venv-vllm has it: LLM.generate, prefix caching on; one engine
                                     per dtype, idle (blocked on its input) while radixkv runs
Why turns: on 2 shared cores the machine's speed drifts by 10-25% over minutes (transformers'
continuous batching took 258 s in one run and 328 s in another), so one run per side, minutes apart,
compared the machine's moods as much as the engines. Each side's reported run is its median-wall run
(`reps_wall_s` has them all); `vs_vllm` has vLLM's wall over ours per turn and their median.
The large variant (8 x 16) runs radixkv with the cache on (turns with vLLM fp32) and transformers
static batching (capped: it stops after the groups that fit the cap) unless --all-baselines; vLLM
bf16 runs once there.

Warm-up (excluded from every timing): each side first serves the workload's shape on other random
prompts (WARMUP_TOKENS out, as many as vLLM's worker warms with), then its prefix cache is cleared
(before every measured run too), so that one-off costs (first-touch pages, buffers that grow to the
batch's size) stay out of the measured run, as vLLM's start-up profile run keeps them out of its.
transformers gets a short generate() warm-up.

Greedy agreement: share of sequences whose tokens equal transformers' static batch (within a group
every prompt has the same length, so there is no padding on that side), over every run of the side.
Time split: radixkv (and continuous batching): prefill = start until every request has its first
token, decode = the rest of the wall time (they overlap under continuous batching: early requests
decode while later ones prefill); transformers static: the sum over groups of start-to-first-token
and first-to-last-token.
"""

from __future__ import annotations

import contextlib
import statistics
import time
import uuid
from collections.abc import Callable, Iterator

from bench import peers
from bench.harness import (
    BLOCK_SIZE,
    WARMUP_TOKENS,
    Json,
    Progress,
    Services,
    alternate,
    dist,
    identical_fraction,
    metrics_delta,
    stream_concurrent,
    stream_stats,
    table,
    time_split,
)
from bench.workloads.base import Context, Workload, num
from model_service.scheduler import DEFAULT_MAX_NUM_SEQS


def sizes(ctx: Context, large: bool) -> Json:
    if ctx.quick:
        return {"groups": 2, "per_group": 4, "prefix": 256, "question": 16, "new_tokens": 16}
    return {"groups": 8 if large else 4, "per_group": 16 if large else 8, "prefix": 1024, "question": 32,
            "new_tokens": 64}


# Idle seconds before each turn: vLLM's workers spin (sched_yield) for 1 s after their last read
# of the engine's queue before they sleep; neither side's turn starts while the other's spins.
SETTLE_S = 2.0


def _reps(ctx: Context) -> int:
    """How many times radixkv and vLLM take turns on the workload (odd: the median is a run)."""
    return 1 if ctx.quick else 3


def _runs(large: bool, ctx: Context) -> int:
    """Progress-bar runs: warm-up, our turns, transformers static, [defeated, continuous batching],
    [bf16: services + its turns, oneDNN: services + one run], vLLM: per engine its start (or the
    single run) and its turns."""
    r, full, with_variants = _reps(ctx), not large or ctx.all_baselines, ctx.dtype == "float32" and not large
    ours = 1 + r + 1 + (2 if full else 0) + ((1 + r) + 2 if with_variants else 0)
    vllm = 0 if peers.vllm_absent_reason() else (1 + r) + ((1 + r) if with_variants else 1)
    return ours + vllm


def _measure(addr: str, label: str, prompts: list[list[int]], new_tokens: int, *, clear: Callable[[], object],
             progress: Progress, scrape: Callable[[], Json] | None = None, defeat: bool = False) -> Json:
    """One measured radixkv run on an empty prefix cache: its stats (`_tokens`: for the agreement)."""
    clear()
    namespaces = [f"nocache-{uuid.uuid4().hex[:8]}-{i}" for i in range(len(prompts))] if defeat else None
    before = scrape() if scrape else {}
    with progress.run(label, len(prompts) * new_tokens) as tick:
        start = time.perf_counter()
        wall, results = stream_concurrent(addr, prompts, new_tokens, namespaces=namespaces, on_tokens=tick)
    out = stream_stats(start, results)
    out.update(wall_s=wall, tok_s=out["completion_tokens"] / wall, split=time_split(start, start + wall, results),
               ttft_samples_s=[r.ttft for r in results], _tokens=[r.token_ids for r in results])
    if scrape:
        out["metrics"] = metrics_delta(before, scrape())
    return out


def _median_run(runs: list[Json]) -> Json:
    """The run of median wall time (the lower middle one for an even count), with every run's wall."""
    chosen = dict(sorted(runs, key=lambda r: r["wall_s"])[(len(runs) - 1) // 2])
    chosen["reps_wall_s"] = [r["wall_s"] for r in runs]
    return chosen


def _vllm_engine(ctx: Context, dtype: str, warmup: list[list[int]], max_num_seqs: int) -> peers.VllmEngine:
    """A vLLM engine for this workload, its processes counted as ours by the load monitor."""
    return peers.VllmEngine(dtype, ctx.threads, warmup=warmup, max_model_len=2048, max_num_seqs=max_num_seqs,
                            register_pid=lambda pid: ctx.extra_pids.clear() if pid is None
                            else ctx.extra_pids.add(pid))


def _take_turns(ctx: Context, dtype: str, ours: Callable[[], Json], prompts: list[list[int]], new_tokens: int,
                warmup: list[list[int]]) -> tuple[list[Json], list[Json], Json]:
    """radixkv (`ours`: one measured run) and vLLM in `dtype` take turns `_reps` times, who goes
    first alternating: (our runs, vLLM's runs, vLLM's engine info or {"absent"/"error": why})."""
    mine: list[Json] = []
    theirs: list[Json] = []
    absent = peers.vllm_absent_reason()
    if absent:
        return [ours() for _ in range(_reps(ctx))], [], {"absent": absent}
    engine = _vllm_engine(ctx, dtype, warmup, len(prompts))
    info: Json = {}

    def vllm() -> None:
        if "error" in info:
            return
        time.sleep(SETTLE_S)
        try:
            with ctx.progress.run(f"vLLM {dtype}", 0):
                theirs.append(engine.run(f"run {len(theirs)}", prompts, new_tokens))
        except peers.VllmError as error:  # recorded, not fatal: our runs go on
            info["error"] = str(error)

    try:
        with ctx.progress.run(f"vLLM {dtype}: starting", 0):
            info.update(engine.start())
    except peers.VllmError as error:
        info["error"] = str(error)

    def radixkv() -> None:
        time.sleep(SETTLE_S)
        mine.append(ours())

    try:
        for rep in range(_reps(ctx)):
            alternate(rep, radixkv, vllm)
    finally:
        engine.close()
    return mine, theirs, info


def _vllm_entry(runs: list[Json], info: Json, reference: list[list[int]]) -> Json:
    """vLLM's side as the tables and plots read it: its median run, every run's wall, agreement."""
    if not runs:
        return {k: v for k, v in info.items() if k in ("absent", "error")} or {"error": "no run"}
    r = _median_run(runs)
    entry = {"wall_s": r["wall_s"], "reps_wall_s": r["reps_wall_s"],
             "tok_s": sum(len(t) for t in r["tokens"]) / r["wall_s"], "version": info.get("vllm_version"),
             "startup_s": info.get("startup_s"),
             "greedy_agreement": identical_fraction(r["tokens"][:len(reference)], reference),
             "_tokens": r["tokens"]}
    if r.get("ttft_s"):  # where this vLLM reports it: the split as for radixkv
        entry["ttft_s"] = dist(r["ttft_s"])
        entry["split"] = {"prefill_s": max(r["ttft_s"]), "decode_s": r["wall_s"] - max(r["ttft_s"])}
    if "error" in info:
        entry["error_after"] = info["error"]
    return entry


def _ours_entry(runs: list[Json], reference: list[list[int]]) -> tuple[Json, float]:
    """radixkv's side: its median run plus every run's wall; the share of sequences equal to
    `reference` over every run (each run must reproduce it, not only the median one)."""
    ran = len(reference)
    agree = identical_fraction([t for r in runs for t in r["_tokens"][:ran]], reference * len(runs))
    return _median_run(runs), agree


def _versus(ours: list[Json], theirs: list[Json]) -> Json:
    """Per turn, vLLM's wall over ours (> 1: radixkv faster), and their median."""
    per_rep = [t["wall_s"] / o["wall_s"] for o, t in zip(ours, theirs, strict=False)]
    return {"per_rep": per_rep, "median": statistics.median(per_rep)} if per_rep else {}


# Our other configurations, each on a pair of services of its own in fp32 runs (4x8), so that they
# stand next to vLLM's in the same run: side key -> (label, dtype, extra model-service flags).
# The bf16 one takes turns with vLLM bf16; the oneDNN one runs once.
VARIANTS = {
    "radixkv_bf16": ("radixkv bf16", "bfloat16", ()),
    "radixkv_onednn": ("radixkv fp32 oneDNN", "float32", ("--fp32-gemm", "onednn")),
}


@contextlib.contextmanager
def _variant_services(ctx: Context, side: str, warm: list[list[int]], warm_shape: list[list[int]]) -> Iterator[Services]:
    """A warmed pair of services for one of VARIANTS (stopped on exit)."""
    label, dtype, extra = VARIANTS[side]
    services = Services(dtype=dtype, worker_id=f"model-bench-{side}", extra_args=extra)
    try:
        with ctx.progress.run(f"{label}: starting services", 0):
            services.start()
            addr = services.wait()
            ctx.extra_pids.update(services.pids())
            stream_concurrent(addr, warm, WARMUP_TOKENS)
            stream_concurrent(addr, warm_shape, WARMUP_TOKENS)
        yield services
    finally:
        for pid in services.pids():
            ctx.extra_pids.discard(pid)
        services.stop()


def run(ctx: Context, deadline: float, large: bool) -> Json:
    cfg = sizes(ctx, large)
    g, n, new = cfg["groups"], cfg["per_group"], cfg["new_tokens"]
    def workload() -> list[list[list[int]]]:
        prefixes = [ctx.prompts.ids(cfg["prefix"]) for _ in range(g)]
        return [[prefix + ctx.prompts.ids(cfg["question"]) for _ in range(n)] for prefix in prefixes]

    groups = workload()
    prompts = [p for group in groups for p in group]
    warm_shape = [p for group in workload() for p in group]  # the same shape, other prompts
    full = not large or ctx.all_baselines
    with_variants = ctx.dtype == "float32" and not large
    ideal = (g * (n - 1) * (cfg["prefix"] // BLOCK_SIZE) * BLOCK_SIZE) / sum(len(p) for p in prompts)
    detail: Json = {"config": {**cfg, "requests": g * n, "sent": "all at once", "dtype": ctx.dtype, "reps_vs_vllm": _reps(ctx),
                               "radixkv": {"num_blocks": ctx.services.num_blocks, "max_num_seqs": DEFAULT_MAX_NUM_SEQS,
                                           "max_batch_tokens": 2048, "block_size": 16},
                               "hf_static_batch": n},
                    "ideal_hit_rate": ideal}

    # warm-ups (excluded): every side's first call pays one-off costs (module docstring)
    warm = [ctx.prompts.ids(64) for _ in range(4)]
    with ctx.progress.run("warm-up", 0):
        stream_concurrent(ctx.addr, warm, WARMUP_TOKENS)
        stream_concurrent(ctx.addr, warm_shape, WARMUP_TOKENS)
        ctx.ref.generate(warm[:2], WARMUP_TOKENS)

    def ours(label: str, defeat: bool = False) -> Json:
        return _measure(ctx.addr, label, prompts, new, clear=ctx.clear_cache, progress=ctx.progress,
                        scrape=ctx.scrape, defeat=defeat)

    mine, theirs, info = _take_turns(ctx, ctx.dtype, lambda: ours("radixkv cache on"), prompts, new, warm + warm_shape)
    # transformers static batching gets about half of what is left of the cap
    hf_deadline = time.perf_counter() + max(0.0, (deadline - time.perf_counter()) * (0.5 if full else 0.9))
    with ctx.progress.run(f"transformers static {n}/group", g * n * new) as tick:
        hf = ctx.ref.static_batches(groups, new, deadline=hf_deadline, on_tokens=tick)
    detail["hf_static"] = hf
    reference = hf.pop("tokens")
    ran = len(reference)
    detail["radixkv"], agreed = _ours_entry(mine, reference)
    agreement = {"radixkv": agreed,
                 "reference": f"transformers static batching ({hf['batches_run']} of {g} groups)"}
    detail["vllm"] = {ctx.dtype: _vllm_entry(theirs, info, reference)}
    detail["vs_vllm"] = {ctx.dtype: _versus(mine, theirs)}
    if full:
        nocache = ours("radixkv cache defeated", defeat=True)
        detail["radixkv_nocache"] = nocache
        agreement["radixkv_nocache"] = identical_fraction(nocache["_tokens"][:ran], reference)
        try:
            with ctx.progress.run("transformers continuous batching", g * n * new) as tick:
                cb = ctx.cb_ref().run(prompts, new, on_tokens=tick, timeout_s=max(120.0, deadline - time.perf_counter()))
            agreement["hf_cb"] = identical_fraction(cb.pop("tokens")[:ran], reference)
            detail["hf_cb"] = cb
        except Exception as error:  # recorded, not fatal: a baseline that fails on this model says why
            detail["hf_cb"] = {"error": f"{type(error).__name__}: {error}"}
        finally:
            ctx.drop_cb_ref()
    else:
        detail["skipped"] = ("radixkv with the cache defeated and transformers' continuous batching: "
                             "run with --all-baselines (together they add ~10 min on 2 cores)")

    other = "bfloat16" if ctx.dtype == "float32" else "float32"
    if with_variants:
        for side in VARIANTS:
            label = VARIANTS[side][0]
            try:
                with _variant_services(ctx, side, warm, warm_shape) as services:
                    def measured(services: Services = services, label: str = label) -> Json:
                        return _measure(services.wait(), f"{label} cache on", prompts, new,
                                        clear=services.clear_pool, progress=ctx.progress)

                    if side == "radixkv_bf16":  # takes turns with vLLM bf16
                        runs, vllm_runs, vllm_info = _take_turns(ctx, other, measured, prompts, new,
                                                                 warm + warm_shape)
                        detail["vllm"][other] = _vllm_entry(vllm_runs, vllm_info, reference)
                        detail["vs_vllm"][other] = _versus(runs, vllm_runs)
                    else:
                        runs = [measured()]
                detail[side], agreement[side] = _ours_entry(runs, reference)
            except Exception as error:  # recorded, not fatal
                detail[side] = {"error": f"{type(error).__name__}: {error}"}
    if other not in detail["vllm"]:  # no radixkv side in that dtype to take turns with: one run
        absent = peers.vllm_absent_reason()
        if absent:
            detail["vllm"][other] = {"absent": absent}
        else:
            try:
                with (_vllm_engine(ctx, other, warm + warm_shape, len(prompts)) as engine,
                      ctx.progress.run(f"vLLM {other}", 0)):
                    detail["vllm"][other] = _vllm_entry([engine.run("run", prompts, new)], engine.info, reference)
            except peers.VllmError as error:
                detail["vllm"][other] = {"error": str(error)}
    bf16_vllm = detail["vllm"].get("bfloat16", {})
    if "_tokens" in detail.get("radixkv_bf16", {}) and "_tokens" in bf16_vllm:
        agreement["radixkv_bf16_vs_vllm_bf16"] = identical_fraction(detail["radixkv_bf16"]["_tokens"],
                                                                     bf16_vllm["_tokens"])
    detail["greedy_agreement"] = agreement
    for entry in (detail.get(side) or {} for side in ("radixkv", "radixkv_nocache", *VARIANTS)):
        entry.pop("_tokens", None)
    for entry in detail["vllm"].values():
        entry.pop("_tokens", None)
    return detail


def flat(detail: Json, prefix: str) -> Json:
    ours, hf = detail["radixkv"], detail["hf_static"]
    agree = detail["greedy_agreement"]
    out = {
        f"{prefix}_tok_s": ours["tok_s"], f"{prefix}_wall_s": ours["wall_s"],
        f"{prefix}_hit_rate": ours["hit_rate"], f"{prefix}_ideal_hit_rate": detail["ideal_hit_rate"],
        f"{prefix}_ttft_p50_s": ours["ttft_s"]["p50"], f"{prefix}_ttft_p99_s": ours["ttft_s"]["p99"],
        f"{prefix}_prefill_s": ours["split"]["prefill_s"], f"{prefix}_decode_s": ours["split"]["decode_s"],
        f"{prefix}_greedy_agreement": agree["radixkv"],
        f"hf_{prefix}_tok_s": hf["tok_s"], f"hf_{prefix}_prefill_s": hf["prefill_s"],
        f"hf_{prefix}_decode_s": hf["decode_s"], f"hf_{prefix}_groups_run": hf["batches_run"],
    }
    if "radixkv_nocache" in detail:
        nc = detail["radixkv_nocache"]
        out.update({f"{prefix}_nocache_tok_s": nc["tok_s"], f"{prefix}_nocache_hit_rate": nc["hit_rate"],
                    f"{prefix}_nocache_greedy_agreement": agree.get("radixkv_nocache")})
    bf16 = detail.get("radixkv_bf16")
    if bf16 and "tok_s" in bf16:
        out.update({f"{prefix}_bf16_tok_s": bf16["tok_s"], f"{prefix}_bf16_wall_s": bf16["wall_s"],
                    f"{prefix}_bf16_hit_rate": bf16["hit_rate"], f"{prefix}_bf16_ttft_p50_s": bf16["ttft_s"]["p50"],
                    f"{prefix}_bf16_greedy_agreement_fp32": agree.get("radixkv_bf16"),
                    f"{prefix}_bf16_greedy_agreement_vllm_bf16": agree.get("radixkv_bf16_vs_vllm_bf16")})
    onednn = detail.get("radixkv_onednn")
    if onednn and "tok_s" in onednn:
        out.update({f"{prefix}_onednn_tok_s": onednn["tok_s"], f"{prefix}_onednn_wall_s": onednn["wall_s"],
                    f"{prefix}_onednn_hit_rate": onednn["hit_rate"],
                    f"{prefix}_onednn_ttft_p50_s": onednn["ttft_s"]["p50"],
                    f"{prefix}_onednn_greedy_agreement": agree.get("radixkv_onednn")})
    cb = detail.get("hf_cb")
    if cb is not None:
        out[f"hf_cb_{prefix}_tok_s"] = cb.get("tok_s")
        out[f"hf_cb_{prefix}_greedy_agreement"] = agree.get("hf_cb")
        if "error" in cb:
            out[f"hf_cb_{prefix}_error"] = cb["error"]
    for dtype, versus in (detail.get("vs_vllm") or {}).items():
        if versus:
            main = dtype == detail["config"].get("dtype", "float32")  # else the bf16 variant's turns
            out[f"{prefix}_vs_vllm" if main else f"{prefix}_bf16_vs_vllm_bf16"] = versus["median"]
    metrics = ours.get("metrics") or {}
    if metrics and prefix == "shared_prefix":
        out.update(cache_rpcs_per_step=num(metrics["cache_rpcs_per_step"]),
                   cache_step_rpc_p50_ms=num(metrics["cache_rpc_p50_ms"]),
                   cache_step_rpc_p99_ms=num(metrics["cache_rpc_p99_ms"]),
                   cache_step_rpc_mean_ms=num(metrics["cache_rpc_mean_ms"]))
    for dtype, v in (detail.get("vllm") or {}).items():
        if isinstance(v, dict) and "tok_s" in v:
            tag = "vllm" if dtype == "float32" else "vllm_bf16"
            out[f"{tag}_{prefix}_tok_s"] = v["tok_s"]
            out[f"{tag}_{prefix}_greedy_agreement"] = v["greedy_agreement"]
    return out


def report(detail: Json) -> str:
    c = detail["config"]
    rows = []

    def row(name: str, d: Json | None, agree: float | None) -> None:
        if not d:
            return
        if "error" in d:
            return
        split = d.get("split") or {"prefill_s": d.get("prefill_s"), "decode_s": d.get("decode_s")}
        ttft = d.get("ttft_s") or d.get("ttft_from_start_s") or {}
        hit = d.get("hit_rate")
        rows.append([name, f"{d['wall_s']:.1f}", f"{d['tok_s']:.1f}",
                     f"{100 * hit:.0f}%" if hit is not None else "",
                     f"{ttft['p50']:.2f} / {ttft['p99']:.2f}" if ttft.get("n") else "",
                     f"{split['prefill_s']:.1f} / {split['decode_s']:.1f}" if split.get("prefill_s") is not None else "",
                     f"{100 * agree:.0f}%" if agree is not None else ""])

    agree = detail["greedy_agreement"]
    row("radixkv, prefix cache on", detail["radixkv"], agree.get("radixkv"))
    row("radixkv, cache defeated (namespace/request)", detail.get("radixkv_nocache"), agree.get("radixkv_nocache"))
    hf = detail["hf_static"]
    row(f"transformers static batch {c['per_group']}/group ({hf['batches_run']}/{hf['batches_total']} groups)", hf,
        1.0)
    row("transformers continuous batching", detail.get("hf_cb"), agree.get("hf_cb"))
    row("radixkv bf16, prefix cache on (= HF fp32)", detail.get("radixkv_bf16"), agree.get("radixkv_bf16"))
    row("radixkv fp32, oneDNN GEMMs, cache on", detail.get("radixkv_onednn"), agree.get("radixkv_onednn"))
    notes = []
    for dtype, v in (detail.get("vllm") or {}).items():
        if dtype == "absent":
            notes.append(f"vLLM not run: {v}")
        elif "error" in v:
            notes.append(f"vLLM {dtype} failed: {v['error']}")
        else:
            row(f"vLLM CPU {dtype}", v, v.get("greedy_agreement"))
    for dtype, versus in (detail.get("vs_vllm") or {}).items():
        if versus:
            ours = "radixkv" if dtype == c.get("dtype", "float32") else "radixkv bf16"
            notes.append(f"{ours} vs vLLM {dtype}, vLLM's wall over ours per turn: "
                         + ", ".join(f"{v:.2f}x" for v in versus["per_rep"]) + f" (median {versus['median']:.2f}x)")
    if "radixkv_bf16_vs_vllm_bf16" in agree:
        notes.append(f"radixkv bf16 greedy = vLLM bf16: {100 * agree['radixkv_bf16_vs_vllm_bf16']:.0f}% of sequences")
    for side, (label, _, _) in VARIANTS.items():
        if "error" in (detail.get(side) or {}):
            notes.append(f"{label} failed: {detail[side]['error']}")
    cb = detail.get("hf_cb")
    if cb and "error" in cb:
        notes.append(f"transformers continuous batching failed: {cb['error']}")
    head = (f"shared prefix: {c['groups']} groups x {c['per_group']} requests, {c['prefix']}-token prefix + "
            f"{c['question']}-token question, {c['new_tokens']} tokens out, all at once "
            f"(ideal hit rate {100 * detail['ideal_hit_rate']:.0f}%)")
    text = head + "\n" + table(rows, ["side", "wall s", "tok/s", "hit", "TTFT p50/p99 s", "prefill/decode s",
                                      "greedy = HF"])
    if detail.get("skipped"):
        notes.append(f"not run: {detail['skipped']}")
    return "\n".join([text, *notes])


SHARED_PREFIX = Workload(
    name="shared_prefix", help="4 groups x 8 requests sharing a 1024-token prefix (+ every baseline)",
    run=lambda ctx, deadline: run(ctx, deadline, large=False), flat=lambda d: flat(d, "shared_prefix"),
    report=report, cap_s=900.0, runs=lambda ctx: _runs(False, ctx))
SHARED_PREFIX_LARGE = Workload(
    name="shared_prefix_large", help="8 groups x 16 requests sharing a 1024-token prefix",
    run=lambda ctx, deadline: run(ctx, deadline, large=True), flat=lambda d: flat(d, "shared_prefix_large"),
    report=report, cap_s=420.0, runs=lambda ctx: _runs(True, ctx))
