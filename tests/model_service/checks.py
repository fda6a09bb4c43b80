"""Helpers for the failure-mode and bad-input tests: expected gRPC errors, leak checks on the
cache manager's pool accounting, bounded waits, streaming helpers."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from protos import cache_pb2, cache_pb2_grpc, model_pb2
from tests.services import Running, start_service


def pool_stats(stub: cache_pb2_grpc.CacheManagerStub, pool_id: str) -> cache_pb2.PoolStats:
    (stats,) = stub.Stats(cache_pb2.StatsRequest(pool_id=pool_id)).pools
    return stats


def assert_pool_whole(stats: cache_pb2.PoolStats) -> None:
    """Block accounting adds up (free + cached + private == total)."""
    assert stats.num_free_blocks + stats.num_cached_blocks + stats.num_private_blocks == stats.num_blocks, stats


def expect_status(call: Callable[[], Any], code: grpc.StatusCode, *fragments: str) -> grpc.RpcError:
    """Runs `call` (a unary call or one that drains a stream) and asserts it fails with `code`
    and a message containing every fragment (case-insensitive)."""
    try:
        result = call()
    except grpc.RpcError as error:
        assert error.code() == code, f"expected {code.name}, got {error.code().name}: {error.details()!r}"
        details = (error.details() or "").lower()
        for fragment in fragments:
            assert fragment.lower() in details, f"{fragment!r} not in the message {error.details()!r}"
        return error
    raise AssertionError(f"expected {code.name}, but the call succeeded: {result!r}")


def drain(stream: Iterator[model_pb2.GenerateResponse]) -> list[model_pb2.GenerateResponse]:
    return list(stream)


def wait_until_idle(stub: cache_pb2_grpc.CacheManagerStub, pool_id: str, timeout_s: float = 15.0
                    ) -> cache_pb2.PoolStats:
    """Polls (bounded) until the pool has no running request and no private block, then asserts
    that, and that free + cached + private == num_blocks. A request finishes at the cache manager
    in the engine's next Step after its last message (or its cancellation), so this is async."""
    deadline = time.monotonic() + timeout_s
    while True:
        # A model service is SERVING before it has registered its pool: wait for that too.
        stats = try_pool_stats(stub, pool_id)
        idle = stats is not None and stats.num_running_requests == 0 and stats.num_private_blocks == 0
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert stats is not None, f"pool {pool_id!r} not registered within {timeout_s} s"
    assert_pool_whole(stats)
    assert stats.num_running_requests == 0, f"requests still running after {timeout_s} s: {stats}"
    assert stats.num_private_blocks == 0, f"private blocks leaked: {stats}"
    return stats


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str, interval_s: float = 0.05) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval_s)


def try_pool_stats(stub: cache_pb2_grpc.CacheManagerStub, pool_id: str) -> cache_pb2.PoolStats | None:
    """The pool's stats, or None when the cache manager does not know the pool (NOT_FOUND)."""
    try:
        return pool_stats(stub, pool_id)
    except grpc.RpcError as error:
        if error.code() == grpc.StatusCode.NOT_FOUND:
            return None
        raise


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_cache_on(port: int, *extra: str) -> Running:
    """A cache service on a given port (to restart one where its clients expect it). The caller
    stops the process itself. (Starting it while this process has gRPC calls in flight is safe:
    ServiceProcess forks with no preexec_fn, see common/parent_death.py.)"""
    return start_service("cache_service", ["--host", "127.0.0.1", "--port", str(port), *extra], 60.0)


def port_of(addr: str) -> int:
    return int(addr.rsplit(":", 1)[1])


def count_lines(running: Running, fragment: str) -> int:
    return sum(fragment in line for line in list(running.log))
