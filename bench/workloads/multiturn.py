"""Multi-turn chat: C conversations of T turns. Each turn's prompt is the whole conversation so far:
previous prompts + the model's greedy answers + a new user message of random token ids (no chat
template: token ids only). radixkv: the conversations run concurrently, the turns of one
conversation sequentially (a turn is sent when the previous answer has fully arrived); the cache
keeps each conversation's history, so a turn prefills only its new tokens.
transformers: the same turns batched per turn (a static batch of the C conversations' turn-t
prompts; they all have the same length, so no padding), every turn prefilling the whole history.
Each side continues its conversations with its own answers; greedy agreement says whether the
answers (and so the histories) were the same.
"""

from __future__ import annotations

import asyncio
import time

import grpc

from bench.harness import (
    WARMUP_TOKENS,
    Json,
    Streamed,
    TimingStreamer,
    alternate,
    dist,
    identical_fraction,
    metrics_delta,
    repetitions,
    stream_async,
    stream_concurrent,
    summary,
    table,
)
from bench.workloads.base import Context, Workload
from protos import model_pb2_grpc


def sizes(ctx: Context) -> Json:
    if ctx.quick:
        return {"conversations": 2, "turns": 2, "first_message": 32, "message": 16, "answer": 16, "reps": 1}
    return {"conversations": 8, "turns": 4, "first_message": 128, "message": 64, "answer": 64, "reps": 2}


def _ours(ctx: Context, messages: list[list[list[int]]], answer: int, tick) -> tuple[float, list[list[Streamed]]]:
    async def conversation(stub: model_pb2_grpc.ModelServiceStub, turns: list[list[int]]) -> list[Streamed]:
        history: list[int] = []
        out = []
        for message in turns:
            prompt = history + message
            streamed = await stream_async(stub, prompt, answer, on_tokens=tick)
            out.append(streamed)
            history = prompt + streamed.token_ids
        return out

    async def run() -> tuple[float, list[list[Streamed]]]:
        async with grpc.aio.insecure_channel(ctx.addr) as channel:
            stub = model_pb2_grpc.ModelServiceStub(channel)
            await channel.channel_ready()
            start = time.perf_counter()
            results = await asyncio.gather(*(conversation(stub, turns) for turns in messages))
            return time.perf_counter() - start, list(results)

    return asyncio.run(run())


def _theirs(ctx: Context, messages: list[list[list[int]]], answer: int, tick) -> Json:
    histories: list[list[int]] = [[] for _ in messages]
    answers: list[list[list[int]]] = [[] for _ in messages]
    prefill = decode = 0.0
    ttft_per_turn = []
    start = time.perf_counter()
    for t in range(len(messages[0])):
        prompts = [h + m[t] for h, m in zip(histories, messages, strict=True)]
        streamer = TimingStreamer(tick)
        began = time.perf_counter()
        wall, generated = ctx.ref.generate(prompts, answer, streamer)
        prefill += streamer.times[0] - began
        decode += began + wall - streamer.times[0]
        ttft_per_turn.append(streamer.times[0] - began)
        for c, g in enumerate(generated):
            answers[c].append(g)
            histories[c] = prompts[c] + g
    wall = time.perf_counter() - start
    return {"wall_s": wall, "answers": answers, "prefill_s": prefill, "decode_s": decode,
            "ttft_per_turn_s": ttft_per_turn, "completion_tokens": sum(len(a) for c in answers for a in c)}


def run(ctx: Context, deadline: float) -> Json:
    cfg = sizes(ctx)
    C, T, A = cfg["conversations"], cfg["turns"], cfg["answer"]
    ours_tok_s, theirs_tok_s, agree, hit_rates = [], [], [], []
    per_turn_ttft: list[list[float]] = [[] for _ in range(T)]
    per_turn_hit: list[list[float]] = [[] for _ in range(T)]
    theirs_turn_ttft: list[list[float]] = [[] for _ in range(T)]
    splits: list[Json] = []
    metrics: list[Json] = []
    state: Json = {}

    with ctx.progress.run("warm-up", 0):
        stream_concurrent(ctx.addr, [ctx.prompts.ids(32) for _ in range(2)], WARMUP_TOKENS)
        ctx.ref.generate([ctx.prompts.ids(32)], WARMUP_TOKENS)

    def ours() -> None:
        ctx.clear_cache()
        before = ctx.scrape()
        with ctx.progress.run("radixkv conversations", C * T * A) as tick:
            wall, convs = _ours(ctx, state["messages"], A, tick)
        metrics.append(metrics_delta(before, ctx.scrape()))
        done = sum(len(s.times) for conv in convs for s in conv)
        ours_tok_s.append(done / wall)
        prompt = sum(s.usage.prompt_tokens for conv in convs for s in conv)
        hit_rates.append(sum(s.usage.cached_prompt_tokens for conv in convs for s in conv) / prompt)
        for conv in convs:
            for t, s in enumerate(conv):
                per_turn_ttft[t].append(s.ttft)
                per_turn_hit[t].append(s.usage.cached_prompt_tokens / s.usage.prompt_tokens)
        state["ours"] = [[s.token_ids for s in conv] for conv in convs]

    def theirs() -> None:
        with ctx.progress.run(f"transformers batch {C} per turn", C * T * A) as tick:
            out = _theirs(ctx, state["messages"], A, tick)
        theirs_tok_s.append(out["completion_tokens"] / out["wall_s"])
        splits.append({"prefill_s": out["prefill_s"], "decode_s": out["decode_s"]})
        for t, v in enumerate(out["ttft_per_turn_s"]):
            theirs_turn_ttft[t].append(v)
        state["theirs"] = out["answers"]

    for rep in repetitions(cfg["reps"], deadline):
        state["messages"] = [[ctx.prompts.ids(cfg["first_message"] if t == 0 else cfg["message"]) for t in range(T)]
                             for _ in range(C)]
        alternate(rep, ours, theirs)
        flat_ours = [a for conv in state["ours"] for a in conv]
        flat_theirs = [a for conv in state["theirs"] for a in conv]
        agree.append(identical_fraction(flat_ours, flat_theirs))
    last_turn_prompt = cfg["first_message"] + (T - 1) * (cfg["message"] + A)
    return {
        "config": {**cfg, "last_turn_prompt_tokens": last_turn_prompt,
                   "radixkv": "conversations concurrent, turns sequential",
                   "transformers": f"static batch of the {C} conversations per turn, turns sequential"},
        "radixkv_tok_s": summary(ours_tok_s), "hf_tok_s": summary(theirs_tok_s),
        "radixkv_hit_rate": summary(hit_rates),
        "radixkv_ttft_per_turn_s": [dist(v) for v in per_turn_ttft],
        "radixkv_hit_rate_per_turn": [sum(v) / len(v) for v in per_turn_hit],
        "hf_batch_ttft_per_turn_s": [summary(v) for v in theirs_turn_ttft],
        "hf_split": splits, "metrics": metrics, "greedy_agreement": agree,
    }


def flat(d: Json) -> Json:
    return {"multiturn_tok_s": d["radixkv_tok_s"]["median"], "hf_multiturn_tok_s": d["hf_tok_s"]["median"],
            "multiturn_hit_rate": d["radixkv_hit_rate"]["median"],
            "multiturn_last_turn_ttft_p50_s": d["radixkv_ttft_per_turn_s"][-1]["p50"],
            "hf_multiturn_last_turn_ttft_s": d["hf_batch_ttft_per_turn_s"][-1]["median"],
            "multiturn_greedy_agreement": min(d["greedy_agreement"])}


def report(d: Json) -> str:
    c = d["config"]
    rows = [["radixkv (concurrent conversations)", f"{d['radixkv_tok_s']['median']:.1f}",
             f"{100 * d['radixkv_hit_rate']['median']:.0f}%",
             " / ".join(f"{t['p50']:.2f}" for t in d["radixkv_ttft_per_turn_s"])],
            [f"transformers (batch {c['conversations']} per turn)", f"{d['hf_tok_s']['median']:.1f}", "",
             " / ".join(f"{t['median']:.2f}" for t in d["hf_batch_ttft_per_turn_s"])]]
    head = (f"multi-turn: {c['conversations']} conversations x {c['turns']} turns, user messages "
            f"{c['first_message']} then {c['message']} tokens, answers {c['answer']} tokens "
            f"(last turn prompt {c['last_turn_prompt_tokens']} tokens); median of {d['radixkv_tok_s']['n']} reps")
    return (head + "\n" + table(rows, ["side", "tok/s", "hit", "TTFT per turn s (ours p50; theirs: batch prefill)"])
            + "\ngreedy answers identical to transformers: "
            + ", ".join(f"{100 * a:.0f}%" for a in d["greedy_agreement"]))


MULTITURN = Workload(name="multiturn", help="8 conversations x 4 turns, the whole history re-sent each turn",
                     run=run, flat=flat, report=report, cap_s=300.0,
                     runs=lambda ctx: 1 + 2 * sizes(ctx)["reps"])
