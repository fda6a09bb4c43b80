"""Parallel sampling (issue 30): one request with n=8 choices (SamplingParams.n: the prompt computed
once, the choices forked from it) vs the same 8 requests sent separately at once, on a replica of
the workload's own (cache manager + model service, the suite's dtype and threads, INFO logs for
its kernels line).

The same work on both sides: a random-token prompt, sampled (temperature 0.8) with ignore_eos and
the same max_tokens; the n=8 request has seed s, the separate request i seed s + i, which the
replica defines to sample exactly what choice i does (checked: `identical_share`, the share of
choices whose tokens equal their separate twin's). Every run gets a fresh cache namespace, so
neither side reuses the other's (or an earlier run's) KV; within a run the separate requests may
still share pages among themselves if some are admitted after another committed the prompt.

Reported per side (median of the runs): output tok/s (completion tokens / wall), prompt tokens
computed (usage prompt_tokens - cached_prompt_tokens summed over the 8 choices / requests: the
n=8 request computes its prompt once), TTFT p50; the n=8 / separate tok/s ratio per repetition
and its median (target >= 1.0x). The sides take turns, who goes first alternating; an unmeasured
warm-up per side first. Fails when the replica answers n=8 with fewer choices (no n support).
"""

from __future__ import annotations

import statistics
import uuid

from bench.harness import (
    BLOCK_SIZE,
    Json,
    alternate,
    dist,
    machine_info,
    repetitions,
    table,
)
from bench.request_runs import RunResult, run_concurrent, start_replica
from bench.workloads.base import Context, Workload
from protos import model_pb2

N = 8
SEED = 1234
TEMPERATURE = 0.8
SIDES = ("n8", "separate")


def sizes(ctx: Context) -> Json:
    if ctx.quick:
        return {"prompt": 128, "new_tokens": 16, "reps": 2, "num_blocks": 512}
    return {"prompt": 512, "new_tokens": 64, "reps": 3, "num_blocks": 2048}


def _sampling(cfg: Json, seed: int, n: int) -> model_pb2.SamplingParams:
    return model_pb2.SamplingParams(temperature=TEMPERATURE, seed=seed, max_tokens=cfg["new_tokens"],
                                    ignore_eos=True, n=n)


def requests(cfg: Json, side: str, prompt: list[int]) -> list[model_pb2.GenerateRequest]:
    """One n=8 request, or 8 single ones with seeds SEED + i; a fresh namespace either way."""
    namespace = f"parallel-{uuid.uuid4().hex[:12]}"
    ids = model_pb2.TokenIds(ids=prompt)
    if side == "n8":
        return [model_pb2.GenerateRequest(token_ids=ids, sampling=_sampling(cfg, SEED, N), namespace=namespace)]
    return [model_pb2.GenerateRequest(token_ids=ids, sampling=_sampling(cfg, SEED + i, 1), namespace=namespace)
            for i in range(N)]


def _stats(r: RunResult) -> Json:
    return {"tok_s": r.tok_s(), "wall_s": r.wall_s, "completion_tokens": r.completion_tokens(),
            "prompt_tokens_computed": r.prompt_tokens_computed(),
            "prompt_tokens": sum(c.usage.prompt_tokens for c in r.choices()), "ttft_s": dist(r.ttfts()),
            "inter_token_ms": dist(r.inter_token_ms()), "choices": len(r.choices())}


def run(ctx: Context, deadline: float) -> Json:
    cfg = sizes(ctx)
    info = machine_info(ctx.threads)
    runs: Json = {side: [] for side in SIDES}
    identical: list[float] = []
    detail: Json = {"config": {**cfg, "n": N, "seed": SEED, "temperature": TEMPERATURE, "dtype": ctx.dtype,
                               "block_size": BLOCK_SIZE},
                    "machine": {"cpu_model": info["cpu_label"], "cpu_isa": info["cpu_isa"]}}
    services, addr, detail["kernels"] = start_replica(ctx, "parallel_sampling", cfg["num_blocks"])
    try:
        def one(side: str, prompt: list[int], label: str) -> RunResult:
            with ctx.progress.run(label, N * cfg["new_tokens"]) as tick:
                result = run_concurrent(addr, requests(cfg, side, prompt), tick)
            if len(result.choices()) != N:
                raise RuntimeError(f"{side}: {len(result.choices())} choices came back, {N} asked: the replica "
                                   "does not support SamplingParams.n")
            return result

        for side in SIDES:
            one(side, ctx.prompts.ids(cfg["prompt"]), f"warm-up {side}")
        for rep in repetitions(cfg["reps"], deadline):
            prompt = ctx.prompts.ids(cfg["prompt"])
            pair: dict[str, RunResult] = {}

            def side_run(side: str, rep: int = rep, prompt: list[int] = prompt, pair: dict = pair) -> None:
                pair[side] = one(side, prompt, f"rep {rep + 1} {side}")
                runs[side].append(_stats(pair[side]))

            alternate(rep, lambda: side_run("n8"), lambda: side_run("separate"))
            forked = pair["n8"].calls[0].ordered()
            single = [call.ordered()[0] for call in pair["separate"].calls]
            identical.append(statistics.fmean(a.token_ids == b.token_ids for a, b in zip(forked, single, strict=True)))
    finally:
        ctx.extra_pids.difference_update(services.pids())
        services.stop()
    per_rep = [a["tok_s"] / b["tok_s"] for a, b in zip(runs["n8"], runs["separate"], strict=True)]
    detail.update(
        runs=runs, ratio_per_rep=per_rep, ratio=statistics.median(per_rep), identical_share_per_rep=identical,
        identical_share=min(identical),
        tok_s={side: statistics.median(r["tok_s"] for r in runs[side]) for side in SIDES},
        prompt_tokens_computed={side: statistics.median(r["prompt_tokens_computed"] for r in runs[side])
                                for side in SIDES})
    return detail


def flat(d: Json) -> Json:
    return {"parallel_n8_tok_s": d["tok_s"]["n8"], "parallel_separate_tok_s": d["tok_s"]["separate"],
            "parallel_n8_vs_separate": d["ratio"],
            "parallel_n8_prompt_tokens_computed": d["prompt_tokens_computed"]["n8"],
            "parallel_separate_prompt_tokens_computed": d["prompt_tokens_computed"]["separate"],
            "parallel_identical_share": d["identical_share"]}


def report(d: Json) -> str:
    c = d["config"]
    rows = []
    for side, label in (("n8", f"one request, n={c['n']}"), ("separate", f"{c['n']} requests at once")):
        for i, r in enumerate(d["runs"][side]):
            rows.append([f"{label} rep {i + 1}", f"{r['tok_s']:.1f}", f"{r['ttft_s']['p50']:.2f}",
                         f"{r['inter_token_ms']['p50']:.1f}", f"{r['prompt_tokens_computed']}/{r['prompt_tokens']}",
                         str(r["completion_tokens"])])
    return "\n".join([
        f"parallel sampling: {c['prompt']}-token prompt, {c['n']} choices x {c['new_tokens']} tokens, temperature "
        f"{c['temperature']}, seeds {c['seed']} + i, {c['dtype']}; CPU {d['machine']['cpu_model']}; "
        f"{d.get('kernels') or '(no kernels line)'}",
        table(rows, ["run", "tok/s", "TTFT p50 s", "ITL p50 ms", "prompt computed/total", "tokens"]),
        f"n={c['n']} / separate tok/s: median {d['ratio']:.2f}x (per rep "
        + ", ".join(f"{x:.2f}x" for x in d["ratio_per_rep"]) + "; target >= 1.0x); prompt tokens computed "
        f"{d['prompt_tokens_computed']['n8']:.0f} vs {d['prompt_tokens_computed']['separate']:.0f}; choice i = "
        f"separate request with seed + i: {100 * d['identical_share']:.0f}% (lowest of the reps)"])


PARALLEL_SAMPLING = Workload(
    name="parallel_sampling", help="one request with n=8 vs the same 8 requests sent at once (SamplingParams.n)",
    run=run, flat=flat, report=report, cap_s=300.0, runs=lambda ctx: 3 + 2 * sizes(ctx)["reps"],
    needs_services=False, needs_model=False)
