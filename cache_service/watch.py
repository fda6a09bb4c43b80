"""One WatchEvents stream: its backlog (a snapshot, or a resume from a sequence number), then live
events, and the numbering of a namespace-limited token's view.

Memory: a stream holds no queue of its own. It reads the EventLog's one bounded replay buffer
through a cursor, a chunk of rows at a time (the rows stay shared with the buffer), and a
snapshot walks the live trees a node at a time (cache_service/tree_walk.py): the pool's device
tree, then the tree of each lower tier (host, disk) of its replica, as BlockStored events with
their tier. The stream yields
one event and waits until gRPC has taken it, so a reader that does not read holds the stream at
one event (flow control) instead of making the server copy what it would have sent. A watcher
whose next event has left the buffer, or that has more than `max_lag` undelivered events of
its own, is ended with RESOURCE_EXHAUSTED (reconnect with snapshot or start_sequence).

Numbering: a token without ns= gets the server-wide sequence numbers. A token limited to
namespaces (its *view*) gets its view's numbers (cache_service/events.py): consecutive over the
events of its namespaces, in every pool, plus every AllCleared, the same whatever other
namespaces do; start_sequence and snapshot sequences are in those numbers too. Its events carry
no block ids: physical block ids are handed out across namespaces, so they would tell how busy
the other namespaces are.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cache_service.errors import ResourceExhausted
from cache_service.events import (
    ROW_POOL,
    ROW_SEQUENCE,
    AllCleared,
    CacheEvent,
    EventLog,
    EventPayload,
    event_in_view,
    in_view,
    unflatten,
)
from cache_service.tree_walk import walk_live

if TYPE_CHECKING:
    from cache_service.durable import DurableState
    from cache_service.pool import Pool
    from common.auth import TokenStore

# Rows read from the buffer at a time: a chunk is what a stream holds beyond the buffer (when the
# buffer drops those rows meanwhile).
CHUNK_ROWS = 64
CHUNK_BYTES = 1 << 20


@dataclass(slots=True)
class WatchRequest:
    """What a WatchEvents call asks for, and the caller's view."""

    pool_id: str = ""
    snapshot: bool = False
    start_sequence: int = 0  # 0: live only
    publisher_epoch: int = 0
    view: frozenset[str] | None = None  # the token's namespaces; None: every one, server-wide numbers


def for_view(payload: EventPayload) -> EventPayload:
    """The payload as a namespace-limited watcher gets it: without physical block ids."""
    if isinstance(payload, AllCleared):
        return payload
    return dataclasses.replace(payload, block_ids=())


class Watch:
    """A stream's position: validated and subscribed when made (call `close`), then `stream()`."""

    def __init__(self, events: EventLog, pools: Sequence[Pool], request: WatchRequest, max_lag: int) -> None:
        """Raises OutOfRange when the resume point is not buffered, ahead, or of another epoch."""
        self.events = events
        self.pool_id = request.pool_id
        self.view = view = request.view
        self.max_lag = max_lag
        last = events.view_sequence(view) if view is not None else events.last_sequence
        if request.start_sequence:
            if view is None:
                events.check_resume(request.start_sequence, request.publisher_epoch)
                self.cursor = request.start_sequence
            else:
                self.cursor = events.locate_view(view, request.start_sequence, request.publisher_epoch)
            last = request.start_sequence - 1
        else:
            self.cursor = events.last_sequence + 1
        self.number = last  # in a view: the number of the last view event behind the cursor
        self._snapshot_pools = list(pools) if request.snapshot else []
        self._snapshot_number = last
        self._subscribed_at = events.last_sequence
        self._pending = 0  # events for this watcher published since it subscribed, not yet yielded
        self.lagging = False
        self._wake = asyncio.Event()
        self._unsubscribe = events.subscribe(self._on_event)

    def close(self) -> None:
        self._unsubscribe()

    def _delivers(self, event: CacheEvent) -> bool:
        return (not self.pool_id or event.pool_id == self.pool_id) and (
            self.view is None or event_in_view(event, self.view))

    def _on_event(self, event: CacheEvent) -> None:
        """Publish-time hook: counts what this watcher owes, steps over what it would skip."""
        if not self._delivers(event):
            if event.sequence == self.cursor:  # caught up: skipping it here keeps the cursor in the buffer
                self.cursor += 1
                if self.view is not None and event_in_view(event, self.view):
                    self.number += 1  # another pool's event of the view still takes its number
            return
        self._pending += 1
        if self._pending > self.max_lag:
            self.lagging = True
            self._unsubscribe()
        self._wake.set()

    def _check_lag(self) -> None:
        if self.lagging:
            raise ResourceExhausted("watcher fell too far behind; reconnect with snapshot")

    async def stream(self) -> AsyncIterator[CacheEvent]:
        """The snapshot (if asked), then the buffered and live events, until an error ends it.

        Raises ResourceExhausted when the watcher fell too far behind (see the module docstring).
        """
        events, view, pool_id = self.events, self.view, self.pool_id
        now, epoch = events.now(), events.epoch
        for pool in self._snapshot_pools:
            # The device tree, then each lower tier's (a page held by several tiers is in each).
            trees = [(pool.tree, 0)]
            if pool.tiers is not None:
                trees += [(tier.tree, tier.tier) for tier in pool.tiers.tiers]
            for tree, tier in trees:
                namespaces = sorted(view) if view is not None else tree.namespaces()
                for payload in walk_live(tree, namespaces, tier):
                    self._check_lag()
                    yield CacheEvent(self._snapshot_number, pool.pool_id, now,
                                     for_view(payload) if view is not None else payload, is_snapshot=True,
                                     publisher_epoch=epoch)
        self._snapshot_pools = []
        while True:
            self._wake.clear()
            self._check_lag()
            rows = events.read(self.cursor, CHUNK_ROWS, CHUNK_BYTES)
            if rows is None:
                raise ResourceExhausted("watcher fell too far behind (its next event left the replay buffer); "
                                        "reconnect with snapshot")
            if not rows:
                await self._wake.wait()
                continue
            # The hook above steps the cursor only once every row up to the last one is behind it,
            # so it never moves while rows of this chunk are left.
            for row in rows:
                sequence = row[ROW_SEQUENCE]
                self.cursor = sequence + 1
                if view is not None:
                    if not in_view(row, view):
                        continue
                    self.number += 1
                if pool_id and row[ROW_POOL] != pool_id:
                    continue
                if sequence > self._subscribed_at:
                    self._pending -= 1
                event = unflatten(row)
                if view is not None:
                    event.sequence = self.number
                    event.payload = for_view(event.payload)
                yield event


def follow_token_namespaces(events: EventLog, tokens: TokenStore, durable: DurableState | None) -> None:
    """Count the events of every namespace an ns= token names (their views), from now on and after
    each reload of the token file; the durable cache manager journals each newly tracked one, so a
    restart counts exactly as this process did."""

    def update() -> None:
        added = events.track_namespaces(tokens.limited_namespaces())
        if added and durable is not None:
            durable.tracked(added)

    update()
    tokens.on_reload.append(update)
