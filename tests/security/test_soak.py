"""A bounded soak and SIGTERM under load, on real processes (the tiny model, its own cache
manager): 400 requests at concurrency 32 with mixed prompt and output lengths, shared and
unshared prefixes, 10% cancelled midway and 5% with deadlines too short. Afterwards nothing is
locked or queued, the accounting is whole, and both processes' resident memory is flat after
warm-up. Then SIGTERM each service while requests run: clean ends, exit code 0."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import psutil
import pytest

from protos import cache_pb2, cache_pb2_grpc, model_pb2, model_pb2_grpc
from tests.model_service.checks import assert_pool_whole, wait_until_idle
from tests.services import Running, start_cache, start_model
from tests.tiny_model import save_tiny_llama

NUM_REQUESTS = 400
CONCURRENCY = 32
POOL = "soak-pool"

# replica: the SIGTERM tests start model services in their own bodies (tests/conftest.py).
pytestmark = [pytest.mark.timeout(300), pytest.mark.replica]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("soak-tiny"))


@pytest.fixture(scope="module")
def soak_services(model_dir) -> Iterator[tuple[Running, Running]]:
    cache = start_cache()
    model = start_model(cache.addr, "--model", str(model_dir), "--worker-id", POOL, "--num-blocks", "512",
                        "--block-size", "8", "--num-threads", "1")
    try:
        yield cache, model
    finally:
        model.process.stop(10.0)
        cache.process.stop(5.0)


def one_request(stub, rng: random.Random, shared: list[list[int]], i: int) -> str:
    """Runs one request of the mix; returns how it ended."""
    if rng.random() < 0.5:
        prompt = rng.choice(shared) + [rng.randrange(3, 49152) for _ in range(rng.randint(1, 20))]
    else:
        prompt = [rng.randrange(3, 49152) for _ in range(rng.randint(1, 120))]
    request = model_pb2.GenerateRequest(request_id=f"soak-{i}", sampling=model_pb2.SamplingParams(
        temperature=rng.choice([0.0, 0.8]), max_tokens=rng.randint(1, 48), ignore_eos=True, seed=i))
    request.token_ids.ids.extend(prompt)
    roll = rng.random()
    timeout = 0.01 if roll < 0.05 else 120.0
    stream = stub.Generate(request, timeout=timeout)
    try:
        for n, _message in enumerate(stream):
            if 0.05 <= roll < 0.15 and n >= 2:
                stream.cancel()
                return "cancelled"
        return "ok"
    except grpc.RpcError as error:
        if error.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED):
            return error.code().name.lower()
        raise


def rss_mb(running: Running) -> float:
    return psutil.Process(running.process.pid).memory_info().rss / 2**20


def test_soak_leaves_nothing_behind_and_memory_flat(soak_services) -> None:
    cache, model = soak_services
    rng = random.Random(400)
    shared = [[rng.randrange(3, 49152) for _ in range(rng.choice((32, 64, 96)))] for _ in range(6)]
    rss: list[tuple[float, float]] = []
    outcomes: dict[str, int] = {}
    lock = threading.Lock()
    with grpc.insecure_channel(model.addr) as channel, ThreadPoolExecutor(CONCURRENCY) as pool:
        stub = model_pb2_grpc.ModelServiceStub(channel)
        seeds = [rng.getrandbits(32) for _ in range(NUM_REQUESTS)]
        quarter = NUM_REQUESTS // 4
        for q in range(4):
            futures = [pool.submit(one_request, stub, random.Random(seeds[i]), shared, i)
                       for i in range(q * quarter, (q + 1) * quarter)]
            for f in futures:
                outcome = f.result(timeout=240)
                with lock:
                    outcomes[outcome] = outcomes.get(outcome, 0) + 1
            rss.append((rss_mb(cache), rss_mb(model)))
    assert sum(outcomes.values()) == NUM_REQUESTS
    assert outcomes.get("ok", 0) > NUM_REQUESTS * 0.7 and outcomes.get("cancelled", 0) > 10, outcomes
    with grpc.insecure_channel(cache.addr) as channel:
        cache_stub = cache_pb2_grpc.CacheManagerStub(channel)
        stats = wait_until_idle(cache_stub, POOL, timeout_s=30)
        assert stats.num_locked_blocks == 0 and stats.num_running_requests == 0
        assert stats.num_free_blocks + stats.num_cached_blocks == stats.num_blocks
        assert_pool_whole(stats)
    with grpc.insecure_channel(model.addr) as channel:
        load = model_pb2_grpc.ModelServiceStub(channel).GetLoad(model_pb2.GetLoadRequest(), timeout=10)
        assert load.num_running_requests == 0 and load.num_waiting_requests == 0
    print(f"soak outcomes {outcomes}; RSS MiB per quarter (cache, model): {rss}")
    for side in (0, 1):  # growth between the second and the last quarter
        assert rss[3][side] <= rss[1][side] * 1.05 + 2, f"RSS grew: {[r[side] for r in rss]}"


def start_streams(stub, n: int, max_tokens: int) -> tuple[list[threading.Thread], list[dict]]:
    outs: list[dict] = [{} for _ in range(n)]

    def run(i: int) -> None:
        request = model_pb2.GenerateRequest(prompt=f"stream {i} " * 10, sampling=model_pb2.SamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        outs[i]["messages"] = 0
        try:
            for message in stub.Generate(request, timeout=60):
                outs[i]["messages"] += 1
                outs[i]["finish"] = message.finish_reason
            outs[i]["code"] = grpc.StatusCode.OK
        except grpc.RpcError as error:
            outs[i]["code"] = error.code()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    return threads, outs


def test_sigterm_under_load_on_the_model_service(model_dir) -> None:
    cache = start_cache()
    model = start_model(cache.addr, "--model", str(model_dir), "--worker-id", "sigterm-load", "--num-threads", "1",
                        "--grace-seconds", "3")
    try:
        with grpc.insecure_channel(model.addr) as channel:
            stub = model_pb2_grpc.ModelServiceStub(channel)
            threads, outs = start_streams(stub, 12, 900)  # within the tiny model's 1024-token context
            deadline = time.monotonic() + 30
            while sum(o.get("messages", 0) > 0 for o in outs) < 12:
                assert time.monotonic() < deadline, outs
                time.sleep(0.05)
            sent = time.monotonic()
            os.kill(model.process.pid, signal.SIGTERM)
            for t in threads:
                t.join(15)
            assert not any(t.is_alive() for t in threads), "a stream hangs after SIGTERM"
            for o in outs:  # each ended cleanly: aborted with its last message, or UNAVAILABLE
                assert o["code"] in (grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE), o
                if o["code"] == grpc.StatusCode.OK:
                    assert o["finish"] == model_pb2.FINISH_REASON_ABORT
            with pytest.raises(grpc.RpcError) as refused:  # new work is refused
                list(stub.Generate(model_pb2.GenerateRequest(prompt="late"), timeout=5))
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert model.process.proc.wait(15) == 0
        assert time.monotonic() - sent < 3 + 5
    finally:
        model.process.stop(10.0)
        cache.process.stop(5.0)


def test_sigterm_under_load_on_the_cache_manager(model_dir) -> None:
    cache = start_cache(["--grace-seconds", "3"])
    model = start_model(cache.addr, "--model", str(model_dir), "--worker-id", "cache-sigterm", "--num-threads", "1")
    try:
        with grpc.insecure_channel(model.addr) as channel:
            stub = model_pb2_grpc.ModelServiceStub(channel)
            threads, outs = start_streams(stub, 8, 200)
            time.sleep(0.5)
            os.kill(cache.process.pid, signal.SIGTERM)
            assert cache.process.proc.wait(10) == 0
            with grpc.insecure_channel(cache.addr) as cache_channel:  # new work is refused
                with pytest.raises(grpc.RpcError) as refused:
                    cache_pb2_grpc.CacheManagerStub(cache_channel).Stats(cache_pb2.StatsRequest(), timeout=2)
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            # The replica does not crash: its clients wait (no error) until a cache manager is back.
            assert model.process.proc.poll() is None
            for o in outs:
                assert o.get("code") in (None, grpc.StatusCode.OK), o
            for t in threads:
                t.join(0.1)
    finally:
        model.process.stop(10.0)
        cache.process.stop(5.0)
