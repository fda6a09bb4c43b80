"""LoopRelay: items put from another thread reach their queues in order, with few wake-ups."""

from __future__ import annotations

import asyncio
import threading

import pytest

from model_service.loop_relay import LoopRelay


def _counting_relay(loop: asyncio.AbstractEventLoop) -> tuple[LoopRelay, list[int]]:
    """A relay whose wake-ups (drains on the loop) are counted in the returned [count]."""
    relay, wakeups = LoopRelay(loop), [0]
    drain = relay._drain

    def counted_drain() -> None:
        wakeups[0] += 1
        drain()

    relay._drain = counted_drain  # type: ignore[method-assign]
    return relay, wakeups


def test_items_from_a_thread_arrive_in_order_per_queue_with_one_wakeup_per_burst():
    async def main() -> tuple[list[list[int]], int]:
        loop = asyncio.get_running_loop()
        relay, wakeups = _counting_relay(loop)
        queues: list[asyncio.Queue[int]] = [asyncio.Queue() for _ in range(4)]
        bursts, per_burst = 50, 4 * 8
        burst_done = threading.Event()
        resume = threading.Event()

        def engine() -> None:  # like the engine thread: a burst of outputs per step
            for burst in range(bursts):
                for i in range(per_burst):
                    relay.put(queues[i % 4], burst * per_burst + i)
                burst_done.set()
                resume.wait()
                resume.clear()

        thread = threading.Thread(target=engine)
        thread.start()
        got: list[list[int]] = [[] for _ in queues]
        for _ in range(bursts):
            while not burst_done.is_set():
                await asyncio.sleep(0.001)
            burst_done.clear()
            for q, items in zip(queues, got, strict=True):
                for _ in range(per_burst // 4):
                    items.append(await asyncio.wait_for(q.get(), 5))
            resume.set()
        thread.join()
        return got, wakeups[0]

    got, wakeups = asyncio.run(main())
    for k, items in enumerate(got):
        assert items == [n for n in range(50 * 32) if n % 4 == k]
    assert 50 <= wakeups < 50 * 32 // 4  # at least one per burst, far fewer than one per item


def test_a_closed_loop_raises_and_the_relay_stays_usable():
    loop = asyncio.new_event_loop()
    relay = LoopRelay(loop)
    loop.close()
    queue: asyncio.Queue[int] = asyncio.Queue()
    for _ in range(2):  # the second put tries again (it does not wait on the hand-over that failed)
        with pytest.raises(RuntimeError):
            relay.put(queue, 1)
        assert relay._pending == []


def test_a_batch_wakes_the_loop_once_when_it_ends():
    async def main() -> tuple[list[int], int, int]:
        loop = asyncio.get_running_loop()
        relay, wakeups = _counting_relay(loop)
        q: asyncio.Queue[int] = asyncio.Queue()
        seen_inside = -1

        def engine() -> None:
            nonlocal seen_inside
            with relay.batch():
                with relay.batch():  # nested: the outer block decides
                    for i in range(10):
                        relay.put(q, i)
                for i in range(10, 32):
                    relay.put(q, i)
                seen_inside = len(relay._pending)  # nothing handed over inside the batch
            with relay.batch():
                pass  # an empty batch wakes nothing

        thread = threading.Thread(target=engine)
        thread.start()
        thread.join()
        got = [await asyncio.wait_for(q.get(), 5) for _ in range(32)]
        await asyncio.sleep(0.01)
        return got, wakeups[0], seen_inside

    got, wakeups, seen_inside = asyncio.run(main())
    assert got == list(range(32)) and seen_inside == 32
    assert wakeups == 1
