"""SamplingParams.prompt_logprobs through the real services on the tiny model: each prompt token's
log probability equals log_softmax of transformers' logits over the prompt (fp32, within 1e-5),
whether the prompt was cached or not, prefilled in chunks or in one, alone or with n choices; a
cached prefix is reused, not rewritten (other requests' greedy output stays transformers')."""

from __future__ import annotations

import random
from collections.abc import Iterator

import grpc
import pytest
import torch

from protos import model_pb2, model_pb2_grpc
from tests.model_service.checks import expect_status, wait_until_idle
from tests.model_service.generation import reference_greedy
from tests.services import serve_model


@pytest.fixture(scope="module", params=["on", "off"])
def pipeline(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def scoring_replica(cache_service, tiny_dir, pipeline) -> Iterator[tuple[model_pb2_grpc.ModelServiceStub, str]]:
    """Blocks of 4 tokens, 8 tokens per step: prompts are scored over several steps."""
    pool = f"tiny-prompt-logprobs-{pipeline}"
    for stub in serve_model(cache_service.addr, "--model", str(tiny_dir), "--worker-id", pool, "--block-size", "4",
                            "--num-blocks", "512", "--max-batch-tokens", "8", "--cache-pipeline", pipeline):
        yield stub, pool


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 49152) for _ in range(n)]


@torch.inference_mode()
def _reference(loaded, prompt: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits at every prompt position: row q scores token q + 1."""
    return torch.log_softmax(loaded.model(torch.tensor([prompt])).logits[0].float(), dim=-1)


def _generate(stub, prompt: list[int], **sampling) -> list[model_pb2.GenerateResponse]:
    request = model_pb2.GenerateRequest(sampling=model_pb2.SamplingParams(**sampling))
    request.token_ids.ids.extend(prompt)
    return list(stub.Generate(request, timeout=120))


def _check(entries, prompt: list[int], reference: torch.Tensor, k: int) -> None:
    assert len(entries) == len(prompt)
    first = entries[0]
    assert first.chosen.token_id == prompt[0] and first.chosen.rank == 0 and not first.top
    for q, entry in enumerate(entries[1:]):
        token = prompt[q + 1]
        assert entry.chosen.token_id == token
        assert entry.chosen.logprob == pytest.approx(float(reference[q, token]), abs=1e-5), q
        value = reference[q, token]  # its rank, up to ties within the tolerance
        assert int((reference[q] > value + 1e-5).sum()) + 1 <= entry.chosen.rank <= int(
            (reference[q] > value - 1e-5).sum()) + 1
        values, ids = reference[q].topk(k)
        assert [t.token_id for t in entry.top] == ids.tolist()
        assert [t.logprob for t in entry.top] == pytest.approx(values.tolist(), abs=1e-5)


def test_prompt_logprobs_equal_transformers_cached_or_not(scoring_replica, cache_stub, tiny_reference) -> None:
    stub, pool = scoring_replica
    prompt = _prompt(27, 1)
    reference = _reference(tiny_reference, prompt)
    cold = _generate(stub, prompt, temperature=0.0, max_tokens=3, prompt_logprobs=3)
    _check(cold[0].prompt_logprobs, prompt, reference, 3)
    assert all(not m.prompt_logprobs for m in cold[1:])
    assert cold[-1].usage.cached_prompt_tokens == 0
    # Cached now: the hit's KV is reused (usage says so), every position is still scored.
    warm = _generate(stub, prompt, temperature=0.0, max_tokens=3, prompt_logprobs=2)
    assert warm[-1].usage.cached_prompt_tokens >= 24
    _check(warm[0].prompt_logprobs, prompt, reference, 2)
    expected = reference_greedy(tiny_reference, prompt, 3)
    assert [t for m in cold for t in m.token_ids] == [t for m in warm for t in m.token_ids] == expected
    # The cached pages were not rewritten: a request sharing the prefix still equals generate().
    longer = prompt + _prompt(6, 2)
    got = _generate(stub, longer, temperature=0.0, max_tokens=6)
    assert got[-1].usage.cached_prompt_tokens >= 24
    assert [t for m in got for t in m.token_ids] == reference_greedy(tiny_reference, longer, 6)
    wait_until_idle(cache_stub, pool)


def test_prompt_logprobs_with_choices_and_a_one_token_prompt(scoring_replica, cache_stub, tiny_reference) -> None:
    stub, pool = scoring_replica
    prompt = _prompt(10, 3)
    messages = _generate(stub, prompt, temperature=0.0, max_tokens=2, prompt_logprobs=0, n=3)
    with_scores = [m for m in messages if m.prompt_logprobs]
    assert len(with_scores) == 1 and with_scores[0].index == 0
    _check(with_scores[0].prompt_logprobs, prompt, _reference(tiny_reference, prompt), 0)
    single = _generate(stub, [prompt[0]], temperature=0.0, max_tokens=1, prompt_logprobs=1)
    (entry,) = single[0].prompt_logprobs
    assert entry.chosen.token_id == prompt[0] and entry.chosen.rank == 0
    wait_until_idle(cache_stub, pool)


def test_prompt_logprobs_out_of_range_is_invalid_argument(scoring_replica) -> None:
    stub, _ = scoring_replica
    request = model_pb2.GenerateRequest(sampling=model_pb2.SamplingParams(prompt_logprobs=21))
    request.token_ids.ids.extend([5, 6, 7])
    expect_status(lambda: list(stub.Generate(request, timeout=30)), grpc.StatusCode.INVALID_ARGUMENT,
                  "prompt_logprobs")
