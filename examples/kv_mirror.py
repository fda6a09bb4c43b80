"""A KV-cache mirror for external routers, built from `CacheManager.WatchEvents` alone.

`KvMirror` holds, per pool and per tier, the set of cached page hashes (BlockStored adds pages,
BlockRemoved drops them, each for the tier the event names; AllCleared empties the pool, every
tier) and answers `match(pool_id, token_ids, namespace)` the way the cache manager's `Match` does:
the longest page-aligned prefix in the pool's device blocks, found by hashing the prompt's pages
with the chained hash of protos/cache.proto (`page_hashes` below). `match_tiers` adds what `Match`
reports as matched_host_tokens / matched_disk_tokens: the tokens after that the replica's host
tier, then its disk tier, holds (docs/tiers.md). A page may be held by several tiers at once.
Events of servers without tiers carry no tier: they are about device blocks (TIER_DEVICE = 0).

`KvMirrorWatcher` keeps a mirror in sync over one stream, in a background thread:

* first connection (or no known position): `snapshot = true`, after dropping all state;
* after a disconnect: resume with `start_sequence = last + 1`; when the server answers
  OUT_OF_RANGE (the events were dropped from its buffer, or the server restarted and is behind),
  drop all state and resubscribe with a snapshot;
* every event carries the server's `publisher_epoch`: when it differs from the one the mirror was
  built from (a cache-manager restart whose new sequence numbers happen to cover the resume
  point), drop all state and resubscribe with a snapshot.

A cache manager run as several shards (common/shards.py: each owns the pools of the replicas
that hash to it) numbers its events per shard, so `ShardedKvMirror` keeps one watcher and one
mirror per shard and answers for a pool from the shard's mirror that holds it.

    python -m examples.kv_mirror --cache-addr 127.0.0.1:50051[,127.0.0.1:50151] [--pool-id P] [--interval 5]

prints each pool's mirrored page count per tier every --interval seconds.
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from xxhash import xxh3_64_intdigest

from protos import cache_pb2, cache_pb2_grpc

log = logging.getLogger("kv_mirror")


def page_hashes(parent_hash: int, namespace: str, tokens: Sequence[int], page_size: int) -> list[int]:
    """Chained uint64 hash of each whole page of `tokens` (protos/cache.proto, BlockStored):
    xxh3_64(uint32_le(token) * page_size, seed=parent XOR xxh3_64(utf8(namespace)))."""
    ns_seed = xxh3_64_intdigest(namespace.encode())
    data = array("I", tokens)
    if sys.byteorder == "big":
        data.byteswap()
    raw = data.tobytes()
    step = 4 * page_size
    hashes, h = [], parent_hash
    for start in range(0, len(raw) - step + 1, step):
        h = xxh3_64_intdigest(raw[start:start + step], h ^ ns_seed)
        hashes.append(h)
    return hashes


TIER_DEVICE, TIER_HOST, TIER_DISK = cache_pb2.TIER_DEVICE, cache_pb2.TIER_HOST, cache_pb2.TIER_DISK
TIER_NAMES = {TIER_DEVICE: "device", TIER_HOST: "host", TIER_DISK: "disk"}


@dataclass
class PoolMirror:
    block_size: int = 0
    # tier -> page hash -> namespace (hashes already differ across namespaces; kept for inspection)
    tiers: dict[int, dict[int, str]] = field(default_factory=dict)

    @property
    def pages(self) -> dict[int, str]:
        """The device tier's pages (what a mirror without tiers held)."""
        return self.tiers.setdefault(TIER_DEVICE, {})

    def tier(self, tier: int) -> dict[int, str]:
        return self.tiers.setdefault(tier, {})

    def prefix_pages(self, hashes: Sequence[int], tier: int) -> int:
        """Leading pages of a prompt (its page hash chain) the tier holds."""
        pages = self.tiers.get(tier, {})
        n = 0
        for h in hashes:
            if h not in pages:
                break
            n += 1
        return n


class KvMirror:
    """Every pool's cached pages, from CacheEvents. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.pools: dict[str, PoolMirror] = {}
        self.last_sequence = 0  # 0: position unknown (resubscribe with a snapshot)
        self.publisher_epoch: int | None = None
        self.num_resets = 0

    def reset(self) -> None:
        """Forget everything (before a snapshot)."""
        with self._lock:
            self.pools = {}
            self.last_sequence = 0
            self.publisher_epoch = None
            self.num_resets += 1

    def apply(self, event: cache_pb2.CacheEvent) -> None:
        with self._lock:
            if not event.is_snapshot and event.sequence <= self.last_sequence:
                return  # already applied
            if self.publisher_epoch is None:
                self.publisher_epoch = event.publisher_epoch
            kind = event.WhichOneof("event")
            if kind == "stored":
                stored = event.stored
                pool = self.pools.setdefault(event.pool_id, PoolMirror())
                pool.block_size = stored.block_size
                pages = pool.tier(stored.tier)  # tier absent (older servers): 0, the device
                for h in stored.block_hashes:
                    pages[h] = stored.namespace
            elif kind == "removed":
                pool = self.pools.get(event.pool_id)
                if pool is not None:
                    pages = pool.tier(event.removed.tier)
                    for h in event.removed.block_hashes:
                        pages.pop(h, None)
            elif kind == "cleared":
                self.pools.pop(event.pool_id, None)
            self.last_sequence = max(self.last_sequence, event.sequence)

    def match(self, pool_id: str, token_ids: Sequence[int], namespace: str = "", tier: int = TIER_DEVICE) -> int:
        """Tokens of the longest cached page-aligned prefix of token_ids in that pool's `tier`
        (default: its device blocks, as Match's matched_tokens)."""
        with self._lock:
            pool = self.pools.get(pool_id)
            if pool is None or not pool.block_size:
                return 0
            return pool.prefix_pages(page_hashes(0, namespace, token_ids, pool.block_size), tier) * pool.block_size

    def match_tiers(self, pool_id: str, token_ids: Sequence[int], namespace: str = "") -> tuple[int, int, int]:
        """(device, host, disk) tokens as Match reports them: the device hit, then the tokens after
        it the host tier holds, then those after both the disk tier holds."""
        with self._lock:
            pool = self.pools.get(pool_id)
            if pool is None or not pool.block_size:
                return 0, 0, 0
            hashes = page_hashes(0, namespace, token_ids, pool.block_size)
            covered = device = pool.prefix_pages(hashes, TIER_DEVICE)
            found = []
            for tier in (TIER_HOST, TIER_DISK):
                pages = pool.prefix_pages(hashes, tier)
                found.append(max(0, pages - covered))
                covered = max(covered, pages)
            return device * pool.block_size, found[0] * pool.block_size, found[1] * pool.block_size

    def num_pages(self) -> dict[str, int]:
        """Device pages per pool."""
        with self._lock:
            return {pool_id: len(pool.tiers.get(TIER_DEVICE, {})) for pool_id, pool in self.pools.items()}

    def num_pages_by_tier(self) -> dict[str, dict[str, int]]:
        """Pages per pool and tier name ("device", "host", "disk"; tiers never seen are left out)."""
        with self._lock:
            return {pool_id: {TIER_NAMES.get(t, str(t)): len(pages) for t, pages in sorted(pool.tiers.items())}
                    for pool_id, pool in self.pools.items()}


class KvMirrorWatcher:
    """Feeds a KvMirror from WatchEvents in a daemon thread; reconnects and resyncs by itself."""

    def __init__(self, cache_addr: str, mirror: KvMirror | None = None, pool_id: str = "",
                 credentials: grpc.ChannelCredentials | None = None, token: str | None = None,
                 retry_delay_s: float = 0.1) -> None:
        self.cache_addr = cache_addr
        self.mirror = mirror if mirror is not None else KvMirror()
        self.pool_id = pool_id
        self.credentials = credentials
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self.retry_delay_s = retry_delay_s
        self.num_connects = 0
        self.num_snapshots = 0
        self.num_resumes = 0
        self.num_epoch_changes = 0
        self.num_out_of_range = 0
        self._need_snapshot = True
        self._stop = threading.Event()
        self._call = None
        self._thread: threading.Thread | None = None

    def start(self) -> KvMirrorWatcher:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="kv-mirror", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Disconnect (the mirror keeps its state and position: start() again resumes)."""
        self._stop.set()
        call = self._call
        if call is not None:
            call.cancel()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def _run(self) -> None:
        options = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                   ("grpc.max_reconnect_backoff_ms", 500)]
        while not self._stop.is_set():
            if self.credentials is not None:
                channel = grpc.secure_channel(self.cache_addr, self.credentials, options=options)
            else:
                channel = grpc.insecure_channel(self.cache_addr, options=options)
            try:
                self._stream(cache_pb2_grpc.CacheManagerStub(channel))
            except grpc.RpcError as err:
                if self._stop.is_set():
                    break
                code = err.code()
                if code == grpc.StatusCode.OUT_OF_RANGE:
                    log.info("resume point is gone (%s): resyncing with a snapshot", err.details())
                    self.num_out_of_range += 1
                    self._need_snapshot = True
                    continue
                if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    self._need_snapshot = True
                log.info("event stream ended (%s); reconnecting", code.name)
            finally:
                self._call = None
                channel.close()
            self._stop.wait(self.retry_delay_s)

    def _stream(self, stub: cache_pb2_grpc.CacheManagerStub) -> None:
        mirror = self.mirror
        snapshot = self._need_snapshot or mirror.last_sequence == 0
        if snapshot:
            mirror.reset()
            request = cache_pb2.WatchEventsRequest(pool_id=self.pool_id, snapshot=True)
        else:
            request = cache_pb2.WatchEventsRequest(pool_id=self.pool_id, start_sequence=mirror.last_sequence + 1)
        epoch = mirror.publisher_epoch
        self._call = call = stub.WatchEvents(request, metadata=self.metadata, wait_for_ready=True)
        if self._stop.is_set():
            call.cancel()
        self.num_connects += 1
        self._need_snapshot = False
        if snapshot:
            self.num_snapshots += 1
        else:
            self.num_resumes += 1
        for event in call:
            if epoch is not None and event.publisher_epoch != epoch:
                log.info("publisher epoch changed (%d -> %d): the cache manager restarted; resyncing",
                         epoch, event.publisher_epoch)
                self.num_epoch_changes += 1
                self._need_snapshot = True
                call.cancel()
                return
            mirror.apply(event)
            epoch = mirror.publisher_epoch


class ShardedKvMirror:
    """One KvMirrorWatcher per cache-manager shard; pools are answered from the shard holding them."""

    def __init__(self, cache_addrs: Sequence[str], **watcher_args) -> None:
        self.watchers = [KvMirrorWatcher(addr, **watcher_args) for addr in cache_addrs]

    def start(self) -> ShardedKvMirror:
        for watcher in self.watchers:
            watcher.start()
        return self

    def stop(self) -> None:
        for watcher in self.watchers:
            watcher.stop()

    def _mirror_of(self, pool_id: str) -> KvMirror | None:
        return next((w.mirror for w in self.watchers if pool_id in w.mirror.pools), None)

    def match(self, pool_id: str, token_ids: Sequence[int], namespace: str = "", tier: int = TIER_DEVICE) -> int:
        mirror = self._mirror_of(pool_id)
        return mirror.match(pool_id, token_ids, namespace, tier) if mirror is not None else 0

    def num_pages_by_tier(self) -> dict[str, dict[str, int]]:
        return {pool_id: pages for w in self.watchers for pool_id, pages in w.mirror.num_pages_by_tier().items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m examples.kv_mirror",
                                     description="mirror the cache manager's pool trees from WatchEvents")
    parser.add_argument("--cache-addr", default="127.0.0.1:50051",
                        help="cache manager address HOST:PORT, or its shards' addresses comma-separated")
    parser.add_argument("--pool-id", default="", help="mirror only this pool (default: every pool)")
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between summaries")
    parser.add_argument("--cache-tls-ca", type=Path, metavar="PEM", help="CA of the cache manager's TLS cert")
    parser.add_argument("--cache-token-file", type=Path, metavar="PATH", help="file with a reader bearer token")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    credentials = (grpc.ssl_channel_credentials(args.cache_tls_ca.read_bytes())
                   if args.cache_tls_ca else None)
    token = args.cache_token_file.read_text().strip() if args.cache_token_file else None
    shards = [addr.strip() for addr in args.cache_addr.split(",") if addr.strip()]
    fleet = ShardedKvMirror(shards, pool_id=args.pool_id, credentials=credentials, token=token).start()
    try:
        while True:
            time.sleep(args.interval)
            for addr, watcher in zip(shards, fleet.watchers, strict=True):
                m = watcher.mirror
                print(f"{addr} sequence={m.last_sequence} epoch={m.publisher_epoch} pages={m.num_pages_by_tier()}",
                      flush=True)
    except KeyboardInterrupt:
        fleet.stop()
        return 0


if __name__ == "__main__":
    sys.exit(main())
