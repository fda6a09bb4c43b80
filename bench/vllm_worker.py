"""Serves vLLM's offline engine on token-id prompts; executed by .venv-vllm/bin/python (see
bench/peers.py), never imported by the suite: only the standard library and vllm here.

    .venv-vllm/bin/python bench/vllm_worker.py SPEC.json

SPEC: {"model": folder, "dtype": "float32"|"bfloat16", "max_model_len": int, "max_num_seqs": int,
       "max_num_batched_tokens": int, "warmup": [[ids]...]}
Protocol: one JSON object per line. The worker answers on its standard output (vLLM's own logs
go to standard error): {"ready": true, "vllm_version", "dtype", "startup_s"} once the engine is up
and has served the warm-up; then for every command line on standard input
{"name", "prompts": [[ids]...], "max_tokens"} it answers
{"name", "wall_s", "tokens": [[ids]...], "ttft_s": [s...] | null}. End of input ends it.
All prompts of a command go to one LLM.generate call (greedy, ignore_eos, prefix caching on); the
prefix cache is reset before each command, so that every run starts cold as radixkv's does.
"""

from __future__ import annotations

import json
import os
import sys
import time


def _ttft(output, start: float) -> float | None:
    """Time to first token of one RequestOutput, where this vLLM version reports it."""
    metrics = getattr(output, "metrics", None)
    if metrics is None:
        return None
    for first, arrival in (("first_token_time", "arrival_time"), ("first_token_ts", "arrival_time")):
        f, a = getattr(metrics, first, None), getattr(metrics, arrival, None)
        if isinstance(f, (int, float)) and isinstance(a, (int, float)) and f > 0 and a > 0:
            return f - a
    latency = getattr(metrics, "first_token_latency", None)
    return float(latency) if isinstance(latency, (int, float)) and latency > 0 else None


def main() -> int:
    # answers go to the original stdout; anything else printing there (vLLM, its engine process) to stderr
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    spec = json.loads(open(sys.argv[1]).read())
    started = time.perf_counter()
    import vllm
    from vllm import LLM, SamplingParams

    try:
        from vllm.inputs import TokensPrompt
    except ImportError:  # older layouts: a plain dict is accepted too
        TokensPrompt = dict  # noqa: N806

    llm = LLM(model=spec["model"], dtype=spec["dtype"], enable_prefix_caching=True,
              max_model_len=spec["max_model_len"], max_num_seqs=spec["max_num_seqs"],
              max_num_batched_tokens=spec["max_num_batched_tokens"], seed=0, skip_tokenizer_init=True)

    def params(max_tokens: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)

    def prompts(ids_list: list[list[int]]) -> list:
        return [TokensPrompt(prompt_token_ids=ids) for ids in ids_list]

    def answer(message: dict) -> None:
        answers.write(json.dumps(message) + "\n")
        answers.flush()

    llm.generate(prompts(spec["warmup"]), params(8), use_tqdm=False)
    answer({"ready": True, "vllm_version": vllm.__version__, "dtype": spec["dtype"],
            "startup_s": time.perf_counter() - started})
    for line in sys.stdin:
        if not line.strip():
            continue
        run = json.loads(line)
        if hasattr(llm, "reset_prefix_cache"):
            llm.reset_prefix_cache()
        start = time.perf_counter()
        outputs = llm.generate(prompts(run["prompts"]), params(run["max_tokens"]), use_tqdm=False)
        wall = time.perf_counter() - start
        ttft = [_ttft(o, start) for o in outputs]
        answer({"name": run["name"], "wall_s": wall, "tokens": [list(o.outputs[0].token_ids) for o in outputs],
                "ttft_s": ttft if all(t is not None for t in ttft) else None})
        print(f"vllm_worker: {run['name']}: {wall:.1f} s", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
