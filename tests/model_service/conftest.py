"""Fixtures for model-service tests: real cache and model services in child processes, and the
reference transformers model in this process."""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import pytest
import torch

from model_service.model_loader import LoadedModel, load_model
from protos import cache_pb2, cache_pb2_grpc, model_pb2_grpc
from tests.services import Running, start_service

MODEL_START_TIMEOUT_S = 300.0


def start_cache(extra: list[str] | None = None) -> Running:
    return start_service("cache_service", ["--host", "127.0.0.1", "--port", "0", *(extra or [])], 60.0)


def start_model(cache_addr: str, *extra: str) -> Running:
    args = ["--host", "127.0.0.1", "--port", "0", "--cache-addr", cache_addr, *extra]
    return start_service("model_service", args, MODEL_START_TIMEOUT_S)


@pytest.fixture(scope="session")
def reference_model() -> LoadedModel:
    """The bundled model loaded by transformers alone (sdpa attention, fp32): the ground truth."""
    return load_model(None, torch.float32, torch.device("cpu"))


@pytest.fixture(scope="session")
def cache_service() -> Iterator[Running]:
    running = start_cache()
    try:
        yield running
    finally:
        running.process.stop(5.0)


@pytest.fixture(scope="session")
def model_service(cache_service: Running) -> Iterator[Running]:
    """The bundled model with a roomy pool (no preemption)."""
    running = start_model(cache_service.addr, "--num-blocks", "512", "--worker-id", "big-pool")
    try:
        yield running
    finally:
        running.process.stop(10.0)


@pytest.fixture(scope="session")
def model_stub(model_service: Running) -> Iterator[model_pb2_grpc.ModelServiceStub]:
    with grpc.insecure_channel(model_service.addr) as channel:
        yield model_pb2_grpc.ModelServiceStub(channel)


@pytest.fixture(scope="session")
def cache_stub(cache_service: Running) -> Iterator[cache_pb2_grpc.CacheManagerStub]:
    with grpc.insecure_channel(cache_service.addr) as channel:
        yield cache_pb2_grpc.CacheManagerStub(channel)


def pool_stats(stub: cache_pb2_grpc.CacheManagerStub, pool_id: str) -> cache_pb2.PoolStats:
    (stats,) = stub.Stats(cache_pb2.StatsRequest(pool_id=pool_id)).pools
    return stats


def assert_pool_whole(stats: cache_pb2.PoolStats) -> None:
    """Block accounting adds up (free + cached + private == total)."""
    assert stats.num_free_blocks + stats.num_cached_blocks + stats.num_private_blocks == stats.num_blocks, stats


def wait_pool_idle(stub: cache_pb2_grpc.CacheManagerStub, pool_id: str, timeout_s: float = 10.0) -> cache_pb2.PoolStats:
    """Stats once the pool has no running request. A request's final message reaches the client
    just before the engine's next Step tells the cache manager, so poll (bounded)."""
    deadline = time.monotonic() + timeout_s
    stats = pool_stats(stub, pool_id)
    while stats.num_running_requests and time.monotonic() < deadline:
        time.sleep(0.05)
        stats = pool_stats(stub, pool_id)
    return stats
