"""Router-test fixtures: a fleet of real processes on loopback (its own cache manager, two model
replicas of the tiny random Llama, a router with the OpenAI HTTP door), shared by the module,
plus helpers to read the router's HTTP address and metrics, and a scriptable in-process replica
for failures a real one cannot be made to show on cue."""

from __future__ import annotations

import contextlib
import re
import socket
import threading
import urllib.request
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from protos import model_pb2, model_pb2_grpc
from tests.services import Running, launch_model, start_cache, start_router
from tests.tiny_model import save_tiny_llama

HTTP_LINE = re.compile(r"router OpenAI HTTP API on (http://\S+)/v1\s*$")
REPLICA_BLOCKS = 256
CHECK_INTERVAL = "0.3"
LEASE_SECONDS = 4


def http_url(router: Running) -> str:
    """http://HOST:PORT of a router started with --http-port."""
    for line in router.log:
        match = HTTP_LINE.search(line)
        if match:
            return match.group(1)
    raise AssertionError(f"no HTTP line in the router's output:\n{router.output()}")


def metric(router: Running, name: str, **labels: str) -> float:
    """One sample of the router's /metrics (0 when absent)."""
    with urllib.request.urlopen(http_url(router) + "/metrics", timeout=5) as reply:
        text = reply.read().decode()
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        sample, _, value = line.rpartition(" ")
        metric_name, _, rest = sample.partition("{")
        got = ",".join(sorted(rest.rstrip("}").split(","))) if rest else ""
        if metric_name == name and got == want:
            total += float(value)
    return total


def free_port() -> int:
    """A port nothing listens on (for a dead address)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Fleet:
    cache: Running
    a: Running
    b: Running
    router: Running

    @property
    def replica_addrs(self) -> set[str]:
        return {self.a.addr, self.b.addr}


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("router-tiny-llama"))


def replica_args(model: Path, worker_id: str) -> list[str]:
    return ["--model", str(model), "--worker-id", worker_id, "--num-threads", "1",
            "--num-blocks", str(REPLICA_BLOCKS)]


@pytest.fixture(scope="module")
def fleet(tiny_model: Path) -> Iterator[Fleet]:
    """Tests may restart its services: they put the new ones in the Fleet, stopped at the end."""
    cache = start_cache(["--lease-seconds", str(LEASE_SECONDS)])  # short: a killed replica's pool goes soon
    launched = [launch_model(cache.addr, *replica_args(tiny_model, name)) for name in ("router-a", "router-b")]
    fleet: Fleet | None = None
    try:
        a, b = (launch.wait() for launch in launched)
        router = start_router(cache.addr, "--http-port", "0", "--check-interval", CHECK_INTERVAL,
                              "--replica", a.addr, "--replica", b.addr)
        fleet = Fleet(cache, a, b, router)
        yield fleet
    finally:
        if fleet is not None:
            fleet.router.process.stop(10.0)
        for launch in launched:
            launch.process.stop(10.0)
        (fleet.cache if fleet is not None else cache).process.stop(5.0)


# ---------------------------------------------------------------------- a scriptable replica


class StandInReplica(model_pb2_grpc.ModelServiceServicer):
    """A ModelService of the test's own that a router takes for a replica of the fleet's model:
    model info, Tokenize and Detokenize come from the real replica at `real_addr`; subclasses
    answer Generate. `pool_id` names it in ModelInfo."""

    pool_id = "stand-in"

    def __init__(self, real_addr: str) -> None:
        self._lock = threading.Lock()
        self._real = grpc.insecure_channel(real_addr)
        self._stub = model_pb2_grpc.ModelServiceStub(self._real)
        self.addr = ""

    def Tokenize(self, request, context):
        return self._stub.Tokenize(request, timeout=10)

    def Detokenize(self, request, context):
        return self._stub.Detokenize(request, timeout=10)

    def ModelInfo(self, request, context):
        info = self._stub.ModelInfo(request, timeout=10)
        info.serving_addr, info.pool_id = self.addr, self.pool_id
        return info

    def GetLoad(self, request, context):
        return model_pb2.GetLoadResponse(serving_addr=self.addr)

    def close(self) -> None:
        self._real.close()


@contextlib.contextmanager
def serving(servicer: StandInReplica, workers: int = 8) -> Iterator[StandInReplica]:
    """`servicer` served on a loopback port (health SERVING) until the block ends."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers))
    model_pb2_grpc.add_ModelServiceServicer_to_server(servicer, server)
    health_servicer = health.HealthServicer()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    servicer.addr = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    try:
        yield servicer
    finally:
        server.stop(0)
        servicer.close()


class ScriptedReplica(StandInReplica):
    """A ModelService whose Generate fails on cue (`mode`), serving the real replica's model info
    and tokenizer (Tokenize is forwarded there) so the router treats it as one of the fleet.

    Modes: "unavailable" / "exhausted" / "invalid" fail before the first message; "partial"
    sends one message, then fails with UNAVAILABLE.
    """

    pool_id = "scripted"

    def __init__(self, real_addr: str) -> None:
        super().__init__(real_addr)
        self.mode = "unavailable"
        self.generate_calls = 0

    def Generate(self, request, context):
        with self._lock:
            self.generate_calls += 1
        if self.mode == "unavailable":
            context.abort(grpc.StatusCode.UNAVAILABLE, "scripted replica: going away")
        if self.mode == "exhausted":
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "waiting queue is full (scripted)")
        if self.mode == "invalid":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "scripted replica: bad request")
        yield model_pb2.GenerateResponse(request_id=request.request_id, text="partial", token_ids=[7])
        context.abort(grpc.StatusCode.UNAVAILABLE, "scripted replica: crashed mid-stream")


@pytest.fixture(scope="module")
def scripted(fleet: Fleet) -> Iterator[ScriptedReplica]:
    with serving(ScriptedReplica(fleet.a.addr)) as servicer:
        yield servicer


@pytest.fixture(scope="module")
def fallback_router(fleet: Fleet, scripted: ScriptedReplica) -> Iterator[Running]:
    """A router whose cache manager is unreachable (a dead port), in front of the scripted replica
    and replica A, round-robin when loads tie: every request is a fallback, every other one
    tries the scripted replica first."""
    router = start_router(f"127.0.0.1:{free_port()}", "--http-port", "0", "--metrics-port", "0",
                          "--check-interval", CHECK_INTERVAL, "--replica", scripted.addr, "--replica", fleet.a.addr)
    try:
        yield router
    finally:
        router.process.stop(10.0)
