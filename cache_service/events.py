"""KV events: what entered and left each pool's tree, with server-wide sequence numbers.

Routers mirror the trees from these (the vLLM / SGLang / Dynamo KV-event model). The log keeps
a replay buffer bounded in events and in bytes (so the cache manager's memory stays proportional
to its pools, not to its history); a consumer that lost its place rebuilds from a snapshot.
WatchEvents streams read that one buffer through a cursor each (cache_service/watch.py), so a
watcher holds no copy of the events it has not read yet.

Namespace views: a token limited to namespaces must not learn how busy the others are, so its
stream is numbered in its own view (the events of its namespaces, plus every AllCleared). For
that the log counts the events of each *tracked* namespace (those some ns= token names:
`track_namespaces`; never every namespace a client made up, which would grow without bound) and
the AllCleared events; a view's number is the sum of its namespaces' counts plus the AllCleared
count. A buffered event remembers whether it was counted (`in_views`), so a view's numbers can
be walked through the buffer (`locate_view`).

Buffered events live long and are many (up to `capacity`), so the buffer holds each one as a
flat tuple of atoms (`_flatten`: ints, strings, bytes, tuples of ints), which Python's cyclic
garbage collector stops tracking after one collection; `replay` rebuilds the events. Buffered as
objects, with lists of ids, they made every full collection walk each buffered event and id:
tens of ms of pause in the middle of some `Step`. Pools publish ids as tuples and token ids as
an array('I'), which the collector does not walk id by id either.
"""

from __future__ import annotations

import itertools
import logging
import time
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from itertools import chain

from cache_service.errors import OutOfRange
from cache_service.radix_tree import EvictedNode, RadixTree, TreeNode
from common.token_bytes import encode_tokens, unpack_tokens

log = logging.getLogger(__name__)


@dataclass(slots=True)
class BlockStored:
    block_hashes: Sequence[int]
    parent_block_hash: int
    token_ids: Sequence[int]
    block_size: int
    namespace: str
    block_ids: Sequence[int]
    tier: int = 0  # cache.proto Tier: 0 the pool's device blocks, 1 host, 2 disk (block_ids: slots)


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: Sequence[int]
    block_ids: Sequence[int]
    namespace: str = ""
    tier: int = 0


@dataclass(slots=True)
class AllCleared:
    pass


EventPayload = BlockStored | BlockRemoved | AllCleared


@dataclass(slots=True)
class CacheEvent:
    sequence: int
    pool_id: str
    timestamp: float
    payload: EventPayload
    is_snapshot: bool = False
    # The EventLog's `epoch` (see CacheEvent.publisher_epoch in protos/cache.proto).
    publisher_epoch: int = 0
    # Counted in namespace views: an AllCleared, or an event of a tracked namespace (module docstring).
    in_views: bool = False


Subscriber = Callable[[CacheEvent], None]

_STORED, _REMOVED, _CLEARED = 0, 1, 2
# A buffered row: (sequence, pool_id, timestamp, is_snapshot, publisher_epoch, in_views, kind,
# namespace ("" for AllCleared), then the payload's other fields). Positions read directly:
ROW_SEQUENCE, ROW_POOL, ROW_IN_VIEWS, ROW_KIND, ROW_NAMESPACE = 0, 1, 5, 6, 7


def _flatten(event: CacheEvent) -> tuple:
    """The event as one tuple of atoms (see the module docstring); `unflatten` inverts it."""
    head = (event.sequence, event.pool_id, event.timestamp, event.is_snapshot, event.publisher_epoch,
            event.in_views)
    p = event.payload
    if isinstance(p, BlockStored):
        return (*head, _STORED, p.namespace, tuple(p.block_hashes), p.parent_block_hash,
                encode_tokens(p.token_ids), p.block_size, tuple(p.block_ids), p.tier)
    if isinstance(p, BlockRemoved):
        return (*head, _REMOVED, p.namespace, tuple(p.block_hashes), tuple(p.block_ids), p.tier)
    return (*head, _CLEARED, "")


def unflatten(row: tuple) -> CacheEvent:
    """The CacheEvent of a buffered row (see `EventLog.read`)."""
    sequence, pool_id, timestamp, is_snapshot, publisher_epoch, in_views, kind, namespace, *rest = row
    payload: EventPayload
    if kind == _STORED:
        hashes, parent_hash, tokens, block_size, block_ids, tier = rest
        payload = BlockStored(hashes, parent_hash, unpack_tokens(tokens), block_size, namespace, block_ids, tier)
    elif kind == _REMOVED:
        hashes, block_ids, tier = rest
        payload = BlockRemoved(hashes, block_ids, namespace, tier)
    else:
        payload = AllCleared()
    return CacheEvent(sequence, pool_id, timestamp, payload, is_snapshot, publisher_epoch, in_views)


def in_view(row: tuple, view: AbstractSet[str]) -> bool:
    """Whether a buffered row counts in the view of these namespaces (see the module docstring)."""
    return row[ROW_IN_VIEWS] and (row[ROW_KIND] == _CLEARED or row[ROW_NAMESPACE] in view)


def event_in_view(event: CacheEvent, view: AbstractSet[str]) -> bool:
    """`in_view` of a live event."""
    payload = event.payload
    return event.in_views and (isinstance(payload, AllCleared) or payload.namespace in view)

# Resident cost of a buffered event, on the safe side: a CacheEvent with its payload object;
# per token id its 4 bytes in an array, or else a pointer plus its own int object (the tree's may
# be evicted meanwhile); per block id a pointer (block ids are shared with the allocator); per
# page hash a pointer plus a 64-bit int object.
_EVENT_OVERHEAD_BYTES = 400
_POINTER_BYTES = 8
_TOKEN_BYTES = 8 + 28
_HASH_BYTES = 8 + 36


def _tokens_size(token_ids: Sequence[int]) -> int:
    if isinstance(token_ids, array):
        return token_ids.itemsize * len(token_ids)
    return _TOKEN_BYTES * len(token_ids)


def event_size(event: CacheEvent) -> int:
    """Approximate bytes an event keeps alive while it is buffered."""
    p = event.payload
    if isinstance(p, BlockStored):
        return (_EVENT_OVERHEAD_BYTES + _tokens_size(p.token_ids) + _POINTER_BYTES * len(p.block_ids)
                + _HASH_BYTES * len(p.block_hashes))
    if isinstance(p, BlockRemoved):
        return _EVENT_OVERHEAD_BYTES + _POINTER_BYTES * len(p.block_ids) + _HASH_BYTES * len(p.block_hashes)
    return _EVENT_OVERHEAD_BYTES


def stored_from_node(node: TreeNode, block_size: int, tier: int = 0) -> BlockStored:
    """The BlockStored event describing all pages of one tree node (ids in untracked forms, see
    the module docstring) of the device tree or of a lower `tier`'s."""
    parent = node.parent
    return BlockStored(
        block_hashes=tuple(node.hashes),
        parent_block_hash=parent.last_hash if parent is not None else 0,
        token_ids=unpack_tokens(node.key),
        block_size=block_size,
        namespace=node.namespace,
        block_ids=tuple(node.value),
        tier=tier,
    )


def removed_by_namespace(evicted: Sequence[EvictedNode], tier: int = 0) -> list[BlockRemoved]:
    """BlockRemoved events for an eviction batch: one per namespace of the batch (namespace-limited
    watchers see their own), even when the batch empties the tree (AllCleared means the pool went)."""
    by_namespace: dict[str, list[EvictedNode]] = {}
    for node in evicted:
        by_namespace.setdefault(node.namespace, []).append(node)
    return [BlockRemoved(tuple(chain.from_iterable(n.hashes for n in nodes)),  # tuples: see the collector
                         tuple(chain.from_iterable(n.block_ids for n in nodes)), namespace, tier)
            for namespace, nodes in by_namespace.items()]


def tree_snapshot(pool_id: str, tree: RadixTree, sequence: int, timestamp: float,
                  publisher_epoch: int = 0, tier: int = 0) -> list[CacheEvent]:
    """The tree's content as BlockStored events, parents before children, all at once (WatchEvents
    walks the live tree a node at a time instead: cache_service/tree_walk.py).

    Every snapshot event carries `sequence`: the state is that after event `sequence`, so live
    events to apply next start at `sequence + 1`. `tier`: the tier whose tree it is (a lower
    tier's tree holds slot ids).
    """
    return [
        CacheEvent(sequence, pool_id, timestamp, stored_from_node(node, tree.page_size, tier), is_snapshot=True,
                   publisher_epoch=publisher_epoch)
        for node in tree.iter_nodes()
    ]


DEFAULT_BUFFER_BYTES = 64 * 1024 * 1024

_last_epoch = 0


def new_epoch() -> int:
    """A publisher epoch: the current Unix time in ns, strictly increasing within the process."""
    global _last_epoch
    _last_epoch = max(time.time_ns(), _last_epoch + 1)
    return _last_epoch


class EventLog:
    """Global sequence numbers, a bounded replay buffer and synchronous subscribers.

    The buffer keeps at most `capacity` events and about `max_bytes` bytes of them (see
    `event_size`), dropping the oldest first. `epoch` (set on every event as publisher_epoch)
    tells this log's stream apart from one of an earlier or later server process.
    `namespace_counts` (tracked namespace -> its events so far) and `cleared_count` (AllCleared
    events so far) number namespace views (module docstring); the durable cache manager keeps
    them across restarts as it keeps `last_sequence`.
    """

    def __init__(self, capacity: int = 65536, clock: Callable[[], float] = time.time,
                 max_bytes: int = DEFAULT_BUFFER_BYTES) -> None:
        if capacity <= 0:
            raise ValueError("capacity must be > 0")
        if max_bytes <= 0:
            raise ValueError("max_bytes must be > 0")
        self.capacity = capacity
        self.max_bytes = max_bytes
        self.buffered_bytes = 0
        self.last_sequence = 0
        self._buffer: deque[tuple] = deque()  # _flatten() of each buffered event
        self._sizes: deque[int] = deque()  # event_size() of each
        self._subscribers: dict[int, Subscriber] = {}
        self._next_subscriber = 0
        self._clock = clock
        self.epoch = new_epoch()
        # Publisher epochs of earlier processes whose numbering this log continues (durable
        # cache manager, cache_service/durable/): a resume from one of them is valid here.
        self.continued_epochs: list[int] = []
        self.namespace_counts: dict[str, int] = {}
        self.cleared_count = 0

    def now(self) -> float:
        return self._clock()

    def publish(self, pool_id: str, payload: EventPayload) -> CacheEvent:
        """Number, buffer and deliver one event to every subscriber."""
        self.last_sequence += 1
        if isinstance(payload, AllCleared):
            self.cleared_count += 1
            in_views = True
        else:
            count = self.namespace_counts.get(payload.namespace)
            in_views = count is not None
            if in_views:
                self.namespace_counts[payload.namespace] = count + 1
        event = CacheEvent(self.last_sequence, pool_id, self._clock(), payload, publisher_epoch=self.epoch,
                           in_views=in_views)
        size = event_size(event)
        self._buffer.append(_flatten(event))
        self._sizes.append(size)
        self.buffered_bytes += size
        while len(self._buffer) > self.capacity or (self.buffered_bytes > self.max_bytes and len(self._buffer) > 1):
            self._buffer.popleft()
            self.buffered_bytes -= self._sizes.popleft()
        for key, callback in list(self._subscribers.items()):
            try:
                callback(event)
            except Exception:  # a broken subscriber must not break the cache
                log.exception("event subscriber failed; unsubscribing it")
                self._subscribers.pop(key, None)
        return event

    @property
    def oldest_sequence(self) -> int:
        """Smallest sequence still replayable (last_sequence + 1 when the buffer is empty)."""
        return self._buffer[0][0] if self._buffer else self.last_sequence + 1

    @property
    def num_buffered(self) -> int:
        return len(self._buffer)

    def check_epoch(self, publisher_epoch: int) -> None:
        """OutOfRange unless `publisher_epoch` (0: unchecked) is this log's epoch or one it continues."""
        if publisher_epoch and publisher_epoch != self.epoch and publisher_epoch not in self.continued_epochs:
            raise OutOfRange(
                f"publisher epoch {publisher_epoch} is not continued by this server (epoch {self.epoch}); "
                "resubscribe with snapshot"
            )

    def check_resume(self, start_sequence: int, publisher_epoch: int = 0) -> None:
        """OutOfRange when a resume at `start_sequence` is impossible: dropped from the buffer,
        beyond the next sequence (e.g. a consumer of a previous server instance), or of an epoch
        this log does not continue (see `check_epoch`)."""
        self.check_epoch(publisher_epoch)
        if start_sequence < self.oldest_sequence:
            raise OutOfRange(
                f"sequence {start_sequence} is no longer buffered (oldest {self.oldest_sequence}); "
                "resubscribe with snapshot"
            )
        if start_sequence > self.last_sequence + 1:
            raise OutOfRange(
                f"sequence {start_sequence} is ahead of this server (last {self.last_sequence}); "
                "resubscribe with snapshot"
            )

    def replay(self, start_sequence: int, pool_id: str = "", publisher_epoch: int = 0) -> list[CacheEvent]:
        """Buffered events with sequence >= start_sequence (of one pool when pool_id is set), as a
        list (WatchEvents reads the buffer through `read` instead); raises as `check_resume`."""
        self.check_resume(start_sequence, publisher_epoch)
        skip = start_sequence - self.oldest_sequence
        rows = itertools.islice(self._buffer, skip, None)
        return [unflatten(row) for row in rows if not pool_id or row[ROW_POOL] == pool_id]

    def read(self, sequence: int, max_rows: int, max_bytes: int) -> list[tuple] | None:
        """Buffered rows (see `unflatten`) from `sequence` on: at most `max_rows` and, past the
        first, about `max_bytes`; [] when nothing is that new yet, None when `sequence` was
        already dropped. Cheap near either end of the buffer (deque indexing)."""
        oldest = self.oldest_sequence
        if sequence < oldest:
            return None
        buffer, sizes = self._buffer, self._sizes
        rows: list[tuple] = []
        total = 0
        for i in range(sequence - oldest, min(len(buffer), sequence - oldest + max_rows)):
            rows.append(buffer[i])
            total += sizes[i]
            if total >= max_bytes:
                break
        return rows

    # ------------------------------------------------------------------ namespace views

    def track_namespaces(self, namespaces: Iterable[str]) -> list[str]:
        """Count the events of these namespaces from now on (never stops); returns those newly
        tracked, sorted (the durable cache manager journals them)."""
        added = sorted(ns for ns in set(namespaces) if ns not in self.namespace_counts)
        for ns in added:
            self.namespace_counts[ns] = 0
        return added

    def restore_counts(self, namespace_counts: dict[str, int], cleared_count: int) -> None:
        """Continue the view counts of an earlier process (durable snapshot)."""
        for ns, count in namespace_counts.items():
            self.namespace_counts[ns] = max(self.namespace_counts.get(ns, 0), int(count))
        self.cleared_count = max(self.cleared_count, int(cleared_count))

    def view_sequence(self, view: AbstractSet[str]) -> int:
        """The number of the view's last event so far (0: none yet)."""
        counts = self.namespace_counts
        return self.cleared_count + sum(counts.get(ns, 0) for ns in view)

    def locate_view(self, view: AbstractSet[str], start: int, publisher_epoch: int = 0) -> int:
        """The sequence of the buffered event numbered `start` in the view (last_sequence + 1 when
        `start` is the view's next number). Walks the buffer from its newest end: O(buffer),
        once per resume. Raises OutOfRange as `check_resume` does, in the view's numbers."""
        self.check_epoch(publisher_epoch)
        number = self.view_sequence(view)
        if start > number + 1:
            raise OutOfRange(f"sequence {start} is ahead of this server (last {number} for this token's "
                             "namespaces); resubscribe with snapshot")
        if start == number + 1:
            return self.last_sequence + 1
        for row in reversed(self._buffer):
            if in_view(row, view):
                if number == start:
                    return row[ROW_SEQUENCE]
                number -= 1
        raise OutOfRange(f"sequence {start} is no longer buffered (oldest {number + 1} for this token's "
                         "namespaces); resubscribe with snapshot")

    def subscribe(self, callback: Subscriber) -> Callable[[], None]:
        """Call `callback(event)` for every later event; returns the unsubscribe function."""
        key = self._next_subscriber
        self._next_subscriber += 1
        self._subscribers[key] = callback
        return lambda: self._subscribers.pop(key, None)

    @property
    def num_subscribers(self) -> int:
        return len(self._subscribers)
