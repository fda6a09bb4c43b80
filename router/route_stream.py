"""The router's Routes over one long-lived `RouteStream` (cache.proto): a message each, instead of a
unary call each, whose set-up costs the cache manager several times a stream message's handling
and queues behind every other new call when many arrive at once.

Requests go out in the order `ask()` is called (writes are serialized) and replies come back in
that order; a reader task hands each to the oldest waiting ask. An ask that times out stays in
line (its reply, when it comes, is dropped). A refused Route comes back as its own error; when
the stream itself fails, every waiting ask fails with that error and the next ask opens a new
stream (CacheManagerClient).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging

import grpc

from protos import cache_pb2
from router.errors import UpstreamError

log = logging.getLogger(__name__)


class RouteStream:
    """One RouteStream call. Create inside the event loop that uses it."""

    def __init__(self, stub, metadata) -> None:
        """`stub`: a CacheManager stub on an aio channel; `metadata`: the call's (the bearer token
        it was opened with: a reloaded token opens a new stream)."""
        self.metadata = metadata
        self._call = stub.RouteStream(metadata=metadata)
        self._waiting: collections.deque[asyncio.Future] = collections.deque()
        self._write = asyncio.Lock()  # one write at a time, in the order asks joined the line
        self.failed: UpstreamError | None = None
        self._sends: set[asyncio.Task] = set()
        self.answered = 0  # replies received
        self._reader = asyncio.get_running_loop().create_task(self._read())

    async def ask(self, request: cache_pb2.RouteRequest, timeout: float | None) -> cache_pb2.RouteResponse:
        """Route's answer for `request`; UpstreamError with Route's status when refused, with the
        stream's when it failed, DEADLINE_EXCEEDED after `timeout` seconds."""
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        future.add_done_callback(_retrieve)  # an ask that timed out never reads its outcome
        # The write is a task of its own: an ask that times out never leaves a request in line
        # unsent (its reply would then be taken for the next one's).
        self._sends.add(sent := asyncio.get_running_loop().create_task(self._send(request, future)))
        sent.add_done_callback(self._sends.discard)
        try:
            reply = await asyncio.wait_for(asyncio.shield(future), timeout)
        except TimeoutError:
            raise UpstreamError("DEADLINE_EXCEEDED", "no Route reply within the deadline") from None
        if reply.code:
            status = _STATUS_BY_NUMBER.get(reply.code)
            raise UpstreamError(status.name if status is not None else "UNKNOWN", reply.message)
        return reply.response

    async def _send(self, request: cache_pb2.RouteRequest, future: asyncio.Future) -> None:
        async with self._write:  # FIFO: the sends write in the order their asks were made
            if self.failed is not None:
                future.set_exception(self.failed)
                return
            self._waiting.append(future)
            try:
                await self._call.write(request)
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                pass  # the call ended: the reader fails the line with its status (not the write's)

    async def close(self) -> None:
        self._call.cancel()
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._reader
        self._fail(UpstreamError("CANCELLED", "the Route stream was closed"))

    async def _read(self) -> None:
        try:
            while True:
                reply = await self._call.read()
                if reply is grpc.aio.EOF:
                    code, details = await self._call.code(), await self._call.details()
                    if code == grpc.StatusCode.OK:
                        code, details = grpc.StatusCode.UNAVAILABLE, "the cache manager ended the Route stream"
                    error = UpstreamError(code.name, details or "")
                    break
                if not self._waiting:  # a reply nobody asked for: nothing the stream says is trusted
                    self._call.cancel()
                    error = UpstreamError("INTERNAL", "a RouteStream reply without a request")
                    break
                waiter = self._waiting.popleft()
                self.answered += 1
                if not waiter.done():
                    waiter.set_result(reply)
        except grpc.aio.AioRpcError as e:
            error = UpstreamError(e.code().name, e.details() or "")
        except asyncio.CancelledError:
            error = UpstreamError("CANCELLED", "the Route stream was closed")
        self._fail(error)

    def _fail(self, error: UpstreamError) -> None:
        if self.failed is None:
            self.failed = error
        waiting, self._waiting = self._waiting, collections.deque()
        for waiter in waiting:
            if not waiter.done():
                waiter.set_exception(error)


_STATUS_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


def _retrieve(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()
