"""The model is loaded on a thread that exits, and its OpenMP workers with it (torch_threads)."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest
import torch

from model_service.torch_threads import run_in_passing_thread


def _num_os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _parallel_work() -> float:
    a = torch.randn(512, 512)
    return float((a @ a).sum())  # a parallel region: the calling thread gets an OpenMP pool


def test_returns_the_result_and_raises_the_error():
    assert asyncio.run(run_in_passing_thread(lambda x: x + 1, 41)) == 42
    with pytest.raises(ValueError, match="boom"):
        asyncio.run(run_in_passing_thread(_raise, "boom"))
    assert not [t for t in threading.enumerate() if t.name.startswith("radixkv-load")]


def _raise(message: str) -> None:
    raise ValueError(message)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task") or torch.get_num_threads() < 2,
                    reason="needs Linux /proc and 2+ torch threads")
def test_no_thread_outlives_the_call():
    """asyncio.to_thread would leave its thread and that thread's OpenMP workers behind."""
    _parallel_work()  # this thread's own pool, if it has none yet
    before = _num_os_threads()
    asyncio.run(run_in_passing_thread(_parallel_work))
    deadline = time.monotonic() + 5.0
    while _num_os_threads() > before and time.monotonic() < deadline:
        time.sleep(0.02)  # the pool's workers exit just after their thread
    assert _num_os_threads() <= before

    async def to_thread() -> float:  # the check can fail: the default executor's thread stays
        return await asyncio.to_thread(_parallel_work)

    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(to_thread())
        assert _num_os_threads() > before
    finally:
        loop.run_until_complete(loop.shutdown_default_executor())  # its thread and pool go now
        loop.close()
