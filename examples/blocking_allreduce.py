"""A plain synchronous script: no asyncio, mpi4py habits, p2pcoll underneath.

    p2pcoll launch -n 2 -- python examples/blocking_allreduce.py
    python examples/blocking_allreduce.py            # alone: a group of one

Each rank allreduces its rank number, starts a second allreduce with ``async_op=True``
(mpi4py's Iallreduce), computes meanwhile, waits for it, and rank 0 sends rank 1 a message.
Every result is checked; a wrong one exits with status 1.
"""

from __future__ import annotations

import sys

import numpy as np

import p2pcoll.blocking


def main() -> int:
    with p2pcoll.blocking.join() as g:
        p = g.world_size
        total = g.allreduce(np.array([g.rank], dtype=np.int64))         # MPI Allreduce
        ok = int(total[0]) == p * (p - 1) // 2

        handle = g.allreduce(np.ones(1024, dtype=np.float32), async_op=True)   # Iallreduce
        busy = sum(i * i for i in range(10_000))                       # overlap some work
        ok &= bool((handle.wait() == p).all()) and busy > 0

        if p > 1 and g.rank == 0:
            g.send(np.arange(3), dst=1, tag=7)                           # MPI Send
        elif p > 1 and g.rank == 1:
            ok &= np.array_equal(g.recv(src=0, tag=7), np.arange(3))     # MPI Recv

        verdicts = g.allgather(np.array([ok]))
        if g.rank == 0:
            print(f"blocking allreduce on {p} ranks: sum of ranks {int(total[0])}, "
                  f"{'all ok' if all(bool(v[0]) for v in verdicts) else 'MISMATCH'}")
        return 0 if all(bool(v[0]) for v in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
