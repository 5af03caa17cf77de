"""Memory on the fast path: the allocator's thresholds.

Every received frame, and every snapshot sent, is a buffer that libzmq mallocs and frees.
With glibc's defaults a buffer above the mmap threshold (128 KiB at start, raised only
after large frees) is a fresh mapping: it page-faults on first touch and is unmapped
after use, which made a 64 MiB allreduce take 1.5-2x as long in a fresh process as in a
warmed one. :func:`tune_malloc` raises the mmap and trim thresholds once per process, so
those buffers come from a reused heap. ``P2PCOLL_TUNE_MALLOC=0`` (``Settings.tune_malloc``)
leaves the allocator alone.
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger("p2pcoll.transport")

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc's largest mmap threshold on 64-bit platforms; every pipeline segment fits below it.
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 64 << 20  # glibc pairs its dynamic mmap threshold with twice it

_tuned = False


def tune_malloc(enabled: bool = True) -> bool:
    """Raise glibc's mmap and trim thresholds for this process (once); True if done.

    Does nothing where the C library has no ``mallopt`` (not glibc) or when not ``enabled``.
    """
    global _tuned
    if _tuned:
        return True
    if not enabled:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1)
    ok = bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1) and ok
    if not ok:
        log.debug("mallopt refused the thresholds; the allocator is unchanged")
    _tuned = ok
    return ok
