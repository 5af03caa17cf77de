"""Ray collective allreduce: p2pcoll's backend ("P2PCOLL") against Ray's GLOO, side by side.

    python benchmarks/ray_collective.py                  # 2 and 4 actors, 4 KiB .. 64 MiB
    python benchmarks/ray_collective.py --actors 2 --max-mib 4 --reps 5

A local Ray (``ray.init``), N actors per world size, each in a "P2PCOLL" group and a "GLOO"
group at once; for every size the same float32 array goes through
``ray.util.collective.allreduce`` on each backend in turn. A round is a barrier, then one
allreduce timed on every rank; the figure is the median over rounds of the slowest rank's
time (the collective is done when the last rank is). One warm-up round per size and
backend is not counted. Prints one markdown table: median milliseconds and effective
bandwidth (bytes / time) per backend, and P2PCOLL's speed-up over GLOO.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import numpy as np
import ray
import ray.util.collective as col

from p2pcoll.integrations import ray as p2pcoll_ray

BACKENDS = ("p2pcoll", "gloo")


@ray.remote(num_cpus=0)
class Bencher:
    def __init__(self) -> None:
        p2pcoll_ray.register()

    def init(self, world_size: int, rank: int) -> None:
        for backend in BACKENDS:
            col.init_collective_group(world_size, rank, backend=backend, group_name=backend)

    def rounds(self, backend: str, nbytes: int, reps: int) -> list[float]:
        """Seconds of each timed allreduce of ``nbytes`` on this rank (after one warm-up)."""
        x = np.ones(nbytes // 4, dtype=np.float32)
        times = []
        for i in range(reps + 1):
            col.barrier(group_name=backend)
            start = time.perf_counter()
            col.allreduce(x, group_name=backend)
            if i:
                times.append(time.perf_counter() - start)
        return times


def sizes(max_mib: int) -> list[int]:
    """4 KiB, then x4 up to ``max_mib`` MiB."""
    out, n = [], 4 << 10
    while n <= max_mib << 20:
        out.append(n)
        n *= 4
    if out[-1] != max_mib << 20:
        out.append(max_mib << 20)
    return out


def human(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def reps_for(nbytes: int, reps: int) -> int:
    """Fewer rounds for the big sizes: the CPU here is shared."""
    return max(3, reps // 4) if nbytes >= 16 << 20 else reps


def measure(world_size: int, all_sizes: list[int], reps: int) -> list[dict[str, Any]]:
    actors = [Bencher.remote() for _ in range(world_size)]  # type: ignore[attr-defined]
    ray.get([a.init.remote(world_size, r) for r, a in enumerate(actors)])
    rows = []
    for nbytes in all_sizes:
        row: dict[str, Any] = {"actors": world_size, "bytes": nbytes}
        for backend in BACKENDS:
            n = reps_for(nbytes, reps)
            per_rank = ray.get([a.rounds.remote(backend, nbytes, n) for a in actors])
            slowest = [max(ts) for ts in zip(*per_rank, strict=True)]
            row[backend] = statistics.median(slowest)
        rows.append(row)
        print(f"  {world_size} actors {human(nbytes)}: " + ", ".join(
            f"{b} {row[b] * 1e3:.2f} ms" for b in BACKENDS), file=sys.stderr, flush=True)
    for a in actors:
        ray.kill(a)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--actors", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--max-mib", type=int, default=64)
    parser.add_argument("--reps", type=int, default=11, help="timed rounds per size")
    args = parser.parse_args()
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # Ray on 127.0.0.1
    ray.init(num_cpus=max(args.actors), include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    p2pcoll_ray.register()
    rows = [r for n in args.actors for r in measure(n, sizes(args.max_mib), args.reps)]
    ray.shutdown()
    print(f"\nRay collective allreduce (float32), median of the slowest rank, "
          f"{os.cpu_count()} CPUs\n")
    print("| actors | size | P2PCOLL ms | GLOO ms | P2PCOLL GB/s | GLOO GB/s | speed-up |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        ours, gloo = r["p2pcoll"], r["gloo"]
        print(f"| {r['actors']} | {human(r['bytes'])} | {ours * 1e3:.2f} | {gloo * 1e3:.2f} | "
              f"{r['bytes'] / ours / 1e9:.2f} | {r['bytes'] / gloo / 1e9:.2f} | "
              f"{gloo / ours:.2f}x |")


if __name__ == "__main__":
    main()
