"""Start our real servers as child processes for tests (shared by every test package)."""

from __future__ import annotations

import collections
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from protos import model_pb2_grpc
from scripts.service_process import ServiceError, ServiceProcess

REPO = Path(__file__).resolve().parents[1]
CACHE_START_TIMEOUT_S = 60.0
MODEL_START_TIMEOUT_S = 300.0
ROUTER_START_TIMEOUT_S = 60.0
# Set by `make test-fast` (no `model` / `replica` tests): launch_model then refuses to start.
NO_MODEL_SERVICE_ENV = "RADIXKV_TESTS_NO_MODEL_SERVICE"

# The session-wide model service (tests/conftest.py): bundled model, a pool smaller than the
# model's 8192-token context (so "larger than the pool" is reachable), big enough for the
# correctness prompts to run concurrently.
SHARED_POOL_ID = "shared-pool"
SHARED_NUM_BLOCKS = 384


@dataclass(frozen=True)
class Running:
    """A started service: its address and the last lines of its output."""

    addr: str
    process: ServiceProcess
    log: collections.deque[str]

    def output(self) -> str:
        return "\n".join(self.log)


@dataclass(frozen=True)
class Launched:
    """A service started but not waited for (start several, then wait: they load in parallel)."""

    name: str
    process: ServiceProcess
    log: collections.deque[str]
    timeout_s: float

    def wait(self) -> Running:
        """Waits for its 'listening on' line and health SERVING (fails the test if it does not)."""
        try:
            addr = self.process.wait_listening(self.timeout_s)
            self.process.wait_serving(self.timeout_s)
        except ServiceError as error:
            self.process.stop(5.0)
            output = "\n".join(self.log)
            pytest.fail(f"{error}\n--- {self.name} output ---\n{output}", pytrace=False)
        return Running(addr, self.process, self.log)


Credentials = grpc.ChannelCredentials | None


def launch_service(name: str, args: list[str], timeout_s: float, credentials: Credentials = None) -> Launched:
    """Starts `python -m NAME ARGS` without waiting for it (`credentials`: for its health checks
    when it serves TLS)."""
    log: collections.deque[str] = collections.deque(maxlen=400)
    process = ServiceProcess(name, args, log.append, cwd=str(REPO), health_credentials=credentials)
    return Launched(name, process, log, timeout_s)


def start_service(name: str, args: list[str], timeout_s: float, credentials: Credentials = None) -> Running:
    """Starts `python -m NAME ARGS`, waits for its 'listening on' line and health SERVING."""
    return launch_service(name, args, timeout_s, credentials).wait()


def start_cache(extra: list[str] | None = None, credentials: Credentials = None) -> Running:
    return start_service("cache_service", ["--host", "127.0.0.1", "--port", "0", *(extra or [])],
                         CACHE_START_TIMEOUT_S, credentials)


def launch_model(cache_addr: str, *extra: str, credentials: Credentials = None) -> Launched:
    if os.environ.get(NO_MODEL_SERVICE_ENV) == "1":
        # `make test-fast` sets it: a test that reached here is missing its `model` / `replica` marker.
        raise RuntimeError("this test starts a model service in a run without any (make test-fast): register "
                           "its fixture in BUNDLED_MODEL_FIXTURES / REPLICA_FIXTURES or mark it (tests/conftest.py)")
    args = ["--host", "127.0.0.1", "--port", "0", "--cache-addr", cache_addr, *extra]
    return launch_service("model_service", args, MODEL_START_TIMEOUT_S, credentials)


def start_model(cache_addr: str, *extra: str, credentials: Credentials = None) -> Running:
    return launch_model(cache_addr, *extra, credentials=credentials).wait()


def serve_model(cache_addr: str, *extra: str) -> Iterator[model_pb2_grpc.ModelServiceStub]:
    """For module fixtures (`yield from`): a model service started with `extra` flags and a stub on
    it; the process is stopped when the fixture ends."""
    running = start_model(cache_addr, *extra)
    try:
        with grpc.insecure_channel(running.addr) as channel:
            yield model_pb2_grpc.ModelServiceStub(channel)
    finally:
        running.process.stop(10.0)


def start_router(cache_addr: str, *extra: str, credentials: Credentials = None) -> Running:
    """A router (SERVING once one of its replicas is reachable); extra: --replica, --http-port ..."""
    args = ["--host", "127.0.0.1", "--port", "0", "--cache-addr", cache_addr, *extra]
    return start_service("router", args, ROUTER_START_TIMEOUT_S, credentials)
