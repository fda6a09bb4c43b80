"""Fixtures of the cache service tests.

In-process: pools and trees that assert every invariant after every operation.
Out-of-process: the real server (`python -m cache_service --port 0`) in a subprocess, its port
read from the `cache_service listening on HOST:PORT` line, a real gRPC channel.
"""

from __future__ import annotations

import os
import re
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from cache_service.pool import Pool
from cache_service.radix_tree import RadixTree
from cache_service.schema import StepInput, StepResult
from protos import cache_pb2, cache_pb2_grpc

REPO = Path(__file__).resolve().parents[2]
LISTEN_RE = re.compile(r"cache_service listening on (\S+):(\d+)")
START_TIMEOUT_S = 30.0


class CheckedPool(Pool):
    """A real Pool that runs check_integrity() after every mutating call, failed or not."""

    def step(self, step: StepInput) -> StepResult:
        try:
            return super().step(step)
        finally:
            self.check_integrity()

    def evict(self, num_blocks: int) -> int:
        try:
            return super().evict(num_blocks)
        finally:
            self.check_integrity()

    def clear(self):
        try:
            return super().clear()
        finally:
            self.check_integrity()

    def retire(self) -> None:
        try:
            super().retire()
        finally:
            self.check_integrity()


class CheckedTree(RadixTree):
    """A real RadixTree that runs check_integrity() after every mutating call."""

    def match_prefix(self, tokens, namespace=""):
        result = super().match_prefix(tokens, namespace)
        self.check_integrity()
        return result

    def insert(self, tokens, block_ids, namespace=""):
        result = super().insert(tokens, block_ids, namespace)
        self.check_integrity()
        return result

    def inc_lock_ref(self, node):
        super().inc_lock_ref(node)
        self.check_integrity()

    def dec_lock_ref(self, node):
        super().dec_lock_ref(node)
        self.check_integrity()

    def evict(self, num_pages):
        result = super().evict(num_pages)
        self.check_integrity()
        return result


@pytest.fixture
def make_pool() -> Callable[..., CheckedPool]:
    def make(num_blocks: int = 16, block_size: int = 4, vocab_size: int = 0, events=None) -> CheckedPool:
        return CheckedPool("pool", 1, num_blocks, block_size, "fp", vocab_size, events)

    return make


# ---------------------------------------------------------------------- real server process


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    host: str
    port: int
    channel: grpc.Channel
    stub: cache_pb2_grpc.CacheManagerStub
    stderr_path: Path

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")


def read_listen_line(proc: subprocess.Popen, timeout: float) -> tuple[str, int]:
    """Wait (bounded) for the `listening on` line on the server's stdout."""
    deadline = time.monotonic() + timeout
    buffer = b""
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if not sel.select(timeout=max(0.0, deadline - time.monotonic())):
                continue
            chunk = os.read(proc.stdout.fileno(), 4096)
            if not chunk:
                break  # process exited
            buffer += chunk
            match = LISTEN_RE.search(buffer.decode(errors="replace"))
            if match:
                return match.group(1), int(match.group(2))
    raise RuntimeError(f"server did not report its port within {timeout}s; stdout: {buffer!r}")


def stop_process(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)


def spawn_server(stderr_path: Path, *extra: str) -> ServerProcess:
    """Start `python -m cache_service --port 0 --host 127.0.0.1 ...extra` and connect to it."""
    with open(stderr_path, "wb") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "cache_service", "--port", "0", "--host", "127.0.0.1", *extra],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=stderr,
        )
    try:
        host, port = read_listen_line(proc, START_TIMEOUT_S)
        channel = grpc.insecure_channel(f"{host}:{port}")
        grpc.channel_ready_future(channel).result(timeout=START_TIMEOUT_S)
    except BaseException:
        stop_process(proc)
        raise
    return ServerProcess(proc, host, port, channel, cache_pb2_grpc.CacheManagerStub(channel), stderr_path)


def stop_server(server: ServerProcess) -> None:
    server.channel.close()
    stop_process(server.proc)


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator[Callable[..., ServerProcess]]:
    """Factory for servers of one test; every one is killed at teardown."""
    started: list[ServerProcess] = []

    def start(*extra: str) -> ServerProcess:
        started.append(spawn_server(tmp_path / f"server{len(started)}.stderr", *extra))
        return started[-1]

    try:
        yield start
    finally:
        for server in started:
            stop_server(server)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    """One long-lease server shared by a test module (its tests use distinct worker ids)."""
    with tempfile.TemporaryDirectory() as tmp:
        running = spawn_server(Path(tmp) / "server.stderr")
        try:
            yield running
        finally:
            stop_server(running)


def register(stub: cache_pb2_grpc.CacheManagerStub, worker_id: str, num_blocks: int = 32,
             block_size: int = 4, vocab_size: int = 0, fingerprint: str = "fp",
             serving_addr: str = "") -> cache_pb2.RegisterPoolResponse:
    return stub.RegisterPool(
        cache_pb2.RegisterPoolRequest(
            worker_id=worker_id, num_blocks=num_blocks, block_size=block_size,
            model_fingerprint=fingerprint, vocab_size=vocab_size, serving_addr=serving_addr,
        ),
        timeout=5,
    )


def assert_accounting(stub: cache_pb2_grpc.CacheManagerStub, pool_id: str) -> cache_pb2.PoolStats:
    """Stats over gRPC: free + cached + private == num_blocks, cached == locked + evictable."""
    (stats,) = stub.Stats(cache_pb2.StatsRequest(pool_id=pool_id), timeout=5).pools
    assert stats.num_free_blocks + stats.num_cached_blocks + stats.num_private_blocks == stats.num_blocks
    assert stats.num_cached_blocks == stats.num_locked_blocks + stats.num_evictable_blocks
    return stats


class ManualClock:
    """A clock the test moves by hand (registries and pools take `clock=`)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()
