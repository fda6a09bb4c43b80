"""Helpers of the stream tests: a bidirectional cache-manager call driven a message at a time,
bearer-token metadata, waiting for a server's log line."""

from __future__ import annotations

import queue
import time

import grpc
import pytest

from tests.cache.conftest import ServerProcess


class Stream:
    """One StepStream (RouteStream) call driven a message at a time: send, then read its reply."""

    def __init__(self, server: ServerProcess, metadata=None, raw: bool = False, method: str = "StepStream") -> None:
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        call = (server.channel.stream_stream(f"/radixkv.v1.CacheManager/{method}") if raw
                else getattr(server.stub, method))
        self.call = call(iter(self._requests.get, None), metadata=metadata, timeout=30)

    def send(self, request) -> None:
        self._requests.put(request)

    def ask(self, request):
        self.send(request)
        return next(self.call)

    def error(self) -> grpc.RpcError:
        """The status the stream ended with (after its last reply)."""
        with pytest.raises(grpc.RpcError) as err:
            next(self.call)
        return err.value

    def close(self) -> None:
        self._requests.put(None)
        self.call.cancel()


def md(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def wait_for_log(server: ServerProcess, text: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in server.stderr():
        assert time.monotonic() < deadline, f"no {text!r} in the server's log"
        time.sleep(0.05)
