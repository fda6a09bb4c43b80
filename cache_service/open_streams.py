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

import grpc

from common.grpc_server import end_call

SHUTTING_DOWN = "the cache manager is shutting down"


class OpenStreams:
    """The handler tasks of the open streams; `end_all()` cancels them, and each then ends its
    call with UNAVAILABLE (`hold`)."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()
        self.closing = False

    @contextlib.contextmanager
    def hold(self, context: grpc.aio.ServicerContext) -> Iterator[None]:
        """While the current handler task serves the stream of `context`; end_all's cancellation
        ends it there with UNAVAILABLE (any other propagates)."""
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            yield
        except asyncio.CancelledError:
            if not self.closing:
                raise
            end_call(context, grpc.StatusCode.UNAVAILABLE, SHUTTING_DOWN)
        finally:
            self._tasks.discard(task)

    def end_all(self) -> None:
        self.closing = True
        for task in list(self._tasks):
            task.cancel()
