"""The router's Routes over a RouteStream (router/route_stream.py, CacheManagerClient) against a real
cache manager process: concurrent asks over one stream each get their own answer, the same as a
unary call's; a refused Route raises its own error and the stream goes on; an ask that times out
(the cache manager stopped) leaves the line in order for the next; the cache manager counts the
Routes per transport; a cache manager without RouteStream gets unary calls, every ask answered."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from protos import cache_pb2
from router.errors import UpstreamError
from router.upstream import CacheManagerClient
from tests.router.test_cache_shards import BS, cache_prompt, register
from tests.services import Running, start_cache, start_service

pytestmark = pytest.mark.timeout(60)

DOCS = [list(range(1000 * d, 1000 * d + 8 * BS)) for d in range(1, 5)]  # 8 pages each


@pytest.fixture(scope="module")
def cache() -> Iterator[Running]:
    """A cache manager (metrics on) with pool "a" holding d + 1 pages of DOCS[d]."""
    running = start_cache(["--metrics-port", "0"])
    stub, channel, pool_id, epoch = register(running.addr, "a")
    register(running.addr, "b")[1].close()
    for d, doc in enumerate(DOCS):
        cache_prompt(stub, pool_id, epoch, doc[: (d + 1) * BS + 1], f"r{d}")
    channel.close()
    yield running
    running.process.stop(5.0)


def ask(d: int) -> cache_pb2.RouteRequest:
    return cache_pb2.RouteRequest(token_ids=DOCS[d], model_fingerprint="fp", dry_run=True)


def routes_counted(cache: Running) -> dict[str, float]:
    url = next(m.group(1) for line in cache.log if (m := re.search(r"metrics on (http://\S+/metrics)", line)))
    with urllib.request.urlopen(url, timeout=5) as reply:
        text = reply.read().decode()
    return {s.labels["transport"]: s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == "radixkv_cache_routes_total"}


def test_concurrent_asks_each_get_their_own_answer_as_a_unary_call_would(cache: Running) -> None:
    async def scenario():
        streamed, unary = CacheManagerClient(cache.addr), CacheManagerClient(cache.addr, route_stream=False)
        try:
            order = [d % 4 for d in range(24)]
            answers = await asyncio.gather(*(streamed.route(ask(d), 10.0) for d in order))
            expected = [await unary.route(ask(d), 10.0) for d in range(4)]
            assert [a.candidates[0].matched_tokens for a in answers] == [(d + 1) * BS for d in order]
            assert answers == [expected[d] for d in order]
            with pytest.raises(UpstreamError) as err:
                await streamed.route(cache_pb2.RouteRequest(token_ids=[1] * (64 * BS + 1), model_fingerprint="fp"),
                                     10.0)
            assert err.value.code == "INVALID_ARGUMENT"
            stream = streamed._stream
            assert (await streamed.route(ask(2), 10.0)) == expected[2] and streamed._stream is stream  # went on
        finally:
            await streamed.close()
            await unary.close()

    before = routes_counted(cache)
    asyncio.run(scenario())
    after = routes_counted(cache)
    assert after["stream"] - before.get("stream", 0) == 26 and after["unary"] - before.get("unary", 0) == 4


def test_an_ask_that_timed_out_leaves_the_line_in_order(cache: Running) -> None:
    async def scenario():
        client = CacheManagerClient(cache.addr)
        try:
            assert (await client.route(ask(0), 10.0)).candidates[0].matched_tokens == BS
            os.kill(cache.process.pid, signal.SIGSTOP)
            try:
                with pytest.raises(UpstreamError) as err:
                    await client.route(ask(1), 0.3)
                assert err.value.code == "DEADLINE_EXCEEDED"
            finally:
                os.kill(cache.process.pid, signal.SIGCONT)
            # ask(1)'s reply comes first now and is dropped: ask(3) gets its own.
            assert (await client.route(ask(3), 10.0)).candidates[0].matched_tokens == 4 * BS
        finally:
            await client.close()

    asyncio.run(scenario())


@pytest.fixture
def older_cache_manager() -> Iterator[str]:
    """A cache manager process without RouteStream (tests/older_cache_manager.py), with pools "a"
    (DOCS[0]'s first page cached) and "b"."""
    running = start_service("tests.older_cache_manager", ["--without", "RouteStream"], 30.0)
    stub, channel, pool_id, epoch = register(running.addr, "a")
    register(running.addr, "b")[1].close()
    cache_prompt(stub, pool_id, epoch, DOCS[0][: BS + 1], "r")
    channel.close()
    try:
        yield running.addr
    finally:
        running.process.stop(5.0)


def test_a_cache_manager_without_route_stream_gets_unary_routes(older_cache_manager: str) -> None:
    async def scenario():
        client = CacheManagerClient(older_cache_manager)
        try:
            first = await client.route(ask(0), 10.0)  # UNIMPLEMENTED on the stream, then a call
            assert first.candidates[0].worker_id == "a" and first.candidates[0].matched_tokens == BS
            # grpc's client now and then reports such a stream as INTERNAL (a write raced the
            # refusal): that ask goes as a call too, and a later one learns UNIMPLEMENTED.
            for _ in range(5):
                assert (await client.route(ask(0), 10.0)) == first
            assert not client.route_stream
        finally:
            await client.close()

    asyncio.run(scenario())
