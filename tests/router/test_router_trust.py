"""The router calls only the replica addresses its operator trusts (--replica, --replica-dns,
--replica-allow; router/trust.py), with real processes on loopback: a cache manager, one
tiny-Llama replica (tests/router/security_setup.py) and a rogue ModelService on 127.0.0.2 that
registers a huge pool under the real model's fingerprint and so wins Route. The rogue must never
get a call (no health check, no request, no token); with TLS, certificates are checked against
the host dialled, or the --replica-dns name an address came from.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common.security import channel_credentials, server_credentials
from protos import cache_pb2, model_pb2, model_pb2_grpc
from router.trust import ReplicaTrust
from router.upstream import ReplicaClients
from tests.router.conftest import CHECK_INTERVAL
from tests.router.security_setup import (
    Running,
    Setup,
    greedy,
    md,
    metric,
    route_candidates,
    router_with_tokens,
    run_setup,
)
from tests.security.certs import make_pki
from tests.services import launch_service, start_router

pytestmark = pytest.mark.timeout(180)

ROGUE_HOST = "127.0.0.2"  # loopback, but outside --replica-allow 127.0.0.1/32


@pytest.fixture(scope="module")
def setup(tiny_model, tmp_path_factory) -> Iterator[Setup]:
    yield from run_setup(tiny_model, tmp_path_factory)


@dataclass
class Rogue:
    """A ModelService on 127.0.0.2 that records every call it gets (method and metadata) and
    answers with forged text; its pool is registered at the cache manager with 2^24 blocks."""

    addr: str = ""
    calls: list[tuple[str, tuple]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


class _Recorder(grpc.ServerInterceptor):
    def __init__(self, rogue: Rogue) -> None:
        self.rogue = rogue

    def intercept_service(self, continuation, handler_call_details):
        with self.rogue.lock:
            self.rogue.calls.append((handler_call_details.method, tuple(handler_call_details.invocation_metadata)))
        return continuation(handler_call_details)


class _Forger(model_pb2_grpc.ModelServiceServicer):
    def __init__(self, info: model_pb2.ModelInfoResponse, rogue: Rogue) -> None:
        self.info, self.rogue = info, rogue

    def Generate(self, request, context):
        yield model_pb2.GenerateResponse(request_id=request.request_id, text="FORGED", token_ids=[1],
                                         finish_reason=model_pb2.FINISH_REASON_STOP,
                                         usage=model_pb2.Usage(served_by=self.rogue.addr))

    def Tokenize(self, request, context):
        return model_pb2.TokenizeResponse(token_ids=[1, 2, 3])

    def ModelInfo(self, request, context):
        info = model_pb2.ModelInfoResponse()
        info.CopyFrom(self.info)
        info.serving_addr = self.rogue.addr
        return info

    def GetLoad(self, request, context):
        return model_pb2.GetLoadResponse(serving_addr=self.rogue.addr)

    def Abort(self, request, context):
        return model_pb2.AbortResponse()


@pytest.fixture(scope="module")
def rogue(setup: Setup) -> Iterator[Rogue]:
    """The rogue server, its pool registered (2^24 blocks) and kept alive by heartbeats."""
    rogue = Rogue()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), interceptors=[_Recorder(rogue)])
    model_pb2_grpc.add_ModelServiceServicer_to_server(_Forger(setup.info, rogue), server)
    health_servicer = health.HealthServicer()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    rogue.addr = f"{ROGUE_HOST}:{server.add_insecure_port(f'{ROGUE_HOST}:0')}"
    server.start()
    cache = setup.cache_stub()
    registered = None
    refusals = []
    for num_blocks in (1 << 24, 1 << 16, 4096):  # the cache manager may cap pool sizes
        try:
            registered = cache.RegisterPool(cache_pb2.RegisterPoolRequest(
                worker_id="rogue-worker", num_blocks=num_blocks, block_size=setup.info.block_size,
                model_fingerprint=setup.info.model_fingerprint, vocab_size=setup.info.vocab_size,
                serving_addr=rogue.addr), timeout=10)
            break
        except grpc.RpcError as e:
            refusals.append(f"{num_blocks}: {e.code().name} {e.details()}")
    assert registered is not None, refusals
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(2.0):
            try:
                cache.Heartbeat(cache_pb2.HeartbeatRequest(pool_id=registered.pool_id, epoch=registered.epoch),
                                timeout=5)
            except grpc.RpcError:
                pass

    beater = threading.Thread(target=beat, daemon=True)
    beater.start()
    try:
        yield rogue
    finally:
        stop.set()
        beater.join(5)
        server.stop(0)


@pytest.fixture(scope="module")
def guarded(setup: Setup, rogue: Rogue) -> Iterator[Running]:
    """A router that trusts 127.0.0.1 only, learning the real replica from the cache manager, and
    sends its own replica token upstream."""
    router = router_with_tokens(setup, "--replica-allow", "127.0.0.1/32",
                                "--replica-token-file", str(setup.tmp / "router-to-replica"))
    try:
        yield router
    finally:
        router.process.stop(10.0)


def test_a_rogue_pool_outside_the_allowlist_never_gets_a_request_or_the_token(setup: Setup, rogue: Rogue,
                                                                            guarded: Running) -> None:
    # The rogue is a real Route candidate, ranked first (its huge pool wins the ties).
    prompts = [[7 + i, 11, 13 + i, 17] * 8 for i in range(8)]
    ranked_first = [route_candidates(setup, ids)[0].serving_addr for ids in prompts]
    assert rogue.addr in ranked_first
    router = setup.model_stub(guarded.addr)
    for ids in prompts:
        out = list(router.Generate(model_pb2.GenerateRequest(token_ids=model_pb2.TokenIds(ids=ids),
                                                             sampling=greedy(2)), metadata=md("alice-tok"),
                                   timeout=60))
        assert out[-1].usage.served_by == setup.replica.addr
        assert "FORGED" not in "".join(m.text for m in out)
    time.sleep(4 * float(CHECK_INTERVAL))  # several background checks
    assert rogue.calls == []  # not a health check, not a request, not the router's token
    assert metric(guarded, "radixkv_router_untrusted_addrs_total", source="stats") > 0
    refusals = [line for line in guarded.log if rogue.addr in line]
    assert len(refusals) == 1 and "not trusted" in refusals[0], guarded.output()
    assert metric(guarded, "radixkv_router_replicas_reachable") == 1  # the real one only


def test_learnt_addresses_outside_the_allowlist_are_not_used_and_dns_names_are(setup: Setup, rogue: Rogue) -> None:
    port = setup.replica.addr.rpartition(":")[2]
    # Allowing only a network the fleet is not on: the router has no replica at all...
    outsider = launch_service("router", ["--host", "127.0.0.1", "--port", "0", "--cache-addr", setup.cache.addr,
                                         "--check-interval", CHECK_INTERVAL, "--replica-allow", "10.255.0.0/16"],
                              60.0)
    try:
        addr = outsider.process.wait_listening(60.0)
        time.sleep(4 * float(CHECK_INTERVAL))
        with grpc.insecure_channel(addr) as channel:
            with pytest.raises(grpc.RpcError) as info:
                list(model_pb2_grpc.ModelServiceStub(channel).Generate(
                    model_pb2.GenerateRequest(token_ids=model_pb2.TokenIds(ids=[5, 6, 7]), sampling=greedy(2)),
                    timeout=30))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        outsider.process.stop(10.0)
    # ... until a DNS name it is told to trust resolves to the replica.
    router = start_router(setup.cache.addr, "--check-interval", CHECK_INTERVAL, "--replica-allow", "10.255.0.0/16",
                          "--replica-dns", f"localhost:{port}")
    try:
        with grpc.insecure_channel(router.addr) as channel:
            out = list(model_pb2_grpc.ModelServiceStub(channel).Generate(
                model_pb2.GenerateRequest(token_ids=model_pb2.TokenIds(ids=[5, 6, 7]), sampling=greedy(2)),
                timeout=60))
        assert out[-1].usage.served_by == setup.replica.addr
    finally:
        router.process.stop(10.0)
    assert rogue.calls == []


# ---------------------------------------------------------------------- TLS to the replicas


def test_tls_checks_each_replica_certificate_against_the_host_or_its_dns_name(tmp_path) -> None:
    """A real TLS health server whose certificate names localhost / 127.0.0.1 / ::1 only, bound on
    127.0.0.1 and on 127.0.0.2: the router's replica clients accept it at 127.0.0.1, refuse it at
    127.0.0.2 (no override to a fixed name), accept 127.0.0.2 when a --replica-dns name
    (localhost) resolved to it, and never dial an untrusted address."""
    pki = make_pki(tmp_path / "pki")
    dialled: list[str] = []

    class Count(grpc.aio.ServerInterceptor):
        async def intercept_service(self, continuation, details):
            dialled.append(details.method)
            return await continuation(details)

    async def go() -> None:
        server = grpc.aio.server(interceptors=[Count()])
        servicer = health.aio.HealthServicer()
        await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        credentials = server_credentials(pki.server.cert, pki.server.key)
        port = server.add_secure_port("127.0.0.1:0", credentials)
        assert server.add_secure_port(f"{ROGUE_HOST}:{port}", credentials) == port
        await server.start()
        at_1, at_2 = f"127.0.0.1:{port}", f"{ROGUE_HOST}:{port}"
        trust = ReplicaTrust(allow=["127.0.0.0/8"])
        clients = ReplicaClients(channel_credentials(pki.ca), trust=trust)
        try:
            assert await clients.check(at_1, 10) is True
            assert await clients.check(at_2, 10) is False  # the certificate does not name 127.0.0.2
            trust.set_resolved("localhost", port, [at_2])
            assert await clients.check(at_2, 10) is True  # checked against the --replica-dns name
            calls = len(dialled)
            strict = ReplicaClients(channel_credentials(pki.ca), trust=ReplicaTrust(allow=["10.0.0.0/8"]))
            assert await strict.check(at_1, 10) is False and len(dialled) == calls  # never dialled
            await strict.close()
        finally:
            await clients.close()
            await server.stop(0)

    asyncio.run(go())
