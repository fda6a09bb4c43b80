"""The long-lived calls a cache manager ends itself when it stops (StepStream, RouteStream).

A graceful stop gives in-flight calls the grace period to finish. A replica's StepStream or a
router's RouteStream never finishes on its own: each would hold the stop for the whole grace
period. At stop they end at once with UNAVAILABLE instead (what a unary call arriving then gets),
after the server stopped taking new calls; their clients reconnect as after any failed call.

A handler is cancelled only where it waits for its next message (`wait`). Cancelled anywhere
else, say inside gRPC's write of a reply it yielded, the handler task ends without its call
getting a status, and the stop then waits out the whole grace period for that call. A stream
that is not waiting when `end_all()` runs ends at its next `wait`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

import grpc

from common.grpc_server import end_call

SHUTTING_DOWN = "the cache manager is shutting down"

T = TypeVar("T")


class OpenStreams:
    """The open streams' handler tasks while they wait for their next message; `end_all()`
    cancels those, and every stream then ends its call with UNAVAILABLE (`hold`)."""

    def __init__(self) -> None:
        self._waiting: set[asyncio.Task] = set()
        self.closing = False

    @contextlib.contextmanager
    def hold(self, context: grpc.aio.ServicerContext) -> Iterator[None]:
        """Around a stream handler's body: ended by `end_all` (at a `wait`), the call ends with
        UNAVAILABLE; any other cancellation propagates."""
        try:
            yield
        except asyncio.CancelledError:
            if not self.closing:
                raise
            end_call(context, grpc.StatusCode.UNAVAILABLE, SHUTTING_DOWN)

    async def wait(self, next_message: Callable[[], Awaitable[T]]) -> T:
        """`await next_message()`, where `end_all` may end the stream (CancelledError, which
        `hold` turns into UNAVAILABLE); once closing, the stream ends here at once."""
        if self.closing:
            raise asyncio.CancelledError
        task = asyncio.current_task()
        assert task is not None
        self._waiting.add(task)
        try:
            return await next_message()
        finally:
            self._waiting.discard(task)

    def end_all(self) -> None:
        self.closing = True
        for task in list(self._waiting):
            task.cancel()
