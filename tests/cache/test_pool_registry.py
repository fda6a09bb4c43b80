"""Pool registry: registration checks, epochs, leases and their expiry (with a manual clock)."""

from __future__ import annotations

import pytest

from cache_service.errors import FailedPrecondition, InvalidArgument, NotFound
from cache_service.events import AllCleared, EventLog
from cache_service.pool_registry import PoolRegistry
from cache_service.schema import Admit, Finish, StepInput


@pytest.fixture
def registry(clock) -> PoolRegistry:
    return PoolRegistry(lease_seconds=10.0, clock=clock)


@pytest.mark.parametrize(
    "worker_id,num_blocks,block_size",
    [("", 8, 4), ("w", 0, 4), ("w", 8, 0), ("w", -1, 4), ("w", 8, -4), ("w", 1 << 30, 4)],
)
def test_register_rejects_bad_arguments(registry, worker_id, num_blocks, block_size) -> None:
    with pytest.raises(InvalidArgument):
        registry.register(worker_id, num_blocks, block_size)
    assert registry.pools == {}


def test_epochs_are_unique_and_increasing(registry) -> None:
    epochs = [registry.register("w", 8, 4).epoch for _ in range(5)]
    assert epochs == sorted(set(epochs))
    other = PoolRegistry()  # a restarted server: epochs seeded from the wall clock
    assert other.register("w", 8, 4).epoch > 0


def test_pool_id_is_worker_id_and_reregistering_retires_the_old_pool(registry) -> None:
    old = registry.register("w", 8, 4)
    assert old.pool_id == "w"
    old.step(StepInput(admits=[Admit("r", [1, 2, 3, 4, 5])]))
    new = registry.register("w", 8, 4)
    assert new.epoch != old.epoch and registry.get("w", new.epoch) is new
    assert old.stats().num_free_blocks == 8 and old.requests == {}  # fully reclaimed
    old.check_integrity()
    with pytest.raises(FailedPrecondition, match="stale epoch"):
        registry.get("w", old.epoch)


def test_unknown_pool_is_not_found(registry) -> None:
    with pytest.raises(NotFound):
        registry.get("nobody", 1)
    with pytest.raises(NotFound):
        registry.peek("nobody")
    with pytest.raises(NotFound):
        registry.heartbeat("nobody", 1)


def test_calls_renew_the_lease(registry, clock) -> None:
    pool = registry.register("w", 8, 4)
    for _ in range(5):
        clock.now += 8.0
        registry.heartbeat("w", pool.epoch)
        assert registry.expire_leases() == []
    assert registry.lease_remaining(pool) == pytest.approx(10.0)
    clock.now += 3.0
    registry.get("w", pool.epoch)  # the getter used by Step / Evict / Clear renews as well
    clock.now += 9.0
    assert registry.expire_leases() == []


def test_expired_lease_reclaims_the_pool(clock) -> None:
    events = EventLog()
    registry = PoolRegistry(lease_seconds=10.0, events=events, clock=clock)
    dead = registry.register("dead", 8, 4)
    alive = registry.register("alive", 8, 4)
    for pool in (dead, alive):
        pool.step(StepInput(admits=[Admit("a", list(range(9)))]))
        pool.step(StepInput(finishes=[Finish("a", [], 9)]))
        pool.step(StepInput(admits=[Admit("b", list(range(9)) + [7, 7, 7])]))
    clock.now += 6.0
    registry.heartbeat("alive", alive.epoch)
    clock.now += 6.0
    assert registry.expire_leases() == ["dead"]
    assert list(registry.pools) == ["alive"]
    assert dead.stats().num_free_blocks == 8 and dead.stats().num_running_requests == 0
    dead.check_integrity()
    last = events.replay(events.last_sequence)[-1]
    assert isinstance(last.payload, AllCleared) and last.pool_id == "dead"
    assert alive.stats().num_running_requests == 1  # the other pool is untouched
    with pytest.raises(FailedPrecondition, match="lease expired"):
        registry.get("dead", dead.epoch)
    with pytest.raises(NotFound):
        registry.peek("dead")  # gone from Stats / Match
    fresh = registry.register("dead", 8, 4)
    assert registry.get("dead", fresh.epoch) is fresh


def test_late_call_after_deadline_fails_even_before_the_sweep(registry, clock) -> None:
    pool = registry.register("w", 8, 4)
    clock.now += 10.0
    with pytest.raises(FailedPrecondition):
        registry.get("w", pool.epoch)
    assert registry.pools == {}
