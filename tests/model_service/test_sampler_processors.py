"""The sampling controls of issue 30 (logit_bias, repetition / presence / frequency penalties,
min_tokens, min_p) against transformers' own processors and the OpenAI formulas, over mixed
batches, across steps, finishes and preemptions."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from transformers import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from model_service.detokenizer import IncrementalDetokenizer
from model_service.logits_processors import LogitsProcessors
from model_service.request import Request, RequestStatus
from model_service.sampler import MAX_LOGIT_BIAS, Sampler, SamplingOptions, make_generator

VOCAB = 300
EOS = (2, 7)


class _NoText:
    """A tokenizer stand-in: the processors never detokenize."""

    def decode(self, ids, **kwargs) -> str:
        return ""


def make_request(prompt: list[int], output: list[int] | None = None, *, stop_token_ids: tuple[int, ...] = (),
                 ignore_eos: bool = False, **options) -> Request:
    request = Request(request_id=f"r{id(prompt)}", prompt_token_ids=list(prompt), sampling=SamplingOptions(**options),
                      max_tokens=64, stop_token_ids=frozenset(stop_token_ids), namespace="", ignore_eos=ignore_eos,
                      arrival_time=0.0, detokenizer=IncrementalDetokenizer(_NoText(), list(prompt)))
    request.output_token_ids = list(output or [])
    request.status = RequestStatus.RUNNING
    return request


def random_logits(batch: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * 3.0


def token_ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture
def processors() -> LogitsProcessors:
    return LogitsProcessors(EOS, capacity=4)


# ---------------------------------------------------------------- each control alone


def test_batch_without_controls_is_returned_untouched(processors: LogitsProcessors) -> None:
    logits = random_logits(3)
    requests = [make_request([1, 2, 3], [4]), make_request([5], temperature=0.0),
                make_request([6], top_k=5, min_p=0.3)]  # min_p is the sampler's own, not a processor
    assert processors.apply(logits, requests) is logits
    assert processors.table.counts is None  # nothing allocated


@pytest.mark.parametrize("penalty", [1.3, 0.7, 2.0])
def test_repetition_penalty_matches_transformers(processors: LogitsProcessors, penalty: float) -> None:
    logits = random_logits(3, seed=1)
    prompt, output = token_ids(40, 2), token_ids(25, 3)
    requests = [make_request(prompt, output, repetition_penalty=penalty),
                make_request(prompt, output),  # no controls: untouched
                make_request(prompt, [], repetition_penalty=penalty)]  # prompt only
    expected = logits.clone()
    reference = RepetitionPenaltyLogitsProcessor(penalty)
    expected[0:1] = reference(torch.tensor([prompt + output]), logits[0:1].clone())
    expected[2:3] = reference(torch.tensor([prompt]), logits[2:3].clone())
    out = processors.apply(logits.clone(), requests)
    assert torch.equal(out, expected)


def test_presence_and_frequency_follow_openai_over_generated_tokens_only(processors: LogitsProcessors) -> None:
    logits = random_logits(2, seed=4)
    prompt = [10, 11, 12, 13]
    output = [11, 20, 20, 20, 30, 11]
    requests = [make_request(prompt, output, presence_penalty=0.5, frequency_penalty=-1.25),
                make_request(prompt, output, presence_penalty=-2.0)]
    counts = torch.bincount(torch.tensor(output), minlength=VOCAB).float()
    expected = logits.clone()
    expected[0] = logits[0] - (-1.25) * counts - 0.5 * (counts > 0).float()
    expected[1] = logits[1] - (-2.0) * (counts > 0).float()
    out = processors.apply(logits.clone(), requests)
    assert torch.allclose(out, expected, atol=1e-6, rtol=0)
    assert out[0, 12] == logits[0, 12]  # a prompt token is not a generated one


def test_logit_bias_is_added(processors: LogitsProcessors) -> None:
    logits = random_logits(2, seed=5)
    requests = [make_request([1], [3], logit_bias={0: 100.0, 17: -100.0, VOCAB - 1: 0.5}),
                make_request([1], [3])]
    expected = logits.clone()
    expected[0, 0] += 100.0
    expected[0, 17] -= 100.0
    expected[0, VOCAB - 1] += 0.5
    assert torch.equal(processors.apply(logits.clone(), requests), expected)


def test_order_is_bias_then_repetition_then_presence_frequency(processors: LogitsProcessors) -> None:
    logits = random_logits(1, seed=6)
    prompt, output = [5, 6, 7, 8], [6, 9, 9]
    bias = {6: 3.0, 9: -4.0, 40: 1.0}
    request = make_request(prompt, output, logit_bias=bias, repetition_penalty=1.5,
                           presence_penalty=0.25, frequency_penalty=0.5)
    expected = logits.clone()
    for token, value in bias.items():
        expected[0, token] += value
    expected = RepetitionPenaltyLogitsProcessor(1.5)(torch.tensor([prompt + output]), expected)
    counts = torch.bincount(torch.tensor(output), minlength=VOCAB).float()
    expected[0] -= 0.5 * counts + 0.25 * (counts > 0).float()
    assert torch.allclose(processors.apply(logits.clone(), [request]), expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize(("stop_token_ids", "ignore_eos"), [((), False), ((50, 51), False), ((50,), True)])
def test_min_tokens_matches_transformers(processors: LogitsProcessors, stop_token_ids: tuple[int, ...],
                                         ignore_eos: bool) -> None:
    prompt = token_ids(9, 7)
    ends = sorted(set(stop_token_ids) | (set() if ignore_eos else set(EOS)))
    for generated in (0, 3, 4, 6):
        logits = random_logits(2, seed=8 + generated)
        output = token_ids(generated, 9)
        requests = [make_request(prompt, output, min_tokens=4, stop_token_ids=stop_token_ids, ignore_eos=ignore_eos),
                    make_request(prompt, output, stop_token_ids=stop_token_ids)]
        expected = logits.clone()
        reference = MinNewTokensLengthLogitsProcessor(len(prompt), 4, ends, device="cpu")
        expected[0:1] = reference(torch.tensor([prompt + output]), logits[0:1].clone())
        assert torch.equal(processors.apply(logits.clone(), requests), expected), generated
        assert (generated < 4) == bool(torch.isinf(expected[0, ends]).all())


def _transformers_warped(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                         min_p: float) -> torch.Tensor:
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return MinPLogitsWarper(min_p)(None, scores)


@pytest.mark.parametrize(("temperature", "top_k", "top_p", "min_p"),
                         [(1.0, 0, 1.0, 0.2), (0.7, 4, 1.0, 0.05), (1.5, 0, 0.9, 0.3), (1.0, 0, 1.0, 1.0)])
def test_min_p_matches_transformers_warper(temperature: float, top_k: int, top_p: float, min_p: float) -> None:
    base = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    expected = _transformers_warped(base.unsqueeze(0), temperature, top_k, top_p, min_p).softmax(-1)[0].double()
    rows = 20_000
    options = SamplingOptions(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=3)
    tokens = Sampler().sample(base.expand(rows, -1).contiguous(), [options] * rows, [make_generator(3, "cpu")] * rows)
    observed = torch.bincount(tokens, minlength=len(base)).double() / rows
    assert set(tokens.unique().tolist()) == set(expected.nonzero().flatten().tolist())  # exactly the support
    assert torch.allclose(observed, expected, atol=0.015), (observed.tolist(), expected.tolist())


# ---------------------------------------------------------------- mixed batches


def test_mixed_batch_rows_without_controls_sample_as_before(processors: LogitsProcessors) -> None:
    """Greedy and seeded rows without controls pick exactly what they pick with no processors in
    the batch at all; greedy rows with controls are the argmax of the processed logits."""
    sampler = Sampler()
    logits = random_logits(6, seed=11)
    prompt, output = token_ids(20, 12), token_ids(10, 13)
    plain = [make_request(prompt, output, temperature=0.0), make_request(prompt, output, temperature=0.8, seed=5),
             make_request(prompt, output, temperature=1.2, top_k=50, seed=6)]
    controlled = [make_request(prompt, output, temperature=0.0, repetition_penalty=1.4, logit_bias={3: 2.0}),
                  make_request(prompt, output, temperature=0.9, seed=7, frequency_penalty=1.0, min_p=0.1),
                  make_request(prompt, output, temperature=0.0, min_tokens=30, presence_penalty=0.5)]
    mixed = [plain[0], controlled[0], plain[1], controlled[1], plain[2], controlled[2]]

    def run(requests: list[Request], rows: torch.Tensor) -> torch.Tensor:
        processed = processors.apply(rows.clone(), requests)
        return sampler.sample(processed, [r.sampling for r in requests],
                              [make_generator(r.sampling.seed, "cpu") for r in requests])

    alone = run(plain, logits[[0, 2, 4]])
    together = run(mixed, logits)
    assert together[[0, 2, 4]].tolist() == alone.tolist()
    processed = processors.apply(logits[[1, 5]].clone(), [controlled[0], controlled[2]])
    assert together[[1, 5]].tolist() == processed.argmax(dim=-1).tolist()


def test_16_bit_logits_are_processed_in_float32(processors: LogitsProcessors) -> None:
    logits = random_logits(2, seed=14).to(torch.bfloat16)
    requests = [make_request([1, 2], [3], repetition_penalty=1.3), make_request([1, 2], [3])]
    out = processors.apply(logits, requests)
    assert out.dtype == torch.float32
    expected = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([[1, 2, 3]]), logits[0:1].float())
    assert torch.equal(out[0:1], expected) and torch.equal(out[1], logits[1].float())


def test_inference_mode_logits_are_processed(processors: LogitsProcessors) -> None:
    """Regression: the model runner returns inference tensors; updating them in place outside
    inference mode raised and took the engine loop down."""
    with torch.inference_mode():
        logits = random_logits(2, seed=15)
    requests = [make_request([1, 2], [3], logit_bias={4: 1.0}, repetition_penalty=1.3, min_tokens=2),
                make_request([1, 2], [3])]
    expected = logits.clone()
    expected[0, 4] += 1.0
    expected[0:1] = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([[1, 2, 3]]), expected[0:1])
    expected[0, list(EOS)] = -math.inf
    out = processors.apply(logits, requests)
    assert torch.equal(out, expected)
    processors.record(requests, torch.tensor([5, 6]))
    assert processors.table.counts[requests[0].processors.slot, 5] == 1


# ---------------------------------------------------------------- state across steps


def _step(processors: LogitsProcessors, requests: list[Request], logits: torch.Tensor) -> list[int]:
    processed = processors.apply(logits, requests)
    tokens = Sampler().sample(processed, [r.sampling for r in requests], [None] * len(requests))
    processors.record(requests, tokens)
    for request, token in zip(requests, tokens.tolist(), strict=True):
        request.output_token_ids.append(token)
    return tokens.tolist()


def _fresh_penalized(request: Request, logits: torch.Tensor) -> torch.Tensor:
    """What a brand-new processors object computes for the request's tokens now."""
    twin = dataclasses.replace(request, processors=None, output_token_ids=list(request.output_token_ids))
    twin.status = RequestStatus.RUNNING
    return LogitsProcessors(EOS, capacity=1).apply(logits.clone(), [twin])


def test_counts_follow_the_generated_tokens_step_by_step(processors: LogitsProcessors) -> None:
    a = make_request(token_ids(12, 20), temperature=0.0, frequency_penalty=0.3, repetition_penalty=1.2)
    b = make_request(token_ids(7, 21), temperature=0.0)
    c = make_request(token_ids(5, 22), temperature=0.0, presence_penalty=1.5)
    for step in range(12):
        logits = random_logits(3, seed=100 + step) * 0.2  # flat: penalties change the picks
        _step(processors, [a, b, c], logits)
        for request in (a, c):
            state = request.processors
            assert state is not None and state.counted == len(request.output_token_ids)
            counts = torch.bincount(torch.tensor(request.output_token_ids), minlength=VOCAB).int()
            assert torch.equal(processors.table.counts[state.slot], counts)
            seen = torch.zeros(VOCAB, dtype=torch.bool)
            seen[request.prompt_token_ids + request.output_token_ids] = True
            assert torch.equal(processors.table.seen[state.slot], seen)
    assert b.processors is None and processors.table.num_used == 2
    assert len(set(a.output_token_ids)) > 1  # the penalties moved greedy off its first pick


def test_release_frees_the_row_and_a_new_request_starts_clean(processors: LogitsProcessors) -> None:
    requests = [make_request([i + 1], temperature=0.0, frequency_penalty=2.0) for i in range(4)]
    for step in range(3):
        _step(processors, requests, random_logits(4, seed=step))
    assert processors.table.num_used == 4
    processors.release(requests[1])
    assert requests[1].processors is None and processors.table.num_used == 3
    newcomer = make_request([9, 9], temperature=0.0, frequency_penalty=2.0, repetition_penalty=1.1)
    logits = random_logits(1, seed=50)
    assert torch.equal(processors.apply(logits.clone(), [newcomer]), _fresh_penalized(newcomer, logits))


def test_preempted_request_keeps_its_counts_or_rebuilds_them(processors: LogitsProcessors) -> None:
    """A preempted request (waiting, its generated tokens kept) continues with the right counts,
    whether its row survived or was reclaimed for running requests while it waited."""
    victim = make_request(token_ids(8, 30), temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.7)
    others = [make_request([i + 40], temperature=0.0, presence_penalty=1.0) for i in range(3)]
    for step in range(4):
        _step(processors, [victim, *others], random_logits(4, seed=200 + step))
    victim.reset_cache_state()  # preempted: waiting, to be recomputed from its tokens
    newcomer = make_request([77], temperature=0.0, frequency_penalty=1.0)  # the table is full: reclaim
    _step(processors, [*others, newcomer], random_logits(4, seed=300))
    assert victim.processors is not None and victim.processors.slot == -1
    victim.status = RequestStatus.RUNNING  # re-admitted: newcomer finished, a row is free again
    processors.release(newcomer)
    logits = random_logits(1, seed=301)
    assert torch.equal(processors.apply(logits.clone(), [victim]), _fresh_penalized(victim, logits))
    kept = make_request(token_ids(8, 31), temperature=0.0, repetition_penalty=1.5)
    _step(processors, [kept], random_logits(1, seed=302))
    kept.reset_cache_state()
    kept.status = RequestStatus.RUNNING  # back before anyone needed its row
    assert torch.equal(processors.apply(logits.clone(), [kept]), _fresh_penalized(kept, logits))


def test_table_grows_when_every_holder_runs() -> None:
    processors = LogitsProcessors(EOS, capacity=2)
    requests = [make_request([i + 1], temperature=0.0, repetition_penalty=1.2) for i in range(5)]
    _step(processors, requests, random_logits(5, seed=60))
    assert processors.table.num_used == 5
    logits = random_logits(5, seed=61)
    expected = torch.cat([_fresh_penalized(r, logits[i:i + 1]) for i, r in enumerate(requests)])
    assert torch.equal(processors.apply(logits.clone(), requests), expected)


# ---------------------------------------------------------------- validation


def test_new_options_default_off() -> None:
    options = SamplingOptions.from_params()
    assert (options.min_p, options.presence_penalty, options.frequency_penalty, options.repetition_penalty,
            options.logit_bias, options.min_tokens) == (0.0, 0.0, 0.0, 1.0, {}, 0)
    assert not options.uses_processors and not options.uses_penalties
    assert SamplingOptions.from_params(repetition_penalty=None).repetition_penalty == 1.0


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"min_p": -0.1}, "min_p"), ({"min_p": 1.5}, "min_p"), ({"min_p": math.nan}, "min_p"),
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"presence_penalty": math.nan}, "presence_penalty"),
    ({"frequency_penalty": -2.01}, "frequency_penalty"), ({"frequency_penalty": math.inf}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"), ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"repetition_penalty": math.inf}, "repetition_penalty"), ({"repetition_penalty": math.nan}, "repetition_penalty"),
    ({"logit_bias": {5: 100.5}}, "logit_bias"), ({"logit_bias": {5: math.nan}}, "logit_bias"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"logit_bias": dict.fromkeys(range(MAX_LOGIT_BIAS + 1), 1.0)}, "logit_bias"),
    ({"min_tokens": -1}, "min_tokens"),
])
def test_new_options_are_validated(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingOptions.from_params(**kwargs)


def test_bounds_are_inclusive() -> None:
    SamplingOptions.from_params(min_p=1.0, presence_penalty=-2.0, frequency_penalty=2.0, repetition_penalty=1e-3,
                                logit_bias=dict.fromkeys(range(MAX_LOGIT_BIAS), -100.0), min_tokens=0)


def test_table_starts_small_and_doubles_up_to_capacity() -> None:
    processors = LogitsProcessors(EOS, capacity=64)
    requests = [make_request([i + 1], temperature=0.0, presence_penalty=1.0) for i in range(9)]
    _step(processors, requests[:1], random_logits(1, seed=70))
    assert processors.table.counts.shape == (4, VOCAB)  # not max_num_seqs x vocab for one request
    _step(processors, requests, random_logits(9, seed=71))
    assert processors.table.counts.shape == (16, VOCAB) and processors.table.num_used == 9
