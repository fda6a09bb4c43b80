"""The replica's Steps over one long-lived `StepStream` (cache.proto): a message each, instead of a
unary call each, whose set-up costs the cache manager several times a stream message's handling.

Replies come back in the order the requests were sent; a reader thread hands each to the waiter
of the oldest request still unanswered. When the stream fails (the cache manager refused a Step,
restarted, went away, or a wait timed out) every unanswered request fails with that error and the
stream is dropped; the next request opens a new one. The caller (CacheClient) treats a failed Step
as it treats a failed unary Step: the pool can no longer be trusted.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future

import grpc

from protos import cache_pb2

log = logging.getLogger(__name__)

_END = None  # put on the request queue: the request iterator ends (the stream half-closes)


class StepStreamError(Exception):
    """The stream failed before this request's reply: `code` and `details` as a failed call's."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class StepStream:
    """One StepStream call: `send()` queues a request and returns the Future of its reply."""

    def __init__(self, open_call: Callable[[Iterator, object], grpc.Call], metadata) -> None:
        """`open_call(requests, metadata)`: the stub's StepStream. `metadata`: the call's (the bearer
        token it was opened with; a reloaded token opens a new stream)."""
        self.metadata = metadata
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._waiting: collections.deque[Future] = collections.deque()
        self._lock = threading.Lock()  # orders send() against the reader's failing of what waits
        self._failed: StepStreamError | None = None
        self._call = open_call(iter(self._requests.get, _END), metadata)
        self._reader = threading.Thread(target=self._read, name="radixkv-step-stream", daemon=True)
        self._reader.start()

    @property
    def failed(self) -> bool:
        return self._failed is not None

    def send(self, request: cache_pb2.StepRequest) -> Future:
        """Queues `request`; the Future resolves to its StepResponse or raises StepStreamError."""
        future: Future = Future()
        with self._lock:
            if self._failed is not None:
                future.set_exception(self._failed)
                return future
            self._waiting.append(future)
            self._requests.put(request)
        return future

    def close(self) -> None:
        """Half-closes and cancels the call; whatever still waits fails with CANCELLED."""
        self._requests.put(_END)
        self._call.cancel()
        self._fail(StepStreamError(grpc.StatusCode.CANCELLED, "the Step stream was closed"))

    def _read(self) -> None:
        try:
            for reply in self._call:
                with self._lock:
                    waiter = self._waiting.popleft() if self._waiting else None
                if waiter is None:  # the server answered what was not asked: nothing it says is trusted
                    self._fail(StepStreamError(grpc.StatusCode.INTERNAL, "a StepStream reply without a request"))
                    self._call.cancel()
                    return
                if not waiter.cancelled():  # one cancelled by its caller still takes its reply's place
                    waiter.set_result(reply)
            error = StepStreamError(grpc.StatusCode.UNAVAILABLE, "the cache manager ended the Step stream")
        except grpc.RpcError as e:
            error = StepStreamError(e.code(), e.details() or "")
        except Exception as e:  # noqa: BLE001 (a bug must fail the waiters, not leave them hanging)
            log.exception("Step stream reader failed")
            error = StepStreamError(grpc.StatusCode.INTERNAL, repr(e))
        self._fail(error)

    def _fail(self, error: StepStreamError) -> None:
        with self._lock:
            if self._failed is None:
                self._failed = error
                self._requests.put(_END)
            waiting, self._waiting = self._waiting, collections.deque()
        for waiter in waiting:
            if not waiter.done():
                waiter.set_exception(error)
