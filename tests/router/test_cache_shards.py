"""The router's view of a sharded cache manager (router/cache_shards.py), against two real
cache-manager processes on loopback: Route asks both and merges by score, records only at the
winning shard, says when a shard dropped out; Stats lists every shard's pools."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from protos import cache_pb2, cache_pb2_grpc
from router.cache_shards import ShardedCache
from router.errors import UpstreamError
from router.upstream import CacheManagerClient
from tests.router.conftest import free_port
from tests.services import start_cache

pytestmark = pytest.mark.timeout(60)

BS = 4
PREFIX = list(range(100, 132))  # 8 pages


@pytest.fixture(scope="module")
def shards():
    running = [start_cache(), start_cache()]
    yield [r.addr for r in running]
    for r in running:
        r.process.stop(5.0)


def register(addr: str, worker: str) -> tuple[cache_pb2_grpc.CacheManagerStub, grpc.Channel, str, int]:
    channel = grpc.insecure_channel(addr)
    stub = cache_pb2_grpc.CacheManagerStub(channel)
    reply = stub.RegisterPool(cache_pb2.RegisterPoolRequest(worker_id=worker, num_blocks=64, block_size=BS,
                                                            model_fingerprint="fp", serving_addr=f"{worker}:1"),
                              timeout=10)
    return stub, channel, reply.pool_id, reply.epoch


def cache_prompt(stub, pool_id: str, epoch: int, tokens: list[int], rid: str) -> None:
    stub.Step(cache_pb2.StepRequest(pool_id=pool_id, epoch=epoch,
                                    admits=[cache_pb2.Admit(request_id=rid, token_ids=tokens)]), timeout=10)
    stub.Step(cache_pb2.StepRequest(pool_id=pool_id, epoch=epoch, finishes=[
        cache_pb2.Finish(request_id=rid, num_computed_tokens=len(tokens))]), timeout=10)


def run(coro):
    return asyncio.run(coro)


async def with_cache(addrs: list[str], call, missing: list[int] | None = None):
    cache = ShardedCache([CacheManagerClient(a) for a in addrs],
                         missing.append if missing is not None else None)
    try:
        return await call(cache)
    finally:
        await cache.close()


def route_request(tokens: list[int], **kw) -> cache_pb2.RouteRequest:
    return cache_pb2.RouteRequest(token_ids=tokens, model_fingerprint="fp", **kw)


def test_route_merges_both_shards_and_records_only_where_it_sends(shards) -> None:
    a, a_channel, a_pool, _ = register(shards[0], "shard-test-a")
    b, b_channel, b_pool, b_epoch = register(shards[1], "shard-test-b")
    try:
        cache_prompt(b, b_pool, b_epoch, PREFIX, "seed")
        answer = run(with_cache(shards, lambda c: c.route(route_request(PREFIX + [1], request_id="r1",
                                                                       reserve_ms=5000), 5.0)))
        assert [c.pool_id for c in answer.candidates] == [b_pool, a_pool]
        assert answer.candidates[0].matched_tokens == 32 and answer.candidates[0].reserved
        assert answer.num_shards_missing == 0 and answer.num_prompt_pages == 8
        # Recorded (routed tokens, a pin) on B's shard only; A's shard saw a dry run.
        stats = {s.pool_id: s for addr in shards for s in cache_pb2_grpc.CacheManagerStub(
            grpc.insecure_channel(addr)).Stats(cache_pb2.StatsRequest(), timeout=10).pools}
        assert stats[b_pool].num_reservations == 1 and stats[a_pool].num_reservations == 0
        again = run(with_cache(shards, lambda c: c.route(route_request(PREFIX + [2], dry_run=True), 5.0)))
        routed = {c.pool_id: c.routed_tokens for c in again.candidates}
        assert routed[a_pool] == 0 and routed[b_pool] == 1
        top = run(with_cache(shards, lambda c: c.route(route_request(PREFIX + [2], dry_run=True, max_candidates=1),
                                                      5.0)))
        assert [c.pool_id for c in top.candidates] == [b_pool]
        pools = run(with_cache(shards, lambda c: c.stats(5.0))).pools
        assert {a_pool, b_pool} <= {p.pool_id for p in pools}
    finally:
        a_channel.close()
        b_channel.close()


def test_a_shard_that_does_not_answer_drops_out_and_the_answer_says_so(shards) -> None:
    b, channel, b_pool, b_epoch = register(shards[1], "shard-test-c")
    try:
        dead = f"127.0.0.1:{free_port()}"
        missing: list[int] = []
        answer = run(with_cache([dead, shards[1]], lambda c: c.route(route_request(PREFIX + [3], dry_run=True), 2.0),
                                missing))
        assert b_pool in {c.pool_id for c in answer.candidates}
        assert answer.num_shards_missing == 1 and missing == [1]
        with pytest.raises(UpstreamError):
            run(with_cache([dead, f"127.0.0.1:{free_port()}"], lambda c: c.route(route_request([1, 2, 3]), 2.0)))
    finally:
        channel.close()
