"""Hands the engine thread's outputs to the event loop with one wake-up per burst.

The engine emits the new token of every running request at the end of a step, from its own
thread. `loop.call_soon_threadsafe` per output costs that thread a lock and a self-pipe write each
(about 2% of a 32-request shared-prefix run, sampled with py-spy), time in which the model's
threads wait for the next step. Here outputs queued while a hand-over is pending ride on it.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any


class LoopRelay:
    """Puts items into asyncio queues of one loop from any thread, in order per queue."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Queue, Any]] = []
        self._scheduled = False

    def put(self, queue: asyncio.Queue, item: Any) -> None:
        """queue.put_nowait(item) on the loop, soon. Raises RuntimeError if the loop is closed."""
        with self._lock:
            self._pending.append((queue, item))
            if self._scheduled:
                return
            self._scheduled = True
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
