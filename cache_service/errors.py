"""Typed errors of the cache core.

The core raises these; the gRPC servicer maps each to a status code (see `code`). They carry a
message that is safe to show to callers.
"""

from __future__ import annotations


class CacheError(Exception):
    """Base class. `code` names the gRPC status the servicer answers with."""

    code = "INTERNAL"


class InvalidArgument(CacheError):
    """Malformed input: empty token list, token id out of vocabulary, duplicate ids in a step."""

    code = "INVALID_ARGUMENT"


class NotFound(CacheError):
    """Unknown pool or request id."""

    code = "NOT_FOUND"


class FailedPrecondition(CacheError):
    """Stale epoch, expired lease, finishing twice, block table that is not the request's."""

    code = "FAILED_PRECONDITION"


class ResourceExhausted(CacheError):
    """A request larger than the whole pool, or a watcher that fell too far behind."""

    code = "RESOURCE_EXHAUSTED"


class PermissionDenied(CacheError):
    """A namespace-limited reader token asked about another namespace."""

    code = "PERMISSION_DENIED"


class OutOfRange(CacheError):
    """An event sequence the replay buffer no longer (or not yet) holds."""

    code = "OUT_OF_RANGE"


class AllocationError(CacheError):
    """Allocator misuse: allocating more than is free, or freeing a block that is already free.

    Pools check `can_allocate` first, so reaching this from an RPC is a bug (INTERNAL).
    """

    code = "INTERNAL"


class IntegrityError(CacheError):
    """An accounting invariant does not hold (a bug, never a caller error)."""

    code = "INTERNAL"
