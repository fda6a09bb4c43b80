"""A fleet whose cache manager runs as two shards (common/shards.py), real processes on loopback:
two replicas of the tiny random Llama, each given both shard addresses, registered with the
shard its worker id hashes to; the router asks both shards; each shard keeps its own --state-dir.
A repeated prompt still goes to the replica that cached it, the client's stats list both shards'
pools, a kill -9 of one shard mid-stream loses nothing, and with one shard down the router keeps
routing by the other and counts the missing shard."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from client import RadixKVClient
from common.shards import shard_for
from protos import cache_pb2, cache_pb2_grpc, model_pb2, model_pb2_grpc
from tests.model_service.checks import count_lines, port_of, start_cache_on, wait_until_idle
from tests.model_service.test_failures import start_stream
from tests.router.conftest import CHECK_INTERVAL, LEASE_SECONDS, metric, replica_args
from tests.services import Running, launch_model, start_cache, start_router

pytestmark = pytest.mark.timeout(180)

LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * 8
MAX_TOKENS = 160  # long enough on the tiny model to be mid-stream when the shard is killed


@dataclass
class ShardedFleet:
    shards: list[Running]
    replicas: list[Running]
    workers: list[str]
    router: Running
    state_dirs: list[str]

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
def sharded_fleet(tiny_model: Path, tmp_path_factory) -> Iterator[ShardedFleet]:
    state = tmp_path_factory.mktemp("shard-state")  # durability per shard: a --state-dir each
    shards = [start_cache(["--lease-seconds", str(LEASE_SECONDS), "--state-dir", str(state / f"shard-{i}")])
              for i in range(2)]
    cache_addr = ",".join(s.addr for s in shards)
    workers = one_worker_per_shard([s.addr for s in shards])
    launched = [launch_model(cache_addr, *replica_args(tiny_model, w)) for w in workers]
    router = None
    try:
        replicas = [launch.wait() for launch in launched]
        router = start_router(cache_addr, "--http-port", "0", "--check-interval", CHECK_INTERVAL,
                              *(flag for r in replicas for flag in ("--replica", r.addr)))
        yield ShardedFleet(shards, replicas, workers, router, [str(state / f"shard-{i}") for i in range(2)])
    finally:
        if router is not None:
            router.process.stop(10.0)
        for launch in launched:
            launch.process.stop(10.0)
        for shard in shards:  # the fleet's list: a shard a test restarted is in it
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


def test_kill_9_of_a_durable_shard_mid_stream_loses_nothing(sharded_fleet: ShardedFleet) -> None:
    """Destructive: restarts shard 0. Shard 0 is killed (SIGKILL) while both replicas stream and
    restarted on its port and --state-dir: every stream completes with the greedy tokens of an
    undisturbed run, nothing recomputed; replica 0 re-attaches to its kept pool, and replica 1,
    whose pool lives on shard 1, never notices."""
    prompts = [[(37 * i + 11 * j) % 40_000 + 100 for j in range(40)] for i in range(4)]
    channels = [grpc.insecure_channel(r.addr) for r in sharded_fleet.replicas]
    stubs = [model_pb2_grpc.ModelServiceStub(channel) for channel in channels]
    sampling = dict(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    streams = [start_stream(stub, p, **sampling) for stub in stubs for p in prompts]
    for stream in streams:
        stream.wait_tokens(2, 60)
    assert not any(s.done.is_set() for s in streams), "a stream ended before the crash"
    shard = sharded_fleet.shards[0]
    shard.process.proc.kill()
    shard.process.stop(5.0)
    time.sleep(0.5)  # replica 0 notices meanwhile (or at its next Step)
    sharded_fleet.shards[0] = start_cache_on(port_of(shard.addr), "--lease-seconds", str(LEASE_SECONDS),
                                             "--state-dir", sharded_fleet.state_dirs[0])
    results = [s.result(120) for s in streams]
    undisturbed = [[t for m in s.result(120) for t in m.token_ids]
                   for s in [start_stream(stub, p, **sampling) for stub in stubs for p in prompts]]
    for channel in channels:
        channel.close()
    assert [[t for m in r for t in m.token_ids] for r in results] == undisturbed
    assert all(r[-1].usage.num_preemptions == 0 for r in results), "a request was recomputed after the restart"
    crashed, untouched = sharded_fleet.replicas
    assert count_lines(crashed, "cache pool lost") >= 1, "the crash went unnoticed"
    assert count_lines(crashed, "re-attached to the kept pool") >= 1
    assert count_lines(crashed, "new cache pool: recomputing") == 0
    assert count_lines(untouched, "cache pool lost") == 0, "a replica of the other shard noticed the crash"
    with grpc.insecure_channel(sharded_fleet.shards[0].addr) as channel:
        stub = cache_pb2_grpc.CacheManagerStub(channel)
        stats = wait_until_idle(stub, sharded_fleet.workers[0])
        assert stats.restored and stats.num_restored_cached_blocks > 0
        assert [p.pool_id for p in stub.Stats(cache_pb2.StatsRequest(), timeout=10).pools] == [sharded_fleet.workers[0]]


def test_with_a_shard_down_the_other_still_routes(sharded_fleet: ShardedFleet) -> None:
    """Destructive: stops shard 0 (the last test of this module)."""
    router = sharded_fleet.router
    survivor = sharded_fleet.replicas[1].addr  # its pool lives on shard 1
    generate(survivor, LONG_PROMPT + "kept", "sharded-down")  # cached there, directly
    sharded_fleet.shards[0].process.stop(5.0)
    reply = generate(router.addr, LONG_PROMPT + "after", "sharded-down")
    assert reply[-1].usage.served_by == survivor and reply[-1].usage.cached_prompt_tokens >= 64
    assert metric(router, "radixkv_router_cache_shards_missing_total") >= 1
