"""Keep glibc from handing sample-sized buffers back to the kernel after every batch.

With glibc's defaults, a batch of ~100 KB samples held at once and then freed is trimmed
from the heap (or unmapped), and the next batch page-faults all of that memory back in: on
this project's test machine that made batched reads 4-5x slower than the same reads one at
a time (docs/decisions/0003-malloc-thresholds.md). Raising the mmap and trim thresholds once
per process keeps the memory for reuse. ``STAGEFS_MALLOC_TUNE=0`` turns this off.
"""

from __future__ import annotations

import ctypes
import ctypes.util

from stagefs.config import env_flag

__all__ = ["trim_malloc", "tune_malloc"]

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 2**20  # glibc's own ceiling for its dynamic threshold
TRIM_THRESHOLD = 128 * 2**20

_done = False


def tune_malloc() -> bool:
    """Apply the thresholds once; return whether they are in force."""
    global _done
    if _done:
        return True
    _done = True
    if not env_flag("MALLOC_TUNE"):
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc: nothing to tune
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )


def trim_malloc() -> bool:
    """Hand the heap's free pages back to the kernel now (glibc's ``malloc_trim``); the
    thresholds above keep them otherwise. For a process that held much for a while and
    will not again soon (a daemon whose stalled readers' replies were dropped). Whether
    any memory was released."""
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return False
    return bool(trim(0))
