"""create_server() used in-process with a grpc.aio channel (no subprocess)."""

from __future__ import annotations

import asyncio

import grpc

from cache_service.pool_registry import PoolRegistry
from cache_service.server import create_server
from protos import cache_pb2 as pb
from protos import cache_pb2_grpc


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=30))


def test_create_server_on_port_0_serves_the_core() -> None:
    async def scenario():
        registry = PoolRegistry()
        server, port = await create_server("127.0.0.1:0", registry)
        assert port > 0
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = cache_pb2_grpc.CacheManagerStub(channel)
                reg = await stub.RegisterPool(pb.RegisterPoolRequest(worker_id="w", num_blocks=8, block_size=4))
                reply = await stub.Step(pb.StepRequest(
                    pool_id="w", epoch=reg.epoch, admits=[pb.Admit(request_id="r", token_ids=[1, 2, 3, 4, 5])]))
                assert reply.admits[0].status == pb.ADMIT_STATUS_ADMITTED
        finally:
            await server.stop(None)
        pool = registry.pools["w"]  # the same core objects the RPCs changed
        pool.check_integrity()
        assert pool.stats().num_private_blocks == 2

    run(scenario())


def test_slow_watcher_is_cut_off_with_resource_exhausted() -> None:
    async def scenario():
        registry = PoolRegistry()
        server, port = await create_server("127.0.0.1:0", registry, watch_queue_size=4)
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = cache_pb2_grpc.CacheManagerStub(channel)
                reg = await stub.RegisterPool(pb.RegisterPoolRequest(worker_id="w", num_blocks=64, block_size=1))
                call = stub.WatchEvents(pb.WatchEventsRequest(pool_id="w", snapshot=True))
                while registry.events.num_subscribers == 0:  # bounded by the wait_for timeout
                    await asyncio.sleep(0.01)
                # 10 finished requests -> 10 BlockStored events in one step, more than the queue holds.
                admits = [pb.Admit(request_id=f"r{i}", token_ids=[i, 100]) for i in range(10)]
                await stub.Step(pb.StepRequest(pool_id="w", epoch=reg.epoch, admits=admits))
                finishes = [pb.Finish(request_id=f"r{i}", num_computed_tokens=2) for i in range(10)]
                await stub.Step(pb.StepRequest(pool_id="w", epoch=reg.epoch, finishes=finishes))
                received = 0
                try:
                    async for _ in call:
                        received += 1
                    raise AssertionError("the stream ended without an error")
                except grpc.aio.AioRpcError as err:
                    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
                assert received <= 4
        finally:
            await server.stop(None)
        assert registry.events.num_subscribers == 0

    run(scenario())
