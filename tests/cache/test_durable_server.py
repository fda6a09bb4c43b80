"""`python -m cache_service --state-dir DIR` as a real process: kill -9, restart on the same port
and directory, re-attach (same incarnation) or not (a new one), torn journals, lease of a pool
nobody re-attaches."""

from __future__ import annotations

import os
import random
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from cache_service.durable.journal import read_records
from protos import cache_pb2
from tests.cache.conftest import REPO, ServerProcess, spawn_server, stop_server

BS = 4
NUM_BLOCKS = 64
PROMPT = list(range(1, 23))  # 22 tokens: 5 full pages cached at finish


def register(server: ServerProcess, incarnation: str, worker: str = "w") -> cache_pb2.RegisterPoolResponse:
    return server.stub.RegisterPool(cache_pb2.RegisterPoolRequest(
        worker_id=worker, num_blocks=NUM_BLOCKS, block_size=BS, model_fingerprint="fp", incarnation=incarnation),
        timeout=10)


def step(server: ServerProcess, reg: cache_pb2.RegisterPoolResponse, **items) -> cache_pb2.StepResponse:
    return server.stub.Step(cache_pb2.StepRequest(pool_id=reg.pool_id, epoch=reg.epoch, **items), timeout=10)


def stats(server: ServerProcess, pool_id: str = "w") -> cache_pb2.PoolStats:
    (pool,) = server.stub.Stats(cache_pb2.StatsRequest(pool_id=pool_id), timeout=10).pools
    assert pool.num_free_blocks + pool.num_cached_blocks + pool.num_private_blocks == pool.num_blocks, pool
    return pool


def start(tmp_path: Path, state_dir: Path, *extra: str, port: int = 0) -> ServerProcess:
    args = ["--state-dir", str(state_dir), *extra]
    if port:
        args = ["--port", str(port), *args]  # the later --port wins over spawn_server's --port 0
    return spawn_server(tmp_path / f"cache-{time.monotonic_ns()}.stderr", *args)


def populate(server: ServerProcess) -> tuple[cache_pb2.RegisterPoolResponse, list[int]]:
    """One finished request (its prompt cached) and one running request (a locked prefix)."""
    reg = register(server, "inc-1")
    admit = step(server, reg, admits=[cache_pb2.Admit(request_id="done", token_ids=PROMPT, num_lookahead_tokens=1)])
    table = list(admit.admits[0].block_table)
    step(server, reg, finishes=[cache_pb2.Finish(request_id="done", num_computed_tokens=len(PROMPT),
                                                 block_table=table)])
    admit = step(server, reg, admits=[cache_pb2.Admit(request_id="live", token_ids=PROMPT + [30, 31],
                                                      num_lookahead_tokens=1)])
    assert admit.admits[0].cached_tokens == 20
    return reg, list(admit.admits[0].block_table)


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    return tmp_path / "state"


def test_kill_9_and_restart_keeps_pools_for_the_same_incarnation(tmp_path: Path, state_dir: Path) -> None:
    server = start(tmp_path, state_dir)
    reg, live_table = populate(server)
    before = stats(server)
    port = server.port
    server.proc.kill()  # SIGKILL: no flush, no goodbye
    stop_server(server)

    server = start(tmp_path, state_dir, port=port)
    try:
        assert server.port == port
        restored = stats(server)
        assert restored.restored and restored.num_restored_cached_blocks == before.num_cached_blocks == 5
        for field in ("num_free_blocks", "num_cached_blocks", "num_locked_blocks", "num_private_blocks",
                      "num_running_requests", "hit_tokens", "queried_tokens", "num_finished"):
            assert getattr(restored, field) == getattr(before, field), field
        durability = server.stub.Stats(cache_pb2.StatsRequest(), timeout=10).durability
        assert durability.num_restored_pools == 1 and durability.num_restored_cached_blocks == 5
        assert durability.num_replayed_records >= 4 and durability.recovery_seconds > 0
        # The old epoch is refused until the replica re-registers.
        with pytest.raises(grpc.RpcError) as err:
            server.stub.Heartbeat(cache_pb2.HeartbeatRequest(pool_id="w", epoch=reg.epoch), timeout=10)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "restarted" in err.value.details()
        again = register(server, "inc-1")
        assert again.restored and again.epoch > reg.epoch and again.num_cached_blocks == 5
        (held,) = again.running_requests
        assert (held.request_id, list(held.block_table), held.cached_tokens) == ("live", live_table, 20)
        # The running request goes on where it was: extend, finish with its table; the prompt is a hit.
        reply = step(server, again, extends=[cache_pb2.Extend(request_id="live", num_tokens=26)])
        assert reply.extends[0].ok
        table = live_table + list(reply.extends[0].new_block_ids)
        step(server, again, finishes=[cache_pb2.Finish(request_id="live", num_computed_tokens=24,
                                                       output_token_ids=[], block_table=table)])
        hit = step(server, again, admits=[cache_pb2.Admit(request_id="again", token_ids=PROMPT)])
        assert hit.admits[0].cached_tokens == 20
    finally:
        stop_server(server)


def test_a_new_incarnation_gets_a_fresh_pool(tmp_path: Path, state_dir: Path) -> None:
    server = start(tmp_path, state_dir)
    populate(server)
    server.proc.kill()
    stop_server(server)
    server = start(tmp_path, state_dir)
    try:
        assert stats(server).restored
        fresh = register(server, "inc-2")  # the replica restarted meanwhile: new KV tensors
        assert not fresh.restored and not fresh.running_requests
        pool = stats(server)
        assert not pool.restored and pool.num_cached_blocks == 0 and pool.num_free_blocks == NUM_BLOCKS
        admit = step(server, fresh, admits=[cache_pb2.Admit(request_id="x", token_ids=PROMPT)])
        assert admit.admits[0].cached_tokens == 0, "a block of the old incarnation was reused"
    finally:
        stop_server(server)
    # ... and that is durable too: after another crash the new pool is what comes back.
    server = start(tmp_path, state_dir)
    try:
        again = register(server, "inc-2")
        assert again.restored and [r.request_id for r in again.running_requests] == ["x"]
    finally:
        stop_server(server)


def test_a_pool_nobody_reattaches_is_reclaimed_after_one_lease(tmp_path: Path, state_dir: Path) -> None:
    server = start(tmp_path, state_dir, "--lease-seconds", "1")
    populate(server)
    server.proc.kill()
    stop_server(server)
    server = start(tmp_path, state_dir, "--lease-seconds", "1")
    try:
        assert stats(server).restored
        deadline = time.monotonic() + 10
        while server.stub.Stats(cache_pb2.StatsRequest(), timeout=10).pools and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not server.stub.Stats(cache_pb2.StatsRequest(), timeout=10).pools
        late = register(server, "inc-1")
        assert not late.restored
    finally:
        stop_server(server)


def test_truncated_journal_recovers_a_consistent_earlier_state(tmp_path: Path, state_dir: Path) -> None:
    server = start(tmp_path, state_dir)
    reg = register(server, "inc-1")
    rng = random.Random(5)
    running: dict[str, list[int]] = {}
    for i in range(40):  # admissions, finishes with pages cached, some evictions
        for rid, table in list(running.items()):
            if rng.random() < 0.5:
                step(server, reg, finishes=[cache_pb2.Finish(request_id=rid, num_computed_tokens=len(PROMPT),
                                                             block_table=table)])
                del running[rid]
        prompt = PROMPT[: rng.randint(5, len(PROMPT))] + [rng.randint(40, 45) for _ in range(rng.randint(0, 6))]
        reply = step(server, reg, admits=[cache_pb2.Admit(request_id=f"r{i}", token_ids=prompt)])
        if reply.admits[0].status == cache_pb2.ADMIT_STATUS_ADMITTED and len(prompt) >= len(PROMPT):
            running[f"r{i}"] = list(reply.admits[0].block_table)
        elif reply.admits[0].status == cache_pb2.ADMIT_STATUS_ADMITTED:
            step(server, reg, releases=[cache_pb2.Finish(request_id=f"r{i}")])
        if i % 10 == 9:
            server.stub.Evict(cache_pb2.EvictRequest(pool_id="w", epoch=reg.epoch, num_blocks=3), timeout=10)
    server.proc.kill()
    stop_server(server)
    (log_name,) = [n for n in os.listdir(state_dir) if n.startswith("journal-")]
    size = os.path.getsize(state_dir / log_name)
    assert size > 1000
    previous_admitted = -1
    for offset in sorted(rng.sample(range(size), 6)) + [size]:
        copy = tmp_path / f"cut-{offset}"
        shutil.copytree(state_dir, copy, ignore=shutil.ignore_patterns("lock"))
        with open(copy / log_name, "r+b") as f:
            f.truncate(offset)
        server = start(tmp_path, copy)
        try:
            pool = stats(server)  # accounting whole (asserted), integrity checked at recovery
            durability = server.stub.Stats(cache_pb2.StatsRequest(), timeout=10).durability
            assert durability.num_dropped_pools == 0
            assert pool.num_admitted >= previous_admitted, "a longer journal recovered less"
            previous_admitted = pool.num_admitted
        finally:
            stop_server(server)
    assert previous_admitted == 40


def test_state_dir_in_use_is_refused(tmp_path: Path, state_dir: Path) -> None:
    server = start(tmp_path, state_dir)
    try:
        with pytest.raises(RuntimeError):
            start(tmp_path, state_dir)
    finally:
        stop_server(server)


def _read(call, n: int) -> list[cache_pb2.CacheEvent]:
    events = []
    for event in call:
        events.append(event)
        if len(events) == n:
            break
    call.cancel()
    return events


def test_watchers_resume_across_a_restart_from_their_sequence(tmp_path: Path, state_dir: Path) -> None:
    server = start(tmp_path, state_dir)
    reg, live_table = populate(server)
    step(server, reg, finishes=[cache_pb2.Finish(request_id="live", num_computed_tokens=24,
                                                 block_table=live_table)])  # its 6th page: stored
    server.stub.Evict(cache_pb2.EvictRequest(pool_id="w", epoch=reg.epoch, num_blocks=2), timeout=10)
    seen = _read(server.stub.WatchEvents(cache_pb2.WatchEventsRequest(start_sequence=1), timeout=10), 3)
    assert [e.WhichOneof("event") for e in seen] == ["stored", "stored", "removed"], seen
    epoch = seen[0].publisher_epoch
    server.proc.kill()
    stop_server(server)

    server = start(tmp_path, state_dir)
    try:
        # The consumer saw the first event only: it resumes at the second, naming its epoch.
        resumed = _read(server.stub.WatchEvents(cache_pb2.WatchEventsRequest(
            start_sequence=seen[1].sequence, publisher_epoch=epoch), timeout=10), 2)
        assert [(e.sequence, e.WhichOneof("event")) for e in resumed] == \
            [(e.sequence, e.WhichOneof("event")) for e in seen[1:]]
        assert resumed[0].stored == seen[1].stored and resumed[1].removed == seen[2].removed
        assert resumed[0].publisher_epoch != epoch  # the restart is visible
        with pytest.raises(grpc.RpcError) as err:
            _read(server.stub.WatchEvents(cache_pb2.WatchEventsRequest(
                start_sequence=seen[1].sequence, publisher_epoch=epoch + 1), timeout=10), 1)
        assert err.value.code() == grpc.StatusCode.OUT_OF_RANGE
    finally:
        stop_server(server)


def test_reattach_needs_the_same_shape_and_a_sane_incarnation(tmp_path: Path, state_dir: Path) -> None:
    server = start(tmp_path, state_dir)
    try:
        populate(server)
        with pytest.raises(grpc.RpcError) as err:
            register(server, "x" * 300)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "incarnation" in err.value.details()
        assert stats(server).num_running_requests == 1, "a refused registration changed the pool"
        # The same incarnation but another shape: not the same KV tensors, a fresh pool.
        other = server.stub.RegisterPool(cache_pb2.RegisterPoolRequest(
            worker_id="w", num_blocks=NUM_BLOCKS * 2, block_size=BS, model_fingerprint="fp", incarnation="inc-1"),
            timeout=10)
        assert not other.restored and stats(server).num_cached_blocks == 0
    finally:
        stop_server(server)


def test_durability_metrics(tmp_path: Path, state_dir: Path) -> None:
    server = start(tmp_path, state_dir)
    populate(server)
    server.proc.kill()
    stop_server(server)
    server = start(tmp_path, state_dir, "--metrics-port", "0")
    try:
        port = int(re.search(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", server.stderr()).group(1))
        register(server, "inc-1")
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert "radixkv_cache_restored_pools 1.0" in text
        assert "radixkv_cache_restored_cached_blocks 5.0" in text
        journal = float(re.search(r"^radixkv_cache_journal_bytes (\S+)$", text, re.M).group(1))
        assert journal > 0  # the re-attach was journaled
        assert re.search(r"^radixkv_cache_journal_max_fsync_seconds \S+$", text, re.M)
        assert "radixkv_cache_snapshots_total 1.0" in text
    finally:
        stop_server(server)


def test_a_corrupt_snapshot_is_refused_with_a_clear_message(tmp_path: Path, state_dir: Path) -> None:
    server = start(tmp_path, state_dir)
    populate(server)
    stop_server(server)
    snapshot = state_dir / "snapshot.bin"
    data = bytearray(snapshot.read_bytes())
    data[len(data) // 2] ^= 0x55
    snapshot.write_bytes(bytes(data))
    proc = subprocess.run([sys.executable, "-m", "cache_service", "--port", "0", "--state-dir", str(state_dir)],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "cannot use state dir" in proc.stderr and "corrupt" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_journal_that_lost_acknowledged_steps_is_not_reattached(tmp_path: Path, state_dir: Path) -> None:
    """A power loss inside --fsync-ms drops the journal's last records: the rebuilt pool is behind
    what the replica saw answered, so blocks the replica wrote since may be cached under other
    prefixes there. Re-attach must refuse it (a fresh pool) instead of serving stale KV."""
    server = start(tmp_path, state_dir)
    reg, table = populate(server)  # 3 Steps answered
    server.proc.kill()
    stop_server(server)
    (log_name,) = [n for n in os.listdir(state_dir) if n.startswith("journal-")]
    with open(state_dir / log_name, "rb") as f:
        data = f.read()
    records = list(read_records(data))
    with open(state_dir / log_name, "r+b") as f:  # lose the last Step (the "live" admission)
        f.truncate(records[-2].end)
    server = start(tmp_path, state_dir)
    try:
        def register_acked(n: int) -> cache_pb2.RegisterPoolResponse:
            return server.stub.RegisterPool(cache_pb2.RegisterPoolRequest(
                worker_id="w", num_blocks=NUM_BLOCKS, block_size=BS, model_fingerprint="fp", incarnation="inc-1",
                num_steps_acknowledged=n), timeout=10)

        kept = register_acked(2)  # what the rebuilt pool did apply: trusted
        assert kept.restored and kept.num_cached_blocks == 5
        fresh = register_acked(3)  # the replica saw one more answered: not trusted
        assert not fresh.restored and not fresh.running_requests
        pool = stats(server)
        assert pool.num_cached_blocks == 0 and pool.num_private_blocks == 0
    finally:
        stop_server(server)
