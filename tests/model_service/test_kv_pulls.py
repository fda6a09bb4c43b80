"""Peer KV pulls through real processes (docs/kv-pulls.md): a durable cache manager and two replicas
of the tiny model with --kv-pulls on, every call authenticated. A prompt computed on one replica is pulled,
not recomputed, by the other, with bit-identical output, from its KV pool or its host tier; the
pins end; KvTransfer refuses callers without the replica role and tickets that do not verify, name
other pages or ran out; a source SIGKILLed mid-pull leaves the puller computing, with the same
output and nothing leaked."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from protos import cache_pb2, cache_pb2_grpc, kv_transfer_pb2, kv_transfer_pb2_grpc, model_pb2, model_pb2_grpc
from testing.fault_proxy import FaultProxy
from tests.router.conftest import free_port
from tests.services import Running, launch_model, start_cache
from tests.tiny_model import save_tiny_llama

BS = 16
REPLICA_TOKEN, CLIENT_TOKEN, ADMIN_TOKEN = "replica-secret", "client-secret", "admin-secret"
PIN_SECONDS = 6.0  # the ticket runs out 2 s before the pin ends (cache_service/peer_pulls.py)


@dataclass
class PullFleet:
    cache: Running
    a: Running
    b: Running
    model: Path
    token_file: Path
    replica_token_file: Path


def replica_args(fleet_model: Path, worker: str, tokens: Path, replica_token: Path) -> list[str]:
    return ["--model", str(fleet_model), "--worker-id", worker, "--num-threads", "1", "--num-blocks", "256",
            "--kv-pulls", "on", "--auth-token-file", str(tokens), "--cache-token-file", str(replica_token),
            "--host-cache-gib", "0.01"]


@pytest.fixture(scope="module")
def pull_fleet(tmp_path_factory) -> Iterator[PullFleet]:
    root = tmp_path_factory.mktemp("pulls")
    model = save_tiny_llama(root / "model")
    tokens = root / "tokens"
    tokens.write_text(f"{REPLICA_TOKEN} replica\n{CLIENT_TOKEN} client\n{ADMIN_TOKEN}\n")
    replica_token = root / "replica-token"
    replica_token.write_text(REPLICA_TOKEN + "\n")
    # Durable: pins are journaled after the Step that made them (cache_service/durable/).
    cache = start_cache(["--auth-token-file", str(tokens), "--pull-pin-seconds", str(PIN_SECONDS),
                         "--lease-seconds", "4", "--state-dir", str(root / "state")])
    launched = [launch_model(cache.addr, *replica_args(model, w, tokens, replica_token)) for w in ("pull-a", "pull-b")]
    started: list[Running] = []
    try:
        started = [launch.wait() for launch in launched]
        yield PullFleet(cache, started[0], started[1], model, tokens, replica_token)
    finally:
        for launch in launched:
            launch.process.stop(10.0)
        cache.process.stop(5.0)


def client_md(token: str = CLIENT_TOKEN) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


def generate(addr: str, prompt: list[int], max_tokens: int = 6) -> tuple[list[int], list[float], model_pb2.Usage]:
    with grpc.insecure_channel(addr) as channel:
        stub = model_pb2_grpc.ModelServiceStub(channel)
        request = model_pb2.GenerateRequest(token_ids=model_pb2.TokenIds(ids=prompt), sampling=model_pb2.SamplingParams(
            max_tokens=max_tokens, temperature=0, logprobs=0, ignore_eos=True))
        tokens, logprobs, usage = [], [], model_pb2.Usage()
        for message in stub.Generate(request, metadata=client_md(), timeout=60):
            tokens.extend(message.token_ids)
            logprobs.extend(p.chosen.logprob for p in message.logprobs)
            if message.HasField("usage"):
                usage = message.usage
        return tokens, logprobs, usage


def pool_stats(fleet: PullFleet) -> dict[str, cache_pb2.PoolStats]:
    with grpc.insecure_channel(fleet.cache.addr) as channel:
        reply = cache_pb2_grpc.CacheManagerStub(channel).Stats(cache_pb2.StatsRequest(), metadata=client_md(ADMIN_TOKEN))
    return {p.pool_id: p for p in reply.pools}


def wait_unpinned(fleet: PullFleet, pool_id: str) -> cache_pb2.PoolStats:
    deadline = time.monotonic() + 10
    while True:
        stats = pool_stats(fleet)[pool_id]
        if stats.pulls.num_pinned_pages == 0 and stats.num_locked_blocks == 0:
            return stats
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)


def prompt(seed: int, n: int = 200) -> list[int]:
    return [(seed * 7919 + i * 31) % 1000 + 10 for i in range(n)]


def test_a_prompt_computed_on_one_replica_is_pulled_by_the_other_bit_exact(pull_fleet: PullFleet) -> None:
    p = prompt(1)
    cold, _, usage_cold = generate(pull_fleet.a.addr, p)
    assert usage_cold.cached_prompt_tokens == 0
    # The reference: a's own cache hit, which computes the same tail on the same cached prefix.
    tokens_a, logprobs_a, usage_a = generate(pull_fleet.a.addr, p)
    cacheable = (len(p) - 1) // BS * BS
    assert usage_a.cached_device_tokens == cacheable
    tokens_b, logprobs_b, usage_b = generate(pull_fleet.b.addr, p)
    assert usage_b.cached_peer_tokens == cacheable == usage_b.cached_prompt_tokens
    assert usage_b.cached_device_tokens == 0 and usage_b.miss_other_replica_tokens == 0
    assert (tokens_b, logprobs_b) == (tokens_a, logprobs_a)  # the pulled KV is a's, bit for bit
    assert tokens_b == cold
    stats_a = wait_unpinned(pull_fleet, "pull-a")
    assert stats_a.pulls.num_served_pulls >= 1 and stats_a.pulls.num_expired_pins == 0
    stats_b = pool_stats(pull_fleet)["pull-b"]
    assert stats_b.pulls.num_pulled_pages >= cacheable // BS and stats_b.pulls.num_failed_pages == 0
    # b holds the prompt now: a third request there is a plain device hit.
    _, _, usage = generate(pull_fleet.b.addr, p)
    assert usage.cached_device_tokens == cacheable and usage.cached_peer_tokens == 0


def _ticket(fleet: PullFleet, p: list[int]) -> tuple[cache_pb2.PeerPull, cache_pb2_grpc.CacheManagerStub,
                                                     cache_pb2.RegisterPoolResponse, grpc.Channel]:
    """A PeerPull for `p` (cached on a) as the cache manager gives it to a replica: a pool
    registered by hand with the replica token, which admits `p` and never pulls."""
    channel = grpc.insecure_channel(fleet.cache.addr)
    stub = cache_pb2_grpc.CacheManagerStub(channel)
    md = client_md(REPLICA_TOKEN)
    reg = stub.RegisterPool(cache_pb2.RegisterPoolRequest(
        worker_id="by-hand", num_blocks=64, block_size=BS, model_fingerprint=pool_stats(fleet)["pull-a"].model_fingerprint,
        kv_transfer_addr="127.0.0.1:1", kv_transfer_key=b"k" * 32), metadata=md)
    reply = stub.Step(cache_pb2.StepRequest(pool_id=reg.pool_id, epoch=reg.epoch, admits=[
        cache_pb2.Admit(request_id="r", token_ids=p)]), metadata=md)
    (pull,) = reply.admits[0].pulls
    assert pull.source_worker_id == "pull-a" and pull.source_addr == fleet.a.addr
    return pull, stub, reg, channel


def read_pages(addr: str, ticket: bytes, mac: bytes, token: str | None = REPLICA_TOKEN) -> list:
    with grpc.insecure_channel(addr) as channel:
        stub = kv_transfer_pb2_grpc.KvTransferStub(channel)
        md = client_md(token) if token is not None else None
        return list(stub.ReadPages(kv_transfer_pb2.ReadPagesRequest(ticket=ticket, ticket_mac=mac), metadata=md,
                                   timeout=10))


def test_kv_transfer_serves_only_signed_live_tickets_to_replicas(pull_fleet: PullFleet) -> None:
    p = prompt(2)
    generate(pull_fleet.a.addr, p)
    pull, stub, reg, channel = _ticket(pull_fleet, p)
    try:
        addr = pull_fleet.a.addr
        pages = read_pages(addr, pull.ticket, pull.ticket_mac)  # the replica role, a live ticket: served
        layers = 2  # the tiny model
        assert {m.layer for m in pages} == set(range(layers))
        assert sum(m.num_pages for m in pages) == layers * len(pull.dst)
        for token, code in ((None, grpc.StatusCode.UNAUTHENTICATED), (CLIENT_TOKEN, grpc.StatusCode.PERMISSION_DENIED)):
            with pytest.raises(grpc.RpcError) as err:
                read_pages(addr, pull.ticket, pull.ticket_mac, token)
            assert err.value.code() == code
        # A ticket changed to name other blocks (or another namespace) no longer verifies.
        ticket = kv_transfer_pb2.PullTicket.FromString(pull.ticket)
        moved = kv_transfer_pb2.PullTicket()
        moved.CopyFrom(ticket)
        moved.src[:] = [b + 1 for b in ticket.src]
        renamed = kv_transfer_pb2.PullTicket()
        renamed.CopyFrom(ticket)
        renamed.namespace = "other-tenant"
        for forged in (moved, renamed):
            with pytest.raises(grpc.RpcError) as err:
                read_pages(addr, forged.SerializeToString(), pull.ticket_mac)
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED and "signature" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            read_pages(addr, b"\x01garbage", b"0" * 32)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        # The pin lasts PIN_SECONDS; the ticket runs out before it.
        assert pool_stats(pull_fleet)["pull-a"].pulls.num_pinned_pages == len(pull.dst)
        heartbeat = cache_pb2.HeartbeatRequest(pool_id=reg.pool_id, epoch=reg.epoch)
        while time.time() < ticket.expires_at + 0.2:  # the by-hand pool stays alive (its lease is 4 s)
            stub.Heartbeat(heartbeat, metadata=client_md(REPLICA_TOKEN))
            time.sleep(0.5)
        with pytest.raises(grpc.RpcError) as err:
            read_pages(addr, pull.ticket, pull.ticket_mac)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED and "run out" in err.value.details()
        # The by-hand pool never reports its pull: the pin ends on time.
        while pool_stats(pull_fleet)["pull-a"].pulls.num_pinned_pages:
            assert time.time() < ticket.expires_at + 4, "the pin did not end"
            stub.Heartbeat(heartbeat, metadata=client_md(REPLICA_TOKEN))
            time.sleep(0.2)
        assert pool_stats(pull_fleet)["pull-a"].pulls.num_expired_pins == 1
        wait_unpinned(pull_fleet, "pull-a")
    finally:
        channel.close()


@dataclass
class ProxiedPull:
    source: Running
    source_addr: str  # its own port (the proxy is what it advertises)
    puller: Running
    proxy: FaultProxy


@contextmanager
def proxied_pull(fleet: PullFleet, latency_s: float, source_name: str, puller_name: str) -> Iterator[ProxiedPull]:
    """A fresh source replica that advertises a fault proxy in front of its port (its KvTransfer
    address is its serving address: each chunk it sends takes `latency_s`), and a fresh puller (one
    that has pulled before may have measured pulls of the tiny model as dearer than computing)."""
    port = free_port()
    with FaultProxy(f"127.0.0.1:{port}", latency_s=latency_s) as proxy:
        launched = [launch_model(fleet.cache.addr, "--port", str(port), "--advertise-addr", proxy.addr,
                                 *replica_args(fleet.model, source_name, fleet.token_file, fleet.replica_token_file)),
                    launch_model(fleet.cache.addr, *replica_args(fleet.model, puller_name, fleet.token_file,
                                                                fleet.replica_token_file))]
        try:
            source, puller = (launch.wait() for launch in launched)
            yield ProxiedPull(source, f"127.0.0.1:{port}", puller, proxy)
        finally:
            for launch in launched:
                launch.process.stop(10.0)


def test_the_puller_runs_others_during_a_pull_and_computes_when_the_source_dies_mid_pull(
        pull_fleet: PullFleet) -> None:
    p = prompt(3)
    # 0.5 s a chunk: the pull is still under way after the other request, within its deadline (3 s).
    with proxied_pull(pull_fleet, 0.5, "pull-c", "pull-e") as run:
        tokens_c, logprobs_c, _ = generate(run.source_addr, p)
        with ThreadPoolExecutor(1) as pool:
            pulled = pool.submit(generate, run.puller.addr, p)
            run.proxy.wait_for(lambda seen: "ReadPages" in seen.methods(), 30)
            other, _, _ = generate(run.puller.addr, prompt(6, 40), max_tokens=4)
            assert len(other) == 4 and not pulled.done()  # served while the pull was under way
            run.source.process.proc.kill()  # SIGKILL mid-pull: its pool stays registered until its lease ends
            run.proxy.reset_connections()
            tokens_e, logprobs_e, usage_e = pulled.result(timeout=60)
        assert (tokens_e, logprobs_e) == (tokens_c, logprobs_c)
        assert usage_e.cached_peer_tokens == 0 and usage_e.cached_prompt_tokens == 0
        deadline = time.monotonic() + 10
        while (stats := pool_stats(pull_fleet)["pull-e"]).num_running_requests:  # its finish: the next Step
            assert time.monotonic() < deadline, stats
            time.sleep(0.05)
        assert stats.pulls.num_pulls == 1 and stats.pulls.num_failed_pages == (len(p) - 1) // BS
        assert stats.num_private_blocks == 0 and stats.pulls.num_pinned_pages == 0


def test_pages_the_source_keeps_in_its_host_tier_are_pulled_from_there(pull_fleet: PullFleet) -> None:
    p = prompt(4)
    generate(pull_fleet.a.addr, p)
    tokens_a, logprobs_a, usage_a = generate(pull_fleet.a.addr, p)  # the reference: a's own hit
    cacheable = (len(p) - 1) // BS * BS
    assert usage_a.cached_device_tokens == cacheable
    # a's finish reaches the cache manager with its next Step: until then p's blocks are locked and
    # the Evict below would leave them on the device.
    wait_unpinned(pull_fleet, "pull-a")
    with grpc.insecure_channel(pull_fleet.cache.addr) as channel:
        cache = cache_pb2_grpc.CacheManagerStub(channel)
        epoch = pool_stats(pull_fleet)["pull-a"].epoch
        cache.Evict(cache_pb2.EvictRequest(pool_id="pull-a", epoch=epoch, num_blocks=256),
                    metadata=client_md(ADMIN_TOKEN))
        deadline = time.monotonic() + 20
        while True:
            (match,) = cache.Match(cache_pb2.MatchRequest(pool_id="pull-a", token_ids=p),
                                   metadata=client_md(ADMIN_TOKEN)).matches
            if (match.matched_tokens, match.matched_host_tokens) == (0, cacheable):
                break  # only a's host tier holds p
            assert match.matched_tokens == 0 and time.monotonic() < deadline, (match, pool_stats(pull_fleet)["pull-a"])
            generate(pull_fleet.a.addr, prompt(99, 20), max_tokens=1)  # a's Steps carry the copies down
    # b has computed no batch of 64 tokens or more (only the tails of pulled prompts): its pull
    # cost is not measured, so it pulls (on the tiny model a measured pull is dearer than computing).
    tokens_b, logprobs_b, usage_b = generate(pull_fleet.b.addr, p)
    assert usage_b.cached_peer_tokens == cacheable
    assert (tokens_b, logprobs_b) == (tokens_a, logprobs_a)
    stats = wait_unpinned(pull_fleet, "pull-a")
    assert stats.host_tier.num_cached_pages >= cacheable // BS
