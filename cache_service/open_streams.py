"""The long-lived calls a cache manager ends itself when it stops (StepStream, RouteStream).

A graceful stop gives in-flight calls the grace period to finish. A replica's StepStream or a
router's RouteStream never finishes on its own: each would hold the stop for the whole grace
period. At stop they end at once with UNAVAILABLE instead (what a unary call arriving then gets),
after the server stopped taking new calls; their clients reconnect as after any failed call.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

SHUTTING_DOWN = "the cache manager is shutting down"


class OpenStreams:
    """The handler tasks of the open streams; `end_all()` cancels them (the handlers then end
    their call with UNAVAILABLE: see `ending`)."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()
        self.closing = False

    def __len__(self) -> int:
        return len(self._tasks)

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """While the current handler task serves a stream."""
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            yield
        finally:
            self._tasks.discard(task)

    def ending(self, error: BaseException) -> bool:
        """Whether `error` (a CancelledError in a held handler) is end_all's doing."""
        return self.closing and isinstance(error, asyncio.CancelledError)

    def end_all(self) -> None:
        self.closing = True
        for task in list(self._tasks):
            task.cancel()
