"""The median wall time of a call, after one untimed call: what every start-up timing run here
(linear/tuning.py, attention/prompt_timing.py) compares kernels by."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Median of `repeats` timed calls of fn, after a first call that pays allocations, thread
    start-up and library kernel builds."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
