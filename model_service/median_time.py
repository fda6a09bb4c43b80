"""Wall times of calls, after one untimed call each: what the start-up timing runs here compare
kernels by (linear/tuning.py: the median over whole passes of the model's weights; attention/
prompt_timing.py: the best of interleaved calls of a millisecond or two)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence


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


def best_seconds(fns: Sequence[Callable[[], object]], repeats: int) -> list[float]:
    """The fastest of `repeats` timed calls of each of fns, the calls taken in turns (one of each,
    then again), after a first call of each. For calls of a few milliseconds on shared cores:
    another process taking a core for a while slows the calls it overlaps, and only those, so
    taking turns spreads it over the candidates and the minimum leaves it out."""
    for fn in fns:
        fn()
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return best
