"""Greedy output through the real services is token-identical to transformers' generate()."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from protos import model_pb2_grpc
from tests.model_service.checks import wait_until_idle
from tests.model_service.generation import LONG_DOCUMENT, correctness_prompts, greedy, reference_greedy
from tests.services import SHARED_POOL_ID, serve_model

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def prompts(reference_model) -> list[list[int]]:
    return correctness_prompts(reference_model.tokenizer)


@pytest.fixture(scope="module")
def expected(reference_model, prompts) -> list[list[int]]:
    return [reference_greedy(reference_model, p, MAX_TOKENS) for p in prompts]


def test_one_at_a_time_then_cached(model_stub, cache_stub, prompts, expected):
    first = [greedy(model_stub, p, MAX_TOKENS) for p in prompts]
    assert [g.token_ids for g in first] == expected
    # The 2nd and 3rd long prompts share the first one's >= 500-token prefix.
    assert first[0].final.usage.cached_prompt_tokens < 500
    assert all(g.final.usage.cached_prompt_tokens >= 496 for g in first[1:3])
    again = [greedy(model_stub, p, MAX_TOKENS) for p in prompts]
    assert [g.token_ids for g in again] == expected
    for prompt, g in zip(prompts, again, strict=True):
        usage = g.final.usage
        assert usage.prompt_tokens == len(prompt)
        assert usage.completion_tokens == len(g.token_ids)
        # Everything but the last partial page (and at least one token) came from the cache.
        assert usage.cached_prompt_tokens == (len(prompt) - 1) // 16 * 16
    stats = wait_until_idle(cache_stub, SHARED_POOL_ID)
    assert stats.num_running_requests == 0 and stats.num_private_blocks == 0


def test_all_concurrently(model_stub, prompts, expected):
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda p: greedy(model_stub, p, MAX_TOKENS), prompts))
    assert [g.token_ids for g in results] == expected


def test_text_equals_decoded_tokens(model_stub, reference_model, prompts, expected):
    tokenizer = reference_model.tokenizer
    g = greedy(model_stub, prompts[3], MAX_TOKENS)
    assert g.text == tokenizer.decode(g.token_ids, skip_special_tokens=True)
    assert g.final.finish_reason in (1, 2)  # STOP or LENGTH


@pytest.fixture(scope="module")
def tiny_pool_service(cache_service) -> Iterator[model_pb2_grpc.ModelServiceStub]:
    """42 blocks: one long prompt (38 blocks) plus the three short ones cannot all grow at once."""
    yield from serve_model(cache_service.addr, "--num-blocks", "42", "--worker-id", "tiny-pool",
                           "--max-batch-tokens", "256")


def test_tiny_pool_preempts_and_evicts_yet_identical(tiny_pool_service, cache_stub, reference_model, prompts,
                                                     expected):
    # Short prompts first, so the long ones are admitted while the short ones still have to grow.
    order = [3, 4, 5, 0, 1, 2]
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = []
        for i in order:
            futures.append(pool.submit(greedy, tiny_pool_service, prompts[i], MAX_TOKENS))
            time.sleep(0.3 if i == 5 else 0.05)
        results = {i: f.result() for i, f in zip(order, futures, strict=True)}
    assert [results[i].token_ids for i in range(len(prompts))] == expected
    assert sum(g.final.usage.num_preemptions for g in results.values()) > 0
    # A new long prompt cannot fit next to the cached ones without evicting them.
    other = reference_model.tokenizer(LONG_DOCUMENT[len(LONG_DOCUMENT) // 2:]).input_ids
    assert greedy(tiny_pool_service, other, 4).token_ids == reference_greedy(reference_model, other, 4)
    stats = wait_until_idle(cache_stub, "tiny-pool")
    assert stats.num_released > 0
    assert stats.num_evicted_blocks > 0
    assert stats.num_running_requests == 0 and stats.num_private_blocks == 0
