"""Bad input to the model service through the real gRPC API: the exact status code, a clear
message, and nothing leaked at the cache manager afterwards."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from protos import cache_pb2_grpc, model_pb2, model_pb2_grpc
from tests.model_service.checks import drain, expect_status, wait_until_idle
from tests.model_service.generation import LONG_DOCUMENT, Generated, generate
from tests.services import SHARED_POOL_ID, start_model

VOCAB = 49152
CONTEXT = 8192
INVALID = grpc.StatusCode.INVALID_ARGUMENT
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED


def request(prompt: str | None = "Hello", token_ids: list[int] | None = None,
            **sampling) -> model_pb2.GenerateRequest:
    req = model_pb2.GenerateRequest(sampling=model_pb2.SamplingParams(**sampling))
    if token_ids is not None:
        req.token_ids.ids.extend(token_ids)
    elif prompt is not None:
        req.prompt = prompt
    return req


def _empty_prompt() -> model_pb2.GenerateRequest:
    req = model_pb2.GenerateRequest(prompt="")
    assert req.WhichOneof("input") == "prompt"
    return req


def _empty_token_ids() -> model_pb2.GenerateRequest:
    req = model_pb2.GenerateRequest()
    req.token_ids.SetInParent()
    return req


def _empty_chat() -> model_pb2.GenerateRequest:
    req = model_pb2.GenerateRequest()
    req.chat.SetInParent()
    return req


# (id, request builder, code, message fragments)
BAD_REQUESTS: list[tuple[str, Callable[[], model_pb2.GenerateRequest], grpc.StatusCode, tuple[str, ...]]] = [
    ("empty-prompt", _empty_prompt, INVALID, ("prompt is empty",)),
    ("no-input", lambda: request(prompt=None), INVALID, ("one of prompt, token_ids or chat is required",)),
    ("empty-token-ids", _empty_token_ids, INVALID, ("prompt is empty",)),
    ("token-id-is-vocab-size", lambda: request(token_ids=[1, 2, VOCAB]), INVALID,
     ("token_ids", str(VOCAB), "vocabulary")),
    ("token-id-huge", lambda: request(token_ids=[2**32 - 1]), INVALID, ("token_ids", str(2**32 - 1))),
    ("max-tokens-zero", lambda: request(max_tokens=0), INVALID, ("max_tokens must be > 0", "got 0")),
    ("max-tokens-negative", lambda: request(max_tokens=-5), INVALID, ("max_tokens must be > 0", "got -5")),
    ("prompt-plus-max-tokens-over-context", lambda: request(token_ids=[1000] * 8000, max_tokens=193), INVALID,
     ("8000 tokens", "max_tokens (193)", f"context of {CONTEXT} tokens")),
    ("prompt-is-whole-context", lambda: request(token_ids=[1000] * CONTEXT), INVALID,
     (f"prompt has {CONTEXT} tokens", f"context is {CONTEXT} tokens")),
    ("prompt-over-context", lambda: request(token_ids=[1000] * (CONTEXT + 100), max_tokens=1), INVALID,
     (f"prompt has {CONTEXT + 100} tokens", "context")),
    ("temperature-negative", lambda: request(temperature=-0.1), INVALID, ("temperature", ">= 0")),
    ("temperature-nan", lambda: request(temperature=float("nan")), INVALID, ("temperature", "finite")),
    ("temperature-inf", lambda: request(temperature=float("inf")), INVALID, ("temperature", "finite")),
    ("top-p-nan", lambda: request(top_p=float("nan")), INVALID, ("top_p must be in (0, 1]",)),
    ("top-p-zero", lambda: request(top_p=0.0), INVALID, ("top_p must be in (0, 1]", "got 0.0")),
    ("top-p-above-one", lambda: request(top_p=1.5), INVALID, ("top_p must be in (0, 1]", "got 1.5")),
    ("top-k-negative", lambda: request(top_k=-1), INVALID, ("top_k", ">= 0", "got -1")),
    ("empty-stop-string", lambda: request(stop=["ok", ""]), INVALID, ("stop strings must not be empty",)),
    ("stop-token-id-out-of-vocab", lambda: request(stop_token_ids=[2, VOCAB + 7]), INVALID,
     ("stop_token_ids", str(VOCAB + 7), "vocabulary")),
    ("chat-without-messages", _empty_chat, INVALID, ("chat has no messages",)),
]


@pytest.mark.parametrize(("build", "code", "fragments"), [case[1:] for case in BAD_REQUESTS],
                         ids=[case[0] for case in BAD_REQUESTS])
def test_bad_generate_request_is_rejected(model_stub: model_pb2_grpc.ModelServiceStub,
                                          cache_stub: cache_pb2_grpc.CacheManagerStub,
                                          build: Callable[[], model_pb2.GenerateRequest], code: grpc.StatusCode,
                                          fragments: tuple[str, ...]) -> None:
    before = wait_until_idle(cache_stub, SHARED_POOL_ID)
    expect_status(lambda: drain(model_stub.Generate(build(), timeout=30)), code, *fragments)
    after = wait_until_idle(cache_stub, SHARED_POOL_ID)
    assert after.num_admitted == before.num_admitted, "a rejected request reached the cache manager"


@pytest.mark.parametrize(("build", "fragments"), [
    (lambda: model_pb2.TokenizeRequest(text=""), ("prompt is empty",)),
    (lambda: model_pb2.TokenizeRequest(), ("one of prompt, token_ids or chat is required",)),
    (lambda: model_pb2.TokenizeRequest(chat=model_pb2.ChatMessages()), ("chat has no messages",)),
], ids=["empty-text", "no-input", "chat-without-messages"])
def test_bad_tokenize_request_is_rejected(model_stub: model_pb2_grpc.ModelServiceStub,
                                          build: Callable[[], model_pb2.TokenizeRequest],
                                          fragments: tuple[str, ...]) -> None:
    expect_status(lambda: model_stub.Tokenize(build(), timeout=30), INVALID, *fragments)


def test_service_still_serves_after_bad_requests(model_stub: model_pb2_grpc.ModelServiceStub,
                                                 cache_stub: cache_pb2_grpc.CacheManagerStub) -> None:
    for _, build, code, _ in BAD_REQUESTS[:4]:
        expect_status(lambda b=build: drain(model_stub.Generate(b(), timeout=30)), code)
    g = generate(model_stub, prompt="The capital of France is", temperature=0.0, max_tokens=4, ignore_eos=True)
    assert len(g.token_ids) == 4
    assert g.final.finish_reason == model_pb2.FINISH_REASON_LENGTH
    wait_until_idle(cache_stub, SHARED_POOL_ID)


# ---------------------------------------------------------------- a constrained service

SMALL_POOL = "small-pool"
SMALL_BLOCKS = 16  # x 16 tokens: the whole pool holds 256 tokens, far below the model's context


@pytest.fixture(scope="module")
def small_stub(cache_service) -> Iterator[model_pb2_grpc.ModelServiceStub]:
    """16 blocks (256 tokens), one running request, one waiting."""
    running = start_model(cache_service.addr, "--num-blocks", str(SMALL_BLOCKS), "--worker-id", SMALL_POOL,
                          "--max-num-seqs", "1", "--max-waiting", "1")
    try:
        with grpc.insecure_channel(running.addr) as channel:
            yield model_pb2_grpc.ModelServiceStub(channel)
    finally:
        running.process.stop(10.0)


@pytest.mark.parametrize(("num_prompt", "max_tokens", "fragments"), [
    (300, None, ("prompt has 300 tokens", "whole KV pool holds 256 tokens")),
    (256, 1, ("prompt has 256 tokens", "256 tokens")),
    (200, 57, ("prompt (200 tokens) + max_tokens (57)", "KV pool of 256 tokens")),
], ids=["prompt-over-pool", "prompt-is-whole-pool", "prompt-plus-max-tokens-over-pool"])
def test_request_larger_than_the_pool_is_resource_exhausted(small_stub, cache_stub, num_prompt: int,
                                                            max_tokens: int | None,
                                                            fragments: tuple[str, ...]) -> None:
    sampling = {} if max_tokens is None else {"max_tokens": max_tokens}
    req = request(token_ids=[1000 + i for i in range(num_prompt)], **sampling)
    expect_status(lambda: drain(small_stub.Generate(req, timeout=30)), EXHAUSTED, *fragments)
    wait_until_idle(cache_stub, SMALL_POOL)


def test_request_exactly_filling_the_pool_succeeds(small_stub, cache_stub, reference_model) -> None:
    tokens = reference_model.tokenizer(LONG_DOCUMENT).input_ids[:250]
    g = generate(small_stub, tokens, temperature=0.0, max_tokens=6, ignore_eos=True)
    assert len(g.token_ids) == 6
    assert g.final.finish_reason == model_pb2.FINISH_REASON_LENGTH
    stats = wait_until_idle(cache_stub, SMALL_POOL)
    assert stats.num_blocks == SMALL_BLOCKS


def test_waiting_queue_full_is_resource_exhausted(small_stub, cache_stub) -> None:
    n = 4
    barrier = threading.Barrier(n)

    def one(i: int) -> Generated | grpc.RpcError:
        barrier.wait(10)
        try:
            return generate(small_stub, prompt=f"Count from {i} to one hundred:", temperature=0.0, max_tokens=16,
                            ignore_eos=True, timeout=120)
        except grpc.RpcError as error:
            return error

    with ThreadPoolExecutor(n) as pool:
        results = list(pool.map(one, range(n)))
    errors = [r for r in results if isinstance(r, grpc.RpcError)]
    done = [r for r in results if not isinstance(r, grpc.RpcError)]
    assert errors, "four concurrent requests with one running and one waiting slot: none was refused"
    assert done, "every request was refused"
    for error in errors:
        assert error.code() == EXHAUSTED, (error.code(), error.details())
        assert "waiting queue is full" in error.details()
    for g in done:
        assert len(g.token_ids) == 16
        assert g.final.finish_reason == model_pb2.FINISH_REASON_LENGTH
    wait_until_idle(cache_stub, SMALL_POOL)
    # Backpressure is transient: once the queue drains, requests are accepted again.
    assert len(generate(small_stub, prompt="Hello", temperature=0.0, max_tokens=2, ignore_eos=True).token_ids) == 2
