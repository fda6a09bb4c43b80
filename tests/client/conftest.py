"""Session fixtures: the real cache service and model service, each in its own process
(group) on 127.0.0.1 with a port the OS picks, ready once gRPC health says SERVING.

One model service (bundled model, small pool) is shared by the whole session: loading the
model dominates the suite's runtime.
"""

from __future__ import annotations

import collections
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from scripts.service_process import ServiceError, ServiceProcess

REPO = Path(__file__).resolve().parents[2]
CACHE_START_TIMEOUT_S = 60.0
MODEL_START_TIMEOUT_S = 300.0
MODEL_NUM_BLOCKS = 256


@dataclass(frozen=True)
class Running:
    """A started service: its address and the last lines of its output."""

    addr: str
    process: ServiceProcess
    log: collections.deque[str]


def start(name: str, args: list[str], timeout_s: float) -> Running:
    log: collections.deque[str] = collections.deque(maxlen=200)
    process = ServiceProcess(name, args, log.append, cwd=str(REPO))
    try:
        addr = process.wait_listening(timeout_s)
        process.wait_serving(timeout_s)
    except ServiceError as error:
        process.stop(5.0)
        output = "\n".join(log)
        pytest.fail(f"{error}\n--- {name} output ---\n{output}", pytrace=False)
    return Running(addr, process, log)


@pytest.fixture(scope="session")
def cache_service() -> Iterator[Running]:
    running = start("cache_service", ["--host", "127.0.0.1", "--port", "0"], CACHE_START_TIMEOUT_S)
    try:
        yield running
    finally:
        running.process.stop(5.0)


@pytest.fixture(scope="session")
def model_service(cache_service: Running) -> Iterator[Running]:
    args = [
        "--host", "127.0.0.1", "--port", "0",
        "--cache-addr", cache_service.addr,
        "--num-blocks", str(MODEL_NUM_BLOCKS),
    ]  # fmt: skip
    running = start("model_service", args, MODEL_START_TIMEOUT_S)
    try:
        yield running
    finally:
        running.process.stop(10.0)


@pytest.fixture(scope="session")
def python() -> str:
    return sys.executable


@pytest.fixture(scope="session")
def node() -> str:
    path = shutil.which("node")
    if path is None:
        pytest.skip("node is not on PATH")
    if not (REPO / "client" / "node" / "node_modules" / "@grpc" / "grpc-js").is_dir():
        pytest.fail("client/node/node_modules is missing: run `make node` (make test does)", pytrace=False)
    return path
