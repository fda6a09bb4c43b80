"""The durable cache manager with peer pulls (cache_service/peer_pulls.py, durable/): a pull's pin
changes what its source may evict, so pins are journaled and kept in snapshots. Random traffic of
two replicas that pull from each other (test_durable's driver, reporting random pull outcomes):
snapshot + replay gives the live state, pins included, and the same further traffic the same
results."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cache_service.pool_registry import PoolRegistry
from protos import cache_pb2
from tests.cache.test_durable import (
    BS,
    NUM_BLOCKS,
    WORKERS,
    Driver,
    crash,
    new_registry,
    open_durable,
    run_then_restore,
    same_further_traffic,
    state,
)

KEYS = {w: bytes([65 + i]) * 32 for i, w in enumerate(WORKERS)}


class PullDriver(Driver):
    """Replicas registered for pulls; each Step reports the last reply's pulls (some short, some not at all)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.pulls: dict[str, list] = {w: [] for w in WORKERS}
        self.num_pulls = 0

    def register(self, worker: str) -> None:
        reg = self.registry.register_replica(worker, NUM_BLOCKS, BS, "m", 3, f"{worker}:1",
                                             incarnation=f"inc-{worker}", kv_transfer_addr=f"{worker}:2",
                                             kv_transfer_key=KEYS[worker])
        if not reg.reattached:
            self.running[worker] = {}
        self.pulls[worker] = []
        self._recorded()

    def step_request(self, worker: str) -> cache_pb2.StepRequest:
        request = super().step_request(worker)
        for pull in self.pulls[worker]:
            if self.rng.random() < 0.9:
                request.pull_outcomes.add(copy_id=pull.pull_id, num_pages_copied=self.rng.randint(0, len(pull.src)))
        self.pulls[worker] = []
        return request

    def on_result(self, worker: str, result: object) -> None:
        pulls = [p for a in result.admits for p in a.pulls]
        self.pulls[worker] = pulls
        self.num_pulls += len(pulls)


def pinned(registry: PoolRegistry) -> int:
    return sum(pool.pulls.pinned_pages for pool in registry.pools.values())


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), num_ops=st.integers(1, 120), tail=st.integers(0, 40))
def test_pins_survive_a_restart_exactly(tmp_path_factory, seed: int, num_ops: int, tail: int) -> None:
    driver, expected, restored, durable2 = run_then_restore(PullDriver, tmp_path_factory, seed, num_ops)
    live = driver.registry
    pins = pinned(live)
    assert state(restored) == expected
    assert pinned(restored) == pins and restored.peer_pulls
    # Further traffic (both sides re-registered: the pullers' pins end then) gives the same states.
    for registry in (live, restored):
        for pool in list(registry.pools.values()):
            registry.register_replica(pool.worker_id, NUM_BLOCKS, BS, "m", 3, f"{pool.worker_id}:1",
                                      incarnation=f"inc-{pool.worker_id}", kv_transfer_addr=f"{pool.worker_id}:2",
                                      kv_transfer_key=KEYS[pool.worker_id])
    assert pinned(live) == pinned(restored) == 0
    driver.pulls = {w: [] for w in WORKERS}  # ended with the re-registrations
    same_further_traffic(driver, restored, durable2, seed, tail)
    durable2.close()


def test_the_driver_makes_pulls_and_pins_outlive_a_snapshot(tmp_path) -> None:
    """The property above is not vacuous: its traffic pulls, and a snapshot taken while pins are
    held restores them (the journal after it alone would not)."""
    path = str(tmp_path / "state")
    live = new_registry()
    durable = open_durable(path, live)
    driver = PullDriver(live, durable, random.Random(3))
    driver.snapshots = False
    for _ in range(300):
        driver.random_op()
        if pinned(live):
            break
    assert driver.num_pulls and pinned(live)
    durable.snapshot()  # pins held now are only in the snapshot
    for pool in live.pools.values():
        pool.drop_routed()  # as recovery does
    expected, pins = state(live), pinned(live)
    crash(durable)
    restored = new_registry()
    open_durable(path, restored)
    assert state(restored) == expected and pinned(restored) == pins
    restored.check_integrity()
