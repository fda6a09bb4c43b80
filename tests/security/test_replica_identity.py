"""Replica identity and the cache manager's resource caps, through real `python -m cache_service`
processes: a token registers only the worker ids its `worker=` allows; a live (or restored) pool
is not taken over or retired by another principal, across a `--state-dir` restart too; under
mutual TLS the worker id must be a subject alternative name of the client certificate; pools and
their memory are capped with RESOURCE_EXHAUSTED, and a refused registration changes nothing."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from common.security import channel_credentials
from protos import cache_pb2 as pb
from protos import cache_pb2_grpc
from tests.security.certs import KeyPair, Pki, client_cert, make_pki
from tests.services import Running, start_cache

TOKENS = """\
admin-tok admin,reader
rep-a replica worker=replica-a|replica-a2|replica-a3
rep-b replica worker=replica-b*
rep-any replica
rep-other replica
"""


def md(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def register_request(worker: str, num_blocks: int = 32, block_size: int = 4, addr: str = "",
                     incarnation: str = "") -> pb.RegisterPoolRequest:
    return pb.RegisterPoolRequest(worker_id=worker, num_blocks=num_blocks, block_size=block_size,
                                  model_fingerprint="fp", serving_addr=addr, incarnation=incarnation)


def refused(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code(), err.value.details() or ""


def pools(stub: cache_pb2_grpc.CacheManagerStub, token: str | None = "admin-tok") -> list[tuple]:
    """What Stats says of every pool, less the lease clock."""
    reply = stub.Stats(pb.StatsRequest(), metadata=md(token) if token else None, timeout=10)
    return sorted((p.pool_id, p.epoch, p.num_blocks, p.serving_addr, p.restored) for p in reply.pools)


class Cache:
    """A cache manager process with a token file, and a plaintext stub to it."""

    def __init__(self, tmp: Path, *extra: str) -> None:
        tokens = tmp / "cache-tokens"
        tokens.write_text(TOKENS)
        self.running: Running = start_cache(["--auth-token-file", str(tokens), *extra])
        self.channel = grpc.insecure_channel(self.running.addr)
        self.stub = cache_pb2_grpc.CacheManagerStub(self.channel)

    def register(self, token: str, request: pb.RegisterPoolRequest) -> pb.RegisterPoolResponse:
        return self.stub.RegisterPool(request, metadata=md(token), timeout=10)

    def stop(self) -> None:
        self.channel.close()
        self.running.process.stop(10.0)


@pytest.fixture
def caches(tmp_path: Path) -> Iterator:
    started: list[Cache] = []

    def start(*extra: str) -> Cache:
        started.append(Cache(tmp_path, *extra))
        return started[-1]

    try:
        yield start
    finally:
        for cache in started:
            cache.stop()


def test_a_token_registers_only_the_worker_ids_of_its_worker_field(caches) -> None:
    cache = caches()
    code, details = refused(lambda: cache.register("rep-b", register_request("replica-a")))
    assert code == grpc.StatusCode.PERMISSION_DENIED
    assert "'replica-a'" in details and "worker=" in details
    assert pools(cache.stub) == []
    cache.register("rep-b", register_request("replica-b7"))  # its pattern: replica-b*
    cache.register("rep-a", register_request("replica-a"))
    assert [p[0] for p in pools(cache.stub)] == ["replica-a", "replica-b7"]


def test_another_principal_can_neither_take_over_nor_retire_a_live_pool(caches) -> None:
    cache = caches()
    reg = cache.register("rep-a", register_request("replica-a", addr="10.0.0.1:50052", incarnation="inc-a"))
    before = pools(cache.stub)
    for incarnation in ("", "inc-a"):  # a fresh pool, or the re-attach of the real one
        hijack = register_request("replica-a", num_blocks=4096, addr="6.6.6.6:50052", incarnation=incarnation)
        code, details = refused(lambda h=hijack: cache.register("rep-any", h))
        assert code == grpc.StatusCode.PERMISSION_DENIED and "held by another principal" in details
        assert "rep-a" not in details and "cache-tokens" not in details  # nothing about who holds it
    assert pools(cache.stub) == before
    # The real replica's pool lives on: its heartbeat (same epoch) still renews it.
    cache.stub.Heartbeat(pb.HeartbeatRequest(pool_id="replica-a", epoch=reg.epoch), metadata=md("rep-a"), timeout=10)
    # Its own principal keeps today's semantics: re-registering gives a new pool.
    again = cache.register("rep-a", register_request("replica-a", addr="10.0.0.1:50052"))
    assert again.epoch != reg.epoch and not again.restored


def test_a_restored_pool_is_re_attachable_by_its_owner_only(caches, tmp_path: Path) -> None:
    state = tmp_path / "state"
    cache = caches("--state-dir", str(state))
    reg = cache.register("rep-any", register_request("replica-x", incarnation="inc-x", addr="10.0.0.9:50052"))
    cache.stub.Step(pb.StepRequest(pool_id="replica-x", epoch=reg.epoch,
                                   admits=[pb.Admit(request_id="r", token_ids=list(range(1, 10)))]),
                    metadata=md("rep-any"), timeout=10)
    cache.stop()
    cache = caches("--state-dir", str(state))  # a restart (a new port: the stub follows)
    before = pools(cache.stub)
    assert before == [("replica-x", reg.epoch, 32, "10.0.0.9:50052", True)]
    code, details = refused(lambda: cache.register("rep-other", register_request("replica-x", incarnation="inc-x")))
    assert code == grpc.StatusCode.PERMISSION_DENIED and "held by another principal" in details
    assert pools(cache.stub) == before
    back = cache.register("rep-any", register_request("replica-x", incarnation="inc-x", addr="10.0.0.9:50052"))
    assert back.restored and [r.request_id for r in back.running_requests] == ["r"]


def test_pool_caps_refuse_with_resource_exhausted_and_change_nothing(caches) -> None:
    cache = caches("--max-pools", "3", "--max-pools-per-principal", "2")
    cache.register("rep-a", register_request("replica-a"))
    cache.register("rep-a", register_request("replica-a2"))
    before = pools(cache.stub)
    code, details = refused(lambda: cache.register("rep-a", register_request("replica-a3")))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_pools_per_principal 2" in details
    assert pools(cache.stub) == before
    cache.register("rep-a", register_request("replica-a"))  # replacing its own pool is no new pool
    cache.register("rep-b", register_request("replica-b1"))
    before = pools(cache.stub)
    code, details = refused(lambda: cache.register("rep-b", register_request("replica-b2")))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_pools 3" in details
    assert pools(cache.stub) == before


def test_the_default_memory_budget_refuses_a_huge_pool(caches) -> None:
    cache = caches()
    cache.register("rep-a", register_request("replica-a", num_blocks=65536, block_size=16))
    before = pools(cache.stub)
    for worker, token in (("replica-a2", "rep-a"), ("replica-a", "rep-a"), ("replica-b", "rep-b")):
        huge = register_request(worker, num_blocks=1 << 24, block_size=16)
        code, details = refused(lambda h=huge, t=token: cache.register(t, h))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_cache_memory_mib 4096" in details
    assert pools(cache.stub) == before


def test_cap_flags_are_checked(capsys) -> None:
    from cache_service.__main__ import main

    for flag, value in (("--max-pools", "-1"), ("--max-pools-per-principal", "-2"), ("--max-cache-memory-mib", "-5")):
        with pytest.raises(SystemExit) as err:
            main([flag, value])
        assert err.value.code == 2
        assert f"{flag} must be >= 0" in capsys.readouterr().err


# ---------------------------------------------------------------------- mutual TLS


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("identity-pki"))


def mtls_cache(pki: Pki, *extra: str) -> Running:
    return start_cache(["--tls-cert", str(pki.server.cert), "--tls-key", str(pki.server.key),
                        "--tls-client-ca", str(pki.ca), *extra],
                       credentials=channel_credentials(pki.ca, pki.client.cert, pki.client.key))


def mtls_stub(cache: Running, pki: Pki, pair: KeyPair, channels: list) -> cache_pb2_grpc.CacheManagerStub:
    channel = grpc.secure_channel(cache.addr, channel_credentials(pki.ca, pair.cert, pair.key))
    channels.append(channel)
    return cache_pb2_grpc.CacheManagerStub(channel)


def test_under_mutual_tls_the_worker_id_is_a_name_of_the_client_certificate(pki: Pki) -> None:
    replica = client_cert(pki, "replica-c", dns=["replica-c"], uris=["spiffe://radixkv/replica-u"])
    twin = client_cert(pki, "replica-c-twin", dns=["replica-c"])  # another certificate of the same name
    cache = mtls_cache(pki)
    channels: list[grpc.Channel] = []
    try:
        stub = mtls_stub(cache, pki, replica, channels)
        reg = stub.RegisterPool(register_request("replica-c", addr="10.0.0.3:50052"), timeout=10)
        stub.RegisterPool(register_request("spiffe://radixkv/replica-u"), timeout=10)
        for worker in ("replica-d", "replica-c.example", "spiffe://radixkv/replica-c"):
            code, details = refused(lambda w=worker: stub.RegisterPool(register_request(w), timeout=10))
            assert code == grpc.StatusCode.PERMISSION_DENIED and "subject alternative name" in details, worker
        # The CA's plain client certificate (no SAN) registers nothing.
        plain = mtls_stub(cache, pki, pki.client, channels)
        code, _ = refused(lambda: plain.RegisterPool(register_request("client"), timeout=10))
        assert code == grpc.StatusCode.PERMISSION_DENIED
        # Without tokens the owner is the certificate: a second certificate naming the same worker
        # cannot take over the first one's live pool.
        other = mtls_stub(cache, pki, twin, channels)
        code, details = refused(lambda: other.RegisterPool(register_request("replica-c"), timeout=10))
        assert code == grpc.StatusCode.PERMISSION_DENIED and "held by another principal" in details
        stats = stub.Stats(pb.StatsRequest(pool_id="replica-c"), timeout=10).pools[0]
        assert (stats.epoch, stats.serving_addr) == (reg.epoch, "10.0.0.3:50052")
    finally:
        for channel in channels:
            channel.close()
        cache.process.stop(10.0)


def test_worker_san_check_off(pki: Pki) -> None:
    cache = mtls_cache(pki, "--worker-san-check", "off")
    channels: list[grpc.Channel] = []
    try:
        stub = mtls_stub(cache, pki, pki.client, channels)
        stub.RegisterPool(register_request("any-worker"), timeout=10)
    finally:
        for channel in channels:
            channel.close()
        cache.process.stop(10.0)
