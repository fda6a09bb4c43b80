"""The sampling controls of issue 30 through a real model service on the tiny random Llama:
validation errors (INVALID_ARGUMENT naming the field, nothing reaching the cache manager),
logit_bias and min_tokens end to end, and greedy with penalties equal to transformers'
generate() token for token, in a pool so small that the requests are preempted and recomputed."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from model_service.model_loader import LoadedModel
from model_service.sampler import MAX_LOGIT_BIAS
from protos import cache_pb2_grpc, model_pb2, model_pb2_grpc
from tests.model_service.checks import drain, expect_status, wait_until_idle
from tests.model_service.generation import Generated, generate
from tests.services import Running, start_model

POOL_ID = "tiny-sampling-controls"
VOCAB = 49152
EOS = 2
BLOCK_SIZE = 4
NUM_BLOCKS = 64  # 256 tokens: four requests of ~130 tokens each cannot all run at once
INVALID = grpc.StatusCode.INVALID_ARGUMENT

_rng = random.Random(30)


def random_prompt(n: int) -> list[int]:
    return [_rng.randrange(3, VOCAB) for _ in range(n)]


@pytest.fixture(scope="module")
def sampling_replica(cache_service: Running, tiny_dir: Path) -> Iterator[Running]:
    running = start_model(cache_service.addr, "--model", str(tiny_dir), "--worker-id", POOL_ID,
                          "--block-size", str(BLOCK_SIZE), "--num-blocks", str(NUM_BLOCKS), "--max-num-seqs", "4")
    try:
        yield running
    finally:
        running.process.stop(10.0)


@pytest.fixture(scope="module")
def stub(sampling_replica: Running) -> Iterator[model_pb2_grpc.ModelServiceStub]:
    with grpc.insecure_channel(sampling_replica.addr) as channel:
        yield model_pb2_grpc.ModelServiceStub(channel)


def request(**sampling) -> model_pb2.GenerateRequest:
    return model_pb2.GenerateRequest(token_ids=model_pb2.TokenIds(ids=[5, 6, 7]),
                                     sampling=model_pb2.SamplingParams(**sampling))


BAD: list[tuple[str, Callable[[], model_pb2.GenerateRequest], tuple[str, ...]]] = [
    ("presence-high", lambda: request(presence_penalty=2.5), ("presence_penalty", "[-2, 2]")),
    ("presence-nan", lambda: request(presence_penalty=float("nan")), ("presence_penalty",)),
    ("frequency-low", lambda: request(frequency_penalty=-3.0), ("frequency_penalty", "[-2, 2]")),
    ("frequency-inf", lambda: request(frequency_penalty=float("inf")), ("frequency_penalty",)),
    ("repetition-zero", lambda: request(repetition_penalty=0.0), ("repetition_penalty", "> 0")),
    ("repetition-negative", lambda: request(repetition_penalty=-1.0), ("repetition_penalty", "> 0")),
    ("repetition-inf", lambda: request(repetition_penalty=float("inf")), ("repetition_penalty", "finite")),
    ("bias-key-is-vocab-size", lambda: request(logit_bias={VOCAB: 1.0}), ("logit_bias", str(VOCAB), "vocabulary")),
    ("bias-value-high", lambda: request(logit_bias={3: 101.0}), ("logit_bias", "[-100, 100]")),
    ("bias-value-nan", lambda: request(logit_bias={3: float("nan")}), ("logit_bias", "[-100, 100]")),
    ("bias-too-many", lambda: request(logit_bias=dict.fromkeys(range(MAX_LOGIT_BIAS + 1), 1.0)),
     ("logit_bias", str(MAX_LOGIT_BIAS + 1), str(MAX_LOGIT_BIAS))),
    ("min-tokens-negative", lambda: request(min_tokens=-1), ("min_tokens", ">= 0")),
    ("min-tokens-over-max-tokens", lambda: request(min_tokens=9, max_tokens=8), ("min_tokens (9)", "max_tokens (8)")),
    ("min-p-negative", lambda: request(min_p=-0.5), ("min_p", "[0, 1]")),
    ("min-p-above-one", lambda: request(min_p=1.5), ("min_p", "[0, 1]")),
]


@pytest.mark.parametrize(("build", "fragments"), [case[1:] for case in BAD], ids=[case[0] for case in BAD])
def test_bad_sampling_controls_are_rejected(stub: model_pb2_grpc.ModelServiceStub,
                                            cache_stub: cache_pb2_grpc.CacheManagerStub,
                                            build: Callable[[], model_pb2.GenerateRequest],
                                            fragments: tuple[str, ...]) -> None:
    before = wait_until_idle(cache_stub, POOL_ID)
    expect_status(lambda: drain(stub.Generate(build(), timeout=30)), INVALID, *fragments)
    after = wait_until_idle(cache_stub, POOL_ID)
    assert after.num_admitted == before.num_admitted, "a rejected request reached the cache manager"


def test_bounds_are_accepted(stub: model_pb2_grpc.ModelServiceStub) -> None:
    g = generate(stub, [5, 6, 7], temperature=0.0, max_tokens=3, min_tokens=3, presence_penalty=-2.0,
                 frequency_penalty=2.0, repetition_penalty=0.5, min_p=1.0,
                 logit_bias=dict.fromkeys(range(MAX_LOGIT_BIAS - 1), -100.0) | {VOCAB - 1: 100.0})
    assert g.token_ids == [VOCAB - 1] * 3


def test_logit_bias_forces_a_token_and_only_for_its_request(stub: model_pb2_grpc.ModelServiceStub) -> None:
    prompt = random_prompt(9)
    plain = generate(stub, prompt, temperature=0.0, max_tokens=6, ignore_eos=True).token_ids
    forced = 4242
    assert forced not in plain
    with ThreadPoolExecutor(2) as pool:
        biased = pool.submit(generate, stub, prompt, temperature=0.0, max_tokens=6, ignore_eos=True,
                             logit_bias={forced: 100.0})
        again = pool.submit(generate, stub, prompt, temperature=0.0, max_tokens=6, ignore_eos=True)
        assert biased.result().token_ids == [forced] * 6
        assert again.result().token_ids == plain
    sampled = generate(stub, prompt, temperature=1.0, seed=3, max_tokens=4, logit_bias={forced: 100.0})
    assert sampled.token_ids == [forced] * 4


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_min_tokens_holds_back_stop_tokens_and_eos(stub: model_pb2_grpc.ModelServiceStub, ignore_eos: bool) -> None:
    """Tokens biased to be the only choice are held back until min_tokens were generated; then
    the request ends on them (a stop token id) or on EOS (unless ignore_eos)."""
    stop = 777
    g = generate(stub, random_prompt(7), temperature=0.0, max_tokens=10, min_tokens=4, stop_token_ids=[stop],
                 logit_bias={stop: 100.0})
    assert len(g.token_ids) == 5 and stop not in g.token_ids[:4] and g.token_ids[4] == stop
    assert g.final.finish_reason == model_pb2.FINISH_REASON_STOP and g.final.matched_stop == str(stop)
    g = generate(stub, random_prompt(7), temperature=0.0, max_tokens=10, min_tokens=3, ignore_eos=ignore_eos,
                 logit_bias={EOS: 100.0})
    if ignore_eos:  # EOS is an ordinary token: not held back, not an end
        assert g.token_ids == [EOS] * 10
    else:
        assert len(g.token_ids) == 4 and EOS not in g.token_ids[:3] and g.token_ids[3] == EOS
        assert g.final.finish_reason == model_pb2.FINISH_REASON_STOP


class _OpenAIPenalties(LogitsProcessor):
    """The OpenAI presence / frequency rule over the generated tokens, for transformers' generate()."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        generated = input_ids[:, self.prompt_len:]
        counts = torch.zeros_like(scores).scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
        scores = scores - self.frequency * counts
        return scores - self.presence * (counts > 0).to(scores.dtype)


@torch.inference_mode()
def reference(loaded: LoadedModel, prompt: list[int], max_tokens: int, repetition_penalty: float = 1.0,
              presence: float = 0.0, frequency: float = 0.0) -> list[int]:
    ids = torch.tensor([prompt])
    processors = LogitsProcessorList([_OpenAIPenalties(len(prompt), presence, frequency)] if presence or frequency
                                     else [])
    out = loaded.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                                repetition_penalty=repetition_penalty, logits_processor=processors,
                                pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_greedy_with_penalties_equals_transformers_under_preemption(
        stub: model_pb2_grpc.ModelServiceStub, tiny_reference: LoadedModel,
        cache_stub: cache_pb2_grpc.CacheManagerStub) -> None:
    """Four concurrent requests of ~130 tokens in a 256-token pool: some are preempted and
    recomputed, and every one still equals transformers (their generated tokens are what count)."""
    max_tokens = 110
    cases = [
        (random_prompt(20), {"repetition_penalty": 1.3}),
        (random_prompt(16), {"presence_penalty": 0.4, "frequency_penalty": 0.8}),
        (random_prompt(24), {"repetition_penalty": 1.2, "frequency_penalty": 0.5}),
        (random_prompt(18), {}),
    ]

    def run(case) -> Generated:
        prompt, controls = case
        return generate(stub, prompt, temperature=0.0, max_tokens=max_tokens, **controls)

    with ThreadPoolExecutor(len(cases)) as pool:
        results = list(pool.map(run, cases))
    assert sum(g.final.usage.num_preemptions for g in results) > 0, "no request was preempted"
    for (prompt, controls), g in zip(cases, results, strict=True):
        expected = reference(tiny_reference, prompt, max_tokens, controls.get("repetition_penalty", 1.0),
                             controls.get("presence_penalty", 0.0), controls.get("frequency_penalty", 0.0))
        assert g.token_ids == expected, controls
    plain = reference(tiny_reference, cases[0][0], max_tokens)
    assert results[0].token_ids != plain  # the penalty changed the output
    wait_until_idle(cache_stub, POOL_ID)
