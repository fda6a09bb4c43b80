"""Durable cache manager core (cache_service/durable/: state.py, snapshot.py, journal.py).

A driver applies random operation sequences exactly as the servicer does (StepRequest protos ->
core -> journal) over two pools, taking snapshots at random points. Recovering a fresh registry
from the state dir must give the live state (canonical dump), and both must then behave the
same under the same further operations. Truncating the journal at any byte gives the state
after some earlier record, never a corrupt one.
"""

from __future__ import annotations

import json
import os
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cache_service import convert
from cache_service.durable import DurableState
from cache_service.durable.journal import HEADER, encode, read_records
from cache_service.durable.replay import Kind
from cache_service.durable.snapshot import canonical, dump_pool, restore_pool
from cache_service.errors import CacheError
from cache_service.pool_registry import PoolRegistry
from cache_service.routing import RouteQuery
from common.token_bytes import encode_tokens
from protos import cache_pb2

BS = 2
NUM_BLOCKS = 16
WORKERS = ("w0", "w1")
STEMS = ((0, 1, 2, 0, 1, 2, 0, 1, 2, 0), (2, 2, 1, 1, 0, 0, 2, 2, 1, 1))


class Clock:
    """A test clock the driver advances (Route reservations and routed requests expire by time)."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Driver:
    """Random but mostly valid traffic of two replicas, applied like the servicer applies it."""

    def __init__(self, registry: PoolRegistry, durable: DurableState | None, rng: random.Random) -> None:
        self.registry = registry
        self.durable = durable
        self.rng = rng
        self.running: dict[str, dict[str, list[int]]] = {w: {} for w in WORKERS}  # rid -> outputs
        self.next_id = 0
        self.snapshots = True
        self.after_record: list = []  # callbacks run after each journaled change

    def _recorded(self) -> None:
        for callback in self.after_record:
            callback()

    def register(self, worker: str) -> None:
        reg = self.registry.register_replica(worker, NUM_BLOCKS, BS, "m", 3, f"{worker}:1",
                                             incarnation=f"inc-{worker}")
        if not reg.reattached:
            self.running[worker] = {}
        self._recorded()

    def _prompt(self) -> list[int]:
        stem = self.rng.choice(STEMS)
        return list(stem[: self.rng.randint(1, len(stem))]) + [self.rng.randint(0, 2)
                                                                for _ in range(self.rng.randint(0, 2))]

    def step_request(self, worker: str) -> cache_pb2.StepRequest:
        rng, pool = self.rng, self.registry.pools[worker]
        req = cache_pb2.StepRequest(pool_id=worker, epoch=pool.epoch)
        for rid in list(self.running[worker]):
            state = pool.requests.get(rid)
            if state is None:
                continue
            outputs = self.running[worker][rid]
            total = len(state.prompt) + len(outputs)
            room = len(state.block_table) * BS
            choice = rng.random()
            if choice < 0.2:
                computed = min(total, room) if rng.random() < 0.8 else rng.randint(0, min(total, room))
                group = req.finishes if rng.random() < 0.7 else req.releases
                group.add(request_id=rid, output_token_ids=outputs, num_computed_tokens=computed)
                del self.running[worker][rid]
            elif choice < 0.5:
                outputs.append(rng.randint(0, 2))
                if total + 1 > room:
                    req.extends.add(request_id=rid, num_tokens=total + 1)
                else:
                    req.commits.add(request_id=rid, num_computed_tokens=min(total, room) // BS * BS,
                                    output_token_ids=outputs[:-1])
        for _ in range(rng.randint(0, 2)):
            rid = f"r{self.next_id}"
            self.next_id += 1
            admit = req.admits.add(request_id=rid, num_lookahead_tokens=1, namespace=rng.choice(("", "t")))
            if rng.random() < 0.5:  # both prompt forms go through the journal and snapshots
                admit.packed_token_ids = encode_tokens(self._prompt())
            else:
                admit.token_ids.extend(self._prompt())
        return req

    def step(self, worker: str) -> None:
        if worker not in self.registry.pools:
            self.register(worker)
        request = self.step_request(worker)
        pool = self.registry.pools[worker]
        try:
            result = pool.step(convert.step_input(request))
        except CacheError:
            for item in list(request.finishes) + list(request.releases):
                self.running[worker].pop(item.request_id, None)
            return
        if self.durable is not None:
            self.durable.step(request, result, pool)
            self._recorded()
        self.on_result(worker, result)
        for admit in result.admits:
            if admit.admitted:
                self.running[worker][admit.request_id] = []
        for ext in result.extends:
            if not ext.ok:  # preempt it: release everything
                outputs = self.running[worker].pop(ext.request_id, [])
                self.apply_release(worker, ext.request_id, outputs[:-1])

    def on_result(self, worker: str, result: object) -> None:
        """A Step's result, after it was recorded (subclasses track more of it)."""

    def adopt(self, other: Driver) -> None:
        """Take over `other`'s view of its requests (a twin driving a restored registry)."""
        self.running = {w: {rid: list(out) for rid, out in reqs.items()} for w, reqs in other.running.items()}
        self.next_id = other.next_id

    def apply_release(self, worker: str, rid: str, outputs: list[int]) -> None:
        pool = self.registry.pools[worker]
        request = cache_pb2.StepRequest(pool_id=worker, epoch=pool.epoch)
        request.releases.add(request_id=rid, output_token_ids=outputs)
        result = pool.step(convert.step_input(request))
        if self.durable is not None:
            self.durable.step(request, result)
            self._recorded()

    def random_op(self) -> None:
        rng = self.rng
        clock = getattr(self.registry, "_clock", None)
        if isinstance(clock, Clock):
            clock.now += rng.random() * 0.3
        worker = rng.choice(WORKERS)
        r = rng.random()
        if r < 0.8:
            self.step(worker)
        elif r < 0.87 and worker in self.registry.pools:
            pool = self.registry.pools[worker]
            n = rng.randint(0, 4)
            pool.evict(n)
            if self.durable is not None:
                self.durable.evicted(worker, n)
                self._recorded()
        elif r < 0.9 and worker in self.registry.pools:
            self.registry.pools[worker].clear()
            if self.durable is not None:
                self.durable.cleared(worker)
                self._recorded()
        elif r < 0.93 and worker in self.registry.pools:
            self.registry.retire(worker, "lease expired")
            self._recorded()
        elif r < 0.94:
            self.register(worker)  # the same incarnation: a re-attach when the pool is live
        elif r < 0.97 and self.registry.pools:
            rid = f"q{self.next_id}"
            self.next_id += 1
            self.registry.route(RouteQuery(token_ids=tuple(self._prompt()), model_fingerprint="m", request_id=rid,
                                           reserve_ms=rng.choice((0, 200, 3000)), namespace=rng.choice(("", "t"))))
            self._recorded()
        elif r < 0.98:
            self.registry.expire_routed()
            self._recorded()
        elif self.durable is not None and self.snapshots:
            self.durable.snapshot()


def new_registry() -> PoolRegistry:
    return PoolRegistry(lease_seconds=1000.0, clock=Clock())


def open_durable(path: str, registry: PoolRegistry) -> DurableState:
    durable = DurableState(path, registry, snapshot_bytes=1 << 30)
    durable.recover()
    return durable


def state(registry: PoolRegistry) -> dict[str, dict]:
    return {pid: canonical(pool) for pid, pool in sorted(registry.pools.items())}


def crash(durable: DurableState) -> None:
    """What kill -9 leaves: the files as written (no final fsync matters for this)."""
    if durable.journal is not None:
        os.close(durable.journal._fd)
        durable.journal = None
    os.close(durable._lock_fd)
    durable._lock_fd = -1


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), num_ops=st.integers(1, 120), tail=st.integers(0, 40))
def test_snapshot_plus_replay_equals_live_state(tmp_path_factory, seed: int, num_ops: int, tail: int) -> None:
    driver, expected, restored, durable2 = run_then_restore(Driver, tmp_path_factory, seed, num_ops)
    assert state(restored) == expected
    for pool in restored.pools.values():
        assert pool.attach.restored and pool.attach.awaiting_reattach
    # The same further traffic gives the same results and states (LRU order came back too).
    for pool in restored.pools.values():
        restored.register_replica(pool.worker_id, NUM_BLOCKS, BS, "m", 3, f"{pool.worker_id}:1",
                                  incarnation=f"inc-{pool.worker_id}")
    same_further_traffic(driver, restored, durable2, seed, tail)
    durable2.close()


def run_then_restore(driver_class: type[Driver], tmp_path_factory, seed: int,
                     num_ops: int) -> tuple[Driver, dict[str, dict], PoolRegistry, DurableState]:
    """`num_ops` random operations of a `driver_class` on a durable registry, then a crash and a
    recovery: (the driver, the live state recovery must give, the restored registry, its state)."""
    path = str(tmp_path_factory.mktemp("state"))
    live = new_registry()
    durable = open_durable(path, live)
    driver = driver_class(live, durable, random.Random(seed))
    for _ in range(num_ops):
        driver.random_op()
    live.check_integrity()
    for pool in live.pools.values():
        pool.drop_routed()  # as recovery does, once its replay is done
    expected = state(live)
    crash(durable)
    restored = new_registry()
    return driver, expected, restored, open_durable(path, restored)


def same_further_traffic(driver: Driver, restored: PoolRegistry, durable: DurableState, seed: int,
                         tail: int) -> None:
    """`tail` more steps of the same random traffic on `driver`'s (live) registry, no longer
    journaled, and on `restored` (its pools re-registered), through a twin of the driver:
    the states must stay equal."""
    live = driver.registry
    for pool in live.pools.values():
        pool.epoch = restored.pools[pool.pool_id].epoch
    restored._clock.now = live._clock.now
    rng_state = random.Random(seed + 1).getstate()
    twin = type(driver)(restored, durable, random.Random())
    driver.durable = None
    for d in (driver, twin):
        d.rng.setstate(rng_state)
    twin.adopt(driver)
    for _ in range(tail):
        worker = driver.rng.choice(WORKERS)
        twin.rng.choice(WORKERS)
        if worker in live.pools:
            driver.step(worker)
            twin.step(worker)
    assert state(restored) == state(live)
    restored.check_integrity()


def test_torn_journal_recovers_an_earlier_consistent_state(tmp_path) -> None:
    path = str(tmp_path / "state")
    live = new_registry()
    durable = open_durable(path, live)
    driver = Driver(live, durable, random.Random(7))
    driver.snapshots = False

    def dropped_routing() -> dict:
        """The state recovery gives at this point: routing hints dropped (on copies of the pools)."""
        saved = {pid: canonical(pool) for pid, pool in live.pools.items()}
        fresh = new_registry()
        for data in (dump_pool(pool) for pool in live.pools.values()):
            pool = restore_pool(data, None)
            pool.drop_routed()
            fresh.pools[pool.pool_id] = pool
        assert {pid: canonical(pool) for pid, pool in live.pools.items()} == saved
        return state(fresh)

    boundaries: dict[int, dict] = {durable.journal.size: dropped_routing()}
    append = durable._append

    def recorded_append(kind, *parts) -> None:  # a boundary after every record, not only every operation
        append(kind, *parts)
        expected = dropped_routing()
        if kind == Kind.RETIRE:  # recorded just before the pool goes
            expected.pop(json.loads(parts[0])["pool_id"], None)
        boundaries[durable.journal.size] = expected

    durable._append = recorded_append
    for _ in range(150):
        driver.random_op()
    log_path = os.path.join(path, "journal-1.log")
    with open(log_path, "rb") as f:
        image = f.read()
    crash(durable)
    rng = random.Random(11)
    offsets = sorted({0, len(image), *(rng.randrange(len(image)) for _ in range(25))})
    assert len(boundaries) > 20
    for offset in offsets:
        with open(log_path, "wb") as f:
            f.write(image[:offset])
        restored = new_registry()
        d = open_durable(path, restored)
        good = max(b for b in boundaries if b <= offset)
        assert state(restored) == boundaries[good], f"cut at byte {offset}"
        restored.check_integrity()
        crash(d)
        # the recovery compacted everything into a new snapshot; put the original back
        for name in os.listdir(path):
            os.unlink(os.path.join(path, name))
        boundaries_snapshot_state(path)
    assert offsets[-1] == len(image)


def boundaries_snapshot_state(path: str) -> None:
    """Recreate the empty generation-1 starting point (a fresh state dir's first snapshot)."""
    registry = new_registry()
    d = DurableState(path, registry, snapshot_bytes=1 << 30)
    d.recover()
    crash(d)


def test_corrupt_record_in_the_middle_stops_replay_there() -> None:
    good = encode(1, b"abc") + encode(2, b"defg")
    bad = bytearray(good + encode(3, b"xyz"))
    bad[len(good) + HEADER.size] ^= 0xFF  # flip a payload byte of the last record
    assert [r.kind for r in read_records(bytes(bad))] == [1, 2]
    assert [r.kind for r in read_records(good[:-1])] == [1]


def test_a_second_cache_manager_cannot_open_the_same_state_dir(tmp_path) -> None:
    first = open_durable(str(tmp_path), new_registry())
    with pytest.raises(RuntimeError, match="in use"):
        open_durable(str(tmp_path), new_registry())
    first.close()


def test_background_snapshots_under_traffic_keep_the_log_bounded(tmp_path) -> None:
    path = str(tmp_path / "state")
    live = new_registry()
    durable = DurableState(path, live, snapshot_bytes=4096)
    durable.recover()
    driver = Driver(live, durable, random.Random(3))
    driver.snapshots = False

    def settle() -> None:  # requests slower than a snapshot write (in-process ops take microseconds)
        if durable._snapshotter is not None:
            durable._snapshotter.join()

    driver.after_record.append(settle)
    for _ in range(400):
        driver.random_op()
    assert durable.stats.num_snapshots >= 2, "the journal never rotated"  # the first one: at recover()
    logs = [n for n in os.listdir(path) if n.startswith("journal-")]
    assert len(logs) == 1 and durable.journal.size < max(4096, 2 * durable._last_snapshot_bytes) + 4096
    for pool in live.pools.values():
        pool.drop_routed()  # as recovery does
    expected = state(live)
    crash(durable)
    restored = new_registry()
    open_durable(path, restored).close()
    assert state(restored) == expected


@pytest.mark.parametrize("older", [False, True])
def test_steps_that_evict_in_batches_replay_to_the_same_state_and_older_pools_evict_exactly(tmp_path, older) -> None:
    """A full 1024-block pool evicts 4 blocks at a time; its Steps replay from the journal to the
    same state, and its batch comes back from the journal and from a snapshot. A pool an older
    version recorded (no "evict_batch" in its REGISTER record or snapshot) evicted exactly what it
    needed: it replays with exact eviction, so its Steps replay to the same digests."""
    live = new_registry()
    durable = open_durable(str(tmp_path / "state"), live)
    if older:  # the record as an older version wrote it
        append = durable._append

        def older_append(kind, *parts) -> None:
            if kind == Kind.REGISTER:
                record = json.loads(parts[0])
                del record["evict_batch"]
                parts = (json.dumps(record).encode(), *parts[1:])
            append(kind, *parts)

        durable._append = older_append
    pool = live.register_replica("big", 1024, BS, "m", 2000, "big:1", incarnation="inc-big").pool
    if older:
        pool.evict_batch = 1  # as that version ran it
    batch = 1 if older else 4
    evicted = []
    for i in range(2000):  # 1-page prompts (plus one token), each finished: the pool fills, then evicts
        request = cache_pb2.StepRequest(pool_id="big", epoch=pool.epoch)
        if i:
            request.finishes.add(request_id=f"r{i - 1}", num_computed_tokens=BS)
        request.admits.add(request_id=f"r{i}", token_ids=[i % 3, i // 3 % 1000, 7])
        result = pool.step(convert.step_input(request))
        durable.step(request, result, pool)
        assert result.admits[0].admitted
        if result.num_evicted_blocks:
            evicted.append(result.num_evicted_blocks)
    assert evicted and set(evicted) == {batch}
    expected = state(live)
    crash(durable)
    replayed = new_registry()
    open_durable(str(tmp_path / "state"), replayed).close()
    assert "big" in replayed.pools and replayed.pools["big"].evict_batch == batch
    replayed.pools["big"].drop_routed()
    assert state(replayed) == expected  # every Step replayed to its digest: the pool was kept
    data = dump_pool(replayed.pools["big"])
    assert restore_pool(data, None).evict_batch == batch
    del data["evict_batch"]  # a snapshot of an older version
    assert restore_pool(data, None).evict_batch == 1
