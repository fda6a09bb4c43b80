"""The registry's core of replica identity and resource caps (no gRPC): a pool's owner, refusal of
another owner's registration of a live or restored worker id, the owner across a durable restart,
and the caps on pools (total, per owner) and on the memory their blocks may take."""

from __future__ import annotations

import gc
import hashlib
import json
import random
import ssl
import tracemalloc

import pytest

from cache_service.durable import DurableState
from cache_service.durable.replay import Kind, Replayer
from cache_service.durable.snapshot import dump_pool, restore_pool
from cache_service.errors import InvalidArgument, PermissionDenied, ResourceExhausted
from cache_service.events import EventLog
from cache_service.pool_registry import PoolRegistry
from cache_service.registry_limits import (
    DEFAULT_MAX_MEMORY_BYTES,
    DEFAULT_MAX_POOLS,
    DEFAULT_MAX_POOLS_PER_OWNER,
    RegistryLimits,
    block_cost_bytes,
    pool_memory_bytes,
)
from cache_service.replica_identity import certificate_digest, certificate_names, owner_key
from cache_service.schema import Admit, Finish, StepInput
from common.auth import parse_tokens


def new_registry(clock, limits: RegistryLimits | None = None) -> PoolRegistry:
    if limits is None:
        return PoolRegistry(lease_seconds=10.0, clock=clock)
    return PoolRegistry(lease_seconds=10.0, clock=clock, limits=limits)


# ---------------------------------------------------------------------- owners


def test_a_live_pool_is_not_taken_over_by_another_owner(clock) -> None:
    registry = new_registry(clock)
    pool = registry.register("w", 8, 4, serving_addr="10.0.0.1:50052", owner="alice-key")
    assert pool.attach.owner == "alice-key"
    pool.step(StepInput(admits=[Admit("r", [1, 2, 3, 4, 5])]))
    clock.now += 5
    for incarnation in ("", "inc-1"):
        with pytest.raises(PermissionDenied, match="held by another principal") as err:
            registry.register_replica("w", 1 << 20, 4, serving_addr="6.6.6.6:1", incarnation=incarnation,
                                      owner="mallory-key")
        assert "alice" not in str(err.value) and "mallory" not in str(err.value)
    # untouched: same pool object, epoch, address, requests; the refusal did not renew its lease
    assert registry.pools["w"] is pool and pool.serving_addr == "10.0.0.1:50052" and "r" in pool.requests
    assert registry.lease_remaining(pool) == pytest.approx(5.0)
    assert registry.get("w", pool.epoch) is pool
    pool.check_integrity()


def test_the_same_owner_keeps_todays_semantics(clock) -> None:
    registry = new_registry(clock)
    old = registry.register_replica("w", 8, 4, incarnation="inc-1", owner="alice").pool
    kept = registry.register_replica("w", 8, 4, incarnation="inc-1", owner="alice")
    assert kept.reattached and kept.pool is old
    new = registry.register("w", 8, 4, owner="alice")  # no incarnation: the old pool is retired
    assert new is not old and new.attach.owner == "alice" and registry.pools["w"] is new


def test_an_expired_pool_may_be_registered_by_anyone_allowed(clock) -> None:
    registry = new_registry(clock)
    old = registry.register("w", 8, 4, owner="alice")
    clock.now += 10.0  # the lease ran out (not yet reaped)
    pool = registry.register("w", 8, 4, owner="bob")
    assert pool.attach.owner == "bob" and registry.pools["w"] is pool and old is not pool


def test_anonymous_owners_are_one_principal(clock) -> None:
    registry = new_registry(clock)
    first = registry.register("w", 8, 4)
    assert first.attach.owner == ""
    assert registry.register("w", 8, 4) is not first  # no auth: re-registration as before


def test_bad_input_is_invalid_argument_before_any_owner_check(clock) -> None:
    registry = new_registry(clock)
    registry.register("w", 8, 4, owner="alice")
    with pytest.raises(InvalidArgument):
        registry.register("w", 0, 4, owner="bob")


def _durable(path, clock) -> tuple[PoolRegistry, DurableState]:
    registry = PoolRegistry(lease_seconds=10.0, clock=clock)
    durable = DurableState(str(path), registry, snapshot_bytes=1 << 30)
    durable.recover()
    return registry, durable


def _crash(durable: DurableState) -> None:
    durable.journal.close()
    durable.journal = None
    durable.close()


def test_the_owner_survives_journal_replay_and_snapshots(tmp_path, clock) -> None:
    registry, durable = _durable(tmp_path, clock)
    registry.register_replica("w", 8, 4, incarnation="inc-1", owner="alice")
    _crash(durable)  # the registration is in the journal only
    for _ in range(2):  # then from the snapshot taken after the first recovery
        registry, durable = _durable(tmp_path, clock)
        restored = registry.pools["w"]
        assert restored.attach.owner == "alice" and restored.attach.awaiting_reattach
        with pytest.raises(PermissionDenied, match="held by another principal"):
            registry.register_replica("w", 8, 4, incarnation="inc-1", owner="mallory")
        assert registry.pools["w"] is restored and restored.attach.awaiting_reattach
        _crash(durable)
    registry, durable = _durable(tmp_path, clock)
    reg = registry.register_replica("w", 8, 4, incarnation="inc-1", owner="alice")
    assert reg.reattached and reg.pool.attach.owner == "alice"
    durable.close()


def test_records_and_snapshots_without_an_owner_read_as_anonymous(clock) -> None:
    registry = new_registry(clock)
    old_record = {"worker_id": "w", "num_blocks": 8, "block_size": 4, "model_fingerprint": "fp", "vocab_size": 0,
                  "serving_addr": "", "incarnation": "inc", "epoch": 7, "reattached": False}
    Replayer(registry, lambda *_: None).apply(Kind.REGISTER, json.dumps(old_record).encode())
    assert registry.pools["w"].attach.owner == ""
    data = dump_pool(registry.register("v", 8, 4, owner="alice"))
    assert data["owner"] == "alice"
    del data["owner"]
    assert restore_pool(data, None).attach.owner == ""


# ---------------------------------------------------------------------- caps


def test_pool_count_caps_total_and_per_owner(clock) -> None:
    registry = new_registry(clock, RegistryLimits(max_pools=3, max_pools_per_owner=2, max_memory_bytes=0))
    a1 = registry.register("a1", 8, 4, owner="a")
    registry.register("a2", 8, 4, owner="a")
    with pytest.raises(ResourceExhausted, match=r"2 pools.*max_pools_per_principal 2"):
        registry.register("a3", 8, 4, owner="a")
    assert registry.register("a1", 8, 4, owner="a") is not a1  # replaces its own pool: not counted twice
    registry.register("b1", 8, 4, owner="b")
    with pytest.raises(ResourceExhausted, match=r"3 pools.*max_pools 3"):
        registry.register("b2", 8, 4, owner="b")
    assert sorted(registry.pools) == ["a1", "a2", "b1"]
    clock.now += 10.0
    registry.expire_leases()  # retired pools free their slots
    registry.register("b2", 8, 4, owner="b")


def test_the_anonymous_owner_has_no_per_owner_cap(clock) -> None:
    # Without tokens or client certificates every replica is owner "": only the total applies.
    registry = new_registry(clock, RegistryLimits(max_pools=4, max_pools_per_owner=1, max_memory_bytes=0))
    for i in range(4):
        registry.register(f"w{i}", 8, 4)
    with pytest.raises(ResourceExhausted, match="max_pools 4"):
        registry.register("w4", 8, 4)


def test_memory_budget_counts_each_pool_once_and_refusals_change_nothing(clock) -> None:
    budget = 2 * pool_memory_bytes(100, 4)
    registry = new_registry(clock, RegistryLimits(max_pools=0, max_pools_per_owner=0, max_memory_bytes=budget))
    registry.register("a", 100, 4, owner="a")
    b = registry.register("b", 100, 4, owner="b")
    with pytest.raises(ResourceExhausted, match="max_cache_memory_mib"):
        registry.register("c", 1, 4, owner="c")
    a = registry.register("a", 100, 4, owner="a")  # its old pool's share is replaced
    with pytest.raises(ResourceExhausted, match="max_cache_memory_mib"):
        registry.register("a", 101, 4, owner="a")
    assert registry.pools == {"a": a, "b": b} and registry.get("a", a.epoch) is a  # the old pool stays


def test_replay_is_never_refused_by_caps_or_owners(clock) -> None:
    # A restart with smaller caps must still rebuild what the previous process accepted.
    registry = new_registry(clock, RegistryLimits(max_pools=1, max_pools_per_owner=1, max_memory_bytes=1))
    registry.register_replica("a", 64, 4, epoch=10, owner="a")
    registry.register_replica("b", 64, 4, epoch=11, owner="b")
    registry.register_replica("a", 64, 4, epoch=12, owner="c")
    assert sorted(registry.pools) == ["a", "b"] and registry.pools["a"].attach.owner == "c"
    with pytest.raises(ResourceExhausted):
        registry.register("d", 1, 4, owner="d")


def test_default_limits_refuse_a_huge_pool_but_not_real_fleets(clock) -> None:
    registry = new_registry(clock)
    assert registry.limits == RegistryLimits()
    with pytest.raises(ResourceExhausted, match="max_cache_memory_mib"):
        registry.register("huge", 1 << 24, 16, owner="a")
    with pytest.raises(ResourceExhausted, match="max_cache_memory_mib"):
        registry.register("huge", 1 << 24, 1, owner="a")
    assert registry.pools == {}
    # 16 replicas of 100k blocks of 16 tokens (a GPU fleet), each its own principal
    for i in range(16):
        registry.register(f"gpu-{i}", 100_000, 16, owner=f"p{i}")
    assert DEFAULT_MAX_POOLS == 256 and DEFAULT_MAX_POOLS_PER_OWNER == 16
    assert DEFAULT_MAX_MEMORY_BYTES == 4 << 30


def test_zero_turns_a_cap_off(clock) -> None:
    registry = new_registry(clock, RegistryLimits.unlimited())
    registry.register("huge", 1 << 24, 16, owner="a")
    with pytest.raises(ValueError):
        RegistryLimits(max_pools=-1)


@pytest.mark.parametrize("block_size, pages_per_prompt, running, id_len", [
    (16, 1, False, 8),  # one tree node per page: the tree's worst case
    (1, 1, False, 8),
    (64, 1, False, 8),
    (16, 1, True, 256),  # running requests: their prompts as int tuples, long request ids
    (64, 1, True, 8),
])
def test_the_block_cost_bounds_what_a_full_pool_takes(block_size, pages_per_prompt, running, id_len) -> None:
    """What one block can make the registry hold, measured: a pool whose every block is cached in
    the tree (after a first fill was evicted, so the evicted-page memory is full too), or held by
    running requests; the events buffer (its own --event-buffer-mb) and the finished-id memory
    (bounded per pool) excluded."""
    num_blocks = 2048
    gc.collect()
    tracemalloc.start()
    try:
        registry = PoolRegistry(lease_seconds=3600, events=EventLog(capacity=1, max_bytes=1))
        pool = registry.register("w", num_blocks, block_size, "fp")
        pool._max_finished_ids = 1
        base = tracemalloc.get_traced_memory()[0]
        rng = random.Random(7)
        n = 0
        for _ in range(1 if running else 2):
            for _ in range(num_blocks // pages_per_prompt - 1):
                tokens = [rng.randrange(1 << 31) for _ in range(pages_per_prompt * block_size)]
                rid = f"r{n}".ljust(id_len, "x")
                n += 1
                pool.step(StepInput(admits=[Admit(rid, tokens)]))
                if not running:
                    pool.step(StepInput(finishes=[Finish(rid, num_computed_tokens=len(tokens))]))
        hashed = sum(len(node.hashes) for node in pool.tree.iter_nodes())  # as events, Route, miss reasons do
        assert hashed == pool.tree.total_size
        gc.collect()
        used = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert used <= pool_memory_bytes(num_blocks, block_size), (used / num_blocks, block_cost_bytes(block_size))


# ---------------------------------------------------------------------- identity from a connection


def test_identity_from_the_auth_context(tmp_path) -> None:
    from tests.security.certs import make_pki  # cryptography: a dev dependency, tests only

    pem = make_pki(tmp_path).client.cert.read_bytes()  # any certificate: the digest is of its DER bytes
    der = ssl.PEM_cert_to_DER_cert(pem.decode())
    context = {"transport_security_type": [b"ssl"], "x509_pem_cert": [pem],
               "peer_dns": [b"model-3", b"model-4"], "peer_uri": [b"spiffe://radixkv/model-5"],
               "peer_email": [b"model-6"]}
    assert certificate_names(context) == {"model-3", "model-4", "spiffe://radixkv/model-5"}
    assert certificate_names({}) == frozenset()
    digest = certificate_digest(context)
    assert digest == hashlib.sha256(der).hexdigest()[:32] and certificate_digest({}) is None
    principal = parse_tokens("tok replica worker=model-*", "t")["tok"]
    assert owner_key(principal, context) == principal.key  # a token is the principal when there is one
    assert owner_key(None, context) == f"x509:{digest}"  # else the client certificate
    assert owner_key(None, {}) == ""  # else anonymous
