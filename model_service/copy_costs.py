"""What copying a token's KV into the pool costs next to computing it, per source.

Sources are the replica's host and disk tiers (tiers/copier.py) and other replicas (kv_pulls/).
Each is measured on this replica: moving averages of seconds per copied token over seconds per
prefilled token (the engine reports its forward passes). The ratios go to the cache manager with
every Step and Heartbeat (ReplicaLoad.host_load_cost / disk_load_cost / peer_load_cost), so Route
prices each kind of hit, and the cache manager stops copying from a source that measures slower
than recomputing. A ratio not refreshed for COST_TTL_SECONDS is reported as unknown (0), so a
source that was once slow gets tried again now and then.
"""

from __future__ import annotations

import time

HOST, DISK, PEER = "host", "disk", "peer"
_EMA = 0.2  # weight of the newest sample in the averages
COST_TTL_SECONDS = 60.0
# Batches with fewer tokens than this are decode-bound: they say little about prefill cost.
MIN_PREFILL_SAMPLE_TOKENS = 64


class CopyCosts:
    """Moving averages of copy and prefill cost (engine thread only)."""

    def __init__(self) -> None:
        self._seconds_per_token: dict[str, float] = {}
        self._sampled_at: dict[str, float] = {}
        self.prefill_seconds_per_token = 0.0  # 0: not measured yet

    def observe_copy(self, source: str, seconds: float, tokens: int) -> None:
        """`tokens` tokens' KV came from `source` in `seconds`."""
        if tokens <= 0:
            return
        per_token = seconds / tokens
        old = self._seconds_per_token.get(source)
        fresh = old is None or time.monotonic() - self._sampled_at[source] > COST_TTL_SECONDS
        self._seconds_per_token[source] = per_token if fresh else (1 - _EMA) * old + _EMA * per_token
        self._sampled_at[source] = time.monotonic()

    def observe_forward(self, seconds: float, num_tokens: int) -> None:
        """A forward pass computed `num_tokens` tokens in `seconds` (prefill-sized ones count)."""
        if num_tokens < MIN_PREFILL_SAMPLE_TOKENS:
            return
        per_token = seconds / num_tokens
        old = self.prefill_seconds_per_token
        self.prefill_seconds_per_token = per_token if not old else (1 - _EMA) * old + _EMA * per_token

    def cost(self, source: str) -> float:
        """Seconds per copied token / seconds per computed token (0: not measured, or stale)."""
        copy = self._seconds_per_token.get(source)
        if copy is None or not self.prefill_seconds_per_token:
            return 0.0
        if time.monotonic() - self._sampled_at[source] > COST_TTL_SECONDS:
            return 0.0
        return copy / self.prefill_seconds_per_token
