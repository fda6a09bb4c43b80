"""Hands the engine thread's outputs to the event loop with one wake-up per burst.

The engine emits the new token of every running request once per step, from its own thread.
`loop.call_soon_threadsafe` per output costs that thread a lock and a self-pipe write each, and
every write wakes the loop's thread, which takes the GIL to stream what it finds while the
engine thread waits for the GIL back, several times a step. Here outputs queued while a
hand-over is pending ride on it, and `batch()` holds
the wake-up until a whole step's outputs are queued.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class LoopRelay:
    """Puts items into asyncio queues of one loop from any thread, in order per queue."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Queue, Any]] = []
        self._scheduled = False
        self._held = 0  # open batch() blocks: puts queue without waking the loop

    def put(self, queue: asyncio.Queue, item: Any) -> None:
        """queue.put_nowait(item) on the loop, soon (once the batch ends, inside `batch()`).
        Raises RuntimeError if the loop is closed."""
        with self._lock:
            self._pending.append((queue, item))
            if self._scheduled or self._held:
                return
            self._scheduled = True
        self._wake()

    @contextmanager
    def batch(self) -> Iterator[None]:
        """Items put inside go to the loop with one wake-up when the block ends."""
        with self._lock:
            self._held += 1
        try:
            yield
        finally:
            with self._lock:
                self._held -= 1
                wake = not self._held and bool(self._pending) and not self._scheduled
                self._scheduled = self._scheduled or wake
            if wake:
                self._wake()

    def _wake(self) -> None:
        try:
            self.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop is closed: nothing pending can reach it
            with self._lock:
                self._pending.clear()
                self._scheduled = False
            raise

    def _drain(self) -> None:
        with self._lock:
            pending, self._pending, self._scheduled = self._pending, [], False
        for queue, item in pending:
            queue.put_nowait(item)
