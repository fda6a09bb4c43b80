"""Routing policies: the order in which a request's candidate replicas are tried.

Pure functions of what the router knows (no I/O): the cache manager's Route ranking for ``kv``,
the replicas' load for ``least-loaded``, a rotation for ``round-robin``. Every plan carries the
reason of its first choice, counted in the router's metrics.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from router.replicas import Replica, ReplicaSet

POLICIES = ("kv", "least-loaded", "round-robin")

# Reasons of route decisions (metrics label values).
KV_HIT = "kv_hit"  # Route's best candidate has (part of) the prompt cached
KV_LOAD = "kv_load"  # Route's ranking, no candidate has any of the prompt: chosen by load alone
KV_PULL = "kv_pull"  # Route's best candidate will pull (part of) the prompt from another replica
LEAST_LOADED = "least_loaded"
ROUND_ROBIN = "round_robin"
FALLBACK_NO_CACHE_MANAGER = "fallback_no_cache_manager"  # kv policy, cache manager unreachable
RETRY = "retry"  # one per further candidate tried after a failure before the first message
REASONS = (KV_HIT, KV_LOAD, KV_PULL, LEAST_LOADED, ROUND_ROBIN, FALLBACK_NO_CACHE_MANAGER, RETRY)


class Candidate(Protocol):
    """What is read of a Route candidate (radixkv.v1.RouteCandidate)."""

    serving_addr: str
    matched_tokens: int
    routed_prefix_tokens: int
    matched_peer_tokens: int


@dataclass(frozen=True, slots=True)
class RoutePlan:
    """Replica addresses to try, in order, and why the first was chosen."""

    addrs: list[str]
    reason: str


class Rotation:
    """Round-robin: each call starts one further along the list."""

    def __init__(self) -> None:
        self._next = 0

    def order(self, replicas: Sequence[Replica]) -> list[str]:
        if not replicas:
            return []
        start = self._next % len(replicas)
        self._next += 1
        return [r.addr for r in (*replicas[start:], *replicas[:start])]


def least_loaded(replicas: Sequence[Replica], rotation: Rotation) -> list[str]:
    """Fewest requests standing first (see Replica.load_score); equal loads in rotation order,
    so an idle fleet is served round-robin."""
    rotated = rotation.order(replicas)
    score = {r.addr: r.load_score() for r in replicas}
    return sorted(rotated, key=score.__getitem__)


def kv_plan(candidates: Sequence[Candidate], replicas: ReplicaSet, others: Sequence[str] = ()) -> RoutePlan:
    """Route's ranking (best first), replicas known to be down moved last, then `others` (further
    live replicas, as a last resort for retries). Empty when Route offered no candidate."""
    seen: set[str] = set()
    ranked: list[Candidate] = []
    for c in candidates:
        if c.serving_addr and c.serving_addr not in seen:
            seen.add(c.serving_addr)
            ranked.append(c)
    if not ranked:
        return RoutePlan([], KV_LOAD)

    def known_down(c: Candidate) -> bool:
        replica = replicas.get(c.serving_addr)
        return replica is not None and replica.reachable is False

    ranked.sort(key=known_down)  # stable: Route's order otherwise
    best = ranked[0]
    if best.matched_peer_tokens > 0:  # more of the prompt comes from another replica than from its own cache
        reason = KV_PULL
    else:
        reason = KV_HIT if best.matched_tokens + best.routed_prefix_tokens > 0 else KV_LOAD
    addrs = [c.serving_addr for c in ranked]
    addrs += [a for a in others if a not in seen]
    return RoutePlan(addrs, reason)
