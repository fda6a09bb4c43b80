"""Unit tests of router/openai_fanout.py: several prompts' streams read as one, errors end them
all and every stream is closed (plain async generators, no server)."""

from __future__ import annotations

import asyncio

import pytest

from router.openai_fanout import merged, opened


def run(coro):
    return asyncio.run(coro)


class Streams:
    """Async generators that yield their items with a pause between, record whether they were
    closed, and fail after their items when told to."""

    def __init__(self) -> None:
        self.closed: set[int] = set()

    async def stream(self, i: int, items: list[str], pause: float, fail: bool = False):
        try:
            for item in items:
                yield item
                await asyncio.sleep(pause)
            if fail:
                raise RuntimeError(f"stream {i} failed")
        finally:
            self.closed.add(i)


def test_items_of_every_stream_tagged_and_interleaved() -> None:
    async def main():
        s = Streams()
        streams = [s.stream(0, ["a0", "a1", "a2"], 0.03), s.stream(1, ["b0", "b1", "b2"], 0.01)]
        firsts = await opened(streams)
        got = [pair async for pair in merged(firsts, streams)]
        return firsts, got, set(s.closed)

    firsts, got, closed = run(main())
    assert firsts == ["a0", "b0"]
    assert sorted(got) == [(0, "a0"), (0, "a1"), (0, "a2"), (1, "b0"), (1, "b1"), (1, "b2")]
    assert got.index((1, "b2")) < got.index((0, "a2"))  # as they come, not one stream after the other
    assert closed == {0, 1}


def test_an_error_in_one_stream_ends_and_closes_all() -> None:
    async def main():
        s = Streams()
        streams = [s.stream(0, ["a"] * 100, 0.01), s.stream(1, ["b"], 0.01, fail=True)]
        messages = merged(await opened(streams), streams)
        with pytest.raises(RuntimeError, match="stream 1 failed"):
            async for _ in messages:
                pass
        return set(s.closed)  # before asyncio.run closes what is left

    assert run(main()) == {0, 1}


def test_an_error_before_the_first_item_closes_the_started_streams() -> None:
    async def main():
        s = Streams()
        streams = [s.stream(0, ["a", "b"], 0.01), s.stream(1, [], 0.0, fail=True)]
        with pytest.raises(RuntimeError, match="stream 1 failed"):
            await opened(streams)
        return set(s.closed)  # before asyncio.run closes what is left

    assert run(main()) == {0, 1}


def test_closing_early_closes_every_stream() -> None:
    async def main():
        s = Streams()
        streams = [s.stream(i, ["x"] * 100, 0.01) for i in range(3)]
        messages = merged(await opened(streams), streams)
        async for _ in messages:
            break
        await messages.aclose()  # a client gone mid-answer
        return set(s.closed)  # before asyncio.run closes what is left

    assert run(main()) == {0, 1, 2}
