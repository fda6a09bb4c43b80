"""SamplingParams.n: one prefill, n choices forked from it (model_service/forks.py), through the
real services on the tiny model, with the cache pipeline on and off. Greedy choices equal
transformers' generate(); seeded choice i equals a single request with seed + i; the prompt is
computed once (the forked choices' usage says all their prompt came from the cache); aborts,
preemption and errors leave the pool whole."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator

import grpc
import pytest

from protos import model_pb2, model_pb2_grpc
from tests.model_service.checks import expect_status, wait_until_idle
from tests.model_service.generation import reference_greedy
from tests.services import serve_model

MAX_TOKENS = 10


@pytest.fixture(scope="module", params=["on", "off"])
def pipeline(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def parallel_replica(cache_service, tiny_dir, pipeline) -> Iterator[tuple[model_pb2_grpc.ModelServiceStub, str]]:
    pool = f"tiny-parallel-{pipeline}"
    for stub in serve_model(cache_service.addr, "--model", str(tiny_dir), "--worker-id", pool, "--block-size", "4",
                            "--num-blocks", "512", "--cache-pipeline", pipeline):
        yield stub, pool


@pytest.fixture(scope="module")
def parallel_small_pool(cache_service, tiny_dir, pipeline) -> Iterator[tuple[model_pb2_grpc.ModelServiceStub, str]]:
    """24 blocks of 4 tokens: one choice fits alone, eight together do not."""
    pool = f"tiny-parallel-small-{pipeline}"
    for stub in serve_model(cache_service.addr, "--model", str(tiny_dir), "--worker-id", pool, "--block-size", "4",
                            "--num-blocks", "24", "--cache-pipeline", pipeline):
        yield stub, pool


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 49152) for _ in range(n)]


def _run(stub, prompt: list[int], **sampling) -> dict[int, list[model_pb2.GenerateResponse]]:
    """One Generate call; its messages by choice."""
    request = model_pb2.GenerateRequest(sampling=model_pb2.SamplingParams(**sampling))
    request.token_ids.ids.extend(prompt)
    by_choice: dict[int, list[model_pb2.GenerateResponse]] = {}
    for message in stub.Generate(request, timeout=120):
        by_choice.setdefault(message.index, []).append(message)
    return by_choice


def _tokens(messages: list[model_pb2.GenerateResponse]) -> list[int]:
    return [t for m in messages for t in m.token_ids]


@pytest.mark.parametrize("length", [13, 16, 1])  # a partial last page, whole pages, one token
def test_greedy_choices_equal_generate_and_share_one_prefill(parallel_replica, cache_stub, tiny_reference, length) -> None:
    stub, pool = parallel_replica
    prompt = _prompt(length, length)
    expected = reference_greedy(tiny_reference, prompt, MAX_TOKENS)
    choices = _run(stub, prompt, temperature=0.0, max_tokens=MAX_TOKENS, n=4)
    assert sorted(choices) == [0, 1, 2, 3]
    for index, messages in choices.items():
        assert _tokens(messages) == expected, index
        assert [m.finish_reason != 0 for m in messages].count(True) == 1 and messages[-1].finish_reason
        usage = messages[-1].usage
        assert usage.prompt_tokens == length and usage.completion_tokens == len(expected)
    # The prompt was computed once: by choice 0 (a fresh prompt: no cache hit); every other choice
    # had all of it from the cache (its full pages shared, its partial last page copied).
    assert choices[0][-1].usage.cached_prompt_tokens == 0
    for index in (1, 2, 3):
        usage = choices[index][-1].usage
        assert usage.cached_prompt_tokens == length, (index, usage)
        assert usage.miss_new_tokens == usage.miss_evicted_tokens == 0
    wait_until_idle(cache_stub, pool)


def test_seeded_choice_i_equals_a_single_request_with_seed_plus_i(parallel_replica, cache_stub) -> None:
    stub, pool = parallel_replica
    prompt = _prompt(11, 99)
    sampling = dict(temperature=1.0, top_p=0.9, max_tokens=MAX_TOKENS, ignore_eos=True)
    choices = _run(stub, prompt, seed=1234, n=4, **sampling)
    outputs = [_tokens(choices[i]) for i in range(4)]
    assert len({tuple(o) for o in outputs}) > 1  # they do sample differently
    for i, output in enumerate(outputs):
        alone = _run(stub, prompt, seed=1234 + i, **sampling)
        assert list(alone) == [0] and _tokens(alone[0]) == output, i
    assert _tokens(_run(stub, prompt, seed=1234, n=4, **sampling)[3]) == outputs[3]  # reproducible
    wait_until_idle(cache_stub, pool)


def test_choices_under_preemption_equal_single_requests(parallel_small_pool, cache_stub) -> None:
    """Eight sampled choices of 9 + 30 tokens need ~70 blocks of a 24-block pool (greedy ones would
    share their identical pages): choices are preempted and recompute; each still equals a single
    request with its seed."""
    stub, pool = parallel_small_pool
    prompt = _prompt(9, 5)
    sampling = dict(temperature=1.0, max_tokens=30, ignore_eos=True)
    choices = _run(stub, prompt, seed=77, n=8, **sampling)
    assert sorted(choices) == list(range(8))
    assert sum(choices[i][-1].usage.num_preemptions for i in range(8)) > 0
    for index, messages in choices.items():
        assert _tokens(messages) == _tokens(_run(stub, prompt, seed=77 + index, **sampling)[0]), index
    wait_until_idle(cache_stub, pool)


def test_abort_ends_every_choice_and_frees_the_id(parallel_replica, cache_stub) -> None:
    stub, pool = parallel_replica
    request = model_pb2.GenerateRequest(request_id="par-abort", sampling=model_pb2.SamplingParams(
        temperature=0.0, max_tokens=400, ignore_eos=True, n=3))
    request.token_ids.ids.extend(_prompt(20, 3))
    stream = stub.Generate(request, timeout=120)
    first = next(stream)
    seen = [first]
    aborted = threading.Event()

    def abort() -> None:
        stub.Abort(model_pb2.AbortRequest(request_id="par-abort"), timeout=10)
        aborted.set()

    for message in stream:
        seen.append(message)
        if len(seen) == 6 and not aborted.is_set():
            threading.Thread(target=abort).start()
    assert aborted.wait(10)
    finals = [m for m in seen if m.finish_reason]
    assert sorted(m.index for m in finals) == [0, 1, 2]
    assert all(m.finish_reason == model_pb2.FINISH_REASON_ABORT for m in finals)
    wait_until_idle(cache_stub, pool)
    again = _run(stub, _prompt(5, 4), temperature=0.0, max_tokens=2, n=2)  # the id is free again
    assert sorted(again) == [0, 1]


def test_cancelled_stream_returns_every_block(parallel_replica, cache_stub) -> None:
    stub, pool = parallel_replica
    request = model_pb2.GenerateRequest(sampling=model_pb2.SamplingParams(
        temperature=0.0, max_tokens=400, ignore_eos=True, n=5))
    request.token_ids.ids.extend(_prompt(30, 8))
    stream = stub.Generate(request, timeout=120)
    for _, _message in zip(range(12), stream, strict=False):
        pass
    stream.cancel()
    wait_until_idle(cache_stub, pool)


def test_n_out_of_range_is_invalid_argument(parallel_replica) -> None:
    stub, _ = parallel_replica
    request = model_pb2.GenerateRequest(sampling=model_pb2.SamplingParams(n=65))
    request.token_ids.ids.extend([5, 6, 7])
    expect_status(lambda: list(stub.Generate(request, timeout=30)), grpc.StatusCode.INVALID_ARGUMENT, "n must be")
