"""Keep freed activation memory inside the process (glibc malloc), so steps do not page-fault.

Every step allocates and frees activation tensors of a few hundred KB to tens of MB (shapes
change with the batch, so they are new allocations). glibc serves blocks above its mmap
threshold with a fresh mmap and trims the heap top back to the OS, so the next step faults the
same memory in again: hundreds of minor page faults per decode step.
Raising the mmap threshold to its maximum and keeping up to `trim_bytes` of free heap makes
steady-state steps fault-free (the same reason CPU serving stacks preload jemalloc/tcmalloc).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

# mallopt parameters from glibc's malloc.h.
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
_MAX_MMAP_THRESHOLD = 32 << 20  # glibc's ceiling on 64-bit (HEAP_MAX_SIZE / 2)


def keep_freed_memory(trim_bytes: int = 512 << 20, top_pad_bytes: int = 64 << 20) -> bool:
    """Tunes glibc malloc for a long-running server; returns False where it does not apply."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = libc.mallopt if libc is not None else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:  # not glibc (musl, macOS): nothing to tune
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = all(mallopt(param, value) == 1 for param, value in (
        (_M_MMAP_THRESHOLD, _MAX_MMAP_THRESHOLD),
        (_M_TRIM_THRESHOLD, trim_bytes),
        (_M_TOP_PAD, top_pad_bytes),
    ))
    if not ok:
        log.warning("mallopt refused a setting; per-step page faults may remain")
    return ok
