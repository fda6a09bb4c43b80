"""Both services' Prometheus /metrics, scraped while traffic flows: the numbers move as they
should (tiny model; its own cache manager and a deliberately small pool)."""

from __future__ import annotations

import random
import re
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from protos import model_pb2_grpc
from testing.fault_proxy import FaultProxy
from tests.model_service.generation import greedy
from tests.services import Running, start_cache, start_model

METRICS_LINE = re.compile(r"metrics on (http://\S+/metrics)")
POOL = "metrics-pool"


def metrics_url(service: Running) -> str:
    for line in service.log:
        match = METRICS_LINE.search(line)
        if match:
            return match.group(1)
    raise AssertionError(f"no metrics line in the output:\n{service.output()}")


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample: (name, sorted labels) -> value."""
    with urllib.request.urlopen(url, timeout=5) as reply:
        text = reply.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


@dataclass
class Services:
    cache: Running
    model: Running
    stub: model_pb2_grpc.ModelServiceStub

    def cache_metrics(self):
        return scrape(metrics_url(self.cache))

    def model_metrics(self):
        return scrape(metrics_url(self.model))


@pytest.fixture(scope="module")
def services(tiny_dir) -> Iterator[Services]:
    cache = start_cache(["--metrics-port", "0"])
    # 32 blocks of 4 tokens: one request fits, six long ones together do not (preemption).
    model = start_model(cache.addr, "--model", str(tiny_dir), "--worker-id", POOL, "--metrics-port", "0",
                        "--block-size", "4", "--num-blocks", "32")
    try:
        with grpc.insecure_channel(model.addr) as channel:
            yield Services(cache, model, model_pb2_grpc.ModelServiceStub(channel))
    finally:
        model.process.stop(10.0)
        cache.process.stop(5.0)


def wait_idle(services: Services, timeout: float = 30.0):
    """Until the pool has no locked or private block (the last finish may be one step behind)."""
    deadline = time.monotonic() + timeout
    while True:
        cache = services.cache_metrics()
        if (value(cache, "radixkv_cache_blocks", pool=POOL, state="locked") == 0
                and value(cache, "radixkv_cache_blocks", pool=POOL, state="private") == 0):
            return cache
        assert time.monotonic() < deadline, "blocks stayed locked after every request ended"
        time.sleep(0.1)


def test_hit_tokens_grow_on_a_repeated_prefix_and_locks_return_to_zero(services: Services) -> None:
    rng = random.Random(3)
    prefix = [rng.randrange(3, 49152) for _ in range(40)]
    before_model, before_cache = services.model_metrics(), services.cache_metrics()
    greedy(services.stub, prefix + [5], 4)
    greedy(services.stub, prefix + [6], 4)
    after_model, after_cache = services.model_metrics(), wait_idle(services)
    hits = (value(after_model, "radixkv_model_prefix_cache_hit_tokens_total")
            - value(before_model, "radixkv_model_prefix_cache_hit_tokens_total"))
    assert hits == 40  # the second request's 10 cached pages
    cache_hits = (value(after_cache, "radixkv_cache_hit_tokens_total", pool=POOL)
                  - value(before_cache, "radixkv_cache_hit_tokens_total", pool=POOL))
    assert cache_hits == hits  # both services count first admissions the same way
    prompt_tokens = (value(after_model, "radixkv_model_prompt_tokens_total")
                     - value(before_model, "radixkv_model_prompt_tokens_total"))
    queried = (value(after_cache, "radixkv_cache_queried_tokens_total", pool=POOL)
               - value(before_cache, "radixkv_cache_queried_tokens_total", pool=POOL))
    assert prompt_tokens == queried == 82
    assert value(after_cache, "radixkv_cache_blocks", pool=POOL, state="cached") > 0
    # The replica's Steps went over its StepStream (--cache-steps stream, the default), none as calls.
    assert (value(after_cache, "radixkv_cache_steps_total", transport="stream")
            > value(before_cache, "radixkv_cache_steps_total", transport="stream"))
    assert value(after_cache, "radixkv_cache_steps_total", transport="unary") == 0


def test_preemptions_are_counted_under_a_small_pool(services: Services) -> None:
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in (30, 35, 40, 45, 50, 55)]
    before = services.model_metrics()
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda p: greedy(services.stub, p, 40), prompts))
    after = services.model_metrics()
    preempted = sum(g.final.usage.num_preemptions for g in results)
    assert preempted > 0
    assert (value(after, "radixkv_model_preemptions_total") - value(before, "radixkv_model_preemptions_total")
            == preempted)
    cache = wait_idle(services)
    assert value(cache, "radixkv_cache_requests_released_total", pool=POOL) >= preempted
    assert value(cache, "radixkv_cache_running_requests", pool=POOL) == 0


def test_ttft_histogram_counts_every_request(services: Services) -> None:
    before = services.model_metrics()
    n = 5
    for i in range(n):
        greedy(services.stub, [100 + i, 200 + i, 300 + i], 3)
    after = services.model_metrics()
    assert (value(after, "radixkv_model_time_to_first_token_seconds_count")
            - value(before, "radixkv_model_time_to_first_token_seconds_count")) == n
    finished = sum(value(after, "radixkv_model_requests_total", finish_reason=r)
                   - value(before, "radixkv_model_requests_total", finish_reason=r) for r in ("stop", "length"))
    assert finished == n
    assert (value(after, "radixkv_model_generated_tokens_total")
            - value(before, "radixkv_model_generated_tokens_total")) == 3 * n
    # One cache Step per scheduler step at most: RPCs never outnumber model steps (+ the finishes' step).
    rpcs = value(after, "radixkv_model_cache_rpc_seconds_count") - value(before, "radixkv_model_cache_rpc_seconds_count")
    steps = value(after, "radixkv_model_step_seconds_count") - value(before, "radixkv_model_step_seconds_count")
    assert 0 < rpcs <= steps + n


def test_cache_waits_are_counted_per_step(services: Services, tiny_dir) -> None:
    """Pipelined (the default): a request arriving at an idle engine waits for its admission
    once; its decodes (lookahead blocks asked for ahead) and its finish (nobody waits for it) at most
    once more. The cache link has 20 ms of one-way latency, many tiny-model steps: whether a Step
    is back when the engine looks must not depend on how fast this machine runs a step."""
    with FaultProxy(services.cache.addr, latency_s=0.02) as proxy:
        model = start_model(proxy.addr, "--model", str(tiny_dir), "--worker-id", "metrics-waits",
                            "--metrics-port", "0")
        try:
            with grpc.insecure_channel(model.addr) as channel:
                stub = model_pb2_grpc.ModelServiceStub(channel)
                before = scrape(metrics_url(model))
                n = 4
                for i in range(n):
                    greedy(stub, [110 + i, 210 + i, 310 + i], 6)
                after = scrape(metrics_url(model))
        finally:
            model.process.stop(10.0)

    def delta(name: str) -> float:
        return value(after, name) - value(before, name)

    steps = delta("radixkv_model_steps_total")
    assert steps == delta("radixkv_model_step_seconds_count") >= 6 * n
    waits = delta("radixkv_model_cache_waits_total")
    assert waits == delta("radixkv_cache_wait_seconds_count")
    # The first admission waits; each later one also waits for the previous finish's Step,
    # still in flight when the next request arrives. The synchronous path: 3n (admit, extend, finish).
    assert n <= waits <= 2 * n
    assert delta("radixkv_cache_wait_seconds_sum") > 0
