"""Requests a router sent to a pool that the pool has not cached yet, and Route reservations.

Between a `Route` answer and the moment the chosen replica has cached the prompt (its first
commit or finish), later Route calls must already see the decision, or a burst of requests
sharing a new prefix would be spread over every replica before any of them cached it. Each
routed request is remembered with its prompt's page hashes (so a later prompt's prefix counts
as about to be cached here) and its expected prefill tokens (counted as queued load until the
pool admits it). A reservation additionally pins the pool's matched prefix (a lock ref on its
tree node) until the request is admitted or the pin expires.

Everything is kept per namespace: an entry is found by (namespace, request_id), and its pages
are promised only to prompts of its own namespace, so neither a Route nor an admission of one
namespace can read, replace or end another namespace's entries (page hashes are public, so
hashes alone must never be the key). Memory is bounded: at most `max_entries` entries and
`max_pages` remembered page hashes per pool, the oldest entries dropped first.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from cache_service import native
from cache_service.page_index import PageListener
from cache_service.radix_tree import TreeNode

DEFAULT_ROUTED_TTL_SECONDS = 30.0
DEFAULT_MAX_ROUTED_ENTRIES = 8192  # routed-but-not-cached requests remembered per pool
MIN_MAX_ROUTED_PAGES = 65536  # page hashes remembered per pool: at least this, else 2 x its blocks


@dataclass(slots=True)
class RoutedRequest:
    request_id: str
    namespace: str
    page_hashes: list[int]
    prefill_tokens: int  # what the pool was expected to compute for it when it was routed
    expires_at: float
    pin: TreeNode | None = None  # locked by a reservation, until pin_expires_at or admission
    pin_expires_at: float = 0.0
    admitted: bool = False
    pin_pages: int = 0  # pages the pin holds (set by RoutedRequests.add)


class RouteJournal(Protocol):
    """Where a durable cache manager records Route decisions that change a pool (cache_service/durable/)."""

    def routed(self, pool_id: str, entry: RoutedRequest) -> None: ...

    def routed_expired(self, pool_id: str, now: float) -> None: ...


def path_pages(node: TreeNode | None) -> int:
    """Pages from the root down to `node` (what locking `node` protects). A node's path length
    never changes: a split keeps the tail's identity and its whole prefix."""
    pages = 0
    while node is not None and node.parent is not None:
        pages += len(node.value)
        node = node.parent
    return pages


class RoutedRequests:
    """The routed-but-not-cached requests of one pool (not thread-safe, like the pool)."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ROUTED_ENTRIES, max_pages: int = MIN_MAX_ROUTED_PAGES) -> None:
        if max_entries < 1 or max_pages < 1:
            raise ValueError("max_entries and max_pages must be >= 1")
        self.max_entries = max_entries
        self.max_pages = max_pages
        # (namespace, request_id) -> entry, oldest first (a re-added id moves to the end).
        self._entries: dict[tuple[str, str], RoutedRequest] = {}
        self._hash_counts: dict[str, dict[int, int]] = {}  # namespace -> page hash -> entries
        self._deadlines: list[tuple[float, str, str]] = []  # lazy: (time, namespace, request_id)
        self._queued_tokens = 0
        self.num_pins = 0
        self.pinned_pages = 0  # pages held by live pins (overlapping pins count each)
        self.num_pages = 0  # page hashes remembered
        # Told when a page becomes promised here, or no longer is (a fleet's page index).
        self._listener: PageListener | None = None
        self._ops = native.page_ops()  # the counting loops in C where it is built (page_ops.c)
        # Told when queued_tokens changes, and of each deadline added (its model group's load
        # order and deadline heap: cache_service/fleet_pages.py).
        self.on_queue_change: Callable[[], None] | None = None
        self.on_deadline: Callable[[float], None] | None = None

    @property
    def queued_tokens(self) -> int:
        """prefill_tokens of routed requests not admitted yet."""
        return self._queued_tokens

    @queued_tokens.setter
    def queued_tokens(self, tokens: int) -> None:
        self._queued_tokens = tokens
        if self.on_queue_change is not None:
            self.on_queue_change()

    def set_listener(self, listener: PageListener | None) -> None:
        """Tell `listener` of every promised page now and of every change from now on."""
        self._listener = listener
        if listener is not None:
            for namespace, counts in self._hash_counts.items():
                listener.added(namespace, list(counts))

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, entry: RoutedRequest) -> list[TreeNode]:
        """Remember a routed request (replacing one of the same namespace and id) and drop the
        oldest entries beyond the bounds; returns pins to unlock. An entry longer than
        `max_pages` keeps only its leading `max_pages` hashes."""
        unlock = self.drop(entry.namespace, entry.request_id)
        if len(entry.page_hashes) > self.max_pages:
            entry.page_hashes = entry.page_hashes[: self.max_pages]
        while self._entries and (len(self._entries) >= self.max_entries
                                 or self.num_pages + len(entry.page_hashes) > self.max_pages):
            namespace, request_id = next(iter(self._entries))
            unlock.extend(self.drop(namespace, request_id))
        key = (entry.namespace, entry.request_id)
        self._entries[key] = entry
        if entry.page_hashes:  # a namespace's counts exist while it has a hash (see drop)
            counts = self._hash_counts.setdefault(entry.namespace, {})
            if self._ops is not None:
                fresh = self._ops.count_add(counts, entry.page_hashes)
            else:
                fresh = []
                for h in entry.page_hashes:
                    n = counts.get(h, 0)
                    counts[h] = n + 1
                    if not n:
                        fresh.append(h)
            if self._listener is not None and fresh:
                self._listener.added(entry.namespace, fresh)
        self.num_pages += len(entry.page_hashes)
        self.queued_tokens += entry.prefill_tokens
        heapq.heappush(self._deadlines, (entry.expires_at, *key))
        if self.on_deadline is not None:
            self.on_deadline(entry.expires_at)
        if entry.pin is not None:
            entry.pin_pages = path_pages(entry.pin)
            self.num_pins += 1
            self.pinned_pages += entry.pin_pages
            heapq.heappush(self._deadlines, (entry.pin_expires_at, *key))
            if self.on_deadline is not None:
                self.on_deadline(entry.pin_expires_at)
        if len(self._deadlines) > 4 * len(self._entries) + 1024:
            self._compact_deadlines()  # dropped and replaced entries leave stale deadlines behind
        return unlock

    def _compact_deadlines(self) -> None:
        """Keep only the deadlines of remembered entries (amortized: the heap at least doubled)."""
        deadlines = [(e.expires_at, *key) for key, e in self._entries.items()]
        deadlines.extend((e.pin_expires_at, *key) for key, e in self._entries.items() if e.pin is not None)
        heapq.heapify(deadlines)
        self._deadlines = deadlines

    def promised_pages(self, namespace: str, page_hashes: list[int]) -> int:
        """Leading pages of a prompt of `namespace` that a routed request of the same namespace
        will have cached here."""
        counts = self._hash_counts.get(namespace)
        if counts is None:
            return 0
        n = 0
        for h in page_hashes:
            if h not in counts:
                break
            n += 1
        return n

    def on_admit(self, namespace: str, request_id: str) -> list[TreeNode]:
        """The pool admitted the request: its queued tokens and pin end (pins are returned)."""
        entry = self._entries.get((namespace, request_id))
        if entry is None or entry.admitted:
            return []
        entry.admitted = True
        self.queued_tokens -= entry.prefill_tokens
        return self._unpin(entry)

    def drop(self, namespace: str, request_id: str) -> list[TreeNode]:
        """The request cached its prompt, ended, or expired: forget it; returns pins to unlock."""
        entry = self._entries.pop((namespace, request_id), None)
        if entry is None:
            return []
        if entry.page_hashes:
            counts = self._hash_counts[namespace]
            if self._ops is not None:
                gone = self._ops.count_remove(counts, entry.page_hashes)
            else:
                gone = []
                for h in entry.page_hashes:
                    left = counts[h] - 1
                    if left:
                        counts[h] = left
                    else:
                        del counts[h]
                        gone.append(h)
            if self._listener is not None and gone:
                self._listener.removed(namespace, gone)
            if not counts:
                del self._hash_counts[namespace]
        self.num_pages -= len(entry.page_hashes)
        if not entry.admitted:
            self.queued_tokens -= entry.prefill_tokens
        return self._unpin(entry)

    @property
    def next_deadline(self) -> float:
        return self._deadlines[0][0] if self._deadlines else float("inf")

    def deadlines(self) -> list[float]:
        """Every deadline still to come (some may be of entries gone since)."""
        return [d[0] for d in self._deadlines]

    def expire(self, now: float) -> list[TreeNode]:
        """End every pin and entry whose time has come; returns the pins to unlock."""
        unlock: list[TreeNode] = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, namespace, request_id = heapq.heappop(self._deadlines)
            entry = self._entries.get((namespace, request_id))
            if entry is None:
                continue
            if entry.expires_at <= now:
                unlock.extend(self.drop(namespace, request_id))
            elif entry.pin is not None and entry.pin_expires_at <= now:
                unlock.extend(self._unpin(entry))
        return unlock

    def promised(self) -> dict[str, list[int]]:
        """The promised pages' hashes per namespace (integrity checks of the page index)."""
        return {namespace: list(counts) for namespace, counts in self._hash_counts.items()}

    def entries(self) -> list[RoutedRequest]:
        """Every remembered routed request, oldest first (for snapshots)."""
        return list(self._entries.values())

    def drop_all(self) -> list[TreeNode]:
        unlock: list[TreeNode] = []
        for namespace, request_id in list(self._entries):
            unlock.extend(self.drop(namespace, request_id))
        self._deadlines.clear()
        return unlock

    def _unpin(self, entry: RoutedRequest) -> list[TreeNode]:
        if entry.pin is None:
            return []
        pin, entry.pin = entry.pin, None
        self.num_pins -= 1
        self.pinned_pages -= entry.pin_pages
        return [pin]


def _no_peer_pages(namespace: str, hashes: Iterable[int], skip: int) -> int:
    return 0


@dataclass(slots=True)
class RoutingState:
    """A pool's routing side (one `Pool.routing` per pool; its pool applies it to its tree).

    `max_pinned_blocks`, `peer_pages` and `journal` are set by the registry (cache_service/pool_registry.py).
    """

    routed: RoutedRequests  # routed-but-not-cached requests and their reservations (pins)
    max_pinned_blocks: int  # blocks Route reservations may pin at once (--max-pinned-fraction)
    # (namespace, a prompt's page hash chain) -> the most leading pages of it another live pool
    # of the same model holds on device: where else a miss was cached.
    peer_pages: Callable[[str, Iterable[int], int], int] = _no_peer_pages
    journal: RouteJournal | None = None  # records routed requests and their expiry

    def may_pin(self, num_pages: int) -> bool:
        """Whether a reservation of `num_pages` more pages stays within `max_pinned_blocks`."""
        return self.routed.pinned_pages + num_pages <= self.max_pinned_blocks
