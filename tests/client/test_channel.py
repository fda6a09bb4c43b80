"""Client behaviour on the wire, against the real services: gRPC retries from the channel's
service config, deadlines, bearer metadata, wait-for-ready, request building.

Faults are injected at the network by ``testing/fault_proxy.py`` (a TCP proxy in front of a real
server that cuts, resets or stalls connections and counts the call attempts it sees), never by
faking our services.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import pytest

from client import AsyncRadixKVClient, RadixKVClient, RadixKVError, RetryPolicy
from client.channel import service_config
from client.messages import generate_request, tokenize_request
from protos import model_pb2
from testing.fault_proxy import FaultProxy
from tests.client.helpers import PROMPT, free_port
from tests.services import Running, start_service

# A call that cannot reach its server gives up within this (its retries back off ~1.5 s in all).
FAIL_FAST_S = 6.0
LONG = {"max_tokens": 100, "ignore_eos": True, "temperature": 0.0}  # far longer than any test waits


@pytest.fixture
def proxy() -> Iterator[Callable[[str], FaultProxy]]:
    """Starts fault proxies in front of real servers; closes them after the test."""
    proxies: list[FaultProxy] = []

    def start(target: str) -> FaultProxy:
        proxies.append(FaultProxy(target))
        return proxies[-1]

    yield start
    for fault_proxy in proxies:
        fault_proxy.close()


@pytest.fixture
def direct(model_service: Running, cache_service: Running) -> Iterator[RadixKVClient]:
    """A client straight to the real services (no proxy), for expected results."""
    with RadixKVClient(model_service.addr, cache_addr=cache_service.addr, timeout=60) as client:
        yield client


def test_service_config_retries_unavailable_for_every_client_method():
    config = json.loads(service_config(RetryPolicy(), wait_for_ready=False))
    (method,) = config["methodConfig"]
    names = {(n["service"], n["method"]) for n in method["name"]}
    for name in ("Generate", "Tokenize", "Detokenize", "ModelInfo"):
        assert ("radixkv.v1.ModelService", name) in names
    assert ("radixkv.v1.CacheManager", "Stats") in names
    assert method["retryPolicy"]["retryableStatusCodes"] == ["UNAVAILABLE"]
    assert method["retryPolicy"]["maxAttempts"] == 5
    assert method["waitForReady"] is False
    assert "retryPolicy" not in json.loads(service_config(None, True))["methodConfig"][0]


def test_unary_calls_are_retried_when_their_connection_drops(model_service, cache_service, proxy, direct):
    model, cache = proxy(model_service.addr), proxy(cache_service.addr)
    with RadixKVClient(model.addr, cache_addr=cache.addr, timeout=30) as client:
        model.cut_next_requests(2)
        assert client.tokenize(PROMPT) == direct.tokenize(PROMPT)
        model.cut_next_requests(1)
        info = client.model_info()
        assert info == direct.model_info()
        cache.cut_next_requests(1)
        (pool,) = client.stats(info.pool_id)
        assert pool.pool_id == info.pool_id and pool.num_blocks == info.num_blocks
    assert model.methods() == ["Tokenize"] * 3 + ["ModelInfo"] * 2
    assert [r.cut for r in model.requests] == [True, True, False, True, False]
    assert model.connections == 4  # each retry after a cut came on a fresh connection
    assert cache.methods() == ["Stats", "Stats"]
    assert [r.cut for r in cache.requests] == [True, False]


def test_retries_are_bounded_and_can_be_turned_off(model_service, proxy):
    without_retries = proxy(model_service.addr)
    with RadixKVClient(without_retries.addr, retry=None, timeout=30) as client:
        without_retries.cut_next_requests(1)
        with pytest.raises(RadixKVError) as raised:
            client.model_info()
        assert raised.value.code == grpc.StatusCode.UNAVAILABLE and raised.value.method == "ModelInfo"
    assert without_retries.methods() == ["ModelInfo"] and without_retries.requests[0].cut

    three_tries = proxy(model_service.addr)
    with RadixKVClient(three_tries.addr, retry=RetryPolicy(max_attempts=3, initial_backoff_s=0.2)) as client:
        three_tries.cut_next_requests(10)
        with pytest.raises(RadixKVError) as raised:
            client.tokenize(PROMPT, timeout=30)
        assert raised.value.code == grpc.StatusCode.UNAVAILABLE
    # Three attempts, then it gives up. (gRPC may start a retry on the connection that just
    # died, before it noticed; such an attempt fails without reaching the proxy, so 2 is
    # possible, rarely. The default policy's 5 attempts would show up as 4 or 5.)
    assert three_tries.methods() in (["Tokenize"] * 3, ["Tokenize"] * 2)


def test_generate_is_retried_before_its_first_message(model_service, proxy, direct):
    fault_proxy = proxy(model_service.addr)
    expected = direct.generate(PROMPT, max_tokens=4, temperature=0)
    with RadixKVClient(fault_proxy.addr, timeout=60) as client:
        fault_proxy.cut_next_requests(2)
        result = client.generate(PROMPT, max_tokens=4, temperature=0)
    assert result.token_ids == expected.token_ids and result.text == expected.text
    assert result.usage.completion_tokens == len(expected.token_ids)
    assert fault_proxy.methods() == ["Generate"] * 3
    assert [r.cut for r in fault_proxy.requests] == [True, True, False]


def test_generate_is_not_retried_after_its_first_message(model_service, proxy, direct):
    fault_proxy = proxy(model_service.addr)
    chunks = []
    with RadixKVClient(fault_proxy.addr, timeout=60) as client, pytest.raises(RadixKVError) as raised:
        for chunk in client.stream(PROMPT, **LONG):
            chunks.append(chunk)
            if len(chunks) == 1:
                assert fault_proxy.reset_connections() == 1  # the server's answer is cut mid-stream
    assert raised.value.code == grpc.StatusCode.UNAVAILABLE and raised.value.method == "Generate"
    assert fault_proxy.methods() == ["Generate"]  # committed at the first message: no replay
    tokens = [t for chunk in chunks for t in chunk.token_ids]
    assert 1 <= len(tokens) < LONG["max_tokens"]
    assert all(chunk.finish_reason is None for chunk in chunks)
    # What was yielded is the start of the completion, each token once.
    assert tokens == direct.generate(PROMPT, max_tokens=len(tokens), temperature=0).token_ids


def test_other_errors_are_not_retried(model_service, proxy, direct):
    fault_proxy = proxy(model_service.addr)
    info = direct.model_info()
    pool_tokens = info.num_blocks * info.block_size
    assert pool_tokens + 64 < info.max_context_tokens  # so max_tokens=pool_tokens overflows the pool only
    with RadixKVClient(fault_proxy.addr, timeout=30) as client:
        with pytest.raises(RadixKVError) as raised:
            client.generate(PROMPT, max_tokens=0)
        assert raised.value.code_name == "INVALID_ARGUMENT"
        assert "max_tokens must be > 0" in raised.value.message
        with pytest.raises(RadixKVError) as raised:
            client.tokenize("")
        assert raised.value.code_name == "INVALID_ARGUMENT" and "prompt is empty" in raised.value.message
        with pytest.raises(RadixKVError) as raised:
            client.generate(PROMPT, max_tokens=pool_tokens)
        assert raised.value.code_name == "RESOURCE_EXHAUSTED"
    assert fault_proxy.methods() == ["Generate", "Tokenize", "Generate"]  # one attempt each


def test_bearer_token_reaches_the_server_on_every_call(model_service, cache_service, proxy):
    model, cache = proxy(model_service.addr), proxy(cache_service.addr)
    with RadixKVClient(model.addr, cache_addr=cache.addr, token="s3cret", timeout=60) as client:
        assert client.tokenize(PROMPT).token_ids
        assert client.model_info().num_blocks > 0
        assert client.generate(PROMPT, max_tokens=1, temperature=0).usage.completion_tokens == 1
        assert client.stats()
        assert client.tokenize(PROMPT).token_ids  # the same headers again: HPACK may index them
    requests = model.requests + cache.requests
    assert [r.method for r in requests] == ["Tokenize", "ModelInfo", "Generate", "Tokenize", "Stats"]
    assert [r.header("authorization") for r in requests] == ["Bearer s3cret"] * 5
    with RadixKVClient(model.addr, timeout=30) as client:  # no token: no authorization header
        client.model_info()
    assert model.requests[-1].method == "ModelInfo" and model.requests[-1].header("authorization") is None


def test_timeout_raises_deadline_exceeded(model_service, proxy):
    fault_proxy = proxy(model_service.addr)
    with RadixKVClient(fault_proxy.addr) as client:
        assert client.tokenize(PROMPT, timeout=30).token_ids  # connected
        fault_proxy.pause()
        start = time.monotonic()
        with pytest.raises(RadixKVError) as raised:
            client.tokenize(PROMPT, timeout=0.3)
        assert 0.25 <= time.monotonic() - start < FAIL_FAST_S
        assert raised.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "Tokenize did not finish within the 0.3 s timeout" in str(raised.value)
        fault_proxy.resume()
        # The timeout bounds the whole stream, not the wait for its first message.
        chunks = []
        start = time.monotonic()
        with pytest.raises(RadixKVError) as raised:
            for chunk in client.stream(PROMPT, timeout=2.0, **LONG):
                chunks.append(chunk)
                fault_proxy.pause()
        assert 1.95 <= time.monotonic() - start < 2.0 + FAIL_FAST_S
        assert raised.value.code_name == "DEADLINE_EXCEEDED" and len(chunks) >= 1
        assert "Generate did not finish within the 2 s timeout" in str(raised.value)


def test_client_default_timeout_applies_to_every_call(model_service, cache_service, proxy):
    model, cache = proxy(model_service.addr), proxy(cache_service.addr)
    model.pause()
    cache.pause()
    with RadixKVClient(model.addr, cache_addr=cache.addr, timeout=0.3) as client:
        calls = {
            "ModelInfo": client.model_info,
            "Tokenize": lambda: client.tokenize(PROMPT),
            "Generate": lambda: client.generate(PROMPT, max_tokens=1),
            "Stats": client.stats,
        }
        for name, call in calls.items():
            start = time.monotonic()
            with pytest.raises(RadixKVError) as raised:
                call()
            assert 0.25 <= time.monotonic() - start < FAIL_FAST_S, name
            assert raised.value.code_name == "DEADLINE_EXCEEDED", name
            assert f"{name} did not finish within the 0.3 s timeout" in str(raised.value)
        # A per-call timeout replaces the default: this call outlives 0.3 s and succeeds.
        result: dict[str, object] = {}
        thread = threading.Thread(target=lambda: result.update(tokens=client.tokenize(PROMPT, timeout=30)))
        start = time.monotonic()
        thread.start()
        time.sleep(0.8)
        model.resume()
        thread.join(30)
        assert not thread.is_alive() and time.monotonic() - start >= 0.8
        assert result["tokens"].token_ids


def test_unreachable_server_fails_fast_with_unavailable():
    addr = f"127.0.0.1:{free_port()}"  # nobody listens there
    start = time.monotonic()
    with RadixKVClient(addr, timeout=30) as client, pytest.raises(RadixKVError) as raised:
        client.generate("hi")
    assert raised.value.code == grpc.StatusCode.UNAVAILABLE
    assert time.monotonic() - start < FAIL_FAST_S  # gives up long before its 30 s deadline


def test_wait_for_ready_waits_for_a_server_that_starts_later():
    addr = f"127.0.0.1:{free_port()}"
    results: dict[str, object] = {}

    def sync_stats() -> None:
        try:
            with RadixKVClient(addr, cache_addr=addr, wait_for_ready=True) as client:
                results["sync"] = client.stats(timeout=60)
        except Exception as error:  # reported by the assertion below
            results["sync"] = error

    async def async_stats() -> None:
        try:
            async with AsyncRadixKVClient(addr, cache_addr=addr, wait_for_ready=True) as client:
                results["async"] = await client.stats(timeout=60)
        except Exception as error:
            results["async"] = error

    waiting = [
        threading.Thread(target=sync_stats),
        threading.Thread(target=lambda: asyncio.run(async_stats())),
    ]
    for thread in waiting:
        thread.start()
    try:
        # Meanwhile a call without wait_for_ready gives up (retries included) ...
        with RadixKVClient(addr, cache_addr=addr) as client, pytest.raises(RadixKVError) as raised:
            client.stats(timeout=60)
        assert raised.value.code == grpc.StatusCode.UNAVAILABLE
        # ... while the waiting ones, started before it, still wait.
        assert all(thread.is_alive() for thread in waiting) and not results
        server = start_service("cache_service", ["--host", "127.0.0.1", "--port", addr.rsplit(":")[1]], 60)
        try:
            for thread in waiting:
                thread.join(30)
        finally:
            server.process.stop(5.0)
    finally:
        for thread in waiting:
            thread.join(60)
    assert results == {"sync": [], "async": []}  # a fresh cache service has no pools yet


def test_async_client_retries_only_before_the_first_message(model_service, cache_service, proxy, direct):
    model, cache = proxy(model_service.addr), proxy(cache_service.addr)
    expected = direct.generate(PROMPT, max_tokens=4, temperature=0)
    tokens = direct.tokenize(PROMPT)

    async def run() -> list[int]:
        async with AsyncRadixKVClient(model.addr, cache_addr=cache.addr, timeout=60) as client:
            model.cut_next_requests(2)
            assert await client.tokenize(PROMPT) == tokens
            model.cut_next_requests(1)
            info = await client.model_info()
            cache.cut_next_requests(1)
            assert info.pool_id in {p.pool_id for p in await client.stats()}
            model.cut_next_requests(1)
            chunks = [c async for c in client.stream(PROMPT, max_tokens=4, temperature=0)]
            assert [t for c in chunks for t in c.token_ids] == expected.token_ids
            assert chunks[-1].finish_reason == expected.finish_reason
            cut_short = []
            with pytest.raises(RadixKVError) as raised:
                async for chunk in client.stream(PROMPT, **LONG):
                    cut_short.append(chunk)
                    if len(cut_short) == 1:
                        assert model.reset_connections() == 1
            assert raised.value.code == grpc.StatusCode.UNAVAILABLE
            return [t for c in cut_short for t in c.token_ids]

    yielded = asyncio.run(asyncio.wait_for(run(), 60))
    assert model.methods() == ["Tokenize"] * 3 + ["ModelInfo"] * 2 + ["Generate"] * 3
    assert [r.cut for r in model.requests] == [True, True, False, True, False, True, False, False]
    assert cache.methods() == ["Stats", "Stats"]
    assert 1 <= len(yielded) < LONG["max_tokens"]
    assert yielded == direct.generate(PROMPT, max_tokens=len(yielded), temperature=0).token_ids


def test_async_client_errors_deadlines_and_token(model_service, proxy):
    fault_proxy = proxy(model_service.addr)

    async def run() -> None:
        async with AsyncRadixKVClient(fault_proxy.addr, token="t0k", timeout=0.3) as client:
            with pytest.raises(RadixKVError) as raised:
                await client.generate(PROMPT, max_tokens=0, timeout=30)
            assert raised.value.code_name == "INVALID_ARGUMENT"
            assert (await client.model_info(timeout=30)).num_blocks > 0
            fault_proxy.pause()  # stays paused: what the client sends from now on is never read
            calls = {
                "ModelInfo": client.model_info,
                "Generate": lambda: client.generate(PROMPT, max_tokens=1),
            }
            for name, call in calls.items():
                start = time.monotonic()
                with pytest.raises(RadixKVError) as raised:
                    await call()
                assert 0.25 <= time.monotonic() - start < FAIL_FAST_S, name
                assert raised.value.code_name == "DEADLINE_EXCEEDED", name
                assert f"{name} did not finish within the 0.3 s timeout" in raised.value.message

    asyncio.run(asyncio.wait_for(run(), 60))
    requests = fault_proxy.requests
    assert [r.method for r in requests] == ["Generate", "ModelInfo"]
    assert [r.header("authorization") for r in requests] == ["Bearer t0k"] * 2


def test_generate_request_building():
    request = generate_request(
        "hi", {"max_tokens": 8, "temperature": 0.0, "stop": ["\n"], "seed": 7, "top_k": None}
    )
    assert request.prompt == "hi"
    assert request.sampling.HasField("temperature") and request.sampling.temperature == 0.0
    assert request.sampling.max_tokens == 8 and request.sampling.seed == 7
    assert not request.sampling.HasField("top_p")
    assert list(request.sampling.stop) == ["\n"]
    chat = generate_request(None, {"messages": [{"role": "user", "content": "Hi"}]})
    assert chat.WhichOneof("input") == "chat" and chat.chat.messages[0].role == "user"
    ids = generate_request(None, {"token_ids": [1, 2, 3]})
    assert list(ids.token_ids.ids) == [1, 2, 3]
    with pytest.raises(ValueError):
        generate_request("hi", {"token_ids": [1]})
    with pytest.raises(ValueError):
        generate_request(None, {})
    assert tokenize_request("x", None) == model_pb2.TokenizeRequest(text="x")
    with pytest.raises(ValueError):
        tokenize_request(None, None)
