"""uvicorn's h11 protocol with a lingering close, so an early answer (a 413) reaches the client.

The door answers some requests before reading their bodies (a Content-Length over the limit
is refused at once) and then closes the connection. A plain close() with the client's unread
bytes still arriving makes the kernel send a reset, and a reset can discard the answer the
client has not read yet: the client sees an empty reply instead of the 413. Servers that
answer early (nginx's `lingering_close`, Apache's lingering close) shut down only their write
side (the answer and a FIN go out) and keep reading and dropping what the client still sends
for a bounded time; the connection is closed when the client closes its side, stays quiet for
LINGER_QUIET_S, or LINGER_MAX_S has passed. Only a connection whose request body was not read
to its end lingers; TLS connections cannot half-close and close at once, as before.
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

LINGER_MAX_S = 5.0  # nginx's lingering_time is 30 s; a client sending a refused body stops on the answer
LINGER_QUIET_S = 1.0  # nginx's lingering_timeout is 5 s


class _LingeringTransport:
    """The connection's transport as the protocol sees it: close() lingers when the request
    body has not been read to its end."""

    def __init__(self, transport: asyncio.Transport, protocol: LingeringH11Protocol) -> None:
        self._transport = transport
        self._protocol = protocol

    def close(self) -> None:
        if self._protocol.start_lingering():
            return
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class LingeringH11Protocol(H11Protocol):
    """H11Protocol whose closes with an unread request body linger (module docstring)."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._raw_transport = transport
        self._lingering = False
        self._linger_timer: asyncio.TimerHandle | None = None
        self._linger_deadline = 0.0
        super().connection_made(_LingeringTransport(transport, self))  # type: ignore[arg-type]

    def start_lingering(self) -> bool:
        """Half-closes instead of closing when the client may still be sending; False when a
        plain close is right (body read, TLS, already closing)."""
        raw = self._raw_transport
        if self._lingering:
            return True
        if raw.is_closing() or not raw.can_write_eof() or self.conn.their_state is not h11.SEND_BODY:
            return False
        self._lingering = True
        raw.write_eof()  # after the buffered answer: the client reads it, then EOF
        raw.resume_reading()  # flow control may have paused reads on a full body buffer
        self._linger_deadline = self.loop.time() + LINGER_MAX_S
        self._rearm_linger()
        return True

    def _rearm_linger(self) -> None:
        if self._linger_timer is not None:
            self._linger_timer.cancel()
        delay = min(LINGER_QUIET_S, max(0.0, self._linger_deadline - self.loop.time()))
        self._linger_timer = self.loop.call_later(delay, self._raw_transport.close)

    def data_received(self, data: bytes) -> None:
        if self._lingering:  # the rest of a refused body: dropped unread
            if self.loop.time() >= self._linger_deadline:
                self._raw_transport.close()
            else:
                self._rearm_linger()
            return
        super().data_received(data)

    def eof_received(self) -> bool | None:  # type: ignore[override]
        if self._lingering:
            self._raw_transport.close()
        return super().eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._linger_timer is not None:
            self._linger_timer.cancel()
            self._linger_timer = None
        super().connection_lost(exc)
