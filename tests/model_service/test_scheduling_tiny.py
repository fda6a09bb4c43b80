"""Scheduler behaviour through the real services on a tiny random Llama (fast): chunked prefill,
odd block sizes, preemption under a tiny pool, namespaces. Greedy output must equal
transformers' generate() on the same weights in every case, with the cache pipeline on and off
(every test runs in both modes). Also exercises `--model PATH` with a local HF folder."""

from __future__ import annotations

import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from protos import model_pb2, model_pb2_grpc
from tests.model_service.checks import wait_until_idle
from tests.model_service.generation import generate, greedy, reference_greedy
from tests.services import serve_model

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, 49152) for _ in range(n)] for n in (3, 17, 40, 61, 9, 33)]


@pytest.fixture(scope="module")
def expected(tiny_reference, prompts) -> list[list[int]]:
    return [reference_greedy(tiny_reference, p, MAX_TOKENS) for p in prompts]


@pytest.fixture(scope="module", params=["on", "off"])
def pipeline(request) -> str:
    """--cache-pipeline of the services below."""
    return request.param


@pytest.fixture(scope="module")
def chunked_pool(pipeline) -> str:
    return f"tiny-chunked-{pipeline}"


@pytest.fixture(scope="module")
def small_pool(pipeline) -> str:
    return f"tiny-small-pool-{pipeline}"


def _serve(cache_addr: str, model_dir: Path, worker_id: str, *flags: str) -> Iterator[model_pb2_grpc.ModelServiceStub]:
    yield from serve_model(cache_addr, "--model", str(model_dir), "--worker-id", worker_id, *flags)


@pytest.fixture(scope="module")
def chunked_service(cache_service, tiny_dir, pipeline, chunked_pool) -> Iterator[model_pb2_grpc.ModelServiceStub]:
    """Token budget 8 per step: every prompt over 8 tokens is prefilled in chunks next to decodes."""
    yield from _serve(cache_service.addr, tiny_dir, chunked_pool, "--block-size", "4",
                      "--num-blocks", "512", "--max-batch-tokens", "8", "--cache-pipeline", pipeline)


@pytest.fixture(scope="module")
def small_pool_service(cache_service, tiny_dir, pipeline, small_pool) -> Iterator[model_pb2_grpc.ModelServiceStub]:
    """32 blocks of 4 tokens: each request fits alone, the six together need ~75 blocks."""
    yield from _serve(cache_service.addr, tiny_dir, small_pool, "--block-size", "4",
                      "--num-blocks", "32", "--cache-pipeline", pipeline)


def _concurrently(stub, prompts: list[list[int]], max_tokens: int = MAX_TOKENS):
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: greedy(stub, p, max_tokens), prompts))


def test_chunked_prefill_matches_generate(chunked_service, cache_stub, chunked_pool, prompts, expected):
    assert [g.token_ids for g in _concurrently(chunked_service, prompts)] == expected
    # Again: now the prefixes are cached (block-aligned, at least one token recomputed).
    again = _concurrently(chunked_service, prompts)
    assert [g.token_ids for g in again] == expected
    for prompt, g in zip(prompts, again, strict=True):
        assert g.final.usage.cached_prompt_tokens == (len(prompt) - 1) // 4 * 4
    stats = wait_until_idle(cache_stub, chunked_pool)
    assert stats.num_running_requests == 0


def test_small_pool_preempts_and_still_matches(small_pool_service, cache_stub, small_pool, tiny_reference, prompts):
    long_outputs = 60
    expected = [reference_greedy(tiny_reference, p, long_outputs) for p in prompts]
    results = _concurrently(small_pool_service, prompts, long_outputs)
    assert [g.token_ids for g in results] == expected
    assert sum(g.final.usage.num_preemptions for g in results) > 0
    stats = wait_until_idle(cache_stub, small_pool)
    assert stats.num_released > 0
    assert stats.num_running_requests == 0 and stats.num_private_blocks == 0


def test_namespaces_do_not_share_prefixes(chunked_service, prompts):
    prompt = prompts[3]
    runs = [generate(chunked_service, prompt, namespace=ns, temperature=0.0, max_tokens=2)
            for ns in ("tenant-a", "tenant-b", "tenant-a")]
    assert [g.final.usage.cached_prompt_tokens for g in runs] == [0, 0, (len(prompt) - 1) // 4 * 4]
    assert runs[0].token_ids == runs[1].token_ids == runs[2].token_ids


def test_running_requests_share_their_computed_prompt(chunked_service, cache_stub, chunked_pool, tiny_reference):
    """A request's prompt pages are cached as soon as they are computed (not when it finishes):
    requests arriving while it still decodes hit them, and every output still matches."""
    rng = random.Random(11)
    prefix = [rng.randrange(3, 49152) for _ in range(50)]
    first = prefix + [rng.randrange(3, 49152) for _ in range(3)]
    later = [prefix + [rng.randrange(3, 49152) for _ in range(n)] for n in (2, 7)]
    long_run = 40
    request = model_pb2.GenerateRequest(sampling=model_pb2.SamplingParams(temperature=0.0, max_tokens=long_run,
                                                                           ignore_eos=True))
    request.token_ids.ids.extend(first)
    stream = chunked_service.Generate(request, timeout=300.0)
    head = next(stream)  # the first token: the whole prompt is computed (and committed)
    results = _concurrently(chunked_service, later)
    rest = list(stream)
    assert rest and rest[-1].HasField("usage")  # `first` was still running while the others ran
    first_tokens = [t for m in [head, *rest] for t in m.token_ids]
    assert first_tokens == reference_greedy(tiny_reference, first, long_run, ignore_eos=True)
    assert [g.token_ids for g in results] == [reference_greedy(tiny_reference, p, MAX_TOKENS) for p in later]
    assert [g.final.usage.cached_prompt_tokens for g in results] == [len(prefix) // 4 * 4] * 2
    stats = wait_until_idle(cache_stub, chunked_pool)
    assert stats.num_running_requests == 0 and stats.num_private_blocks == 0



def test_no_hit_across_tenants_after_a_preemption(small_pool_service, prompts):
    """Tenant A's requests are preempted in a small pool (their computed pages go to A's tree on
    release); tenant B sending one of A's prompts still gets nothing from the cache, A does."""
    with ThreadPoolExecutor(len(prompts)) as pool:
        runs = list(pool.map(lambda p: generate(small_pool_service, p, namespace="tenant-a-pre", temperature=0.0,
                                                max_tokens=60, ignore_eos=True), prompts))
    assert sum(g.final.usage.num_preemptions for g in runs) > 0
    prompt = prompts[3]
    generate(small_pool_service, prompt, namespace="tenant-a-pre", temperature=0.0, max_tokens=2)  # (re)cache it
    own = generate(small_pool_service, prompt, namespace="tenant-a-pre", temperature=0.0, max_tokens=2)
    assert own.final.usage.cached_prompt_tokens > 0  # A's pages are cached (and now the most recent)
    other = generate(small_pool_service, prompt, namespace="tenant-b-pre", temperature=0.0, max_tokens=2)
    assert other.final.usage.cached_prompt_tokens == 0
