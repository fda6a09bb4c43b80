"""TLS, mutual TLS and bearer tokens with real processes on loopback: a cache manager (mutual TLS +
tokens with roles), a model service of the tiny random Llama (TLS + tokens, reaching the cache
manager over mutual TLS with its replica token) and a router (TLS + tokens on gRPC and HTTP,
finding the replica through the cache manager's Stats and calling it over TLS with a token);
then the Python library, the CLI and the Node client against them. Certificates come from a
throwaway CA made at test time (tests/security/certs.py)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client import AsyncRadixKVClient, RadixKVClient
from common.security import channel_credentials
from protos import cache_pb2 as pb
from protos import cache_pb2_grpc, model_pb2, model_pb2_grpc
from tests.security.certs import KeyPair, Pki, client_cert, make_pki
from tests.services import Running, launch_model, start_cache, start_router
from tests.tiny_model import save_tiny_llama

REPO = Path(__file__).resolve().parents[2]
PROMPT = "A radix tree keeps the prefixes of many prompts so that"

CACHE_TOKENS = """\
# the cache manager's tokens
admin-tok admin,reader
replica-tok replica
router-tok reader,router
reader-tok reader
tenant-tok reader ns=tenant-a|tenant-b
doomed-tok reader
"""
SERVING_TOKENS = "client-tok client\nnot-a-client reader\n"  # the model service's and the router's


@dataclass
class SecureFleet:
    pki: Pki
    cache: Running
    model: Running
    router: Running
    cache_tokens: Path
    replica: KeyPair  # the replica's client certificate: its worker ids as DNS names (--worker-san-check)

    def cache_stub(self) -> cache_pb2_grpc.CacheManagerStub:
        """A mutual-TLS stub of the cache manager, with the replica's certificate (no token: give
        metadata per call)."""
        return cache_pb2_grpc.CacheManagerStub(self._channel(self.cache.addr, mutual=True))

    def model_stub(self, addr: str) -> model_pb2_grpc.ModelServiceStub:
        return model_pb2_grpc.ModelServiceStub(self._channel(addr, mutual=False))

    def _channel(self, addr: str, mutual: bool) -> grpc.Channel:
        pki = self.pki
        creds = (channel_credentials(pki.ca, self.replica.cert, self.replica.key) if mutual
                 else channel_credentials(pki.ca))
        channel = grpc.secure_channel(addr, creds)
        self._channels.append(channel)
        return channel

    def __post_init__(self) -> None:
        self._channels: list[grpc.Channel] = []

    def close(self) -> None:
        for channel in self._channels:
            channel.close()


def md(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def rpc_code(call) -> tuple[grpc.StatusCode, str]:
    try:
        call()
    except grpc.RpcError as e:
        return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> Iterator[SecureFleet]:
    tmp = tmp_path_factory.mktemp("security")
    pki = make_pki(tmp / "pki")
    tiny = save_tiny_llama(tmp / "tiny-llama")
    files = {"cache-tokens": CACHE_TOKENS, "serving-tokens": SERVING_TOKENS, "model-to-cache": "replica-tok\n",
             "router-to-cache": "router-tok\n", "router-to-replica": "client-tok\n"}
    for name, text in files.items():
        (tmp / name).write_text(text)
    server_tls = ["--tls-cert", str(pki.server.cert), "--tls-key", str(pki.server.key)]
    to_cache = ["--cache-tls-ca", str(pki.ca), "--cache-tls-cert", str(pki.client.cert),
                "--cache-tls-key", str(pki.client.key)]
    # Under mutual TLS a worker id must be a SAN of the registering client's certificate.
    replica = client_cert(pki, "secure-replica", dns=["secure-replica", "ns-pool"])
    replica_to_cache = ["--cache-tls-ca", str(pki.ca), "--cache-tls-cert", str(replica.cert),
                        "--cache-tls-key", str(replica.key)]
    cache = start_cache([*server_tls, "--tls-client-ca", str(pki.ca), "--auth-token-file", str(tmp / "cache-tokens")],
                        credentials=channel_credentials(pki.ca, pki.client.cert, pki.client.key))
    started: list[Running] = [cache]
    try:
        model = launch_model(cache.addr, "--model", str(tiny), "--worker-id", "secure-replica", "--num-threads", "1",
                             "--num-blocks", "64", *server_tls, "--auth-token-file", str(tmp / "serving-tokens"),
                             *replica_to_cache, "--cache-token-file", str(tmp / "model-to-cache"),
                             credentials=channel_credentials(pki.ca)).wait()
        started.append(model)
        # No --replica: the router learns the replica from the cache manager's Stats.
        router = start_router(cache.addr, "--http-port", "0", "--check-interval", "0.3", *server_tls,
                              "--auth-token-file", str(tmp / "serving-tokens"), *to_cache,
                              "--cache-token-file", str(tmp / "router-to-cache"), "--replica-tls-ca", str(pki.ca),
                              "--replica-token-file", str(tmp / "router-to-replica"),
                              credentials=channel_credentials(pki.ca))
        started.append(router)
        running = SecureFleet(pki, cache, model, router, tmp / "cache-tokens", replica)
        yield running
        running.close()
    finally:
        for service in reversed(started):
            service.process.stop(10.0)


def test_python_client_generates_over_tls_with_a_token_directly_and_through_the_router(fleet: SecureFleet):
    for addr in (fleet.model.addr, fleet.router.addr):
        with RadixKVClient(addr, root_certificates=fleet.pki.ca, token="client-tok", timeout=60) as client:
            result = client.generate(PROMPT, max_tokens=4, temperature=0, ignore_eos=True)
        assert len(result.token_ids) == 4 and result.usage.served_by == fleet.model.addr

    async def generate_async():
        async with AsyncRadixKVClient(fleet.router.addr, root_certificates=fleet.pki.ca.read_bytes(),
                                      token="client-tok", timeout=60) as client:
            return await client.generate(PROMPT, max_tokens=2, temperature=0, ignore_eos=True)

    assert len(asyncio.run(generate_async()).token_ids) == 2
    # The replica registered and stepped through the authenticated mutual-TLS cache manager.
    stats = fleet.cache_stub().Stats(pb.StatsRequest(pool_id="secure-replica"), metadata=md("admin-tok"), timeout=10)
    (pool,) = stats.pools
    assert pool.serving_addr == fleet.model.addr and pool.num_admitted >= 3 and pool.queried_tokens > 0
    # The router routed by the cache manager's Route (reader,router token: it records and pins) all
    # along, never by fallback.
    assert "cache manager unreachable" not in fleet.router.output()
    assert "UNAUTHENTICATED" not in fleet.model.output() + fleet.router.output()


def test_leaving_an_authenticated_stream_early_cancels_it(fleet: SecureFleet):
    with RadixKVClient(fleet.model.addr, root_certificates=fleet.pki.ca, token="client-tok", timeout=60) as client:
        stream = client.stream(PROMPT, max_tokens=900, ignore_eos=True)
        next(iter(stream))
        stream.close()
        deadline = time.monotonic() + 2  # the 900 tokens would take about 5 s
        while client.get_load().num_running_requests:
            assert time.monotonic() < deadline, "the request kept running after its stream was left"
            time.sleep(0.05)


def test_plaintext_to_a_tls_port_fails(fleet: SecureFleet):
    for addr in (fleet.cache.addr, fleet.model.addr, fleet.router.addr):
        with grpc.insecure_channel(addr) as channel:
            code, _ = rpc_code(lambda ch=channel: health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(), timeout=5))
        assert code == grpc.StatusCode.UNAVAILABLE, addr


def test_mutual_tls_refuses_clients_without_a_certificate_of_the_ca(fleet: SecureFleet):
    pki = fleet.pki
    for creds in (channel_credentials(pki.ca), channel_credentials(pki.ca, pki.stranger.cert, pki.stranger.key)):
        with grpc.secure_channel(fleet.cache.addr, creds) as channel:
            code, _ = rpc_code(lambda ch=channel: health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(), timeout=5))
        assert code == grpc.StatusCode.UNAVAILABLE
    # With the CA's client certificate, health answers without any token.
    health = health_pb2_grpc.HealthStub(fleet._channel(fleet.cache.addr, mutual=True))
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.SERVING


def test_missing_or_wrong_tokens_are_unauthenticated(fleet: SecureFleet):
    cache = fleet.cache_stub()
    for metadata in (None, md("wrong-tok"), (("authorization", "Basic admin-tok"),)):
        code, details = rpc_code(lambda m=metadata: cache.Stats(pb.StatsRequest(), metadata=m, timeout=5))
        assert code == grpc.StatusCode.UNAUTHENTICATED and "bearer token" in details
    for addr in (fleet.model.addr, fleet.router.addr):
        model = fleet.model_stub(addr)
        code, details = rpc_code(lambda m=model: m.Tokenize(model_pb2.TokenizeRequest(text="hi"),
                                                            metadata=md("replica-tok"), timeout=5))
        assert code == grpc.StatusCode.UNAUTHENTICATED and details == "invalid bearer token"
        code, details = rpc_code(lambda m=model: m.Tokenize(model_pb2.TokenizeRequest(text="hi"),
                                                            metadata=md("not-a-client"), timeout=5))
        assert code == grpc.StatusCode.PERMISSION_DENIED and "'client' role" in details
        health = health_pb2_grpc.HealthStub(fleet._channel(addr, mutual=False))
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == \
            health_pb2.HealthCheckResponse.SERVING


def test_a_reader_token_cannot_step_or_clear(fleet: SecureFleet):
    cache = fleet.cache_stub()
    (pool,) = cache.Stats(pb.StatsRequest(pool_id="secure-replica"), metadata=md("reader-tok"), timeout=5).pools
    code, details = rpc_code(lambda: cache.Step(pb.StepRequest(pool_id=pool.pool_id, epoch=pool.epoch),
                                                metadata=md("reader-tok"), timeout=5))
    assert code == grpc.StatusCode.PERMISSION_DENIED and "'replica' role" in details
    code, details = rpc_code(lambda: cache.Clear(pb.ClearRequest(pool_id=pool.pool_id, epoch=pool.epoch),
                                                 metadata=md("reader-tok"), timeout=5))
    assert code == grpc.StatusCode.PERMISSION_DENIED and "'admin' role" in details


def test_http_door_over_tls_checks_bearer_tokens(fleet: SecureFleet):
    url = next(line.split(" on ")[1] for line in fleet.router.log if "OpenAI HTTP API on" in line)
    assert url.startswith("https://")
    base = url.removesuffix("/v1")
    context = ssl.create_default_context(cafile=str(fleet.pki.ca))

    def get(path: str, token: str | None = None) -> tuple[int, dict]:
        request = urllib.request.Request(base + path, headers={"Authorization": f"Bearer {token}"} if token else {})
        try:
            with urllib.request.urlopen(request, timeout=10, context=context) as reply:
                return reply.status, json.loads(reply.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    assert get("/health")[0] == 200  # open
    status, body = get("/v1/models")
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert get("/v1/models", "wrong")[0] == 401
    assert get("/v1/models", "not-a-client")[0] == 403
    status, body = get("/v1/models", "client-tok")
    assert status == 200 and body["data"][0]["object"] == "model"


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "RADIXKV_TOKEN"}
    return subprocess.run([sys.executable, "-m", "client", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=60, env=env)


def test_cli_over_tls_and_tokens(fleet: SecureFleet):
    pki = fleet.pki
    result = run_cli("generate", PROMPT, "--addr", fleet.router.addr, "--root-certs", str(pki.ca), "--token",
                     "client-tok", "--max-tokens", "3", "--temperature", "0", "--ignore-eos", "--json")
    assert result.returncode == 0, result.stderr
    assert len(json.loads(result.stdout)["token_ids"]) == 3
    mutual = ["--root-certs", str(pki.ca), "--client-cert", str(pki.client.cert), "--client-key", str(pki.client.key)]
    result = run_cli("stats", "--cache-addr", fleet.cache.addr, *mutual, "--token", "reader-tok", "--json")
    assert result.returncode == 0, result.stderr
    assert "secure-replica" in {p["pool_id"] for p in json.loads(result.stdout)["pools"]}
    result = run_cli("stats", "--cache-addr", fleet.cache.addr, *mutual, "--token", "wrong-tok")
    assert result.returncode == 1 and "error: UNAUTHENTICATED: invalid bearer token" in result.stderr
    result = run_cli("stats", "--cache-addr", fleet.cache.addr, "--root-certs", str(pki.ca), "--client-cert",
                     str(pki.client.cert))
    assert result.returncode == 2 and "needs its key" in result.stderr


def test_node_client_over_tls_and_tokens(fleet: SecureFleet):
    node = shutil.which("node")
    if node is None or not (REPO / "client/node/node_modules/@grpc/grpc-js").is_dir():
        pytest.skip("node or client/node/node_modules missing (make node)")
    pki = fleet.pki

    def run_node(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([node, "client/node/radixkv.js", *args], cwd=REPO, capture_output=True, text=True,
                              timeout=60, env={k: v for k, v in os.environ.items() if k != "RADIXKV_TOKEN"})

    result = run_node("generate", PROMPT, "--addr", fleet.model.addr, "--root-certs", str(pki.ca), "--token",
                      "client-tok", "--max-tokens", "3", "--temperature", "0")
    assert result.returncode == 0, result.stderr
    mutual = ["--root-certs", str(pki.ca), "--client-cert", str(pki.client.cert), "--client-key", str(pki.client.key)]
    result = run_node("stats", "--addr", fleet.cache.addr, *mutual, "--token", "reader-tok", "--timeout", "10")
    assert result.returncode == 0, result.stderr
    assert "secure-replica" in {p["pool_id"] for p in json.loads(result.stdout)["pools"]}
    result = run_node("stats", "--addr", fleet.cache.addr, *mutual, "--timeout", "10")
    assert result.returncode == 1 and "UNAUTHENTICATED" in result.stderr
    result = run_node("stats", "--addr", fleet.cache.addr, "--root-certs", str(pki.ca), "--timeout", "10")
    assert result.returncode == 1 and "UNAVAILABLE" in result.stderr  # mutual TLS: no client certificate


def _watch(cache: cache_pb2_grpc.CacheManagerStub, token: str, until: list[int], out: list[pb.CacheEvent],
           subscribed: threading.Event) -> threading.Thread:
    """Collects the pool's events (snapshot first) until a BlockStored of the tokens `until`."""
    def run() -> None:
        call = cache.WatchEvents(pb.WatchEventsRequest(pool_id="ns-pool", snapshot=True), metadata=md(token),
                                 timeout=20)
        try:
            subscribed.set()  # set once the call is open; the snapshot covers what came before
            for event in call:
                out.append(event)
                if event.WhichOneof("event") == "stored" and list(event.stored.token_ids) == until:
                    return
        finally:
            call.cancel()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_namespace_limited_reader_sees_only_its_namespaces(fleet: SecureFleet):
    cache = fleet.cache_stub()
    rep = md("replica-tok")
    reg = cache.RegisterPool(pb.RegisterPoolRequest(worker_id="ns-pool", num_blocks=32, block_size=4),
                             metadata=rep, timeout=5)

    def store(tokens: list[int], *namespaces: str) -> None:
        admits = [pb.Admit(request_id=f"{ns}-{tokens[0]}", token_ids=tokens, namespace=ns) for ns in namespaces]
        cache.Step(pb.StepRequest(pool_id=reg.pool_id, epoch=reg.epoch, admits=admits), metadata=rep, timeout=5)
        finishes = [pb.Finish(request_id=a.request_id, num_computed_tokens=len(tokens)) for a in admits]
        cache.Step(pb.StepRequest(pool_id=reg.pool_id, epoch=reg.epoch, finishes=finishes), metadata=rep, timeout=5)

    store([1, 2, 3, 4, 5], "tenant-a", "tenant-b", "tenant-c", "")
    match = pb.MatchRequest(token_ids=[1, 2, 3, 4, 5], pool_id=reg.pool_id, namespace="tenant-b")
    assert cache.Match(match, metadata=md("tenant-tok"), timeout=5).matches[0].matched_tokens == 4
    for namespace in ("tenant-c", ""):
        match.namespace = namespace
        code, details = rpc_code(lambda: cache.Match(match, metadata=md("tenant-tok"), timeout=5))
        assert code == grpc.StatusCode.PERMISSION_DENIED and "may not read namespace" in details
    assert cache.Match(match, metadata=md("reader-tok"), timeout=5).matches[0].matched_tokens == 4

    end = [7, 7, 7, 7]
    limited: list[pb.CacheEvent] = []
    everything: list[pb.CacheEvent] = []
    ready = [threading.Event(), threading.Event()]
    watchers = [_watch(cache, "tenant-tok", end, limited, ready[0]), _watch(cache, "admin-tok", end, everything, ready[1])]
    for event in ready:
        assert event.wait(10)
    time.sleep(0.5)  # the calls reach the server and subscribe
    evicted = cache.Evict(pb.EvictRequest(pool_id=reg.pool_id, epoch=reg.epoch, num_blocks=32), metadata=md("admin-tok"),
                          timeout=5)
    assert evicted.num_evicted_blocks == 4
    store(end, "tenant-a")
    for watcher in watchers:
        watcher.join(20)
        assert not watcher.is_alive()

    def seen(events: list[pb.CacheEvent], kind: str) -> list[str]:
        return sorted(getattr(e, kind).namespace for e in events if e.WhichOneof("event") == kind)

    assert seen(everything, "stored") == ["", "tenant-a", "tenant-a", "tenant-b", "tenant-c"]
    assert seen(everything, "removed") == ["", "tenant-a", "tenant-b", "tenant-c"]  # one event per namespace
    assert seen(limited, "stored") == ["tenant-a", "tenant-a", "tenant-b"]
    assert seen(limited, "removed") == ["tenant-a", "tenant-b"]


def test_sighup_reloads_the_token_file(fleet: SecureFleet):
    cache = fleet.cache_stub()
    assert cache.Stats(pb.StatsRequest(), metadata=md("doomed-tok"), timeout=5).pools
    fleet.cache_tokens.write_text(CACHE_TOKENS.replace("doomed-tok reader\n", ""))
    os.kill(fleet.cache.process.pid, signal.SIGHUP)
    deadline = time.monotonic() + 10
    while rpc_code(lambda: cache.Stats(pb.StatsRequest(), metadata=md("doomed-tok"), timeout=5))[0] == grpc.StatusCode.OK:
        assert time.monotonic() < deadline, "the removed token still works"
        time.sleep(0.1)
    code, _ = rpc_code(lambda: cache.Stats(pb.StatsRequest(), metadata=md("doomed-tok"), timeout=5))
    assert code == grpc.StatusCode.UNAUTHENTICATED
    assert "token file" in fleet.cache.output() and fleet.cache.process.running()
    # The other tokens still work: the replica keeps serving through the cache manager.
    with RadixKVClient(fleet.router.addr, root_certificates=fleet.pki.ca, token="client-tok", timeout=60) as client:
        assert len(client.generate(PROMPT, max_tokens=2, temperature=0, ignore_eos=True).token_ids) == 2
