"""The pools of one model group in the order of their load, kept as loads change.

Route's score is the prefill term plus the load terms (routing.py). With the default weights the
load terms of a pool are `queue_load(pool)`; pools that hold the prompt's pages lower the prefill
term by at most the deepest hit, so a Route can read pools from the least loaded up and stop once
even the deepest hit could not bring the next pool into its answer (routing.route). This keeps the
order: every change of a pool's reported load (Pool.load) or routed tokens
(RoutedRequests.queued_tokens) moves that pool to its place, a bisection in a list.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cache_service.pool import Pool

# The default weights of Route's load terms (routing.RouteWeights), per queued and per running request.
QUEUE_WEIGHT = 1.0
RUNNING_WEIGHT = 16.0


def load_terms(pool: Pool, queue_weight: float, running_weight: float) -> float:
    """Route's load terms for `pool`: what it has queued (reported and routed) and running."""
    load = pool.load
    return (queue_weight * (load.num_waiting_tokens + pool.routing.routed.queued_tokens)
            + running_weight * load.num_running_requests)


def queue_load(pool: Pool) -> float:
    """The pool's load terms at the default weights."""
    return load_terms(pool, QUEUE_WEIGHT, RUNNING_WEIGHT)


class LoadOrder:
    """Pool ids by (queue_load, pool id), ascending. Not thread-safe."""

    def __init__(self) -> None:
        self._keys: list[tuple[float, str]] = []
        self._key_of: dict[str, tuple[float, str]] = {}

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, pool: Pool) -> None:
        key = (queue_load(pool), pool.pool_id)
        self._key_of[pool.pool_id] = key
        insort(self._keys, key)

    def remove(self, pool_id: str) -> None:
        key = self._key_of.pop(pool_id)
        del self._keys[bisect_left(self._keys, key)]

    def update(self, pool: Pool) -> None:
        """`pool`'s load changed: move it to its place."""
        old = self._key_of.get(pool.pool_id)
        if old is None:
            return
        key = (queue_load(pool), pool.pool_id)
        if key != old:
            del self._keys[bisect_left(self._keys, old)]
            self._key_of[pool.pool_id] = key
            insort(self._keys, key)

    def __iter__(self) -> Iterator[tuple[float, str]]:
        """(load, pool id), least loaded first. Do not change loads while iterating."""
        return iter(self._keys)

    def check(self, pools: dict[str, Pool]) -> bool:
        """Whether the order holds exactly `pools` at their current loads (integrity checks)."""
        return self._keys == sorted((queue_load(p), pid) for pid, p in pools.items())
