"""The durable cache manager (cache_service/durable/) restores lower-tier residency exactly.

Two replicas with tiers (w0: host + disk, evict policy, its disk announcing pages at
registration; w1: disk only, write-through) are driven with random traffic as the servicer
applies it: Steps with admissions (tier loads), finishes, releases, commits, extensions, copy
outcomes (complete, partial, late, or never sent), reported load costs, admin Evict / Clear,
retirements, re-registrations, snapshots at random points. Recovering a fresh registry from the
state dir must give the live pools, tiers included (snapshot.canonical: each tier's tree, free
slots, counters, pending and queued copies), and both must behave the same afterwards.
"""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cache_service.durable.snapshot import canonical
from cache_service.pool_registry import PoolRegistry
from cache_service.schema import DiskRun, TierSpec
from common.token_bytes import encode_tokens
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

# w0's disk announces STEMS[0]'s first two pages (BS 2) in slots 3 and 5 at every registration.
W0_RUNS = [DiskRun("", encode_tokens([0, 1, 2, 0]), [3, 5])]
SPECS = {"w0": lambda: TierSpec(6, 8, "evict", list(W0_RUNS)),
         "w1": lambda: TierSpec(0, 6, "write-through", [])}


class TierDriver(Driver):
    """test_durable's Driver, with tiers: copy outcomes go back in later Steps, as a replica sends them."""

    def __init__(self, registry: PoolRegistry, durable, rng: random.Random) -> None:
        super().__init__(registry, durable, rng)
        self.copies: dict[str, list[cache_pb2.TierCopy]] = {w: [] for w in WORKERS}  # ordered, not reported
        self.num_copies = 0
        self.num_tier_ops = 0

    def adopt(self, other: Driver) -> None:
        super().adopt(other)
        self.copies = {w: list(c) for w, c in other.copies.items()}

    def register(self, worker: str) -> None:
        reg = self.registry.register_replica(worker, NUM_BLOCKS, BS, "m", 3, f"{worker}:1",
                                             incarnation=f"inc-{worker}", tiers=SPECS[worker]())
        if not reg.reattached:
            self.running[worker] = {}
            self.copies[worker] = []  # a new pool: the old one's copy ids mean nothing to it
        self._recorded()

    def step_request(self, worker: str) -> cache_pb2.StepRequest:
        req = super().step_request(worker)
        rng, pending = self.rng, self.copies[worker]
        kept = []
        for copy in pending:
            r = rng.random()
            if r < 0.6:
                req.copy_outcomes.add(copy_id=copy.copy_id, num_pages_copied=len(copy.src))
            elif r < 0.75:  # partial: a failed write or a torn read
                req.copy_outcomes.add(copy_id=copy.copy_id, num_pages_copied=rng.randint(0, len(copy.src) - 1))
            elif r < 0.95:
                kept.append(copy)  # reported in a later Step
            # else: never reported (the replica died with it, say)
        self.copies[worker] = kept
        if rng.random() < 0.3:
            req.load.host_load_cost = rng.choice((0.0, 0.1, 2.0))  # 2.0: slower than computing, not loaded
            req.load.disk_load_cost = rng.choice((0.0, 0.3, 1.5))
        return req

    def on_result(self, worker: str, result) -> None:
        ordered = list(result.offloads) + [c for a in result.admits for c in a.loads]
        self.copies[worker].extend(ordered)
        self.num_copies += len(ordered)


def _tier_state(registry: PoolRegistry) -> dict[str, object]:
    return {pid: canonical(pool)["tiers"] for pid, pool in registry.pools.items()}


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), num_ops=st.integers(1, 150), tail=st.integers(0, 40))
def test_snapshot_plus_replay_restores_tiers(tmp_path_factory, seed: int, num_ops: int, tail: int) -> None:
    driver, expected, restored, durable2 = run_then_restore(TierDriver, tmp_path_factory, seed, num_ops)
    live = driver.registry
    assert all(data["tiers"] is not None for data in expected.values())
    assert _tier_state(restored) == _tier_state(live)
    assert state(restored) == expected
    # The same further traffic (copy outcomes included) gives the same states.
    for pool in restored.pools.values():
        restored.register_replica(pool.worker_id, NUM_BLOCKS, BS, "m", 3, f"{pool.worker_id}:1",
                                  incarnation=f"inc-{pool.worker_id}", tiers=SPECS[pool.worker_id]())
    for pool in live.pools.values():
        live.register_replica(pool.worker_id, NUM_BLOCKS, BS, "m", 3, f"{pool.worker_id}:1",
                              incarnation=f"inc-{pool.worker_id}", tiers=SPECS[pool.worker_id]())
        pool.epoch = restored.pools[pool.pool_id].epoch
    assert state(restored) == state(live)  # both re-attached: pending copies dropped alike
    same_further_traffic(driver, restored, durable2, seed, tail)
    durable2.close()


def test_the_driver_exercises_the_tiers(tmp_path) -> None:
    """Guards the property test above against vacuity: over a fixed run, pages reach both tiers,
    come back as loads, fail partially, and the journal + snapshot restore a non-empty tier state."""
    live = new_registry()
    durable = open_durable(str(tmp_path / "state"), live)
    driver = TierDriver(live, durable, random.Random(1))
    seen = {"host": 0, "disk": 0, "loaded": 0, "failed": 0}
    for i in range(400):
        driver.random_op()
        if i == 200:
            durable.snapshot()
        for pool in live.pools.values():
            tiers = pool.tiers
            if tiers.host is not None:
                seen["host"] = max(seen["host"], tiers.host.tree.total_size)
            seen["disk"] = max(seen["disk"], tiers.disk.tree.total_size)
            seen["loaded"] = max(seen["loaded"], sum(t.counters.num_loaded_pages for t in tiers.tiers))
            seen["failed"] = max(seen["failed"], sum(t.counters.num_failed_pages for t in tiers.tiers))
    assert all(seen.values()), seen
    for pool in live.pools.values():
        pool.drop_routed()
    expected = state(live)
    assert any(t["nodes"] for data in expected.values() for t in data["tiers"]["tiers"]), expected
    crash(durable)
    restored = new_registry()
    open_durable(str(tmp_path / "state"), restored).close()
    assert state(restored) == expected
