"""Tenant isolation through the real services and the bundled model: tenant B sending tenant A's
exact prompt gets no cached tokens and no timing signal (its time to first token is that of a
cold miss, while A's own repeat is clearly faster, so the measurement can tell), also while A's
request still runs with its prompt committed mid-flight."""

from __future__ import annotations

import random
import statistics
import time

from protos import model_pb2
from tests.model_service.generation import greedy

PROMPT_TOKENS = 520


def fresh_prompt(rng: random.Random) -> list[int]:
    return [rng.randrange(1000, 40000) for _ in range(PROMPT_TOKENS)]


def ttft(stub, prompt: list[int], namespace: str) -> tuple[float, int]:
    """Client-side time to the first streamed message, and the cached prompt tokens."""
    request = model_pb2.GenerateRequest(namespace=namespace, sampling=model_pb2.SamplingParams(
        temperature=0.0, max_tokens=2, ignore_eos=True))
    request.token_ids.ids.extend(prompt)
    start = time.perf_counter()
    first = None
    for message in stub.Generate(request, timeout=120):
        if first is None:
            first = time.perf_counter() - start
        last = message
    return first, last.usage.cached_prompt_tokens


def test_another_tenant_gets_no_hit_and_no_timing_signal(model_stub) -> None:
    rng = random.Random(1234)
    secret = fresh_prompt(rng)
    greedy(model_stub, secret, 1)  # tenant A's prompt, now cached in A's namespace (the default one)
    other, own, cold = [], [], []
    for i in range(4):  # interleaved, so drift of the machine's speed hits all three alike
        seconds, cached = ttft(model_stub, secret, f"tenant-b-{i}-{rng.random()}")
        assert cached == 0
        other.append(seconds)
        seconds, cached = ttft(model_stub, secret + [7, i], "")
        assert cached >= PROMPT_TOKENS - 16
        own.append(seconds)
        seconds, cached = ttft(model_stub, fresh_prompt(rng), f"tenant-c-{i}-{rng.random()}")
        assert cached == 0
        cold.append(seconds)
    assert statistics.median(own) < 0.5 * statistics.median(cold), (own, cold)  # a hit is visible
    assert statistics.median(other) > 0.7 * statistics.median(cold), (other, cold)  # B's is not one


def test_no_hit_across_tenants_while_the_owner_still_runs(model_stub) -> None:
    rng = random.Random(4321)
    secret = fresh_prompt(rng)
    request = model_pb2.GenerateRequest(namespace="tenant-a-live", sampling=model_pb2.SamplingParams(
        temperature=0.0, max_tokens=60, ignore_eos=True))
    request.token_ids.ids.extend(secret)
    stream = model_stub.Generate(request, timeout=120)
    next(stream)  # A's prompt is computed and committed: requests of A's namespace would hit it now
    seconds, cached = ttft(model_stub, secret, "tenant-b-live")
    assert cached == 0
    seconds_a, cached_a = ttft(model_stub, secret + [9], "tenant-a-live")
    assert cached_a >= PROMPT_TOKENS - 16  # the same prompt does hit inside A's namespace
    assert seconds_a < seconds
    stream.cancel()
