"""Keep the cycle collector's pauses off the Step path.

A full collection walks every tracked object: with hundreds of thousands of tree nodes, page
hashes and request states that is 40-200 ms, and CPython starts one by itself every few seconds
under Step traffic, in the middle of some Step. So the server turns the automatic full passes
off and moves what survives to the permanent generation (gc.freeze, which costs nothing), every
FREEZE_INTERVAL_S right after collecting the young generations (so no young garbage cycle is
frozen). A collection's pause grows with the objects it walks, and frozen ones are not walked:
freezing 40 times a second keeps the young generations to what was made in the last 25 ms, and
each pause under ~1 ms at 2,400 Steps/s, where freezing once a second paused 10-15 ms (a whole
second of survivors). Under fleet traffic (Steps, Routes, registrations) the young collections
find no garbage and a full pass after it finds none either: everything is freed by reference
counting. Frozen objects are still freed that way when their last reference goes (a tree node
leaves its tree by unlinking from its parent); only a reference cycle that became garbage after
it was frozen would stay, so a full collection of everything still runs, rarely (every
`full_every_s`; the debug log says what it found).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time

log = logging.getLogger(__name__)

FREEZE_INTERVAL_S = 0.025
FULL_COLLECTION_INTERVAL_S = 600.0
_NO_AUTOMATIC_FULL = 1 << 30  # gen-1 collections between automatic full ones: never, in practice


def freeze_survivors() -> None:
    """Collect the young generations, then freeze every object alive."""
    gc.collect(1)
    gc.freeze()


def full_collection() -> int:
    """Collect everything, frozen objects included, and freeze the survivors again; returns the
    unreachable objects it found."""
    start = time.perf_counter()
    gc.unfreeze()
    found = gc.collect()
    gc.freeze()
    log.debug("full collection: %d unreachable objects, %.0f ms", found, 1e3 * (time.perf_counter() - start))
    return found


def no_automatic_full_collections() -> None:
    """Keep the young generations' thresholds; full collections only when asked for."""
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, _NO_AUTOMATIC_FULL)


async def keep_full_collections_rare(interval_s: float = FREEZE_INTERVAL_S,
                                     full_every_s: float = FULL_COLLECTION_INTERVAL_S) -> None:
    """Background task of the server: see the module docstring. Starts with a full collection
    (the start-up heap: modules, the gRPC stack, pools restored from --state-dir)."""
    no_automatic_full_collections()
    full_collection()
    loop = asyncio.get_running_loop()
    next_full = loop.time() + full_every_s
    while True:
        await asyncio.sleep(interval_s)
        if loop.time() >= next_full:
            full_collection()
            next_full = loop.time() + full_every_s
        else:
            freeze_survivors()
