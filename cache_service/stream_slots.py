"""A cap on the concurrent streams of each principal (WatchEvents: --max-watch-streams).

Streams are long-lived: without a cap one reader could hold any number open, each with its
snapshot walk, its gRPC buffers and its share of the event loop. Principals are told apart by
their token's key (common/auth.py); callers of a server without a token file are one principal.
"""

from __future__ import annotations

from cache_service.errors import ResourceExhausted

DEFAULT_MAX_WATCH_STREAMS = 16


class StreamSlots:
    """At most `limit` streams open per principal key at once."""

    def __init__(self, limit: int = DEFAULT_MAX_WATCH_STREAMS, what: str = "WatchEvents streams",
                 flag: str = "--max-watch-streams") -> None:
        if limit < 1:
            raise ValueError("limit must be >= 1")
        self.limit = limit
        self.what = what
        self.flag = flag
        self._open: dict[str, int] = {}

    def acquire(self, key: str) -> None:
        """Take a slot of `key`; ResourceExhausted when it has `limit` open. Pair with `release`."""
        held = self._open.get(key, 0)
        if held >= self.limit:
            raise ResourceExhausted(f"this caller already has {held} {self.what} open, the most the server allows "
                                    f"per token ({self.flag} {self.limit}); close one first")
        self._open[key] = held + 1

    def release(self, key: str) -> None:
        held = self._open[key] - 1
        if held:
            self._open[key] = held
        else:
            del self._open[key]
