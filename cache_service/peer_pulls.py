"""Peer pulls (docs/kv-pulls.md): pages another replica of the model holds, pulled instead of computed.

When a pool admits a prompt and another live pool of the same model and page size (the *source*)
holds more of it, in its device blocks or its host tier, than the admitting pool has (its device
hit and lower-tier loads together), the admission pulls the pages in between: `AdmitResult.pulls`
names the source's blocks (or host slots) in a ticket the cache manager signs with the source
replica's own key (`RegisterPoolRequest.kv_transfer_key`), and the source's path through them is
pinned (a lock ref on the node of its device tree, or host tier tree) until a later Step of the
puller reports the pull (the puller pulls while it runs other requests), the puller re-registers,
or the pin's time runs out (a puller that died or stalled). Only pools registered with a
kv_transfer_addr pull or are pulled from.

A pull happens only where it is cheaper than computing: the puller measures a pulled token's cost
as a share of a computed one (`ReplicaLoad.peer_load_cost`; DEFAULT_PEER_LOAD_COST until it has),
counted at both ends of the pull (`peer_load_cost`), and at 1 or more pulls nothing. Pins of a
source hold at most MAX_PINNED_SHARE of its blocks.

Pins change what the source may evict, so a durable cache manager journals them (`PullJournal`:
a pin with the pull that made it, a pin that expired) and keeps them in snapshots; its replay
brokers no pulls itself (the journal's pins are applied instead) and keeps the pins, with a fresh
expiry, past the restart (the puller may still be reading). Every lookup is made in the admission's namespace only: a source's other namespaces are never read.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from cache_service.attach import AttachState
from cache_service.errors import IntegrityError, InvalidArgument
from cache_service.radix_tree import RadixTree, TreeNode, path_hashes
from cache_service.routed import path_pages
from cache_service.schema import CopyOutcome, PeerPull, PullStats, ReplicaLoad
from cache_service.tiers.lower_tier import TIER_DEVICE, TIER_HOST
from cache_service.tiers.pool_tiers import PoolTiers
from common.token_bytes import TOKEN_BYTES

DEFAULT_PEER_LOAD_COST = 0.1  # a pulled token / a computed one until the puller measured it
PULL_ENDS = 2  # a pull keeps two replicas busy: its measured cost counts at each end
DEFAULT_PIN_SECONDS = 10.0  # how long a source's pages stay pinned for a puller that never reports
# A ticket runs out this long before its pin ends, so clocks a little apart between the cache
# manager and the source replica never let the source read pages whose pin has ended.
TICKET_MARGIN_SECONDS = 2.0
MAX_PINNED_SHARE = 0.25  # of a source's blocks, pinned for pulls at once
MIN_KEY_BYTES, MAX_KEY_BYTES = 16, 64


class Pool(Protocol):
    """What peer pulls read of a pool (cache_service/pool.py)."""

    pool_id: str
    worker_id: str
    block_size: int
    num_blocks: int
    tree: RadixTree
    tiers: PoolTiers | None
    attach: AttachState
    load: ReplicaLoad
    pulls: PeerPulls


class PullJournal(Protocol):
    """Where a durable cache manager records pins ended by time (cache_service/durable/; it records
    the pins a Step made after that Step, from `pinned`)."""

    def pull_expired(self, puller_id: str, pull_id: int) -> None: ...


@dataclass(slots=True)
class TransferEndpoint:
    """Where a replica serves KvTransfer, and the key its pull tickets are signed with."""

    addr: str
    key: bytes


@dataclass(slots=True)
class PullPin:
    """A source's pages pinned for one pull (a lock ref on `node`, its path's last node)."""

    source: Pool
    tier: int  # TIER_DEVICE or TIER_HOST: the tree `node` is in
    node: TreeNode
    num_pages: int
    expires_at: float  # the registry's clock
    active: bool = True

    def release(self) -> None:
        if not self.active:
            return
        holds = self.holds
        self.active = False
        source = self.source
        source.pulls.pinned_pages -= self.num_pages
        if holds:
            source_tree(source, self.tier).dec_lock_ref(self.node)

    @property
    def holds(self) -> bool:
        """Whether it still pins anything (a retired source's tree went with it)."""
        return self.active and not self.source.pulls.retired and self.node.in_tree


def source_tree(source: Pool, tier: int) -> RadixTree:
    """The tree of `source`'s `tier` (its device pool's, or its host tier's)."""
    if tier == TIER_DEVICE:
        return source.tree
    host = source.tiers.host if source.tiers is not None else None
    if tier != TIER_HOST or host is None:
        raise IntegrityError(f"pool {source.pool_id!r} has no tier {tier} to pull from")
    return host.tree


def held_pages(source: Pool, pages_of: Callable[[RadixTree], int]) -> tuple[int, int]:
    """(pages, tier): the most pages of a prompt `source` holds, in its device blocks or its host
    tier (the device on a tie: nothing to copy out of host memory first on a GPU). `pages_of`: a
    tree's leading pages of the prompt, read-only."""
    best = (pages_of(source.tree), TIER_DEVICE)
    host = source.tiers.host if source.tiers is not None else None
    if host is not None:
        pages = pages_of(host.tree)
        if pages > best[0]:
            best = (pages, TIER_HOST)
    return best


@dataclass(slots=True)
class _PendingPull:
    pin: PullPin
    num_pages: int


@dataclass(slots=True)
class PullCounters:
    num_pulls: int = 0
    num_pulled_pages: int = 0
    num_failed_pages: int = 0
    peer_hit_tokens: int = 0
    num_served_pulls: int = 0
    num_expired_pins: int = 0


class PlannedPull(NamedTuple):
    pull: PeerPull
    num_pages: int
    last_hash: int  # hash of the last pulled page


def _no_sources() -> Iterable[Pool]:
    return ()


@dataclass(slots=True)
class PeerPulls:
    """One pool's side of peer pulls: as a puller (the pulls of its last reply) and as a source
    (pages others pin on it). The registry wires `sources`, `brokered` and the clocks."""

    endpoint: TransferEndpoint | None = None
    pool_id: str = ""
    counters: PullCounters = field(default_factory=PullCounters)
    next_pull_id: int = 1
    pending: dict[int, _PendingPull] = field(default_factory=dict)
    pinned_pages: int = 0  # this pool's pages pinned by other pools' pulls
    retired: bool = False  # this pool is gone (its pins with its tree)
    sources: Callable[[], Iterable[Pool]] = _no_sources  # live pools of the same model
    brokered: bool = True  # False: no pulls brokered (--peer-pulls off, or a journal replaying)
    pin_seconds: float = DEFAULT_PIN_SECONDS
    clock: Callable[[], float] = time.monotonic
    wall_clock: Callable[[], float] = time.time
    journal: PullJournal | None = None

    @property
    def enabled(self) -> bool:
        return self.endpoint is not None

    def plan(self, pool: Pool, key: bytes, namespace: str, covered: int, max_pages: int,
             dst: Sequence[int]) -> PlannedPull | None:
        """The pull of pages [covered, n) of `key` (the cacheable prompt, encoded) from the source
        that holds the most of them, pinned there; None when no source adds a page or a pull would
        cost as much as computing. `dst`: the admitted request's whole block table."""
        if not (self.brokered and self.enabled) or peer_load_cost(pool) >= 1.0 or covered >= max_pages:
            return None
        bs = pool.block_size
        prompt = key[: max_pages * bs * TOKEN_BYTES]

        def pages_of(tree: RadixTree) -> int:
            return tree.peek_key(prompt, namespace) // bs

        best: Pool | None = None
        best_pages, best_tier = covered, TIER_DEVICE
        for source in self.sources():
            if source is pool or not source.pulls.enabled or source.block_size != bs or source.attach.awaiting_reattach:
                continue
            pages, tier = held_pages(source, pages_of)
            room = int(MAX_PINNED_SHARE * source.num_blocks) - source.pulls.pinned_pages
            if pages > best_pages and pages - covered <= room:
                best, best_pages, best_tier = source, pages, tier
        if best is None:
            return None
        tree = source_tree(best, best_tier)
        match = tree.match_prefix(key[: best_pages * bs * TOKEN_BYTES], namespace)
        node, n = match.last_node, best_pages - covered
        assert node is not None and len(match.block_ids) == best_pages
        tree.inc_lock_ref(node)
        source_pulls = best.pulls
        source_pulls.pinned_pages += n
        source_pulls.counters.num_served_pulls += 1
        now = self.clock()
        pin = PullPin(best, best_tier, node, n, now + self.pin_seconds)
        pull_id = self.next_pull_id
        self.next_pull_id += 1
        self.pending[pull_id] = _PendingPull(pin, n)
        self.counters.num_pulls += 1
        self.counters.num_pulled_pages += n
        endpoint = source_pulls.endpoint
        assert endpoint is not None
        pull = PeerPull(pull_id, best.worker_id, endpoint.addr, best.attach.incarnation, endpoint.key, best_tier,
                        list(match.block_ids[covered:]), list(dst[covered:best_pages]), namespace,
                        path_hashes(node, n), self.pin_seconds,
                        self.wall_clock() + self.pin_seconds - TICKET_MARGIN_SECONDS, pool.worker_id)
        return PlannedPull(pull, n, node.last_hash)

    def validate_outcomes(self, outcomes: Sequence[CopyOutcome]) -> None:
        seen = set()
        for o in outcomes:
            if o.copy_id in seen:
                raise InvalidArgument(f"pull {o.copy_id} is reported twice")
            seen.add(o.copy_id)
            pending = self.pending.get(o.copy_id)
            if pending is not None and o.num_pages_copied > pending.num_pages:
                raise InvalidArgument(f"pull {o.copy_id}: num_pages_copied {o.num_pages_copied} exceeds its "
                                      f"{pending.num_pages} pages")

    def apply_outcomes(self, outcomes: Sequence[CopyOutcome]) -> None:
        """Reported pulls end: their pins are released, their missing pages counted failed. A pull
        not reported yet keeps its pin (its puller is still reading) until a later Step reports it
        or the pin expires; outcomes of unknown (ended) pulls change nothing."""
        for o in outcomes:
            pending = self.pending.pop(o.copy_id, None)
            if pending is not None:
                pending.pin.release()
                self.counters.num_failed_pages += pending.num_pages - o.num_pages_copied

    def expire(self, now: float) -> None:
        """End the pins of pulls whose puller did not report them in time (counted failed whole)."""
        for pull_id in [i for i, p in self.pending.items() if p.pin.expires_at <= now]:
            if self.journal is not None:
                self.journal.pull_expired(self.pool_id, pull_id)
            self.end(pull_id)

    def end(self, pull_id: int) -> None:
        """End one pull's pin, counted as expired (`expire`, and its journal record replayed)."""
        pending = self.pending.pop(pull_id, None)
        if pending is None:
            return
        if pending.pin.active:
            pending.pin.source.pulls.counters.num_expired_pins += 1
        self.counters.num_failed_pages += pending.num_pages
        pending.pin.release()

    def restore(self, source: Pool, pull_id: int, tier: int, tokens: Sequence[int], namespace: str,
                num_pages: int, replayed: bool = True) -> None:
        """Pin again what a pull pinned, its pin lasting `pin_seconds` from now: `replayed` (a journal
        record) matches the pages as the pull did (touching their access times, splitting where it
        split); else (a snapshot, taken after both) finds the node as it is. IntegrityError when the
        source does not hold those pages."""
        tree = source_tree(source, tier)
        match = tree.match_prefix(tokens, namespace) if replayed else tree.peek_prefix(tokens, namespace)
        if (match.last_node is None or match.num_tokens != len(tokens) or len(match.block_ids) < num_pages
                or path_pages(match.last_node) * tree.page_size != len(tokens)):
            raise IntegrityError(f"pull {pull_id}: the source {source.pool_id!r} does not hold the pinned pages")
        tree.inc_lock_ref(match.last_node)
        source.pulls.pinned_pages += num_pages
        pin = PullPin(source, tier, match.last_node, num_pages, self.clock() + self.pin_seconds)
        self.pending[pull_id] = _PendingPull(pin, num_pages)
        self.next_pull_id = max(self.next_pull_id, pull_id + 1)

    def pinned(self, pull_ids: Iterable[int] | None = None) -> list[tuple[int, Pool, int, TreeNode, int]]:
        """(pull id, source, tier, pinned node, pages) of the pulls waiting for a report (all, or
        those of `pull_ids`): what a snapshot keeps, and what the journal records after a Step."""
        ids = self.pending if pull_ids is None else [i for i in pull_ids if i in self.pending]
        return [(i, p.pin.source, p.pin.tier, p.pin.node, p.num_pages) for i in ids if (p := self.pending[i]).pin.holds]

    def drop(self) -> None:
        """Release every pin this pool's pulls hold (its replica re-registered)."""
        for pending in self.pending.values():
            pending.pin.release()
        self.pending = {}

    def retire(self) -> None:
        """The pool is gone: its pulls' pins end, and pins on its pages with its tree."""
        self.drop()
        self.retired = True

    def stats(self) -> PullStats | None:
        if not self.enabled:
            return None
        c = self.counters
        return PullStats(c.num_pulls, c.num_pulled_pages, c.num_failed_pages, c.peer_hit_tokens,
                         c.num_served_pulls, self.pinned_pages, c.num_expired_pins)


def peer_load_cost(pool: Pool) -> float:
    """What pulling a token costs the fleet as a share of computing it on `pool`'s replica: its
    measured (or the default) cost of a pulled token, counted at both ends (the source spends as
    long sending the pages as the puller receiving them, and a pull displaces work on both)."""
    return PULL_ENDS * (pool.load.peer_load_cost or DEFAULT_PEER_LOAD_COST)


def check_endpoint(addr: str, key: bytes, max_addr_len: int) -> TransferEndpoint | None:
    """The endpoint a registration gives (None: it serves and makes no pulls); InvalidArgument
    when only one of the two is set, the key's length is outside [16, 64] or the address too long."""
    if not addr and not key:
        return None
    if not addr or not key:
        raise InvalidArgument("kv_transfer_addr and kv_transfer_key go together: set both or neither")
    if not MIN_KEY_BYTES <= len(key) <= MAX_KEY_BYTES:
        raise InvalidArgument(f"kv_transfer_key must be {MIN_KEY_BYTES}-{MAX_KEY_BYTES} bytes, got {len(key)}")
    if len(addr) > max_addr_len:
        raise InvalidArgument(f"kv_transfer_addr longer than {max_addr_len} characters")
    return TransferEndpoint(addr, bytes(key))
