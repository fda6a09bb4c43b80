"""The cache manager as the router sees it when it runs as several shards (common/shards.py).

Each shard owns the pools of the replicas that hash to it, so a Route is asked of every shard at
once and their candidates merged by score (every shard scores with the same formula; peer pulls
and "cached on another replica" only see pools of the same shard). A shard that fails or misses
the deadline drops out of that decision, which says so (RouteResponse.num_shards_missing, and
the router's radixkv_router_cache_shards_missing counter). A shard that refuses the prompt as too
large for its pools (INVALID_ARGUMENT) has no pool that could take it and simply has no
candidate. A Route that records its decision (a request_id, not a dry run) is asked of every
shard as a dry run first, then again, recording and reserving, of the winning shard only, so no
other shard counts a request that will never come; the recorded candidate leads the answer.
Stats merges every answering shard's pools.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from protos import cache_pb2
from router.errors import UpstreamError
from router.upstream import CacheManagerClient

T = TypeVar("T")
INVALID_ARGUMENT = "INVALID_ARGUMENT"


class ShardedCache:
    """router.core's CachePort over several cache-manager shards (one: that shard as it is)."""

    def __init__(self, shards: Sequence[CacheManagerClient],
                 on_missing: Callable[[int], None] | None = None) -> None:
        if not shards:
            raise ValueError("no cache manager shard")
        self.shards = list(shards)
        self._on_missing = on_missing  # told how many shards dropped out of a decision

    async def _ask_all(self, call: Callable[[CacheManagerClient], Awaitable[T]]) -> list[T | UpstreamError]:
        async def one(shard: CacheManagerClient) -> T | UpstreamError:
            try:
                return await call(shard)
            except UpstreamError as e:
                return e

        return list(await asyncio.gather(*(one(shard) for shard in self.shards)))

    async def route(self, request: cache_pb2.RouteRequest, timeout: float | None) -> cache_pb2.RouteResponse:
        if len(self.shards) == 1:
            return await self.shards[0].route(request, timeout)
        started = time.monotonic()
        recording = bool(request.request_id) and not request.dry_run
        ask = request
        if recording:
            ask = cache_pb2.RouteRequest()
            ask.CopyFrom(request)
            ask.dry_run, ask.reserve_ms = True, 0
        answers = await self._ask_all(lambda shard: shard.route(ask, timeout))
        errors = [a for a in answers if isinstance(a, UpstreamError)]
        if len(errors) == len(answers):
            raise next((e for e in errors if e.code != INVALID_ARGUMENT), errors[0])
        missing = sum(e.code != INVALID_ARGUMENT for e in errors)
        ranked = sorted(((c, i) for i, a in enumerate(answers) if not isinstance(a, UpstreamError)
                         for c in a.candidates), key=lambda item: (item[0].score, item[0].pool_id))
        pages = max(a.num_prompt_pages for a in answers if not isinstance(a, UpstreamError))
        if recording and ranked:
            winner = ranked[0][1]
            left = None if timeout is None else max(0.0, timeout - (time.monotonic() - started))
            try:
                recorded = await self.shards[winner].route(request, left)
            except UpstreamError as e:
                recorded = None  # the dry answer stands, unrecorded
                if e.code != INVALID_ARGUMENT:
                    missing += 1
            if recorded is not None and recorded.candidates:
                top = recorded.candidates[0]
                ranked = [(top, winner)] + [(c, i) for c, i in ranked if c.pool_id != top.pool_id]
        if missing and self._on_missing is not None:
            self._on_missing(missing)
        limit = request.max_candidates or len(ranked)
        return cache_pb2.RouteResponse(candidates=[c for c, _ in ranked[:limit]], num_prompt_pages=pages,
                                       num_shards_missing=missing)

    async def stats(self, timeout: float | None) -> cache_pb2.StatsResponse:
        if len(self.shards) == 1:
            return await self.shards[0].stats(timeout)
        answers = await self._ask_all(lambda shard: shard.stats(timeout))
        replies = [a for a in answers if not isinstance(a, UpstreamError)]
        if not replies:
            raise answers[0]
        if len(replies) < len(answers) and self._on_missing is not None:
            self._on_missing(len(answers) - len(replies))
        return cache_pb2.StatsResponse(pools=[p for r in replies for p in r.pools])

    async def close(self) -> None:
        for shard in self.shards:
            await shard.close()
