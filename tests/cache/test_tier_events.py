"""Events of the lower tiers (cache_service/tiers/): live BlockStored / BlockRemoved with their tier,
WatchEvents snapshots that walk every tier's tree (cache_service/watch.py), namespace-limited views
of them, and the disk pages a replica restarted on its disk dir registers with (pool_registry.py).
In-process: a real EventLog, PoolRegistry and CheckedPools."""

from __future__ import annotations

import asyncio
import random

import pytest

from cache_service.events import AllCleared, BlockRemoved, BlockStored, EventLog
from cache_service.pool_registry import PoolRegistry
from cache_service.schema import Admit, CopyOutcome, DiskRun, Finish, StepInput, TierSpec
from cache_service.tiers.lower_tier import TIER_DEVICE, TIER_DISK, TIER_HOST
from cache_service.watch import Watch, WatchRequest
from common.token_bytes import encode_tokens
from tests.cache.conftest import CheckedPool

BS = 2
NAMESPACES = ("", "tenant-a", "tenant-b")

Page = tuple[int, str, int]  # (tier, namespace, page hash)


def tier_pages(pool) -> set[Page]:
    """Every page the pool holds, per tier (device tree and each lower tier's tree)."""
    trees = [(TIER_DEVICE, pool.tree)] + [(t.tier, t.tree) for t in pool.tiers.tiers]
    return {(tier, node.namespace, h) for tier, tree in trees for node in tree.iter_nodes() for h in node.hashes}


def apply(mirror: set[Page], payload) -> None:
    """A page-keyed mirror per tier (idempotent per page, as examples/kv_mirror.py)."""
    if isinstance(payload, BlockStored):
        mirror.update((payload.tier, payload.namespace, h) for h in payload.block_hashes)
    elif isinstance(payload, BlockRemoved):
        mirror.difference_update((payload.tier, payload.namespace, h) for h in payload.block_hashes)
    else:
        assert isinstance(payload, AllCleared)
        mirror.clear()


class TierWorkload:
    """Random admits / finishes / evictions over shared prefixes on a small device pool with host
    and disk tiers; every copy ordered is reported (mostly complete, sometimes partly) a step later."""

    def __init__(self, pool, seed: int) -> None:
        self.pool = pool
        self.rng = random.Random(seed)
        self.running: list[str] = []
        self.next_id = 0
        self.unreported = []

    def _outcomes(self) -> list[CopyOutcome]:
        rng = self.rng
        out = [CopyOutcome(c.copy_id, len(c.src) if rng.random() < 0.9 else rng.randrange(len(c.src) + 1))
               for c in self.unreported]
        self.unreported = []
        return out

    def _step(self, admits=(), finishes=()):
        result = self.pool.step(StepInput(admits=list(admits), finishes=list(finishes),
                                          copy_outcomes=self._outcomes()))
        self.unreported = list(result.offloads) + [c for a in result.admits for c in a.loads]
        return result

    def op(self) -> None:
        rng = self.rng
        roll = rng.random()
        if roll < 0.5 or not self.running:
            stem = rng.choice(([1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9], []))
            tokens = stem + [rng.randrange(1, 6) for _ in range(rng.randrange(1, 12))]
            rid = f"r{self.next_id}"
            self.next_id += 1
            (result,) = self._step(admits=[Admit(rid, tokens, rng.choice(NAMESPACES))]).admits
            if result.admitted:
                self.running.append(rid)
        elif roll < 0.9:
            rid = self.running.pop(rng.randrange(len(self.running)))
            self._step(finishes=[Finish(rid, [], len(self.pool.requests[rid].prompt))])
        else:
            self.pool.evict(rng.randrange(1, 4))


def make_pool(events: EventLog, policy: str = "evict") -> CheckedPool:
    return CheckedPool("p", 1, 12, BS, "fp", 0, events, tiers=TierSpec(6, 10, policy, []))


async def take(stream, n: int) -> list:
    return [await asyncio.wait_for(anext(stream), 5) for _ in range(n)]


async def drain_snapshot(stream, on_each=None) -> tuple[list, asyncio.Future]:
    """The snapshot events (those before the stream waits for a live one), and the future of the
    first live event (not cancelled: cancelling it would end the stream)."""
    got = []
    while True:
        nxt = asyncio.ensure_future(anext(stream))
        done, _ = await asyncio.wait({nxt}, timeout=0.2)
        if not done or not nxt.result().is_snapshot:
            return got, nxt
        got.append(nxt.result())
        if on_each is not None:
            on_each()


def run(coro) -> None:
    asyncio.run(asyncio.wait_for(coro, 60))


def test_live_events_carry_the_tier_and_rebuild_every_tier() -> None:
    log = EventLog()
    pool = make_pool(log)
    seen: list = []
    log.subscribe(seen.append)
    work = TierWorkload(pool, seed=3)
    for _ in range(150):
        work.op()
    mirror: set[Page] = set()
    for event in seen:
        apply(mirror, event.payload)
    tiers = {event.payload.tier for event in seen if not isinstance(event.payload, AllCleared)}
    assert tiers == {TIER_DEVICE, TIER_HOST, TIER_DISK}, "the workload should reach every tier"
    assert mirror == tier_pages(pool)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("policy", ["evict", "write-through"])
def test_snapshot_walks_every_tier_and_with_later_events_is_the_pool(seed: int, policy: str) -> None:
    """A fuzzy snapshot (the pool keeps changing while it is walked) plus the events after it rebuilds
    every tier; lower-tier events carry slot ids as block ids."""

    async def scenario() -> None:
        log = EventLog()
        pool = make_pool(log, policy)
        work = TierWorkload(pool, seed)
        for _ in range(work.rng.randrange(60, 120)):
            work.op()
        for _ in range(400):
            if pool.tiers.host.tree.total_size and pool.tiers.disk.tree.total_size:
                break
            work.op()
        assert pool.tiers.host.tree.total_size and pool.tiers.disk.tree.total_size
        at = log.last_sequence
        watch = Watch(log, [pool], WatchRequest(snapshot=True), max_lag=10_000)
        stream = watch.stream()
        try:
            snapshot, live = await drain_snapshot(stream, lambda: [work.op() for _ in range(work.rng.randrange(3))])
            assert {e.sequence for e in snapshot} == {at}
            assert {e.payload.tier for e in snapshot} & {TIER_HOST, TIER_DISK}
            mirror: set[Page] = set()
            for e in snapshot:
                p = e.payload
                assert p.parent_block_hash == 0 or (p.tier, p.namespace, p.parent_block_hash) in mirror
                assert len(p.block_ids) == len(p.block_hashes)  # slots for a lower tier
                apply(mirror, p)
            later = [await asyncio.wait_for(live, 5)] if log.last_sequence > at else []
            while later and later[-1].sequence < log.last_sequence:
                later += await take(stream, 1)
            assert [e.sequence for e in later] == list(range(at + 1, log.last_sequence + 1))
            for e in later:
                apply(mirror, e.payload)
            assert mirror == tier_pages(pool)
        finally:
            watch.close()

    run(scenario())


def test_snapshot_of_a_lower_tier_gives_its_slots() -> None:
    async def scenario() -> None:
        log = EventLog()
        pool = make_pool(log)
        work = TierWorkload(pool, seed=5)
        for i in range(400):  # 80 ops, then on until every tier holds a page
            if i >= 80 and all(t.tree.total_size for t in pool.tiers.tiers):
                break
            work.op()
        watch = Watch(log, [pool], WatchRequest(snapshot=True), max_lag=10_000)
        try:
            snapshot, live = await drain_snapshot(watch.stream())
            live.cancel()
        finally:
            watch.close()
        for tier in pool.tiers.tiers:
            expected = {(n.namespace, h, s) for n in tier.tree.iter_nodes()
                        for h, s in zip(n.hashes, n.value, strict=True)}
            got = {(e.payload.namespace, h, s) for e in snapshot if e.payload.tier == tier.tier
                   for h, s in zip(e.payload.block_hashes, e.payload.block_ids, strict=True)}
            assert got == expected and got

    run(scenario())


def test_a_namespace_limited_view_sees_only_its_tier_events_without_ids_in_its_numbers() -> None:
    async def scenario() -> None:
        log = EventLog()
        view = frozenset({"tenant-a"})
        log.track_namespaces(view)
        pool = make_pool(log)
        work = TierWorkload(pool, seed=11)
        everything: list = []
        log.subscribe(everything.append)
        for _ in range(1000):
            work.op()
            if {p[0] for p in tier_pages(pool) if p[1] == "tenant-a"} >= {TIER_HOST, TIER_DISK}:
                break
        number = log.view_sequence(view)
        assert number == sum(1 for e in everything if isinstance(e.payload, AllCleared)
                             or e.payload.namespace == "tenant-a")
        watch = Watch(log, [pool], WatchRequest(snapshot=True, view=view), max_lag=10_000)
        stream = watch.stream()
        try:
            snapshot, live = await drain_snapshot(stream)
            assert not live.done()
            assert snapshot and {e.sequence for e in snapshot} == {number}
            assert {e.payload.namespace for e in snapshot} == {"tenant-a"}
            assert {e.payload.tier for e in snapshot} & {TIER_HOST, TIER_DISK}
            assert all(e.payload.block_ids == () for e in snapshot)
            mirror: set[Page] = set()
            for e in snapshot:
                apply(mirror, e.payload)
            assert mirror == {p for p in tier_pages(pool) if p[1] == "tenant-a"}
            # live: only tenant-a's events (every tier), numbered on from the snapshot's number
            start = len(everything)
            for _ in range(60):
                work.op()
            mine = [e for e in everything[start:] if e.payload.namespace == "tenant-a"]
            assert {e.payload.tier for e in mine} - {TIER_DEVICE}, "the workload should move tenant-a's pages"
            got = [await asyncio.wait_for(live, 5)] + await take(stream, len(mine) - 1)
            assert [e.sequence for e in got] == list(range(number + 1, number + 1 + len(mine)))
            assert [(e.payload.tier, e.payload.block_hashes) for e in got] == [
                (e.payload.tier, tuple(e.payload.block_hashes)) for e in mine]
            assert all(e.payload.block_ids == () for e in got)
            assert log.view_sequence(view) == number + len(mine)
        finally:
            watch.close()

    run(scenario())


# ---------------------------------------------------------------------- disk runs at registration


def runs_of(*prompts: tuple[str, list[int]]) -> list[DiskRun]:
    out, slot = [], 0
    for namespace, tokens in prompts:
        n = len(tokens) // BS
        out.append(DiskRun(namespace, encode_tokens(tokens), list(range(slot, slot + n))))
        slot += n
    return out


def test_a_pool_registered_with_disk_runs_announces_them_after_the_old_pool_cleared() -> None:
    log = EventLog()
    log.track_namespaces(["tenant-a"])
    registry = PoolRegistry(events=log)
    seen: list = []
    log.subscribe(seen.append)
    registry.register_replica("w", 8, BS, "fp", 0, tiers=TierSpec(0, 16, "evict", []))
    assert seen == []  # an empty disk: nothing to announce
    runs = runs_of(("", [1, 2, 3, 4, 5, 6]), ("tenant-a", [7, 8, 9, 10]))
    before = log.view_sequence(frozenset({"tenant-a"}))
    reg = registry.register_replica("w", 8, BS, "fp", 0, tiers=TierSpec(0, 16, "evict", runs))
    assert isinstance(seen[0].payload, AllCleared)  # the old pool went first
    stored = [e.payload for e in seen[1:]]
    assert stored and all(isinstance(p, BlockStored) and p.tier == TIER_DISK for p in stored)
    assert [e.sequence for e in seen] == list(range(1, len(seen) + 1))
    mirror: set[Page] = set()
    for p in stored:
        apply(mirror, p)
    assert mirror == tier_pages(reg.pool) and len(mirror) == 5
    by_ns = {(p.namespace, tuple(p.token_ids), tuple(p.block_ids)) for p in stored}
    assert by_ns == {("", (1, 2, 3, 4, 5, 6), (0, 1, 2)), ("tenant-a", (7, 8, 9, 10), (3, 4))}
    assert log.view_sequence(frozenset({"tenant-a"})) == before + 2  # the AllCleared and tenant-a's run


def test_a_refused_disk_run_announces_nothing() -> None:
    log = EventLog()
    registry = PoolRegistry(events=log)
    seen: list = []
    log.subscribe(seen.append)
    bad = [DiskRun("", encode_tokens([1, 2, 3, 4]), [0, 99])]
    with pytest.raises(Exception, match="out of range"):
        registry.register_replica("w", 8, BS, "fp", 0, tiers=TierSpec(0, 16, "evict", bad))
    assert seen == [] and log.last_sequence == 0


def test_a_restarted_durable_cache_manager_numbers_the_announcement_as_the_live_one_did(tmp_path) -> None:
    """The journal replays the registration, announcement included: the restored log continues the
    live one's numbers, and its snapshot walks the restored disk tier."""
    from cache_service.durable import DurableState

    live = PoolRegistry(lease_seconds=1000.0)
    durable = DurableState(str(tmp_path), live, snapshot_bytes=1 << 30)
    durable.recover()
    runs = runs_of(("", [1, 2, 3, 4, 5, 6]), ("tenant-a", [7, 8, 9, 10]))
    live.register_replica("w", 8, BS, "fp", 0, incarnation="i1", tiers=TierSpec(0, 16, "evict", []))
    live.register_replica("w", 8, BS, "fp", 0, incarnation="i2", tiers=TierSpec(0, 16, "evict", runs))
    expected = live.events.last_sequence
    assert expected == 1 + 2  # AllCleared + one BlockStored per run
    durable.close()

    restored = PoolRegistry(lease_seconds=1000.0)
    again = DurableState(str(tmp_path), restored, snapshot_bytes=1 << 30)
    again.recover()
    try:
        assert restored.events.last_sequence == expected
        pool = restored.pools["w"]
        assert tier_pages(pool) == tier_pages(live.pools["w"])

        async def scenario() -> None:
            watch = Watch(restored.events, [pool], WatchRequest(snapshot=True), max_lag=100)
            try:
                snapshot, live_event = await drain_snapshot(watch.stream())
                live_event.cancel()
            finally:
                watch.close()
            mirror: set[Page] = set()
            for e in snapshot:
                assert e.sequence == expected and e.payload.tier == TIER_DISK
                apply(mirror, e.payload)
            assert mirror == tier_pages(pool)

        run(scenario())
    finally:
        again.close()
