"""Watch (cache_service/watch.py) on a real EventLog, in-process: view numbers with a pool filter,
a caught-up watcher of a quiet pool kept in the buffer, a lapped one cut off, the lag bound."""

from __future__ import annotations

import asyncio

import pytest

from cache_service.errors import OutOfRange, ResourceExhausted
from cache_service.events import AllCleared, BlockRemoved, EventLog
from cache_service.watch import Watch, WatchRequest


def removed(namespace: str, page: int) -> BlockRemoved:
    return BlockRemoved((page,), (page,), namespace)


async def take(stream, n: int) -> list:
    return [await asyncio.wait_for(anext(stream), 5) for _ in range(n)]


def run(coro) -> None:
    asyncio.run(asyncio.wait_for(coro, 30))


def test_view_numbers_count_every_pool_even_with_a_pool_filter() -> None:
    async def scenario() -> None:
        log = EventLog()
        log.track_namespaces(["a", "b"])
        log.publish("p", removed("b", 1))  # view {b}: 1
        log.publish("q", removed("b", 2))  # 2 (another pool)
        log.publish("p", removed("c", 3))  # not in the view
        watch = Watch(log, [], WatchRequest(pool_id="p", start_sequence=1, view=frozenset({"b"})), max_lag=100)
        stream = watch.stream()
        try:
            (first,) = await take(stream, 1)
            assert (first.sequence, first.payload.block_hashes, first.payload.block_ids) == (1, (1,), ())
            # caught up: live events of other pools and namespaces are stepped over as they come
            log.publish("q", removed("b", 4))  # 3
            log.publish("p", removed("a", 5))
            log.publish("q", AllCleared())  # 4: every view counts AllCleared
            log.publish("p", removed("b", 6))  # 5
            (second,) = await take(stream, 1)
            assert (second.sequence, second.payload.block_hashes) == (5, (6,))
            assert log.view_sequence(frozenset({"b"})) == 5
        finally:
            watch.close()
        # A resume in the view's numbers lands on the same event.
        again = Watch(log, [], WatchRequest(pool_id="p", start_sequence=5, view=frozenset({"b"})), max_lag=100)
        try:
            (event,) = await take(again.stream(), 1)
            assert (event.sequence, event.payload.block_hashes) == (5, (6,))
        finally:
            again.close()
        with pytest.raises(OutOfRange, match="ahead"):
            Watch(log, [], WatchRequest(start_sequence=7, view=frozenset({"b"})), max_lag=100)

    run(scenario())


def test_a_caught_up_watcher_of_a_quiet_pool_outlives_the_buffer() -> None:
    async def scenario() -> None:
        log = EventLog(capacity=8)
        watch = Watch(log, [], WatchRequest(pool_id="quiet"), max_lag=100)
        stream = watch.stream()
        try:
            waiting = asyncio.ensure_future(take(stream, 1))
            await asyncio.sleep(0)  # the stream waits for an event of its pool
            for i in range(50):  # six times the buffer, none of them its pool's
                log.publish("busy", removed("", i))
            log.publish("quiet", removed("", 99))
            (event,) = await waiting
            assert event.sequence == 51 and event.payload.block_hashes == (99,)
        finally:
            watch.close()

    run(scenario())


def test_a_watcher_lapped_by_the_buffer_is_cut_off() -> None:
    async def scenario() -> None:
        log = EventLog(capacity=8)
        log.publish("p", removed("", 0))
        watch = Watch(log, [], WatchRequest(start_sequence=1), max_lag=1000)
        stream = watch.stream()
        try:
            await take(stream, 1)
            for i in range(20):  # the reader does not read meanwhile
                log.publish("p", removed("", i))
            with pytest.raises(ResourceExhausted, match="left the replay buffer"):
                await take(stream, 1)
        finally:
            watch.close()

    run(scenario())


def test_more_undelivered_events_than_max_lag_cut_the_watcher_off() -> None:
    async def scenario() -> None:
        log = EventLog()
        watch = Watch(log, [], WatchRequest(), max_lag=3)
        stream = watch.stream()
        try:
            for i in range(4):
                log.publish("p", removed("", i))
            assert watch.lagging and log.num_subscribers == 0
            with pytest.raises(ResourceExhausted, match="too far behind"):
                await take(stream, 4)
        finally:
            watch.close()

    run(scenario())
