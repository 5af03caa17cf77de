"""Memory on the fast path: reusable snapshot buffers and the allocator's thresholds.

Two costs dominate large collectives once the sockets are busy, and neither is the copy
itself: fresh 1 MiB buffers are fresh ``mmap`` regions that page-fault on first touch, and
the ``munmap`` of each one after use. Both come from glibc's default of serving requests
above its mmap threshold (128 KiB at start) with their own mapping.

- :class:`SnapshotPool` gives a send that must not read the caller's array after ``send``
  returns (the executor's snapshots, every send over inproc) a pooled buffer to copy into;
  the buffer goes out zero-copy and returns to the pool once libzmq has let go of it.
- :func:`tune_malloc` raises glibc's mmap and trim thresholds once per process, so the
  buffers libzmq allocates for every received frame come from the reused heap instead.
  ``P2PCOLL_TUNE_MALLOC=0`` leaves the allocator alone.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections import deque

import numpy as np
import zmq

log = logging.getLogger("p2pcoll.transport")

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc's largest mmap threshold on 64-bit platforms; every pipeline segment fits below it.
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 256 << 20

_tuned = False


def tune_malloc() -> bool:
    """Raise glibc's mmap and trim thresholds for this process (once); True if done.

    Does nothing where the C library has no ``mallopt`` (not glibc) or when
    ``P2PCOLL_TUNE_MALLOC=0``.
    """
    global _tuned
    if _tuned:
        return True
    if os.environ.get("P2PCOLL_TUNE_MALLOC", "1") == "0":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    ok = mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and ok
    if not ok:
        log.debug("mallopt refused the thresholds; the allocator is unchanged")
    _tuned = ok
    return ok


class SnapshotPool:
    """Buffers to copy send payloads into, reused once libzmq has let go of them.

    Buffers come in power-of-two size classes; each class is a FIFO of (buffer, tracker)
    in send order, so its oldest entry is the one most likely released. Taking a snapshot
    looks at that entry only: reuse it if released, else allocate another buffer. At most
    ``max_bytes`` are kept; beyond that a snapshot gets a buffer of its own that is dropped
    after the send.
    """

    def __init__(self, max_bytes: int = 256 << 20) -> None:
        self.max_bytes = max_bytes
        self.kept_bytes = 0
        self._classes: dict[int, deque[tuple[np.ndarray, zmq.MessageTracker]]] = {}

    def snapshot(self, piece: np.ndarray) -> zmq.Frame:
        """A zero-copy frame holding a copy of ``piece`` (any contiguous-able array)."""
        n = piece.nbytes
        size = 1 << max(n - 1, 0).bit_length()
        queue = self._classes.setdefault(size, deque())
        if queue and queue[0][1].done:
            buf, _ = queue.popleft()
        else:
            buf = np.empty(size, np.uint8)
            if self.kept_bytes + size > self.max_bytes:
                np.copyto(buf[:n].view(piece.dtype).reshape(piece.shape), piece)
                return zmq.Frame(buf[:n], copy=False)
            self.kept_bytes += size
        np.copyto(buf[:n].view(piece.dtype).reshape(piece.shape), piece)
        frame = zmq.Frame(buf[:n], copy=False, track=True)
        queue.append((buf, frame.tracker))
        return frame

    def clear(self) -> None:
        """Forget every buffer (those still in flight stay alive until libzmq frees them)."""
        self._classes.clear()
        self.kept_bytes = 0
