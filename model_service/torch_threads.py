"""Keeping torch's CPU work on threads whose OpenMP pools do not outlive them.

libgomp gives every thread that starts a parallel region a pool of its own, and counts the
workers of all pools. Once they outnumber the cores, every pool's workers stop spinning between
parallel regions and sleep at once ("throttled" waiting), so each of the thousands of small ops
of a decode step wakes its worker through the kernel. The model service loads the model on one
thread and runs steps on the engine thread: with the loading thread kept alive (asyncio's
default executor keeps its threads), its idle pool alone throttled the engine thread's workers
and slowed every decode step markedly. A pool is freed when its thread exits, so the model
is loaded on a thread that then ends.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


async def run_in_passing_thread(fn: Callable[..., T], *args: object, name: str = "radixkv-load") -> T:
    """`await asyncio.to_thread(fn, *args)`, on a thread that has exited when this returns."""
    loop = asyncio.get_running_loop()
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
    try:
        return await loop.run_in_executor(pool, fn, *args)
    finally:
        pool.shutdown(wait=True)
