"""``p2pcoll bench --load N``: CPU-bound processes beside the benchmark, for the busy-host rows.

A training host is rarely quiet: compute threads, data loaders and other jobs share its cores
with the collectives. :func:`cpu_load` starts ``N`` processes that each keep one core busy
(a Python loop, no I/O) for the whole run, p2pcoll's peers and every compared library's, and
stops them afterwards by their process ids. Each checks now and then that its parent (the
benchmark) is still there and exits when it is not, so a benchmark killed outright leaves
none behind.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

STOP_WAIT = 5.0  # seconds a load process has to exit after SIGTERM before it is killed

# One core's worth of work; os.getppid() every 2^20 turns (tens of milliseconds): the
# benchmark's process (its pid the argument: it may be gone before this one starts) is its
# parent, and when that is gone the load goes too.
_PROGRAM = ("import os, sys\n"
            "parent, turns = int(sys.argv[1]), 0\n"
            "while True:\n"
            "    turns += 1\n"
            "    if not turns & 0xFFFFF and os.getppid() != parent:\n"
            "        break\n")


@contextmanager
def cpu_load(processes: int) -> Iterator[list[int]]:
    """Keep ``processes`` CPU-bound processes running for the body; yields their pids.

    Raises:
        OSError: a process could not be started (those already started are stopped).
    """
    started: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(processes):
            started.append(subprocess.Popen(
                [sys.executable, "-c", _PROGRAM, str(os.getpid())], stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        yield [p.pid for p in started]
    finally:
        for p in started:
            p.terminate()
        for p in started:
            try:
                p.wait(STOP_WAIT)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


__all__ = ["cpu_load"]
