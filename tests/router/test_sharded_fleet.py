"""A fleet whose cache manager runs as two shards (common/shards.py), real processes on loopback:
two replicas of the tiny random Llama, each given both shard addresses, registered with the
shard its worker id hashes to; the router asks both shards. A repeated prompt still goes to the
replica that cached it, the client's stats list both shards' pools, and with one shard down the
router keeps routing by the other and counts the missing shard."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from client import RadixKVClient
from common.shards import shard_for
from protos import model_pb2, model_pb2_grpc
from tests.router.conftest import CHECK_INTERVAL, LEASE_SECONDS, metric, replica_args
from tests.services import Running, launch_model, start_cache, start_router

pytestmark = pytest.mark.timeout(180)

LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * 8


@dataclass
class ShardedFleet:
    shards: list[Running]
    replicas: list[Running]
    workers: list[str]
    router: Running

    @property
    def cache_addr(self) -> str:
        return ",".join(s.addr for s in self.shards)


def one_worker_per_shard(shard_addrs: list[str]) -> list[str]:
    """Worker ids the shards own one each (shard_for decides; the ports are picked at start)."""
    found: dict[str, str] = {}
    for i in range(1000):
        worker = f"sharded-{i}"
        found.setdefault(shard_for(worker, shard_addrs), worker)
        if len(found) == len(shard_addrs):
            return [found[addr] for addr in shard_addrs]
    raise AssertionError("no worker id for some shard")


@pytest.fixture(scope="module")
def sharded_fleet(tiny_model: Path) -> Iterator[ShardedFleet]:
    shards = [start_cache(["--lease-seconds", str(LEASE_SECONDS)]) for _ in range(2)]
    cache_addr = ",".join(s.addr for s in shards)
    workers = one_worker_per_shard([s.addr for s in shards])
    launched = [launch_model(cache_addr, *replica_args(tiny_model, w)) for w in workers]
    router = None
    try:
        replicas = [launch.wait() for launch in launched]
        router = start_router(cache_addr, "--http-port", "0", "--check-interval", CHECK_INTERVAL,
                              *(flag for r in replicas for flag in ("--replica", r.addr)))
        yield ShardedFleet(shards, replicas, workers, router)
    finally:
        if router is not None:
            router.process.stop(10.0)
        for launch in launched:
            launch.process.stop(10.0)
        for shard in shards:
            shard.process.stop(5.0)


def generate(addr: str, prompt: str, namespace: str) -> list[model_pb2.GenerateResponse]:
    with grpc.insecure_channel(addr) as channel:
        stub = model_pb2_grpc.ModelServiceStub(channel)
        return list(stub.Generate(model_pb2.GenerateRequest(
            prompt=prompt, namespace=namespace, sampling=model_pb2.SamplingParams(max_tokens=4, temperature=0)),
            timeout=60))


def test_each_replica_registers_with_its_own_shard(sharded_fleet: ShardedFleet) -> None:
    for shard, worker, replica in zip(sharded_fleet.shards, sharded_fleet.workers, sharded_fleet.replicas,
                                      strict=True):
        with RadixKVClient(replica.addr, cache_addr=shard.addr) as client:
            assert [p.pool_id for p in client.stats()] == [worker]
            assert client.model_info().cache_addr == shard.addr
    with RadixKVClient(sharded_fleet.replicas[0].addr, cache_addr=sharded_fleet.cache_addr) as client:
        assert sorted(p.pool_id for p in client.stats()) == sorted(sharded_fleet.workers)
        assert [p.pool_id for p in client.stats(sharded_fleet.workers[1])] == [sharded_fleet.workers[1]]


def test_a_repeated_prompt_goes_where_it_is_cached_across_shards(sharded_fleet: ShardedFleet) -> None:
    router = sharded_fleet.router
    first = generate(router.addr, LONG_PROMPT + "first", "sharded-repeat")
    second = generate(router.addr, LONG_PROMPT + "again", "sharded-repeat")
    assert second[-1].usage.served_by == first[-1].usage.served_by
    assert second[-1].usage.cached_prompt_tokens >= 64
    assert metric(router, "radixkv_router_route_decisions_total", reason="kv_hit") >= 1
    assert metric(router, "radixkv_router_cache_shards_missing_total") == 0


def test_with_a_shard_down_the_other_still_routes(sharded_fleet: ShardedFleet) -> None:
    """Destructive: stops shard 0 (the last test of this module)."""
    router = sharded_fleet.router
    survivor = sharded_fleet.replicas[1].addr  # its pool lives on shard 1
    generate(survivor, LONG_PROMPT + "kept", "sharded-down")  # cached there, directly
    sharded_fleet.shards[0].process.stop(5.0)
    reply = generate(router.addr, LONG_PROMPT + "after", "sharded-down")
    assert reply[-1].usage.served_by == survivor and reply[-1].usage.cached_prompt_tokens >= 64
    assert metric(router, "radixkv_router_cache_shards_missing_total") >= 1
