"""What the blocking API costs over the async one: a 4 KiB allreduce at p=2 on this host.

    python benchmarks/blocking_overhead.py                  # 3 alternating runs per mode
    python benchmarks/blocking_overhead.py --runs 5 --iters 5000 --bytes 4096

Not a test: it prints a markdown table. Each run is two processes on loopback (the default
transport, ipc between processes of one host) that allreduce ``--bytes`` of float32
``--iters`` times after a warm-up, timing every call on rank 0. The modes:

- ``async``: ``await g.allreduce(x)`` on the caller's own event loop (the baseline);
- ``blocking``: ``g.allreduce(x)`` from p2pcoll.blocking, the collective on the loop thread;
- ``async_op``: ``g.allreduce(x, async_op=True).wait()``, the same with a Handle.

Modes alternate run by run, so drifts of the host's load hit all alike. A run's figure is
the median call time on rank 0; the table shows the median over runs, and the overhead of
each blocking mode over ``async``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = ("async", "blocking", "async_op")


def worker(mode: str, rank: int, url: str, nbytes: int, iters: int) -> None:
    import numpy as np

    x = np.ones(nbytes // 4, dtype=np.float32)
    warmup = max(iters // 10, 50)
    times: list[float] = []
    if mode == "async":
        import p2pcoll

        async def run() -> None:
            async with p2pcoll.join(url, world_size=2, rank=rank, timeout=60) as g:
                for i in range(warmup + iters):
                    t0 = time.perf_counter()
                    await g.allreduce(x)
                    if i >= warmup:
                        times.append(time.perf_counter() - t0)
                await g.barrier()

        asyncio.run(run())
    else:
        import p2pcoll.blocking

        with p2pcoll.blocking.join(url, world_size=2, rank=rank, timeout=60) as g:
            for i in range(warmup + iters):
                t0 = time.perf_counter()
                if mode == "blocking":
                    g.allreduce(x)
                else:
                    g.allreduce(x, async_op=True).wait()
                if i >= warmup:
                    times.append(time.perf_counter() - t0)
            g.barrier()
    if rank == 0:
        print(json.dumps({"median_us": statistics.median(times) * 1e6}), flush=True)


def one_run(mode: str, nbytes: int, iters: int) -> float:
    from p2pcoll.testing import free_port

    url = f"tcp://127.0.0.1:{free_port()}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen(
        [sys.executable, __file__, "--worker", mode, str(r), url, str(nbytes), str(iters)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in range(2)]
    outs = []
    try:
        for rank, p in enumerate(procs):
            out, err = p.communicate(timeout=600)
            if err.strip():  # said with the mode and rank that said it
                print("".join(f"[{mode} rank {rank}] {line}\n" for line in err.splitlines()),
                      file=sys.stderr, end="")
            if p.returncode != 0:
                raise SystemExit(f"{mode} rank {rank} failed with status {p.returncode}")
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return float(json.loads(outs[0].strip().splitlines()[-1])["median_us"])


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        mode, rank, url, nbytes, iters = sys.argv[2:7]
        worker(mode, int(rank), url, int(nbytes), int(iters))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--iters", type=int, default=3000)
    parser.add_argument("--bytes", type=int, default=4096)
    args = parser.parse_args()
    figures: dict[str, list[float]] = {m: [] for m in MODES}
    for run in range(args.runs):
        order = MODES if run % 2 == 0 else MODES[::-1]
        for mode in order:
            figures[mode].append(one_run(mode, args.bytes, args.iters))
    base = statistics.median(figures["async"])
    print(f"allreduce of {args.bytes} B, p=2, {args.iters} calls per run, "
          f"median over {args.runs} runs of rank 0's median call time\n")
    print("| mode | median µs | runs (µs) | overhead vs async |")
    print("|---|---:|---|---:|")
    for mode in MODES:
        med = statistics.median(figures[mode])
        runs = ", ".join(f"{f:.1f}" for f in figures[mode])
        extra = "" if mode == "async" else f"+{med - base:.1f} µs ({med / base:.2f}x)"
        print(f"| {mode} | {med:.1f} | {runs} | {extra} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
