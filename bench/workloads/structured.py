"""Structured outputs (issue 30): what a JSON schema costs. The same 16 concurrent chat requests
(the bundled model, the suite's dtype; prompts that ask for a JSON list of products), the same
max_tokens, greedy, once constrained to a JSON Schema (SamplingParams.structured_output) and once
unconstrained, through gRPC against a replica of the workload's own (cache manager + model service,
started with INFO logs so its kernels line can be printed beside the numbers).

Same work on both sides: the schema asks for at least 10 products, which cannot fit in max_tokens,
so no guided request completes its JSON early (a completed format ends the request, and thinner
batches would decode fewer tokens per second for a reason other than the grammar); the unguided
requests run with ignore_eos. Every request on both sides therefore generates exactly max_tokens
(checked: `same_tokens`). The two sides take turns, who goes first alternating (bench.harness.
alternate), a fresh cache namespace per run (the prompts' KV is computed anew in every run); an
unmeasured warm-up per side first (the unguided one first; `compile_warmup_s`, the guided warm-up's wall minus the
unguided one's, what the schema's first use costs, is reported, not counted). Reported: tok/s per
side (median of the runs), the guided / unguided ratio per repetition and its median (target
>= 0.9x), TTFT and inter-token p50. Checks (reported): every run generated concurrency x
max_tokens tokens, every guided output starts with '{' and ended by length; and how many of the
unconstrained outputs write the JSON too (contain '"products"': the prompts make the model write
it by itself, so both sides decode similar text)."""

from __future__ import annotations

import json
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

TOPICS = ("kitchen", "garden", "bicycle", "camping", "office", "music", "toy", "pet", "bakery", "book",
          "shoe", "phone", "paint", "fishing", "coffee", "hardware")
SCHEMA = {
    "type": "object",
    "properties": {"products": {"type": "array", "minItems": 10, "items": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "category": {"type": "string"}, "price": {"type": "number"},
                       "in_stock": {"type": "boolean"}},
        "required": ["name", "category", "price", "in_stock"], "additionalProperties": False}}},
    "required": ["products"], "additionalProperties": False,
}
SIDES = ("guided", "free")


def sizes(ctx: Context) -> Json:
    if ctx.quick:
        return {"concurrency": 4, "new_tokens": 16, "reps": 2, "num_blocks": 512}
    return {"concurrency": 16, "new_tokens": 64, "reps": 4, "num_blocks": 2048}


def prompt(topic: str) -> str:
    return (f"List ten products of a {topic} shop as JSON, exactly in this form: "
            '{"products": [{"name": "...", "category": "...", "price": 9.99, "in_stock": true}, ...]}. '
            "Answer with the JSON only.")


def requests(cfg: Json, guided: bool) -> list[model_pb2.GenerateRequest]:
    """The run's requests: one chat prompt per topic (cycled), a fresh namespace for the run."""
    namespace = f"structured-{uuid.uuid4().hex[:12]}"
    out = []
    for i in range(cfg["concurrency"]):
        sampling = model_pb2.SamplingParams(temperature=0.0, max_tokens=cfg["new_tokens"], ignore_eos=not guided)
        if guided:
            sampling.structured_output.json_schema = json.dumps(SCHEMA)
        chat = model_pb2.ChatMessages(messages=[model_pb2.ChatMessage(role="user",
                                                                      content=prompt(TOPICS[i % len(TOPICS)]))])
        out.append(model_pb2.GenerateRequest(chat=chat, sampling=sampling, namespace=namespace))
    return out


def _stats(r: RunResult) -> Json:
    choices = r.choices()
    return {"tok_s": r.tok_s(), "wall_s": r.wall_s, "completion_tokens": r.completion_tokens(),
            "ttft_s": dist(r.ttfts()), "inter_token_ms": dist(r.inter_token_ms()),
            "finish_reasons": sorted({model_pb2.FinishReason.Name(c.finish_reason) for c in choices}),
            "texts": [c.text for c in choices]}


def run(ctx: Context, deadline: float) -> Json:
    cfg = sizes(ctx)
    info = machine_info(ctx.threads)
    runs: Json = {side: [] for side in SIDES}
    detail: Json = {"config": {**cfg, "schema": SCHEMA, "dtype": ctx.dtype, "block_size": BLOCK_SIZE},
                    "machine": {"cpu_model": info["cpu_label"], "cpu_isa": info["cpu_isa"]}}
    services, addr, detail["kernels"] = start_replica(ctx, "structured", cfg["num_blocks"])
    try:
        def one(side: str, label: str) -> RunResult:
            with ctx.progress.run(label, cfg["concurrency"] * cfg["new_tokens"]) as tick:
                return run_concurrent(addr, requests(cfg, side == "guided"), tick)

        # Unguided first: the replica's very first requests (cold caches) are not billed to the schema.
        warm = {side: one(side, f"warm-up {side}").wall_s for side in sorted(SIDES, key=lambda s: s != "free")}
        detail["compile_warmup_s"] = warm["guided"] - warm["free"]
        for rep in repetitions(cfg["reps"], deadline):
            alternate(rep, lambda rep=rep: runs["guided"].append(_stats(one("guided", f"rep {rep + 1} guided"))),
                      lambda rep=rep: runs["free"].append(_stats(one("free", f"rep {rep + 1} unconstrained"))))
    finally:
        ctx.extra_pids.difference_update(services.pids())
        services.stop()
    expected = cfg["concurrency"] * cfg["new_tokens"]
    per_rep = [g["tok_s"] / f["tok_s"] for g, f in zip(runs["guided"], runs["free"], strict=True)]
    detail.update(
        runs=runs, ratio_per_rep=per_rep, ratio=statistics.median(per_rep),
        tok_s={side: statistics.median(r["tok_s"] for r in runs[side]) for side in SIDES},
        same_tokens=all(r["completion_tokens"] == expected for side in SIDES for r in runs[side]),
        guided_json_prefix=all(t.startswith("{") for r in runs["guided"] for t in r["texts"])
        and all(r["finish_reasons"] == ["FINISH_REASON_LENGTH"] for r in runs["guided"]),
        free_json_share=statistics.fmean('"products"' in t for r in runs["free"] for t in r["texts"]))
    for side in SIDES:  # the texts were for the checks; one run's worth is kept as a sample
        for r in runs[side][1:]:
            r.pop("texts")
    return detail


def flat(d: Json) -> Json:
    return {"structured_tok_s": d["tok_s"]["guided"], "structured_free_tok_s": d["tok_s"]["free"],
            "structured_vs_free": d["ratio"], "structured_checks_ok": d["same_tokens"] and d["guided_json_prefix"]}


def report(d: Json) -> str:
    c = d["config"]
    rows = []
    for side, label in (("guided", "JSON schema (structured_output)"), ("free", "unconstrained (ignore_eos)")):
        for i, r in enumerate(d["runs"][side]):
            rows.append([f"{label} rep {i + 1}", f"{r['tok_s']:.1f}", f"{r['ttft_s']['p50']:.2f}",
                         f"{r['inter_token_ms']['p50']:.1f}", str(r["completion_tokens"])])
    return "\n".join([
        f"structured: {c['concurrency']} concurrent chat requests, {c['new_tokens']} tokens out each, greedy, "
        f"{c['dtype']}; CPU {d['machine']['cpu_model']}; {d.get('kernels') or '(no kernels line)'}",
        table(rows, ["run", "tok/s", "TTFT p50 s", "ITL p50 ms", "tokens"]),
        f"JSON schema / unconstrained tok/s: median {d['ratio']:.2f}x (per rep "
        + ", ".join(f"{x:.2f}x" for x in d["ratio_per_rep"]) + "; target >= 0.9x); "
        f"guided warm-up {d['compile_warmup_s']:+.2f} s vs unguided; checks: same tokens "
        f"{'ok' if d['same_tokens'] else 'FAILED'}, guided outputs JSON prefixes "
        f"{'ok' if d['guided_json_prefix'] else 'FAILED'}; unconstrained outputs writing the JSON ('\"products\"') "
        f"{100 * d['free_json_share']:.0f}%"])


STRUCTURED = Workload(name="structured", help="16 concurrent chat requests: JSON schema vs unconstrained tok/s",
                      run=run, flat=flat, report=report, cap_s=300.0,
                      runs=lambda ctx: 3 + 2 * sizes(ctx)["reps"], needs_services=False, needs_model=False)
