"""The router's error: a status name (gRPC's, e.g. "UNAVAILABLE") and a message.

The core raises it; the gRPC servicer turns it into the same status, the HTTP door into an HTTP
status and OpenAI's error JSON. Status names are plain strings so the core needs no gRPC.
"""

from __future__ import annotations

OK = "OK"
CANCELLED = "CANCELLED"
UNKNOWN = "UNKNOWN"
INVALID_ARGUMENT = "INVALID_ARGUMENT"
DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
NOT_FOUND = "NOT_FOUND"
ALREADY_EXISTS = "ALREADY_EXISTS"
PERMISSION_DENIED = "PERMISSION_DENIED"
RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
FAILED_PRECONDITION = "FAILED_PRECONDITION"
ABORTED = "ABORTED"
UNIMPLEMENTED = "UNIMPLEMENTED"
INTERNAL = "INTERNAL"
UNAVAILABLE = "UNAVAILABLE"

# A replica failing with one of these before its first message is retried on the next candidate:
# it could not take the request (down, shutting down, queue full, pool too small), and nothing was
# sent to the client yet. Anything else (INVALID_ARGUMENT above all) is the client's answer.
RETRYABLE_BEFORE_FIRST_MESSAGE = frozenset({UNAVAILABLE, RESOURCE_EXHAUSTED, ABORTED, CANCELLED, UNKNOWN})


class RouterError(Exception):
    """A call failed with `code` (a gRPC status name)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    def __repr__(self) -> str:
        return f"RouterError({self.code}, {self.message!r})"


class UpstreamError(RouterError):
    """A call to a replica or the cache manager failed with `code`."""
