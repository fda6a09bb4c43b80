"""OpenStreams (cache_service/open_streams.py) directly: at stop a stream handler is cancelled only
where it waits for its next message, and one that is elsewhere ends at its next wait; either way
its call ends with UNAVAILABLE. Other cancellations are not turned into a status."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from cache_service.open_streams import SHUTTING_DOWN, OpenStreams


class Context:
    """What `end_call` sets on a grpc.aio servicer context."""

    def __init__(self) -> None:
        self.code: grpc.StatusCode | None = None
        self.details: str | None = None

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=10))


async def handler(streams: OpenStreams, context: Context, messages: asyncio.Queue, busy: asyncio.Event,
                  resume: asyncio.Event, seen: list) -> None:
    """A stream handler: waits for each message; on "work" it is busy elsewhere until `resume`."""
    with streams.hold(context):
        while (message := await streams.wait(messages.get)) is not None:
            seen.append(message)
            if message == "work":
                busy.set()
                await resume.wait()  # not a wait of the stream: end_all must not cancel it here


def test_a_waiting_stream_ends_at_once_with_unavailable():
    async def main() -> tuple[Context, list]:
        streams, context, messages, seen = OpenStreams(), Context(), asyncio.Queue(), []
        task = asyncio.create_task(handler(streams, context, messages, asyncio.Event(), asyncio.Event(), seen))
        await messages.put("hello")
        while not seen:
            await asyncio.sleep(0)
        streams.end_all()
        await task  # ends normally: its call gets the status
        return context, seen

    context, seen = run(main())
    assert seen == ["hello"]
    assert (context.code, context.details) == (grpc.StatusCode.UNAVAILABLE, SHUTTING_DOWN)


def test_a_stream_busy_elsewhere_is_not_cancelled_there_and_ends_at_its_next_wait():
    async def main() -> tuple[Context, list, bool]:
        streams, context, messages, seen = OpenStreams(), Context(), asyncio.Queue(), []
        busy, resume = asyncio.Event(), asyncio.Event()
        task = asyncio.create_task(handler(streams, context, messages, busy, resume, seen))
        await messages.put("work")
        await busy.wait()
        streams.end_all()
        await asyncio.sleep(0.05)
        still_busy = not task.done()
        await messages.put("after")  # there to read, yet the next wait ends the stream first
        resume.set()
        await task
        return context, seen, still_busy

    context, seen, still_busy = run(main())
    assert still_busy and seen == ["work"]
    assert (context.code, context.details) == (grpc.StatusCode.UNAVAILABLE, SHUTTING_DOWN)


def test_a_cancellation_not_from_a_stop_propagates():
    async def main() -> Context:
        streams, context, messages = OpenStreams(), Context(), asyncio.Queue()
        task = asyncio.create_task(handler(streams, context, messages, asyncio.Event(), asyncio.Event(), []))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return context

    assert run(main()).code is None
