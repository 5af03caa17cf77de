"""Instructions per rank and call of a 4 KiB allreduce over TCP lanes, counted by callgrind.

    OMP_NUM_THREADS=1 P2PCOLL_SHM=0 valgrind --tool=callgrind --dump-before='os_getppid*' \\
        --callgrind-out-file=cg.out python benchmarks/lane_instructions.py 2 300
    grep ^summary cg.out.2    # the loop's instructions; divide by world size x calls

As ``board_instructions.py``, but the ranks count as on different hosts (``host_ids``), so
the messages go over tcp and its lanes (the cross-host path) rather than the board. The
group is insecure (no job key), as ``p2pcoll bench --insecure``. Rank 0 calls
``os.getppid()`` just before and after the counted loop: with ``--dump-before`` callgrind
writes the loop's count alone to ``cg.out.2``. Arguments: world size (2), calls (300), and
a strategy (default: auto's pick, which at p = 4 may differ between runs: name one there).
"""

from __future__ import annotations

import asyncio
import os
import sys

import numpy as np

import p2pcoll
from p2pcoll.testing import run_ranks


async def body(g: p2pcoll.Group, calls: int, strategy: str | None) -> None:
    x = np.ones(1024, np.float32)
    for _ in range(50):  # warm: programs, lanes, buffers
        await g.allreduce(x, out=x, strategy=strategy)
    await g.barrier()
    if g.rank == 0:
        os.getppid()  # the marker: callgrind dumps its counts here
    for _ in range(calls):
        await g.allreduce(x, out=x, strategy=strategy)
    if g.rank == 0:
        os.getppid()
    await g.barrier()


def main() -> None:
    size = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    calls = int(sys.argv[2]) if len(sys.argv) > 2 else 300
    strategy = sys.argv[3] if len(sys.argv) > 3 else None
    hosts = [f"host{r}" for r in range(size)]
    asyncio.run(run_ranks(size, lambda g: body(g, calls, strategy), host_ids=hosts,
                          transport="tcp"))


if __name__ == "__main__":
    main()
