"""examples/kv_mirror.py against the real `python -m cache_service` process: a random workload
(admits, finishes, Evict, Clear, a lease expiry), a disconnect + resume, and a kill -9 restart
(detected through OUT_OF_RANGE and through a publisher_epoch change); a pool with host and disk
tiers mirrored per tier."""

from __future__ import annotations

import random
import time

from examples.kv_mirror import KvMirror, KvMirrorWatcher, page_hashes
from protos import cache_pb2 as pb
from tests.cache.conftest import register, spawn_server, stop_server

BLOCK = 4


def wait_for(predicate, timeout: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


class Workload:
    def __init__(self, stub, seed: int) -> None:
        self.stub = stub
        self.rng = random.Random(seed)
        self.prompts: list[tuple[list[int], str]] = []
        self.regs: dict[str, pb.RegisterPoolResponse] = {}
        self.running: dict[str, list[tuple[str, int]]] = {}
        self.next_id = 0
        self.prefixes = [[self.rng.randrange(1000) for _ in range(self.rng.choice((4, 8, 12)))] for _ in range(4)]

    def add_pool(self, name: str, num_blocks: int = 24) -> None:
        self.regs[name] = register(self.stub, name, num_blocks=num_blocks, block_size=BLOCK)
        self.running[name] = []

    def step(self, name: str, **items) -> pb.StepResponse:
        reg = self.regs[name]
        return self.stub.Step(pb.StepRequest(pool_id=reg.pool_id, epoch=reg.epoch, **items), timeout=5)

    def prompt(self) -> tuple[list[int], str]:
        rng = self.rng
        tokens = list(rng.choice(self.prefixes)) + [rng.randrange(1000) for _ in range(rng.randrange(1, 14))]
        namespace = rng.choice(("", "", "tenant-a"))
        self.prompts.append((tokens, namespace))
        return tokens, namespace

    def op(self, name: str) -> None:
        rng, reg = self.rng, self.regs[name]
        roll = rng.random()
        running = self.running[name]
        if roll < 0.5 or not running:
            tokens, namespace = self.prompt()
            rid = f"r{self.next_id}"
            self.next_id += 1
            reply = self.step(name, admits=[pb.Admit(request_id=rid, token_ids=tokens, namespace=namespace)])
            if reply.admits[0].status == pb.ADMIT_STATUS_ADMITTED:
                running.append((rid, len(tokens)))
        elif roll < 0.85:
            rid, length = running.pop(rng.randrange(len(running)))
            self.step(name, finishes=[pb.Finish(request_id=rid, num_computed_tokens=length)])
        elif roll < 0.97:
            self.stub.Evict(pb.EvictRequest(pool_id=reg.pool_id, epoch=reg.epoch,
                                            num_blocks=rng.randrange(1, 6)), timeout=5)
        else:
            self.stub.Clear(pb.ClearRequest(pool_id=reg.pool_id, epoch=reg.epoch), timeout=5)

    def heartbeat(self, *names: str) -> None:
        for name in names:
            reg = self.regs[name]
            self.stub.Heartbeat(pb.HeartbeatRequest(pool_id=reg.pool_id, epoch=reg.epoch), timeout=5)


def live_pools(stub) -> set[str]:
    return {p.pool_id for p in stub.Stats(pb.StatsRequest(), timeout=5).pools}


def disagreements(stub, mirror: KvMirror, prompts) -> list:
    """(pool, prompt, server, mirror) for every live pool and prompt where the two differ."""
    bad = []
    pools = live_pools(stub)
    for pool_id in pools:
        for tokens, namespace in prompts:
            served = stub.Match(pb.MatchRequest(pool_id=pool_id, token_ids=tokens, namespace=namespace),
                                timeout=5).matches[0].matched_tokens
            mirrored = mirror.match(pool_id, tokens, namespace)
            if served != mirrored:
                bad.append((pool_id, tokens, namespace, served, mirrored))
    bad.extend((pool_id, "not a live pool") for pool_id in set(mirror.pools) - pools)
    return bad


def assert_in_sync(stub, mirror: KvMirror, prompts, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        bad = disagreements(stub, mirror, prompts)
        if not bad:
            return
        assert time.monotonic() < deadline, f"mirror disagrees with Match: {bad[:5]} ({len(bad)} in all)"
        time.sleep(0.1)


def test_mirror_follows_a_random_workload_reconnects_and_survives_restarts(start_server, tmp_path) -> None:
    srv = start_server("--lease-seconds", "2")
    stub = srv.stub
    work = Workload(stub, seed=7)
    for name in ("p0", "p1", "dying"):
        work.add_pool(name)
    # Content before the mirror starts: its first snapshot must carry it.
    for _ in range(15):
        work.op(work.rng.choice(("p0", "p1", "dying")))
    watcher = KvMirrorWatcher(srv.address).start()
    mirror = watcher.mirror
    try:
        assert_in_sync(stub, mirror, work.prompts)
        assert watcher.num_snapshots == 1
        for i in range(120):
            work.op(work.rng.choice(("p0", "p1")) if i > 40 else work.rng.choice(("p0", "p1", "dying")))
            if i % 10 == 0:
                work.heartbeat("p0", "p1")
        assert_in_sync(stub, mirror, work.prompts)
        assert mirror.pools.get("p0") and mirror.pools.get("p1")
        hits = sum(mirror.match(pool, tokens, ns) > 0 for pool in ("p0", "p1") for tokens, ns in work.prompts)
        assert hits > 10, "the workload should leave cached prefixes to match"

        # Lease expiry of "dying": AllCleared, the pool leaves the mirror.
        def expired() -> bool:
            work.heartbeat("p0", "p1")
            return "dying" not in live_pools(stub)
        wait_for(expired, 10, "the lease of 'dying' to expire")
        wait_for(lambda: "dying" not in mirror.pools, 5, "the mirror to drop 'dying'")
        assert_in_sync(stub, mirror, work.prompts)

        # Disconnect, change things meanwhile, reconnect: a start_sequence resume, no snapshot.
        watcher.stop()
        for _ in range(30):
            work.op(work.rng.choice(("p0", "p1")))
        missed = mirror.last_sequence
        watcher.start()
        assert_in_sync(stub, mirror, work.prompts)
        assert watcher.num_resumes == 1 and watcher.num_snapshots == 1 and mirror.num_resets == 1
        assert mirror.last_sequence > missed  # the events of the disconnect were replayed

        # kill -9 + restart on the same port, mirror connected: the resume point is ahead of the new
        # server (OUT_OF_RANGE), the mirror resyncs to the empty state, then follows the refill.
        port = srv.port
        stop_server(srv)
        srv = spawn_server(tmp_path / "restart1.stderr", "--port", str(port), "--lease-seconds", "30")
        try:
            stub = work.stub = srv.stub
            wait_for(lambda: watcher.num_out_of_range >= 1 and watcher.num_snapshots == 2, 15,
                     "the mirror to resync after the restart")
            assert mirror.pools == {}
            work.add_pool("p0")
            for _ in range(20):
                work.op("p0")
            assert_in_sync(stub, mirror, work.prompts)
            assert mirror.pools.get("p0")

            # Restart while the mirror is disconnected; the new server has issued more events than
            # the mirror's resume point, so the resume is accepted: the publisher_epoch tells.
            watcher.stop()
            resume_from = mirror.last_sequence + 1
            stop_server(srv)
            srv = spawn_server(tmp_path / "restart2.stderr", "--port", str(port), "--lease-seconds", "30")
            stub = work.stub = srv.stub
            work.add_pool("p1", num_blocks=64)
            probe = KvMirrorWatcher(srv.address).start()  # tells the new server's last sequence
            try:
                for n in range(10_000):
                    if probe.mirror.last_sequence >= resume_from + 2:
                        break
                    tokens, namespace = work.prompt()
                    work.step("p1", admits=[pb.Admit(request_id=f"e{n}", token_ids=tokens, namespace=namespace)])
                    work.step("p1", finishes=[pb.Finish(request_id=f"e{n}", num_computed_tokens=len(tokens))])
                    time.sleep(0.01)
            finally:
                probe.stop()
            assert probe.mirror.last_sequence >= resume_from
            watcher.start()
            wait_for(lambda: watcher.num_epoch_changes == 1, 10, "the mirror to notice the new publisher epoch")
            assert_in_sync(stub, mirror, work.prompts)
            assert set(mirror.pools) == {"p1"}  # nothing left of the previous server's "p0"
        finally:
            stop_server(srv)
    finally:
        watcher.stop()



def test_mirror_follows_every_tier_of_a_pool_with_host_and_disk_tiers(start_server) -> None:
    """Pages copied down to the host and disk tiers (and dropped from them) are mirrored per tier,
    through the snapshot and live: match_tiers agrees with Match's device / host / disk tokens."""
    srv = start_server()
    stub = srv.stub
    reg = stub.RegisterPool(pb.RegisterPoolRequest(
        worker_id="tiered", num_blocks=8, block_size=BLOCK, model_fingerprint="fp",
        tiers=pb.TierConfig(num_host_slots=6, num_disk_slots=12)), timeout=5)
    rng = random.Random(3)
    unreported: list = []
    prompts: list[tuple[list[int], str]] = []

    def step(**items) -> pb.StepResponse:
        outcomes = [pb.CopyOutcome(copy_id=c.copy_id, num_pages_copied=len(c.src)) for c in unreported]
        reply = stub.Step(pb.StepRequest(pool_id=reg.pool_id, epoch=reg.epoch, copy_outcomes=outcomes, **items),
                          timeout=5)
        unreported[:] = list(reply.offloads) + [c for a in reply.admits for c in a.loads]
        return reply

    def run_some(n: int) -> None:
        for i in range(n):
            tokens = [rng.randrange(1000) for _ in range(rng.choice((5, 9, 13)))]
            if prompts and rng.random() < 0.4:
                tokens, namespace = rng.choice(prompts)  # a repeat: loads from a tier
            else:
                namespace = rng.choice(("", "tenant-a"))
                prompts.append((tokens, namespace))
            rid = f"t{len(prompts)}-{i}-{rng.randrange(10**6)}"
            reply = step(admits=[pb.Admit(request_id=rid, token_ids=tokens, namespace=namespace)])
            if reply.admits[0].status == pb.ADMIT_STATUS_ADMITTED:
                step(finishes=[pb.Finish(request_id=rid, num_computed_tokens=len(tokens))])
        step()  # report the last copies

    def tier_disagreements() -> list:
        bad = []
        for tokens, namespace in prompts:
            (m,) = stub.Match(pb.MatchRequest(pool_id=reg.pool_id, token_ids=tokens, namespace=namespace),
                              timeout=5).matches
            served = (m.matched_tokens, m.matched_host_tokens, m.matched_disk_tokens)
            mirrored = mirror.match_tiers(reg.pool_id, tokens, namespace)
            if served != mirrored:
                bad.append((tokens, namespace, served, mirrored))
        return bad

    def in_sync() -> None:
        deadline = time.monotonic() + 10
        while bad := tier_disagreements():
            assert time.monotonic() < deadline, f"mirror disagrees with Match: {bad[:5]} ({len(bad)} in all)"
            time.sleep(0.1)

    run_some(25)  # before the mirror: its snapshot must carry every tier
    watcher = KvMirrorWatcher(srv.address).start()
    mirror = watcher.mirror
    try:
        in_sync()
        counts = mirror.num_pages_by_tier()[reg.pool_id]
        assert counts.get("host") and counts.get("disk"), counts
        run_some(40)  # live: pages move down and out of the tiers
        in_sync()
        assert any(sum(mirror.match_tiers(reg.pool_id, t, ns)[1:]) for t, ns in prompts), "some tier hits"
        (stats,) = stub.Stats(pb.StatsRequest(pool_id=reg.pool_id), timeout=5).pools
        counts = mirror.num_pages_by_tier()[reg.pool_id]
        assert (counts.get("host", 0), counts.get("disk", 0)) == (stats.host_tier.num_cached_pages,
                                                                   stats.disk_tier.num_cached_pages)
    finally:
        watcher.stop()


def test_events_without_a_tier_are_device_events() -> None:
    """An older server's events carry no tier: the mirror reads them as the device tier's."""
    mirror = KvMirror()
    hashes = page_hashes(0, "", [1, 2, 3, 4, 5, 6, 7, 8], BLOCK)
    mirror.apply(pb.CacheEvent(sequence=1, pool_id="p", stored=pb.BlockStored(block_hashes=hashes, block_size=BLOCK)))
    mirror.apply(pb.CacheEvent(sequence=2, pool_id="p", stored=pb.BlockStored(
        block_hashes=hashes, block_size=BLOCK, tier=pb.TIER_HOST)))
    assert mirror.match_tiers("p", [1, 2, 3, 4, 5, 6, 7, 8]) == (8, 0, 0)
    assert mirror.num_pages() == {"p": 2}
    mirror.apply(pb.CacheEvent(sequence=3, pool_id="p", removed=pb.BlockRemoved(block_hashes=hashes)))
    assert mirror.match_tiers("p", [1, 2, 3, 4, 5, 6, 7, 8]) == (0, 8, 0)
    assert mirror.num_pages_by_tier() == {"p": {"device": 0, "host": 2}}
