"""What a fast sender leaves in a slow receiver: the eager window (p2pcoll.engine.credit).

Two peers over tcp in this process; rank 0 sends ``--count`` messages of ``--size`` bytes
to rank 1, which first sleeps ``--sleep`` seconds (its receives not posted) and then
receives them all. Prints the process's peak RSS growth (both peers; the receiver's backlog
dominates it), the receiver's ``eager_held_peak`` (absent before the window existed) and
the seconds the whole took. Run it with PYTHONPATH at each side to compare:

    P2PCOLL_SHM=0 PYTHONPATH=. python benchmarks/eager_window.py --count 400 --size 1M
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import time

import numpy as np

import p2pcoll
from p2pcoll.settings_env import parse_bytes
from p2pcoll.testing import run_ranks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=400)
    parser.add_argument("--size", default="1M")
    parser.add_argument("--sleep", type=float, default=2.0)
    args = parser.parse_args()
    size = parse_bytes(args.size)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    async def fn(g: p2pcoll.Group) -> dict[str, object]:
        item = np.ones(size // 4, np.float32)
        if g.rank == 0:
            for _ in range(args.count):
                await g.send(item, 1)
        else:
            await asyncio.sleep(args.sleep)
            out = np.empty_like(item)
            for _ in range(args.count):
                await g.recv(0, out=out)
        await g.barrier()
        return dict(g.stats())

    started = time.perf_counter()
    _, receiver = asyncio.run(run_ranks(2, fn, transport="tcp"))
    took = time.perf_counter() - started
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    held = receiver.get("eager_held_peak")
    print(f"{p2pcoll.__file__}: {args.count} x {args.size}: peak RSS +{grown:.0f} MiB, "
          f"receiver held at most {'-' if held is None else f'{held / 2**20:.1f} MiB'}, "
          f"{took:.2f} s")


if __name__ == "__main__":
    main()
