"""What the durable cache manager's journal records mean, and replaying them (cache_service/durable/state.py).

Records carry the inputs of state changes; replay feeds them through the same core code (the
core is deterministic given its inputs), verifying each Step against the digest of its result.
"""

from __future__ import annotations

import base64
import json
import logging
import struct
import zlib
from array import array
from collections.abc import Callable
from enum import IntEnum
from typing import Any

from cache_service import convert
from cache_service.errors import CacheError, IntegrityError
from cache_service.pool import Pool
from cache_service.pool_registry import PoolRegistry
from cache_service.routed import RoutedRequest
from cache_service.schema import DiskRun, StepResult, TierSpec
from protos import cache_pb2

log = logging.getLogger(__name__)


class Kind(IntEnum):
    """The record kinds of a journal (the u8 of each record's header)."""

    STEP = 1
    REGISTER = 2
    RETIRE = 3
    EVICT = 4
    CLEAR = 5
    ROUTED = 6  # a Route decision remembered by a pool (its reservation pin, if any)
    ROUTED_EXPIRED = 7  # routed requests / pins of a pool ended by time
    TRACK = 8  # namespaces whose events are counted from here on (WatchEvents views, events.py)
    PULL_PINNED = 9  # a peer pull's pin on its source (cache_service/peer_pulls.py)
    PULL_EXPIRED = 10  # a pull's pin ended by time


def step_digest(result: StepResult) -> int:
    """crc32 of what a Step handed out (miss reasons excluded: they depend on peers' leases)."""
    head = [result.num_free_blocks, result.num_evicted_blocks]
    crc = 0
    for a in result.admits:
        head += (a.admitted, a.cached_tokens, len(a.block_table))
        crc = zlib.crc32(array("I", a.block_table), crc)
    for e in result.extends:
        head += (e.ok, len(e.new_block_ids))
        crc = zlib.crc32(array("I", e.new_block_ids), crc)
    for c in result.commits:
        head += (c.cached_tokens, len(c.cached_block_ids))
        crc = zlib.crc32(array("I", c.cached_block_ids), crc)
    # Tier copies (none without tiers: the digest of such a pool is what older versions computed).
    for copy in [c for a in result.admits for c in a.loads] + list(result.offloads):
        head += (copy.copy_id, copy.src_tier, copy.dst_tier, len(copy.src))
        crc = zlib.crc32(array("I", copy.dst), zlib.crc32(array("I", copy.src), crc))
    return zlib.crc32(array("q", head), crc)


STEP_HEADER = struct.Struct("<I")  # a STEP record: [u32 digest][StepRequest bytes]


class Replayer:
    """Applies journal records to a registry (whose journal is off meanwhile)."""

    def __init__(self, registry: PoolRegistry, on_drop: Callable[[str, str], None]) -> None:
        self.registry = registry
        self.on_drop = on_drop  # (pool_id, why) of a pool dropped because its replay did not verify
        self.dropped: set[str] = set()

    def apply(self, kind: int, payload: bytes) -> None:
        """Apply one journal record; a pool whose replay does not verify is dropped."""
        registry, dropped = self.registry, self.dropped
        if kind == Kind.REGISTER:
            r = json.loads(payload)
            if r["reattached"] and r["worker_id"] in dropped:
                return
            dropped.discard(r["worker_id"])
            # "owner": absent from the records of older versions (read as anonymous)
            reg = registry.register_replica(r["worker_id"], r["num_blocks"], r["block_size"], r["model_fingerprint"],
                                            r["vocab_size"], r["serving_addr"], r["incarnation"], r["epoch"],
                                            owner=r.get("owner", ""), tiers=tier_spec_of_record(r.get("tiers")))
            if reg.reattached != r["reattached"]:
                self._drop(r["worker_id"], dropped, "re-attach did not replay")
                return
            # Absent from the records of older versions, whose pools evicted exactly what was needed.
            reg.pool.evict_batch = r.get("evict_batch", 1)
            return
        if kind == Kind.RETIRE:
            r = json.loads(payload)
            if r["pool_id"] in registry.pools:
                registry.retire(r["pool_id"], r["why"])
            else:
                registry.remember_retired(r["pool_id"], r["why"])
            return
        if kind == Kind.STEP:
            (digest,) = STEP_HEADER.unpack_from(payload)
            request = cache_pb2.StepRequest.FromString(payload[STEP_HEADER.size:])
            pool = registry.pools.get(request.pool_id)
            if pool is None or request.pool_id in dropped:
                return
            try:
                result = pool.step(convert.step_input(request))
            except CacheError as err:
                self._drop(pool.pool_id, dropped, f"step failed on replay: {err}")
                return
            if step_digest(result) != digest:
                self._drop(pool.pool_id, dropped, "step result differs on replay")
            return
        if kind == Kind.TRACK:
            registry.events.track_namespaces(json.loads(payload)["namespaces"])
            return
        if kind in (Kind.PULL_PINNED, Kind.PULL_EXPIRED):
            r = json.loads(payload)
            if kind == Kind.PULL_EXPIRED:
                puller = registry.pools.get(r["pool_id"])
                if puller is not None and r["pool_id"] not in dropped:
                    puller.pulls.end(r["pull_id"])
                return
            source, puller = registry.pools.get(r["pool_id"]), registry.pools.get(r["puller"])
            if source is None or puller is None or dropped & {r["pool_id"], r["puller"]}:
                return
            try:
                puller.pulls.restore(source, r["pull_id"], r["tier"], r["tokens"], r["namespace"], r["num_pages"])
            except IntegrityError as err:
                self._drop(source.pool_id, dropped, f"a pull's pin did not replay: {err}")
            return
        if kind in (Kind.EVICT, Kind.CLEAR, Kind.ROUTED, Kind.ROUTED_EXPIRED):
            r = json.loads(payload)
            pool = registry.pools.get(r["pool_id"])
            if pool is not None and r["pool_id"] not in dropped:
                _apply_pool_record(pool, kind, r)
            return
        log.warning("journal record of unknown kind %d skipped", kind)

    def _drop(self, pool_id: str, dropped: set[str], why: str) -> None:
        log.error("pool %s: %s; dropping it (its replica gets a fresh pool)", pool_id, why)
        dropped.add(pool_id)
        self.on_drop(pool_id, why)
        if pool_id in self.registry.pools:
            self.registry.retire(pool_id, "not restorable")


def _apply_pool_record(pool: Pool, kind: int, r: dict[str, Any]) -> None:
    """One admin or routing record (EVICT, CLEAR, ROUTED, ROUTED_EXPIRED) of a live pool."""
    if kind == Kind.EVICT:
        pool.evict(r["num_blocks"])
    elif kind == Kind.CLEAR:
        pool.clear()
    elif kind == Kind.ROUTED_EXPIRED:
        pool.expire_routed(r["now"])
    else:
        pin = pool.pin_prefix(r["pin"], r["namespace"]) if r["pin"] is not None else None
        # "namespace": the entry's (older journals wrote it only with a pin, else "").
        pool.add_routed(RoutedRequest(r["request_id"], r["namespace"], r["page_hashes"], r["prefill_tokens"],
                                      r["expires_at"], pin, r["pin_expires_at"]))


def tier_record(spec: TierSpec) -> dict[str, Any]:
    """A registration's tiers for the journal (disk runs included: a new pool starts with them)."""
    return {"host": spec.num_host_slots, "disk": spec.num_disk_slots, "policy": spec.offload_policy,
            "runs": [[run.namespace, base64.b64encode(run.token_bytes).decode(), run.slots]
                     for run in spec.disk_runs]}


def tier_spec_of_record(record: dict[str, Any] | None) -> TierSpec | None:
    """`tier_record` read back (None: no tiers, as in the records of older versions)."""
    if not record:
        return None
    runs = [DiskRun(ns, base64.b64decode(tokens), list(slots)) for ns, tokens, slots in record["runs"]]
    return TierSpec(record["host"], record["disk"], record["policy"], runs)
