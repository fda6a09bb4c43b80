"""The durable cache manager (`--state-dir DIR`): journal, snapshots and recovery.

What is journaled are the *inputs* of every applied state change, replayed through the same
core code on restart (the core is deterministic given its inputs: the tree's LRU clock is
logical, the allocator's free list ordered, epochs are recorded):

- `STEP`: the StepRequest exactly as it was applied, plus a digest of its result (block tables,
  cached tokens, free blocks) that replay must reproduce;
- `REGISTER`: a registration or re-attach with the epoch it was given;
- `RETIRE`: a pool retired (lease expired, re-registered, dropped);
- `EVICT` / `CLEAR`: the admin calls;
- `ROUTED` / `ROUTED_EXPIRED`: a Route decision a pool remembers (with the prefix its reservation
  pinned) and routed requests ending by time, because a pin changes what an eviction may take;
- `PULL_PINNED` / `PULL_EXPIRED`: a peer pull's pin on its source (cache_service/peer_pulls.py) and
  one ended by time, because a pin changes what an eviction may take too;
- `TRACK`: namespaces whose events are counted from then on (the numbers of namespace-limited
  WatchEvents streams, cache_service/events.py), so replay numbers their events as they were.

Files in DIR: `snapshot.bin` (`[8s magic][u32 crc32][JSON]`, written to a temporary file, fsynced
and renamed over the old one), `journal-<generation>.log` (cache_service/durable/journal.py), `lock`.
They hold tenants' token ids: the directory is kept 0700 and every file 0600
(common/private_files.py), whatever the umask and whatever modes an older version left.
A snapshot of generation G holds the state just before the first record of `journal-G.log`;
recovery loads it and replays every log of generation >= G in order. A snapshot is taken when
the current log passes `snapshot_bytes` (or twice the last snapshot's size, if larger; written by
a thread) and once after every recovery, so the log stays bounded.

Not kept across a restart: Route reservations and routed-request hints (replayed, then dropped at
the end of recovery: their times are the old process's clock and they are short-lived), replica
load reports, WatchEvents' replay buffer beyond the last snapshot. A replayed Step that does not
reproduce its recorded digest, or a pool that fails its integrity check, means a bug or a damaged
state dir: that pool is dropped rather than trusted (its replica re-registers into a fresh pool).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import re
import struct
import threading
import time
import zlib
from typing import Any

from cache_service.durable.journal import Journal, read_records
from cache_service.durable.replay import STEP_HEADER, Kind, Replayer, step_digest, tier_record
from cache_service.durable.snapshot import FORMAT_VERSION, dump_pool, restore_pool, restore_pulls
from cache_service.errors import IntegrityError
from cache_service.pool import Pool
from cache_service.pool_registry import PoolRegistry
from cache_service.radix_tree import path_tokens
from cache_service.routed import RoutedRequest
from cache_service.schema import DurableStats, StepResult
from common.private_files import make_private_dir, open_private
from protos import cache_pb2

log = logging.getLogger(__name__)

SNAPSHOT_MAGIC = b"RKVSNAP1"
SNAPSHOT_HEADER = struct.Struct("<8sI")
SNAPSHOT_NAME = "snapshot.bin"
DEFAULT_SNAPSHOT_BYTES = 16 * 1024 * 1024
DEFAULT_FSYNC_SECONDS = 0.05
_STATE_FILE = re.compile(r"^(lock|snapshot\.bin(\.tmp)?|journal-\d+\.log)$")


def is_state_file(name: str) -> bool:
    """Whether `name` is a file this module writes in the state dir (the only files it chmods)."""
    return _STATE_FILE.match(name) is not None


class DurableState:
    """Owns the state dir: recovers the registry from it, then journals every change."""

    def __init__(self, state_dir: str, registry: PoolRegistry, snapshot_bytes: int = DEFAULT_SNAPSHOT_BYTES,
                 fsync_seconds: float = DEFAULT_FSYNC_SECONDS) -> None:
        self.state_dir = state_dir
        self.registry = registry
        self.snapshot_bytes = snapshot_bytes
        self.fsync_seconds = fsync_seconds
        self.generation = 0
        self.journal: Journal | None = None
        self.stats = DurableStats()
        self._lock_fd = -1
        self._broken = False
        self._last_snapshot_bytes = 0
        self._snapshotter: threading.Thread | None = None

    # ------------------------------------------------------------------ recovery

    def recover(self) -> DurableStats:
        """Rebuild every pool from snapshot + logs, then snapshot and open a fresh log.

        Raises RuntimeError when another process holds the state dir or its snapshot is corrupt.
        """
        started = time.perf_counter()
        # Token ids of every tenant live here: the directory 0700, every file 0600 (also those an
        # older version left readable), whatever the umask.
        make_private_dir(self.state_dir, owns=is_state_file)
        self._lock_fd = open_private(os.path.join(self.state_dir, "lock"), os.O_RDWR)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            raise RuntimeError(f"state dir {self.state_dir} is in use by another cache manager") from err
        registry = self.registry
        registry.journal = None  # replay records nothing
        # Replay brokers no pulls: the journal's pins (PULL_PINNED) are applied as they were.
        brokering, registry.peer_pulls = registry.peer_pulls, False
        snapshot = self._read_snapshot()
        if snapshot is not None:
            self._load_snapshot(snapshot)
        replayer = Replayer(registry, self._dropped)
        try:
            for gen, path in self._logs():
                if gen < self.generation:
                    continue
                with open(path, "rb") as f:
                    data = f.read()
                for record in read_records(data):
                    replayer.apply(record.kind, record.payload)
                    self.stats.num_replayed_records += 1
        except Exception:  # an intact record this build cannot apply: keep the state before it
            log.exception("journal record %d could not be replayed; the rest of the journal is ignored",
                          self.stats.num_replayed_records + 1)
        now_ok = []
        for pool in list(registry.pools.values()):
            # Replayed so evictions came out as they did; their times are the old process's clock,
            # and routing hints are short-lived anyway: a restored pool starts without them.
            pool.drop_routed()
            try:
                pool.check_integrity()
            except IntegrityError as err:
                log.error("restored pool %s fails its integrity check (%s): dropped", pool.pool_id, err)
                registry.retire(pool.pool_id, "not restorable")
                self.stats.num_dropped_pools += 1
                continue
            registry.add_pool(pool)  # a fresh lease: one lease period to re-attach
            pool.attach.restored = pool.attach.awaiting_reattach = True
            pool.attach.num_restored_cached_blocks = pool.tree.total_size
            now_ok.append(pool)
        self.stats.num_restored_pools = len(now_ok)
        self.stats.num_restored_cached_blocks = sum(p.attach.num_restored_cached_blocks for p in now_ok)
        self.snapshot()
        registry.journal = self
        registry.peer_pulls = brokering
        self.stats.recovery_seconds = time.perf_counter() - started
        log.info("state dir %s: restored %d pools (%d cached blocks, %d running requests) from %d records in %.3fs",
                 self.state_dir, len(now_ok), self.stats.num_restored_cached_blocks,
                 sum(len(p.requests) for p in now_ok), self.stats.num_replayed_records, self.stats.recovery_seconds)
        return self.stats

    def _logs(self) -> list[tuple[int, str]]:
        logs = []
        for name in os.listdir(self.state_dir):
            if name.startswith("journal-") and name.endswith(".log"):
                with contextlib.suppress(ValueError):
                    logs.append((int(name[len("journal-"):-len(".log")]), os.path.join(self.state_dir, name)))
        return sorted(logs)

    def _read_snapshot(self) -> dict[str, Any] | None:
        path = os.path.join(self.state_dir, SNAPSHOT_NAME)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        if len(data) < SNAPSHOT_HEADER.size:
            raise RuntimeError(f"snapshot {path} is truncated")
        magic, crc = SNAPSHOT_HEADER.unpack_from(data)
        body = data[SNAPSHOT_HEADER.size:]
        if magic != SNAPSHOT_MAGIC or zlib.crc32(body) != crc:
            raise RuntimeError(f"snapshot {path} is corrupt (bad magic or checksum)")
        snapshot = json.loads(body)
        if snapshot.get("version") != FORMAT_VERSION:
            raise RuntimeError(f"snapshot {path} has format version {snapshot.get('version')}, "
                               f"this build reads {FORMAT_VERSION}")
        return snapshot

    def _load_snapshot(self, snapshot: dict[str, Any]) -> None:
        registry = self.registry
        self.generation = int(snapshot["generation"])
        events = registry.events
        events.last_sequence = max(events.last_sequence, int(snapshot["event_sequence"]))
        events.continued_epochs = [int(e) for e in snapshot.get("publisher_epochs", [])]
        events.restore_counts(snapshot.get("namespace_sequences", {}), snapshot.get("cleared_sequence", 0))
        for pool_id, why in snapshot["tombstones"]:
            registry.remember_retired(pool_id, why)
        for data in snapshot["pools"]:
            try:
                registry.add_pool(restore_pool(data, registry.events))
            except IntegrityError as err:
                log.error("snapshot of pool %s does not restore (%s): dropped", data.get("pool_id"), err)
                self.stats.num_dropped_pools += 1
        for data in snapshot["pools"]:  # pins of pulls name another pool: once every pool is back
            pool = registry.pools.get(data["pool_id"])
            if pool is None:
                continue
            try:
                restore_pulls(pool, data.get("pulls"), registry.pools)
            except IntegrityError as err:
                log.error("pulls of pool %s do not restore (%s): pool dropped", pool.pool_id, err)
                registry.retire(pool.pool_id, "not restorable")
                self.stats.num_dropped_pools += 1
        registry.note_epoch(int(snapshot["last_epoch"]))

    def _dropped(self, pool_id: str, why: str) -> None:
        self.stats.num_dropped_pools += 1

    # ------------------------------------------------------------------ journaling

    def _append(self, kind: Kind, *parts: bytes) -> None:
        journal = self.journal
        if journal is None or self._broken:
            return
        try:
            journal.append(kind, *parts)
        except OSError:
            # Serving goes on; durability does not (a restart would lose what follows).
            log.exception("journal write failed: the state dir is no longer kept up to date")
            self._broken = True
            return
        # Bounded log; and never more than one snapshot per 2x its own size of journal, so a large
        # state is not rewritten all the time (snapshot work stays <= half the journal's).
        if (journal.size >= max(self.snapshot_bytes, 2 * self._last_snapshot_bytes)
                and (self._snapshotter is None or not self._snapshotter.is_alive())):
            self.snapshot(background=True)

    def step(self, request: cache_pb2.StepRequest | bytes, result: StepResult, pool: Pool | None = None) -> None:
        """Record an applied Step (before its reply is sent): the request's bytes as they arrived
        (or the message, serialized here) and the digest of its result; then the pins of the pulls
        it ordered (`pool`: the pool it was applied to), which replay applies after the Step, as
        the Step itself brokers none there."""
        raw = request if isinstance(request, bytes) else request.SerializeToString()
        self._append(Kind.STEP, STEP_HEADER.pack(step_digest(result)), raw)
        pulls = [p.pull_id for a in result.admits for p in a.pulls]
        if pulls and pool is not None:
            for pull_id, source, tier, node, pages in pool.pulls.pinned(pulls):
                self._append(Kind.PULL_PINNED, json.dumps({
                    "pool_id": source.pool_id, "puller": pool.pool_id, "pull_id": pull_id, "tier": tier,
                    "tokens": path_tokens(node), "namespace": node.namespace, "num_pages": pages}).encode())

    def registered(self, pool: Pool, reattached: bool) -> None:
        """A registration or re-attach, with the epoch it was given."""
        self._append(Kind.REGISTER, json.dumps({
            "worker_id": pool.worker_id, "num_blocks": pool.num_blocks, "block_size": pool.block_size,
            "model_fingerprint": pool.model_fingerprint, "vocab_size": pool.vocab_size,
            "serving_addr": pool.serving_addr, "incarnation": pool.attach.incarnation, "epoch": pool.epoch,
            "reattached": reattached, "owner": pool.attach.owner, "evict_batch": pool.evict_batch,
            "tiers": tier_record(pool.tier_spec) if pool.tier_spec.enabled else None,
        }).encode())

    def retired(self, pool_id: str, why: str) -> None:
        """A pool retired whole (recorded just before it goes)."""
        self._append(Kind.RETIRE, json.dumps({"pool_id": pool_id, "why": why}).encode())

    def evicted(self, pool_id: str, num_blocks: int) -> None:
        """An admin Evict of up to `num_blocks` blocks."""
        self._append(Kind.EVICT, json.dumps({"pool_id": pool_id, "num_blocks": num_blocks}).encode())

    def tracked(self, namespaces: list[str]) -> None:
        """Namespaces whose events are counted from now on (WatchEvents views): replay counts alike."""
        self._append(Kind.TRACK, json.dumps({"namespaces": namespaces}).encode())

    def cleared(self, pool_id: str) -> None:
        """An admin Clear."""
        self._append(Kind.CLEAR, json.dumps({"pool_id": pool_id}).encode())

    def routed(self, pool_id: str, entry: RoutedRequest) -> None:
        """A Route decision (after its pin, if any, was locked): replay locks the same prefix."""
        self._append(Kind.ROUTED, json.dumps({
            "pool_id": pool_id, "request_id": entry.request_id, "page_hashes": entry.page_hashes,
            "prefill_tokens": entry.prefill_tokens, "expires_at": entry.expires_at,
            "pin": path_tokens(entry.pin) if entry.pin is not None else None,
            "namespace": entry.namespace,
            "pin_expires_at": entry.pin_expires_at,
        }).encode())

    def pull_expired(self, puller_id: str, pull_id: int) -> None:
        """A pull's pin ended by time (its puller never reported it)."""
        self._append(Kind.PULL_EXPIRED, json.dumps({"pool_id": puller_id, "pull_id": pull_id}).encode())

    def routed_expired(self, pool_id: str, now: float) -> None:
        """Routed requests or reservations of pool `pool_id` ended at time `now`."""
        self._append(Kind.ROUTED_EXPIRED, json.dumps({"pool_id": pool_id, "now": now}).encode())

    # ------------------------------------------------------------------ snapshots

    def snapshot(self, background: bool = False) -> None:
        """Write the whole state as snapshot generation G+1 and start journal-(G+1).log.

        The state is captured and the journal switched synchronously (so the snapshot holds
        exactly what precedes the new log's first record); with `background` the file is written,
        fsynced and renamed by a thread, off the request path. Until that rename the previous
        snapshot and every log since stay, so a crash meanwhile recovers from them.
        """
        if self._snapshotter is not None:
            self._snapshotter.join()  # one snapshot at a time
        started = time.perf_counter()
        registry = self.registry
        # Above every log on disk: a log left by a crash during rotation was replayed, and stays
        # until this snapshot (which holds its effects) is renamed into place.
        generation = max([self.generation, *(gen for gen, _ in self._logs())]) + 1
        state = {
            "version": FORMAT_VERSION,
            "generation": generation,
            "last_epoch": registry.last_epoch,
            "event_sequence": registry.events.last_sequence,
            # This process's epoch and those it continues (bounded): resumable after a restart.
            "publisher_epochs": [*registry.events.continued_epochs, registry.events.epoch][-16:],
            # Namespace views' numbers (tracked namespaces, zeros included) continue as event_sequence.
            "namespace_sequences": dict(registry.events.namespace_counts),
            "cleared_sequence": registry.events.cleared_count,
            "tombstones": registry.tombstones(),
            "pools": [dump_pool(pool) for pool in registry.pools.values()],
        }
        journal, _ = Journal.open(os.path.join(self.state_dir, f"journal-{generation}.log"))
        old, self.journal, self.generation = self.journal, journal, generation
        body = json.dumps(state, separators=(",", ":")).encode()
        self._last_snapshot_bytes = len(body)
        if background:
            self._snapshotter = threading.Thread(target=self._persist, args=(body, old, generation, started),
                                                 name="snapshot", daemon=True)
            self._snapshotter.start()
        else:
            self._persist(body, old, generation, started)

    def _persist(self, body: bytes, old: Journal | None, generation: int, started: float) -> None:
        try:
            tmp = os.path.join(self.state_dir, SNAPSHOT_NAME + ".tmp")
            with os.fdopen(open_private(tmp, os.O_WRONLY | os.O_TRUNC), "wb") as f:
                f.write(SNAPSHOT_HEADER.pack(SNAPSHOT_MAGIC, zlib.crc32(body)))
                f.write(body)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, os.path.join(self.state_dir, SNAPSHOT_NAME))
            dir_fd = os.open(self.state_dir, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
            if old is not None:
                old.close()
            for gen, log_path in self._logs():
                if gen < generation:
                    os.unlink(log_path)
        except OSError:
            if threading.current_thread() is threading.main_thread():
                raise
            log.exception("snapshot %d failed; the previous snapshot and the journals since stay", generation)
            return
        self.stats.num_snapshots += 1
        self.stats.last_snapshot_seconds = time.perf_counter() - started
        log.info("snapshot %d written (%d bytes) in %.3fs", generation, len(body), self.stats.last_snapshot_seconds)

    # ------------------------------------------------------------------ upkeep

    def current_stats(self) -> DurableStats:
        """Stats with the journal's current size and fsync latency."""
        journal = self.journal
        if journal is not None:
            self.stats.journal_bytes = journal.size
            self.stats.journal_records = journal.num_records
            self.stats.last_fsync_seconds = journal.last_sync_seconds
            self.stats.max_fsync_seconds = max(self.stats.max_fsync_seconds, journal.max_sync_seconds)
        return self.stats

    async def sync_forever(self) -> None:
        """Background task: fsync the journal every `fsync_seconds` (group commit)."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.fsync_seconds)
            journal = self.journal
            if journal is None or not journal.unsynced_bytes:
                continue
            try:
                await loop.run_in_executor(None, journal.sync)
            except OSError as err:  # rotated and closed meanwhile (the close fsynced it)
                log.debug("journal fsync skipped: %s", err)

    def close(self) -> None:
        """fsync and close the journal, release the state dir."""
        if self._snapshotter is not None:
            self._snapshotter.join()
        if self.journal is not None:
            self.journal.close()
            self.journal = None
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1
