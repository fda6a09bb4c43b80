"""Failure modes through real processes: client cancel and deadline, cache manager killed and
restarted, cache manager not up yet, lease expiry of a stopped model service, SIGTERM of the
model service mid-stream. After each: the right status (or none, where the failure model says
the client must not notice), identical greedy output, and no leaked blocks."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import pytest

from protos import cache_pb2_grpc, model_pb2, model_pb2_grpc
from tests.model_service.checks import (
    count_lines,
    expect_status,
    free_port,
    pool_stats,
    port_of,
    start_cache_on,
    try_pool_stats,
    wait_for,
    wait_until_idle,
)
from tests.model_service.generation import LONG_DOCUMENT, generate, greedy, reference_greedy
from tests.services import SHARED_POOL_ID, Running, start_cache, start_model

pytestmark = pytest.mark.model

# Requests to the shared big-pool service cache their prefixes in a namespace of their own, so
# other modules' cold-cache expectations for the same document hold whatever runs first.
NAMESPACE = "failure-tests"


@dataclass
class Stream:
    """A Generate call read in a background thread, so the test can act while it is in flight."""

    call: grpc.Call
    messages: list[model_pb2.GenerateResponse] = field(default_factory=list)
    error: grpc.RpcError | None = None
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def token_ids(self) -> list[int]:
        return [t for m in self.messages for t in m.token_ids]

    def wait_tokens(self, n: int, timeout_s: float) -> None:
        wait_for(lambda: len(self.token_ids) >= n or self.done.is_set(), timeout_s, f"{n} streamed tokens")
        assert len(self.token_ids) >= n, f"stream ended early: {self.messages} {self.error}"

    def result(self, timeout_s: float) -> list[model_pb2.GenerateResponse]:
        assert self.done.wait(timeout_s), f"stream still open after {timeout_s} s"
        if self.error is not None:
            raise self.error
        return self.messages


def start_stream(stub: model_pb2_grpc.ModelServiceStub, token_ids: list[int], timeout_s: float = 120.0,
                 namespace: str = "", **sampling) -> Stream:
    request = model_pb2.GenerateRequest(token_ids=model_pb2.TokenIds(ids=token_ids), namespace=namespace,
                                        sampling=model_pb2.SamplingParams(**sampling))
    stream = Stream(stub.Generate(request, timeout=timeout_s))

    def read() -> None:
        try:
            for message in stream.call:
                stream.messages.append(message)
        except grpc.RpcError as error:
            stream.error = error
        finally:
            stream.done.set()

    threading.Thread(target=read, daemon=True).start()
    return stream


@pytest.fixture(scope="module")
def long_prompt(reference_model) -> list[int]:
    return reference_model.tokenizer(f"{LONG_DOCUMENT}\n\nIn summary,").input_ids


@pytest.fixture(scope="module")
def medium_prompt(reference_model) -> list[int]:
    """~100 tokens: quick to prefill and recompute."""
    return reference_model.tokenizer(LONG_DOCUMENT).input_ids[:100]


# ---------------------------------------------------------------- client cancel and deadline

def test_client_cancel_mid_stream_returns_the_blocks(model_stub, cache_stub, medium_prompt,
                                                     reference_model) -> None:
    before = wait_until_idle(cache_stub, SHARED_POOL_ID)
    stream = start_stream(model_stub, medium_prompt, namespace=NAMESPACE, temperature=0.0, max_tokens=200,
                          ignore_eos=True)
    stream.wait_tokens(2, 60)
    stream.call.cancel()
    assert stream.done.wait(10), "the stream did not end after cancel()"
    assert stream.error is not None and stream.error.code() == grpc.StatusCode.CANCELLED
    assert len(stream.token_ids) < 200
    after = wait_until_idle(cache_stub, SHARED_POOL_ID)
    assert after.num_finished == before.num_finished + 1
    # The cancelled request's computed pages went to the tree: the same prompt hits them now.
    g = generate(model_stub, medium_prompt, namespace=NAMESPACE, temperature=0.0, max_tokens=4)
    assert g.token_ids == reference_greedy(reference_model, medium_prompt, 4)
    assert g.final.usage.cached_prompt_tokens == (len(medium_prompt) - 1) // 16 * 16
    wait_until_idle(cache_stub, SHARED_POOL_ID)


@pytest.mark.parametrize("timeout_s", [0.05, 1.5], ids=["before-first-token", "mid-stream"])
def test_deadline_exceeded_leaks_nothing(model_stub, cache_stub, long_prompt, timeout_s: float) -> None:
    request = model_pb2.GenerateRequest(token_ids=model_pb2.TokenIds(ids=long_prompt), namespace=NAMESPACE,
                                        sampling=model_pb2.SamplingParams(max_tokens=500, ignore_eos=True))
    started = time.monotonic()
    expect_status(lambda: list(model_stub.Generate(request, timeout=timeout_s)), grpc.StatusCode.DEADLINE_EXCEEDED,
                  "deadline")
    assert time.monotonic() - started < timeout_s + 5
    wait_until_idle(cache_stub, SHARED_POOL_ID)
    assert len(generate(model_stub, prompt="Hi", max_tokens=3, ignore_eos=True, timeout=60).token_ids) == 3
    wait_until_idle(cache_stub, SHARED_POOL_ID)


# ---------------------------------------------------------------- cache manager down or restarted

@dataclass
class Pair:
    """A cache service and a model service of their own, with a channel to each. A cache
    restarted on the same port is reached through the same channel."""

    cache: Running
    model: Running
    worker_id: str
    channels: list[grpc.Channel] = field(default_factory=list)
    pipeline: str = "on"  # its --cache-pipeline

    def __post_init__(self) -> None:
        self.channels = [grpc.insecure_channel(self.cache.addr), grpc.insecure_channel(self.model.addr)]
        self.cache_stub = cache_pb2_grpc.CacheManagerStub(self.channels[0])
        self.model_stub = model_pb2_grpc.ModelServiceStub(self.channels[1])

    def stop(self) -> None:
        for channel in self.channels:
            channel.close()
        os.kill(self.model.process.pid, signal.SIGCONT)  # never leave it stopped
        self.model.process.stop(10.0)
        self.cache.process.stop(5.0)


@pytest.fixture(params=["on", "off"])
def pair(request) -> Iterator[Pair]:
    """The test may kill and replace the cache service. Param: --cache-pipeline."""
    cache = start_cache()
    p = Pair(cache, start_model(cache.addr, "--num-blocks", "128", "--worker-id", "restart-pool",
                                "--cache-pipeline", request.param), "restart-pool", pipeline=request.param)
    try:
        yield p
    finally:
        p.stop()


def test_cache_killed_and_restarted_mid_generation_is_invisible_to_the_client(pair: Pair, medium_prompt,
                                                                              reference_model) -> None:
    # 100 prompt tokens: the request needs a new block (a cache Step) at its 13th token; pipelined,
    # it asks for it (with 2 lookahead blocks) at its 13th token when it can grow past 133.
    max_tokens = 24 if pair.pipeline == "off" else 48
    expected = reference_greedy(reference_model, medium_prompt, max_tokens, ignore_eos=True)
    stub = pair.model_stub
    wait_until_idle(pair.cache_stub, pair.worker_id)  # registered
    stream = start_stream(stub, medium_prompt, temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    stream.wait_tokens(1, 120)
    port = port_of(pair.cache.addr)
    pair.cache.process.proc.kill()  # SIGKILL: no goodbye
    pair.cache.process.stop(5.0)
    time.sleep(0.5)  # the model service finds it gone meanwhile (or at its next Step)
    pair.cache = start_cache_on(port)
    messages = stream.result(120)  # no error for the client
    assert [t for m in messages for t in m.token_ids] == expected
    assert messages[-1].finish_reason == model_pb2.FINISH_REASON_LENGTH
    assert messages[-1].usage.num_preemptions >= 1, "the request was not recomputed: the cache loss went unnoticed"
    assert count_lines(pair.model, "cache pool lost") >= 1
    # The model service registered its pool at the new cache manager, and serves on.
    stats = wait_until_idle(pair.cache_stub, pair.worker_id)
    assert stats.num_blocks == 128 and stats.num_finished >= 1
    assert greedy(stub, medium_prompt[:40], 4).token_ids == reference_greedy(reference_model, medium_prompt[:40], 4)


def test_model_service_started_before_the_cache_waits_for_it(medium_prompt, reference_model) -> None:
    port = free_port()
    model = start_model(f"127.0.0.1:{port}", "--num-blocks", "64", "--worker-id", "early-pool")
    cache: Running | None = None
    try:
        with grpc.insecure_channel(model.addr) as channel, ThreadPoolExecutor(1) as pool:
            stub = model_pb2_grpc.ModelServiceStub(channel)
            info = stub.ModelInfo(model_pb2.ModelInfoRequest(), timeout=10)  # answers without a cache manager
            assert info.num_blocks == 64
            future: Future = pool.submit(greedy, stub, medium_prompt, 8)
            # A request whose deadline passes while it waits for the cache manager is dropped.
            expect_status(lambda: generate(stub, medium_prompt[:20], max_tokens=4, timeout=1.0),
                          grpc.StatusCode.DEADLINE_EXCEEDED)
            assert not future.done(), f"finished without a cache manager: {future}"
            cache = start_cache_on(port)
            result = future.result(timeout=90)  # no error: it waited for the cache manager
        assert result.token_ids == reference_greedy(reference_model, medium_prompt, 8)
        with grpc.insecure_channel(cache.addr) as channel:
            stats = wait_until_idle(cache_pb2_grpc.CacheManagerStub(channel), "early-pool")
        assert stats.num_blocks == 64
        assert stats.num_admitted == stats.num_finished == 1, "the expired request was admitted"
    finally:
        model.process.stop(10.0)
        if cache is not None:
            cache.process.stop(5.0)


# ---------------------------------------------------------------- leases

LEASE_S = 2.0  # longer than any single engine step here (short prompts), far shorter than a generation
LEASE_BLOCK_SIZE = 256  # a decode step needs a cache RPC only every 256 tokens
LONG_STEP_TOKENS = 3800  # a prompt prefilled in one step that outlasts the lease (~4 s on 2 cores)


@pytest.fixture(scope="module")
def short_lease() -> Iterator[Pair]:
    cache = start_cache(["--lease-seconds", str(LEASE_S)])
    model = start_model(cache.addr, "--num-blocks", "16", "--block-size", str(LEASE_BLOCK_SIZE),
                        "--max-batch-tokens", str(LONG_STEP_TOKENS), "--worker-id", "lease-pool")
    p = Pair(cache, model, "lease-pool")
    try:
        yield p
    finally:
        p.stop()


@pytest.fixture(scope="module")
def short_prompt(reference_model) -> list[int]:
    """40 tokens: each (re)prefill is one short step, well within the lease."""
    return reference_model.tokenizer(LONG_DOCUMENT).input_ids[:40]


def test_busy_model_service_keeps_its_lease(short_lease: Pair, short_prompt) -> None:
    """A generation that makes no cache RPC for longer than the lease (no new block, no finish)
    must not lose the pool: the model service renews its lease while it is busy too."""
    cache_stub = short_lease.cache_stub
    before = wait_until_idle(cache_stub, short_lease.worker_id)
    lost_before = count_lines(short_lease.model, "cache pool lost")
    stream = start_stream(short_lease.model_stub, short_prompt, temperature=0.0, max_tokens=200, ignore_eos=True)
    stream.wait_tokens(1, 60)
    time.sleep(LEASE_S + 1.0)
    assert not stream.done.is_set(), "the generation ended before outliving the lease: nothing was shown"
    stream.call.cancel()
    stats = wait_until_idle(cache_stub, short_lease.worker_id)
    assert count_lines(short_lease.model, "cache pool lost") == lost_before
    assert stats.epoch == before.epoch, "the pool was re-registered: its lease expired while the model was busy"
    assert stats.num_finished == before.num_finished + 1


def test_one_step_longer_than_the_lease_keeps_the_pool(short_lease: Pair, reference_model) -> None:
    """A 3800-token prompt is prefilled in one step that outlasts the 2 s lease; the lease is
    renewed from a background thread meanwhile, so the pool is neither lost nor recomputed."""
    prompt = reference_model.tokenizer((LONG_DOCUMENT + "\n\n") * 8).input_ids[:LONG_STEP_TOKENS]
    assert len(prompt) == LONG_STEP_TOKENS
    cache_stub = short_lease.cache_stub
    before = wait_until_idle(cache_stub, short_lease.worker_id)
    lost_before = count_lines(short_lease.model, "cache pool lost")
    stream = start_stream(short_lease.model_stub, prompt, timeout_s=120, temperature=0.0, max_tokens=2,
                          ignore_eos=True)
    messages = stream.result(120)
    usage = messages[-1].usage
    if usage.time_to_first_token < LEASE_S * 1.25:
        pytest.skip(f"this machine prefills {LONG_STEP_TOKENS} tokens in {usage.time_to_first_token:.1f} s, "
                    f"within the {LEASE_S} s lease: no step outlasts it")
    assert usage.num_preemptions == 0, "the request was recomputed: the pool was lost during the long step"
    assert count_lines(short_lease.model, "cache pool lost") == lost_before
    stats = wait_until_idle(cache_stub, short_lease.worker_id)
    assert stats.epoch == before.epoch and stats.num_finished == before.num_finished + 1


def test_lease_expiry_of_a_stopped_model_service_is_recovered(short_lease: Pair, short_prompt,
                                                              reference_model) -> None:
    max_tokens = 24
    expected = reference_greedy(reference_model, short_prompt, max_tokens)
    assert len(expected) == max_tokens  # no early end-of-sequence: the request is in flight throughout
    cache_stub = short_lease.cache_stub
    epoch = wait_until_idle(cache_stub, short_lease.worker_id).epoch
    rejected_before = count_lines(short_lease.model, "FAILED_PRECONDITION")
    stream = start_stream(short_lease.model_stub, short_prompt, temperature=0.0, max_tokens=max_tokens)
    stream.wait_tokens(1, 60)
    pid = short_lease.model.process.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        # The cache manager reclaims the pool (locks, private blocks and tree) once the lease runs out.
        wait_for(lambda: try_pool_stats(cache_stub, short_lease.worker_id) is None, LEASE_S + 5,
                 "the cache manager to retire the stopped model's pool")
        assert not stream.done.is_set()
    finally:
        os.kill(pid, signal.SIGCONT)
    messages = stream.result(120)
    assert [t for m in messages for t in m.token_ids] == expected
    assert messages[-1].usage.num_preemptions >= 1, "in-flight request not recomputed after losing its pool"
    assert count_lines(short_lease.model, "FAILED_PRECONDITION") > rejected_before
    stats = wait_until_idle(cache_stub, short_lease.worker_id)
    assert stats.epoch > epoch, "the model service did not re-register"
    assert stats.num_finished >= 1


# ---------------------------------------------------------------- model service shutdown

def test_sigterm_mid_stream_ends_the_stream_and_exits_zero(cache_service, cache_stub, medium_prompt) -> None:
    model = start_model(cache_service.addr, "--num-blocks", "64", "--worker-id", "sigterm-pool")
    try:
        with grpc.insecure_channel(model.addr) as channel:
            stream = start_stream(model_pb2_grpc.ModelServiceStub(channel), medium_prompt, timeout_s=60,
                                  temperature=0.0, max_tokens=900, ignore_eos=True)
            stream.wait_tokens(2, 60)
            sent = time.monotonic()
            os.kill(model.process.pid, signal.SIGTERM)
            assert stream.done.wait(15), "the stream hangs after SIGTERM"
        ended = time.monotonic() - sent
        if stream.error is not None:
            assert stream.error.code() == grpc.StatusCode.UNAVAILABLE, (stream.error.code(), stream.error.details())
            assert "shutting down" in stream.error.details(), stream.error.details()
        else:
            assert stream.messages[-1].finish_reason == model_pb2.FINISH_REASON_ABORT
        assert len(stream.token_ids) < 900
        assert model.process.proc.wait(15) == 0
        exited = time.monotonic() - sent
        assert exited < 10, f"exit took {exited:.1f} s (stream ended after {ended:.1f} s)"
        # The in-flight request's blocks went back before the process left (not at lease expiry).
        stats = pool_stats(cache_stub, "sigterm-pool")
        assert stats.num_running_requests == 0 and stats.num_private_blocks == 0, stats
    finally:
        model.process.stop(10.0)
