"""Registered pools with epochs and leases.

pool_id == worker_id. Every registration gets a fresh epoch, unique across server restarts
(seeded from the wall clock in ns, then strictly increasing). Calls must echo the epoch:
a mismatch means the caller talks about a pool that no longer exists (FAILED_PRECONDITION).

Leases: a pool RPC (Step, Heartbeat, Evict, Clear) with the right epoch renews the lease.
When it runs out (checked by `expire_leases()` periodically and on every call) the pool is
retired whole: its requests' locks and private blocks are reclaimed and its tree is dropped
too, because the replica that held the KV tensors is presumed gone and must re-register
(a new, empty pool) before it may write anything again. A tombstone remembers retired pool
ids so late calls get FAILED_PRECONDITION rather than NOT_FOUND.

Owners: every pool records who registered it (`owner`: a principal's key, a client
certificate's digest, or "" anonymous; cache_service/replica_identity.py). While a pool is live
(its lease, or a restored pool's wait for re-attach, has not run out) only its owner may
register its worker id again; anyone else gets PERMISSION_DENIED and the pool stays as it was.
Caps (cache_service/registry_limits.py) bound the pools and their memory: RESOURCE_EXHAUSTED.
A refused registration changes nothing. Journal replay (`epoch` given) repeats past decisions
and is refused by neither.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import NamedTuple, Protocol

from cache_service.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied
from cache_service.events import EventLog, stored_from_node
from cache_service.fleet_pages import FleetPages
from cache_service.peer_pulls import DEFAULT_PIN_SECONDS, PullJournal, TransferEndpoint, check_endpoint
from cache_service.pool import Pool
from cache_service.registry_limits import RegistryLimits
from cache_service.routed import RouteJournal
from cache_service.routing import RouteQuery, RouteResult, check_route_size, route, within_group_sizes
from cache_service.schema import ReplicaLoad, TierSpec
from cache_service.tiers.lower_tier import TIER_DISK
from common.limits import quote_id

log = logging.getLogger(__name__)

MAX_NUM_BLOCKS = 1 << 24
MAX_BLOCK_SIZE = 1 << 16
MAX_ADDR_LEN = 1024
MAX_INCARNATION_LEN = 256
DEFAULT_MAX_PINNED_FRACTION = 0.25


class RegistryJournal(RouteJournal, PullJournal, Protocol):
    """What a durable cache manager records of the registry's and its pools' decisions
    (cache_service/durable/)."""

    def registered(self, pool: Pool, reattached: bool) -> None: ...

    def retired(self, pool_id: str, why: str) -> None: ...


class Registration(NamedTuple):
    pool: Pool
    reattached: bool  # the replica's existing pool (same incarnation) was kept, with a new epoch


def _check_shape(worker_id: str, num_blocks: int, block_size: int, vocab_size: int, serving_addr: str) -> None:
    """InvalidArgument unless a registration's fields are in range."""
    if not worker_id:
        raise InvalidArgument("worker_id must be non-empty")
    if not 0 < num_blocks <= MAX_NUM_BLOCKS:
        raise InvalidArgument(f"num_blocks must be in [1, {MAX_NUM_BLOCKS}], got {num_blocks}")
    if not 0 < block_size <= MAX_BLOCK_SIZE:
        raise InvalidArgument(f"block_size must be in [1, {MAX_BLOCK_SIZE}], got {block_size}")
    if vocab_size < 0:
        raise InvalidArgument("vocab_size must be >= 0")
    if len(serving_addr) > MAX_ADDR_LEN:
        raise InvalidArgument(f"serving_addr longer than {MAX_ADDR_LEN} characters")


MAX_TIER_SLOTS = 1 << 24


def _check_tiers(tiers: TierSpec) -> None:
    if tiers.num_host_slots > MAX_TIER_SLOTS or tiers.num_disk_slots > MAX_TIER_SLOTS:
        raise InvalidArgument(f"num_host_slots and num_disk_slots must be at most {MAX_TIER_SLOTS}")
    if tiers.disk_runs and not tiers.num_disk_slots:
        raise InvalidArgument("disk_runs given without a disk tier (num_disk_slots 0)")


class PoolRegistry:
    """All pools of one cache server, keyed by pool_id (== worker_id)."""

    def __init__(
        self,
        lease_seconds: float = 30.0,
        events: EventLog | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_tombstones: int = 4096,
        max_pinned_fraction: float = DEFAULT_MAX_PINNED_FRACTION,
        limits: RegistryLimits | None = None,
    ) -> None:
        """`max_pinned_fraction`: the share of each pool's blocks that Route reservations may pin
        at once (a Route beyond it answers without pinning). `limits`: caps on pools and their
        memory (None: the defaults of RegistryLimits; RegistryLimits.unlimited() for none)."""
        if lease_seconds <= 0:
            raise ValueError("lease_seconds must be > 0")
        if not 0.0 <= max_pinned_fraction <= 1.0:
            raise ValueError(f"max_pinned_fraction must be in [0, 1], got {max_pinned_fraction}")
        self.max_pinned_fraction = max_pinned_fraction
        self.limits = limits if limits is not None else RegistryLimits()
        self.lease_seconds = lease_seconds
        self.events = events if events is not None else EventLog()
        self.pools: dict[str, Pool] = {}
        self.pages = FleetPages()  # which pool holds which pages, per model (Route, miss reasons)
        self._clock = clock
        self._last_epoch = 0
        self._tombstones: OrderedDict[str, str] = OrderedDict()  # pool_id -> why it went away
        self._max_tombstones = max_tombstones
        self._journal: RegistryJournal | None = None
        self._peer_pulls = True
        self.pull_pin_seconds = DEFAULT_PIN_SECONDS  # set before pools register (cache_service/server.py)

    @property
    def peer_pulls(self) -> bool:
        """Whether admissions pull pages from other replicas (cache_service/peer_pulls.py): off by
        --peer-pulls off, and while a durable cache manager replays its journal."""
        return self._peer_pulls

    @peer_pulls.setter
    def peer_pulls(self, on: bool) -> None:
        self._peer_pulls = on
        for pool in self.pools.values():
            pool.pulls.brokered = on

    @property
    def journal(self) -> RegistryJournal | None:
        """Records the registry's and its pools' decisions (a durable cache manager); None: off."""
        return self._journal

    @journal.setter
    def journal(self, journal: RegistryJournal | None) -> None:
        self._journal = journal
        for pool in self.pools.values():
            pool.routing.journal = journal
            pool.pulls.journal = journal

    def _new_epoch(self) -> int:
        self._last_epoch = max(time.time_ns(), self._last_epoch + 1)
        return self._last_epoch

    def register(
        self,
        worker_id: str,
        num_blocks: int,
        block_size: int,
        model_fingerprint: str = "",
        vocab_size: int = 0,
        serving_addr: str = "",
        owner: str = "",
    ) -> Pool:
        """Create the pool of `worker_id`, retiring any previous one of the same worker."""
        return self.register_replica(worker_id, num_blocks, block_size, model_fingerprint, vocab_size,
                                     serving_addr, owner=owner).pool

    def register_replica(
        self,
        worker_id: str,
        num_blocks: int,
        block_size: int,
        model_fingerprint: str = "",
        vocab_size: int = 0,
        serving_addr: str = "",
        incarnation: str = "",
        epoch: int | None = None,
        num_steps_acknowledged: int = 0,
        owner: str = "",
        tiers: TierSpec | None = None,
        kv_transfer_addr: str = "",
        kv_transfer_key: bytes = b"",
    ) -> Registration:
        """Register a replica's pool; re-attach to its existing one when the incarnation matches.

        Same worker, same non-empty `incarnation` (the replica's KV tensors are the same ones) and
        the same shape: the pool is kept (a restored pool stops waiting) with a new epoch, unless it
        applied fewer Steps than the replica saw answered (`num_steps_acknowledged`: the journal
        lost its last records, say at a power loss, so blocks the replica wrote since may be cached
        here under other prefixes). Anything else retires the old pool and creates a new, empty one.
        `epoch`: replay of a journal only (the live decision is replayed as it was).
        `owner`: who registers (see the module docstring). `tiers`: the replica's host / disk tiers
        (a kept pool must have the same ones; a new pool's disk tier starts with `tiers.disk_runs`,
        what the replica's disk holds). `kv_transfer_addr` / `kv_transfer_key`: where the replica
        serves KvTransfer and its ticket key (peer pulls; both or neither). Raises InvalidArgument (bad shape),
        PermissionDenied (the worker id's live pool has another owner) or ResourceExhausted (a
        cap), in that order, having changed nothing.
        """
        if len(incarnation) > MAX_INCARNATION_LEN:
            raise InvalidArgument(f"incarnation longer than {MAX_INCARNATION_LEN} characters")
        _check_shape(worker_id, num_blocks, block_size, vocab_size, serving_addr)
        tiers = tiers if tiers is not None else TierSpec()
        _check_tiers(tiers)
        transfer = check_endpoint(kv_transfer_addr, kv_transfer_key, MAX_ADDR_LEN)
        old = self.pools.get(worker_id)
        if epoch is None and old is not None and old.attach.owner != owner and self._clock() < old.lease_deadline:
            # Neither the owner nor anything about it is named: the caller learns only that the id is taken.
            raise PermissionDenied(f"worker id {quote_id(worker_id)} is held by another principal; a live pool "
                                   "is re-registered by the principal that registered it")
        if (old is not None and incarnation and old.attach.incarnation == incarnation and old.num_blocks == num_blocks
                and old.block_size == block_size and old.model_fingerprint == model_fingerprint
                and old.vocab_size == vocab_size and len(serving_addr) <= MAX_ADDR_LEN
                and old.tier_spec.same_shape(tiers)
                and (epoch is not None or (self._clock() < old.lease_deadline
                                           and old.num_steps >= num_steps_acknowledged))):
            old.epoch = epoch if epoch is not None else self._new_epoch()
            self._last_epoch = max(self._last_epoch, old.epoch)
            old.attach.awaiting_reattach = False
            old.serving_addr = serving_addr
            old.lease_deadline = self._clock() + self.lease_seconds
            if old.tiers is not None:  # copies the replica may not have seen ordered: not waited for
                old.tiers.drop_pending()
            old.pulls.drop()  # pulls too: their pins end now
            old.pulls.endpoint = transfer
            self.pages.of_pool(old).note_special(old)
            if self.journal is not None:
                self.journal.registered(old, True)
            log.info("pool re-attached pool=%s epoch=%d restored=%s running_requests=%d cached_blocks=%d",
                     worker_id, old.epoch, old.attach.restored, len(old.requests), old.tree.total_size)
            return Registration(old, True)
        if epoch is None:  # the pool this replaces (if any) gives its share back
            self.limits.check((p for p in self.pools.values() if p is not old), owner,
                              num_blocks + tiers.num_host_slots + tiers.num_disk_slots, block_size)
        pool = self._create(worker_id, num_blocks, block_size, model_fingerprint, vocab_size, serving_addr,
                            epoch, tiers, transfer)
        pool.attach.incarnation = incarnation
        pool.attach.owner = owner
        if self.journal is not None:
            self.journal.registered(pool, False)
        return Registration(pool, False)

    def _create(self, worker_id: str, num_blocks: int, block_size: int, model_fingerprint: str, vocab_size: int,
                serving_addr: str, epoch: int | None, tiers: TierSpec,
                transfer: TransferEndpoint | None = None) -> Pool:
        pool = Pool(worker_id, 0, num_blocks, block_size, model_fingerprint, vocab_size, self.events,
                    serving_addr=serving_addr, tiers=tiers, transfer=transfer)
        if pool.tiers is not None:  # validated before the old pool goes: a refusal changes nothing
            pool.tiers.restore_disk(tiers.disk_runs, vocab_size)
        if worker_id in self.pools:
            self._retire(worker_id, "re-registered")
        if epoch is None:
            epoch = self._new_epoch()
        self._last_epoch = max(self._last_epoch, epoch)
        pool.epoch = epoch
        self.add_pool(pool)
        self._tombstones.pop(worker_id, None)
        if pool.tiers is not None and pool.tiers.disk is not None:
            # What the replica's disk holds from an earlier run, announced after the old pool's
            # AllCleared (a journal replay re-registers the same way: the numbering is the same).
            for node in pool.tiers.disk.tree.iter_nodes():
                self.events.publish(pool.pool_id, stored_from_node(node, block_size, TIER_DISK))
        log.info(
            "pool registered pool=%s epoch=%d num_blocks=%d block_size=%d fingerprint=%s serving_addr=%s",
            worker_id, pool.epoch, num_blocks, block_size, model_fingerprint, serving_addr or "-",
        )
        return pool

    @property
    def last_epoch(self) -> int:
        return self._last_epoch

    def note_epoch(self, epoch: int) -> None:
        """Never hand out an epoch <= `epoch` (one a previous server process issued)."""
        self._last_epoch = max(self._last_epoch, epoch)

    def tombstones(self) -> list[tuple[str, str]]:
        """(pool_id, why) of retired pools, oldest first."""
        return list(self._tombstones.items())

    def remember_retired(self, pool_id: str, why: str) -> None:
        """Add a tombstone (restore of a snapshot or journal)."""
        self._tombstones[pool_id] = why
        self._tombstones.move_to_end(pool_id)
        if len(self._tombstones) > self._max_tombstones:
            self._tombstones.popitem(last=False)

    def add_pool(self, pool: Pool) -> None:
        """Take a pool in (a new one, or one restored from a snapshot), with a fresh lease."""
        model_fingerprint = pool.model_fingerprint
        routing = pool.routing
        model = self.pages.of_pool(pool)
        pool_id = pool.pool_id
        routing.peer_pages = lambda namespace, hashes, skip: model.deepest_other(pool_id, namespace, hashes,
                                                                                 self._clock(), skip)
        pulls = pool.pulls
        pulls.sources = lambda: self.live_pools(model_fingerprint)
        pulls.brokered = self._peer_pulls
        pulls.clock = self._clock
        pulls.pin_seconds = self.pull_pin_seconds
        pulls.journal = self._journal
        routing.max_pinned_blocks = int(self.max_pinned_fraction * pool.num_blocks)
        pool.lease_deadline = self._clock() + self.lease_seconds
        routing.journal = self._journal
        self.pools[pool.pool_id] = pool
        model.join(pool)
        self._last_epoch = max(self._last_epoch, pool.epoch)

    def get(self, pool_id: str, epoch: int) -> Pool:
        """The live pool for a pool RPC; checks the epoch and lease, and renews the lease."""
        pool = self.pools.get(pool_id)
        if pool is None:
            why = self._tombstones.get(pool_id)
            if why is not None:
                raise FailedPrecondition(f"pool {quote_id(pool_id)} is gone ({why}); re-register")
            raise NotFound(f"unknown pool {quote_id(pool_id)}; register it first")
        if pool.attach.awaiting_reattach:
            raise FailedPrecondition(
                f"the cache manager restarted; pool {quote_id(pool_id)} waits for its replica to re-register")
        if epoch != pool.epoch:
            raise FailedPrecondition(f"stale epoch for pool {quote_id(pool_id)}; re-register")
        now = self._clock()
        if now >= pool.lease_deadline:
            self._retire(pool_id, "lease expired")
            raise FailedPrecondition(f"lease of pool {quote_id(pool_id)} expired; re-register")
        pool.lease_deadline = now + self.lease_seconds
        return pool

    def peek(self, pool_id: str) -> Pool:
        """The pool for a read-only call (Stats, Match, WatchEvents): no epoch, no renewal."""
        pool = self.pools.get(pool_id)
        if pool is None:
            raise NotFound(f"unknown pool {quote_id(pool_id)}")
        return pool

    def heartbeat(self, pool_id: str, epoch: int, load: ReplicaLoad | None = None) -> float:
        """Renew the lease (and take the replica's load report); returns its length in seconds."""
        pool = self.get(pool_id, epoch)
        if load is not None:
            pool.load = load
        return self.lease_seconds

    def live_pools(self, model_fingerprint: str = "") -> list[Pool]:
        """Pools whose lease has not run out (of one model when a fingerprint is given)."""
        now = self._clock()
        return [p for p in self.pools.values() if now < p.lease_deadline
                and (not model_fingerprint or p.model_fingerprint == model_fingerprint)]

    def route(self, query: RouteQuery) -> RouteResult:
        """Rank the live pools of the query's model for its prompt (see `routing.route`)."""
        return route(self.pages.of_model(query.model_fingerprint), query, self._clock())

    def check_route_size(self, model_fingerprint: str, num_tokens: int, num_pages: int) -> None:
        """InvalidArgument for a Route prompt larger than any pool of the model holds, lease
        running or not, with `route`'s message: a caller refuses it before copying the prompt.
        `route` checks it exactly (against the live pools)."""
        if not within_group_sizes(self.pages.of_model(model_fingerprint), num_tokens, num_pages):
            check_route_size(self.live_pools(model_fingerprint), num_tokens, num_pages)

    def expire_routed(self) -> None:
        """End reservations and routed requests whose time has come, in every pool."""
        now = self._clock()
        for pool in self.pools.values():
            pool.expire_routed(now)
            pool.pulls.expire(now)  # pins of pulls whose puller never reported

    def lease_remaining(self, pool: Pool) -> float:
        return max(0.0, pool.lease_deadline - self._clock())

    def expire_leases(self) -> list[str]:
        """Retire every pool whose lease ran out; returns their ids."""
        now = self._clock()
        expired = [pid for pid, pool in self.pools.items() if now >= pool.lease_deadline]
        for pid in expired:
            self._retire(pid, "lease expired")
        return expired

    def retire(self, pool_id: str, why: str) -> None:
        """Retire a pool whole (its requests, locks and tree); later calls get FAILED_PRECONDITION."""
        self._retire(pool_id, why)

    def _retire(self, pool_id: str, why: str) -> None:
        if self.journal is not None:
            self.journal.retired(pool_id, why)
        pool = self.pools.pop(pool_id)
        running = len(pool.requests)
        pool.retire()
        self.pages.leave(pool)  # after retire emptied its tree and routed prompts: no index scan
        self.remember_retired(pool_id, why)
        log.info("pool retired pool=%s epoch=%d reason=%s running_requests=%d", pool_id, pool.epoch, why, running)

    def check_integrity(self) -> None:
        for pool in self.pools.values():
            pool.check_integrity()
        self.pages.check_integrity()
