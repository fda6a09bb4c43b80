"""Several Generate streams of one OpenAI request (a completions request with several prompts),
run at once and read as one: each message tagged with its stream's index, in the order they
arrive. The first error of any stream ends them all; every stream is closed on the way out (a
client gone mid-answer stops every replica's generation, not only one)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import TypeVar

T = TypeVar("T")

_END = object()
_QUEUED_PER_STREAM = 4  # messages read ahead per stream: a slow client slows the replicas


async def close_all(streams: Sequence[AsyncGenerator[T, None]]) -> None:
    for stream in streams:
        with contextlib.suppress(Exception):
            await stream.aclose()


async def opened(streams: Sequence[AsyncGenerator[T, None]]) -> list[T]:
    """The first item of every stream, awaited at once (routing and admission errors come
    here, before any answer is sent). On an error every stream is closed and the first error
    (in stream order) raised; a stream that ends at once raises StopAsyncIteration."""
    if len(streams) == 1:  # the common case: no tasks
        try:
            return [await anext(streams[0])]
        except BaseException:
            await close_all(streams)
            raise
    results = await asyncio.gather(*(anext(stream) for stream in streams), return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            await close_all(streams)
            raise result
    return list(results)  # type: ignore[arg-type]


async def merged(firsts: Sequence[T], streams: Sequence[AsyncGenerator[T, None]]) -> AsyncIterator[tuple[int, T]]:
    """(stream index, item) for each stream's first item (from `opened`), then the rest of
    every stream as it comes. Closing this closes every stream."""
    tasks: list[asyncio.Task[None]] = []
    try:
        for i, first in enumerate(firsts):
            yield i, first
        if len(streams) == 1:  # the common case: no tasks
            async for item in streams[0]:
                yield 0, item
            return
        queue: asyncio.Queue[tuple[int, object, BaseException | None]] = \
            asyncio.Queue(_QUEUED_PER_STREAM * len(streams))

        async def pump(i: int, stream: AsyncGenerator[T, None]) -> None:
            try:
                async for item in stream:
                    await queue.put((i, item, None))
                await queue.put((i, _END, None))
            except Exception as e:  # noqa: BLE001 - handed to the reader, which raises it
                await queue.put((i, _END, e))

        tasks = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(streams)]
        live = len(tasks)
        while live:
            i, item, error = await queue.get()
            if error is not None:
                raise error
            if item is _END:
                live -= 1
                continue
            yield i, item  # type: ignore[misc]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await close_all(streams)
