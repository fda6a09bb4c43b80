"""LoopRelay: items put from another thread reach their queues in order, with few wake-ups."""

from __future__ import annotations

import asyncio
import threading

import pytest

from model_service.loop_relay import LoopRelay


def test_items_from_a_thread_arrive_in_order_per_queue_with_one_wakeup_per_burst():
    async def main() -> tuple[list[list[int]], int]:
        loop = asyncio.get_running_loop()
        relay = LoopRelay(loop)
        wakeups = 0
        drain = relay._drain

        def counted_drain() -> None:
            nonlocal wakeups
            wakeups += 1
            drain()

        relay._drain = counted_drain  # type: ignore[method-assign]
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
        return got, wakeups

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
