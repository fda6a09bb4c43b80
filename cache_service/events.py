"""KV events: what entered and left each pool's tree, with server-wide sequence numbers.

Routers mirror the trees from these (the vLLM / SGLang / Dynamo KV-event model). The log keeps
a replay buffer bounded in events and in bytes (so the cache manager's memory stays proportional
to its pools, not to its history); a consumer that lost its place rebuilds from a snapshot.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from cache_service.errors import OutOfRange
from cache_service.radix_tree import RadixTree, TreeNode

log = logging.getLogger(__name__)


@dataclass(slots=True)
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int
    token_ids: list[int]
    block_size: int
    namespace: str
    block_ids: list[int]


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: list[int]
    block_ids: list[int]
    namespace: str = ""


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


Subscriber = Callable[[CacheEvent], None]

# Resident cost of a buffered event, on the safe side: a CacheEvent with its payload object;
# per token id a list pointer plus its own int object (the tree's may be evicted meanwhile); per
# block id a pointer (block ids are shared with the allocator); per page hash a pointer plus a
# 64-bit int object.
_EVENT_OVERHEAD_BYTES = 400
_POINTER_BYTES = 8
_TOKEN_BYTES = 8 + 28
_HASH_BYTES = 8 + 36


def event_size(event: CacheEvent) -> int:
    """Approximate bytes an event keeps alive while it is buffered."""
    p = event.payload
    if isinstance(p, BlockStored):
        return (_EVENT_OVERHEAD_BYTES + _TOKEN_BYTES * len(p.token_ids) + _POINTER_BYTES * len(p.block_ids)
                + _HASH_BYTES * len(p.block_hashes))
    if isinstance(p, BlockRemoved):
        return _EVENT_OVERHEAD_BYTES + _POINTER_BYTES * len(p.block_ids) + _HASH_BYTES * len(p.block_hashes)
    return _EVENT_OVERHEAD_BYTES


def stored_from_node(node: TreeNode, block_size: int) -> BlockStored:
    """The BlockStored event describing all pages of one tree node."""
    parent = node.parent
    return BlockStored(
        block_hashes=list(node.hashes),
        parent_block_hash=parent.last_hash if parent is not None else 0,
        token_ids=node.token_ids,
        block_size=block_size,
        namespace=node.namespace,
        block_ids=list(node.value),
    )


def tree_snapshot(pool_id: str, tree: RadixTree, sequence: int, timestamp: float,
                  publisher_epoch: int = 0) -> list[CacheEvent]:
    """The tree's content as BlockStored events, parents before children.

    Every snapshot event carries `sequence`: the state is that after event `sequence`, so live
    events to apply next start at `sequence + 1`.
    """
    return [
        CacheEvent(sequence, pool_id, timestamp, stored_from_node(node, tree.page_size), is_snapshot=True,
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
        self._buffer: deque[tuple[CacheEvent, int]] = deque()
        self._subscribers: dict[int, Subscriber] = {}
        self._next_subscriber = 0
        self._clock = clock
        self.epoch = new_epoch()
        # Publisher epochs of earlier processes whose numbering this log continues (durable
        # cache manager, cache_service/durable.py): a resume from one of them is valid here.
        self.continued_epochs: list[int] = []

    def now(self) -> float:
        return self._clock()

    def publish(self, pool_id: str, payload: EventPayload) -> CacheEvent:
        """Number, buffer and deliver one event to every subscriber."""
        self.last_sequence += 1
        event = CacheEvent(self.last_sequence, pool_id, self._clock(), payload, publisher_epoch=self.epoch)
        size = event_size(event)
        self._buffer.append((event, size))
        self.buffered_bytes += size
        while len(self._buffer) > self.capacity or (self.buffered_bytes > self.max_bytes and len(self._buffer) > 1):
            self.buffered_bytes -= self._buffer.popleft()[1]
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
        return self._buffer[0][0].sequence if self._buffer else self.last_sequence + 1

    @property
    def num_buffered(self) -> int:
        return len(self._buffer)

    def replay(self, start_sequence: int, pool_id: str = "", publisher_epoch: int = 0) -> list[CacheEvent]:
        """Buffered events with sequence >= start_sequence (of one pool when pool_id is set).

        Raises OutOfRange when that sequence was already dropped from the buffer, or is beyond
        the next one (e.g. a consumer of a previous server instance), or when `publisher_epoch`
        (0: unchecked) is neither this log's epoch nor one it continues.
        """
        if publisher_epoch and publisher_epoch != self.epoch and publisher_epoch not in self.continued_epochs:
            raise OutOfRange(
                f"publisher epoch {publisher_epoch} is not continued by this server (epoch {self.epoch}); "
                "resubscribe with snapshot"
            )
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
        skip = start_sequence - self.oldest_sequence
        events = [e for e, _ in itertools.islice(self._buffer, skip, None)]
        if pool_id:
            events = [e for e in events if e.pool_id == pool_id]
        return events

    def subscribe(self, callback: Subscriber) -> Callable[[], None]:
        """Call `callback(event)` for every later event; returns the unsubscribe function."""
        key = self._next_subscriber
        self._next_subscriber += 1
        self._subscribers[key] = callback
        return lambda: self._subscribers.pop(key, None)

    @property
    def num_subscribers(self) -> int:
        return len(self._subscribers)
