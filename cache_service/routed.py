"""Requests a router sent to a pool that the pool has not cached yet, and Route reservations.

Between a `Route` answer and the moment the chosen replica has cached the prompt (its first
commit or finish), later Route calls must already see the decision, or a burst of requests
sharing a new prefix would be spread over every replica before any of them cached it. Each
routed request is remembered with its prompt's page hashes (so a later prompt's prefix counts
as about to be cached here) and its expected prefill tokens (counted as queued load until the
pool admits it). A reservation additionally pins the pool's matched prefix (a lock ref on its
tree node) until the request is admitted or the pin expires.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from cache_service.radix_tree import TreeNode

DEFAULT_ROUTED_TTL_SECONDS = 30.0


@dataclass(slots=True)
class RoutedRequest:
    request_id: str
    page_hashes: list[int]
    prefill_tokens: int  # what the pool was expected to compute for it when it was routed
    expires_at: float
    pin: TreeNode | None = None  # locked by a reservation, until pin_expires_at or admission
    pin_expires_at: float = 0.0
    admitted: bool = False


class RoutedRequests:
    """The routed-but-not-cached requests of one pool (not thread-safe, like the pool)."""

    def __init__(self) -> None:
        self._entries: dict[str, RoutedRequest] = {}
        self._hash_counts: dict[int, int] = {}
        self._deadlines: list[tuple[float, str]] = []  # lazy: (time, request_id)
        self.queued_tokens = 0  # prefill_tokens of routed requests not admitted yet
        self.num_pins = 0

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, entry: RoutedRequest) -> list[TreeNode]:
        """Remember a routed request (replacing one of the same id); returns pins to unlock."""
        unlock = self.drop(entry.request_id)
        self._entries[entry.request_id] = entry
        for h in entry.page_hashes:
            self._hash_counts[h] = self._hash_counts.get(h, 0) + 1
        self.queued_tokens += entry.prefill_tokens
        heapq.heappush(self._deadlines, (entry.expires_at, entry.request_id))
        if entry.pin is not None:
            self.num_pins += 1
            heapq.heappush(self._deadlines, (entry.pin_expires_at, entry.request_id))
        return unlock

    def promised_pages(self, page_hashes: list[int]) -> int:
        """Leading pages of a prompt that a routed request will have cached here."""
        n = 0
        for h in page_hashes:
            if h not in self._hash_counts:
                break
            n += 1
        return n

    def on_admit(self, request_id: str) -> list[TreeNode]:
        """The pool admitted the request: its queued tokens and pin end (pins are returned)."""
        entry = self._entries.get(request_id)
        if entry is None or entry.admitted:
            return []
        entry.admitted = True
        self.queued_tokens -= entry.prefill_tokens
        return self._unpin(entry)

    def drop(self, request_id: str) -> list[TreeNode]:
        """The request cached its prompt, ended, or expired: forget it; returns pins to unlock."""
        entry = self._entries.pop(request_id, None)
        if entry is None:
            return []
        for h in entry.page_hashes:
            left = self._hash_counts[h] - 1
            if left:
                self._hash_counts[h] = left
            else:
                del self._hash_counts[h]
        if not entry.admitted:
            self.queued_tokens -= entry.prefill_tokens
        return self._unpin(entry)

    @property
    def next_deadline(self) -> float:
        return self._deadlines[0][0] if self._deadlines else float("inf")

    def expire(self, now: float) -> list[TreeNode]:
        """End every pin and entry whose time has come; returns the pins to unlock."""
        unlock: list[TreeNode] = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, request_id = heapq.heappop(self._deadlines)
            entry = self._entries.get(request_id)
            if entry is None:
                continue
            if entry.expires_at <= now:
                unlock.extend(self.drop(request_id))
            elif entry.pin is not None and entry.pin_expires_at <= now:
                unlock.extend(self._unpin(entry))
        return unlock

    def entries(self) -> list[RoutedRequest]:
        """Every remembered routed request (for snapshots)."""
        return list(self._entries.values())

    def drop_all(self) -> list[TreeNode]:
        unlock: list[TreeNode] = []
        for request_id in list(self._entries):
            unlock.extend(self.drop(request_id))
        self._deadlines.clear()
        return unlock

    def _unpin(self, entry: RoutedRequest) -> list[TreeNode]:
        if entry.pin is None:
            return []
        pin, entry.pin = entry.pin, None
        self.num_pins -= 1
        return [pin]
