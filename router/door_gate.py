"""The HTTP door's gate: every request's caller, its announced body size, and its count by path
and status, as plain ASGI middleware.

Starlette's `@app.middleware("http")` (BaseHTTPMiddleware) runs the app in a task of its own and
passes a streamed answer's every chunk through a memory channel and a second task: a cost per
SSE event, one per generated token. Here the app gets the connection's own `send`, wrapped only
to see the status line.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from common.auth import Principal

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# (the caller, or None when the door runs without tokens or the path is open; the refusal to
# answer instead of running the app, or None)
Admit = Callable[[Request], tuple[Principal | None, Response | None]]
Count = Callable[[str, int], None]  # (path, status) of a request answered


class DoorGate:
    """Runs `admit` on each HTTP request before the app: its refusal is the answer, else the
    caller goes to the endpoints as `request.state.principal`. `count` gets the path and the
    status of every request once its answer ends (500 when the app failed before answering)."""

    def __init__(self, app: ASGIApp, admit: Admit, count: Count) -> None:
        self.app = app
        self.admit = admit
        self.count = count

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        principal, refused = self.admit(request)
        request.state.principal = principal  # the caller (request ids, Abort and namespaces are its own)
        status = 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await (refused if refused is not None else self.app)(scope, receive, send_status)
        finally:
            self.count(request.url.path, status)
