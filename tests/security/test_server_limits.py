"""Transport limits of the servers (common/limits.py), each just over the limit, on a cache
manager started with small ones; and what the servers log at INFO (no prompt text, no ids)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from common.limits import (
    DEFAULT_MAX_CONCURRENT_STREAMS,
    DEFAULT_MAX_RECEIVE_MESSAGE_BYTES,
    MIN_PING_INTERVAL_MS,
    ServerLimits,
    quote_id,
)
from protos import cache_pb2, cache_pb2_grpc, model_pb2, model_pb2_grpc
from tests.services import Running, start_cache

MAX_MESSAGE_BYTES = 64 * 1024
MAX_STREAMS = 2


@pytest.fixture(scope="module")
def small_cache() -> Iterator[Running]:
    running = start_cache(["--max-receive-message-mb", str(MAX_MESSAGE_BYTES / 2**20),
                           "--max-concurrent-streams", str(MAX_STREAMS)])
    try:
        yield running
    finally:
        running.process.stop(5.0)


def test_server_options_come_from_one_place() -> None:
    options = dict(ServerLimits().options())
    assert options["grpc.max_receive_message_length"] == DEFAULT_MAX_RECEIVE_MESSAGE_BYTES
    assert options["grpc.max_concurrent_streams"] == DEFAULT_MAX_CONCURRENT_STREAMS
    assert options["grpc.http2.min_ping_interval_without_data_ms"] == MIN_PING_INTERVAL_MS
    assert options["grpc.keepalive_permit_without_calls"] == 0
    assert options["grpc.so_reuseport"] == 0


def test_quote_id_shortens_with_an_ellipsis() -> None:
    assert quote_id("abc") == "'abc'"
    quoted = quote_id("x" * 100_000)
    assert len(quoted) < 120 and "..." in quoted and "100000 characters" in quoted


def test_a_message_just_over_the_receive_limit_is_resource_exhausted(small_cache: Running) -> None:
    with grpc.insecure_channel(small_cache.addr) as channel:
        stub = cache_pb2_grpc.CacheManagerStub(channel)
        under = cache_pb2.MatchRequest(token_ids=[1] * (MAX_MESSAGE_BYTES - 16))
        assert under.ByteSize() <= MAX_MESSAGE_BYTES
        stub.Match(under, timeout=10)  # no pools: an empty answer
        over = cache_pb2.MatchRequest(token_ids=[1] * (MAX_MESSAGE_BYTES + 1))
        assert over.ByteSize() > MAX_MESSAGE_BYTES
        with pytest.raises(grpc.RpcError) as info:
            stub.Match(over, timeout=10)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "larger than max" in info.value.details().lower()


def test_streams_beyond_the_per_connection_limit_wait(small_cache: Running) -> None:
    """HTTP/2 MAX_CONCURRENT_STREAMS: a call beyond it on the same connection is queued by the
    client (never served concurrently), here until its deadline; other connections are not held up."""
    with grpc.insecure_channel(small_cache.addr) as channel:
        stub = cache_pb2_grpc.CacheManagerStub(channel)
        watches = [stub.WatchEvents(cache_pb2.WatchEventsRequest()) for _ in range(MAX_STREAMS)]
        try:
            time.sleep(0.5)
            with pytest.raises(grpc.RpcError) as info:
                stub.Stats(cache_pb2.StatsRequest(), timeout=1.5)
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            with grpc.insecure_channel(small_cache.addr, options=[("grpc.use_local_subchannel_pool", 1)]) as other:
                cache_pb2_grpc.CacheManagerStub(other).Stats(cache_pb2.StatsRequest(), timeout=10)
        finally:
            for watch in watches:
                watch.cancel()
        stub.Stats(cache_pb2.StatsRequest(), timeout=10)  # the connection is fine afterwards


def test_a_client_pinging_too_often_is_sent_away(small_cache: Running) -> None:
    """Keepalive enforcement: pings every 50 ms on an idle stream (no data) are strikes; after
    MAX_PING_STRIKES the server ends the connection (GOAWAY too_many_pings)."""
    options = [("grpc.keepalive_time_ms", 50), ("grpc.keepalive_timeout_ms", 1000),
               ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0),
               ("grpc.use_local_subchannel_pool", 1)]
    with grpc.insecure_channel(small_cache.addr, options=options) as channel:
        watch = cache_pb2_grpc.CacheManagerStub(channel).WatchEvents(cache_pb2.WatchEventsRequest(), timeout=20)
        began = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            for _ in watch:
                pass
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value
        assert time.monotonic() - began < 15


def test_info_logs_hold_no_prompt_text_or_token_ids(cache_service: Running, model_service: Running) -> None:
    secret = "zebra quokka marmalade 73191"
    with grpc.insecure_channel(model_service.addr) as channel:
        stub = model_pb2_grpc.ModelServiceStub(channel)
        ids = list(stub.Tokenize(model_pb2.TokenizeRequest(text=secret), timeout=30).token_ids)
        request = model_pb2.GenerateRequest(prompt=secret, request_id="log-check",
                                            sampling=model_pb2.SamplingParams(max_tokens=2, temperature=0))
        for _ in stub.Generate(request, timeout=60):
            pass
        with pytest.raises(grpc.RpcError):  # a rejected request: its error is logged by nobody
            for _ in stub.Generate(model_pb2.GenerateRequest(prompt=secret, sampling=model_pb2.SamplingParams(
                    max_tokens=-1)), timeout=30):
                pass
    threading.Event().wait(0.5)
    id_text = ", ".join(map(str, ids))
    for running in (cache_service, model_service):
        output = running.output()
        assert "log-check" in output or running is cache_service  # the request id is logged
        assert "quokka" not in output
        assert id_text not in output
