"""Instructions per rank and call of a 4 KiB board allreduce, counted by callgrind.

    OMP_NUM_THREADS=1 valgrind --tool=callgrind --dump-before='os_getppid*' \\
        --callgrind-out-file=cg.out python benchmarks/board_instructions.py 2 1000
    grep ^summary cg.out.2    # the loop's instructions; divide by world size x calls

The ranks run in this process on the board (``p2pcoll.testing.run_ranks``); rank 0 calls
``os.getppid()`` just before and just after the timed loop, so with ``--dump-before``
callgrind writes the loop's count alone to ``cg.out.2`` (start-up, join and close go to the
other two files). Counts are reproducible within about 0.5% on a loaded host, where times
are not. Arguments: world size (2), calls (1000).
"""

from __future__ import annotations

import asyncio
import os
import sys

import numpy as np

import p2pcoll
from p2pcoll.testing import run_ranks


async def body(g: p2pcoll.Group, calls: int) -> None:
    x = np.ones(1024, np.float32)
    for _ in range(50):  # warm: programs, pages, the board's budgets
        await g.allreduce(x, out=x)
    await g.barrier()
    if g.rank == 0:
        os.getppid()  # the marker: callgrind dumps its counts here
    for _ in range(calls):
        await g.allreduce(x, out=x)
    if g.rank == 0:
        os.getppid()
    await g.barrier()


def main() -> None:
    size = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    calls = int(sys.argv[2]) if len(sys.argv) > 2 else 1000
    asyncio.run(run_ranks(size, lambda g: body(g, calls)))


if __name__ == "__main__":
    main()
