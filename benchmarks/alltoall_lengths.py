"""An all-to-all whose lengths change every call (a Mixture-of-Experts layer's routing)
against one whose lengths stay, on one host (the board).

    python benchmarks/alltoall_lengths.py                 # p = 4, 1000 calls, 3 runs
    python benchmarks/alltoall_lengths.py -n 8 --calls 2000 --runs 5 --rows 2000

Not a test: it prints a markdown table. Each run starts ``-n`` processes with
``p2pcoll launch`` that call ``g.alltoall`` ``--calls`` times with float32 rows of 64
elements: "fixed" sends the same lengths every call, "changing" new random ones (0 to
``--rows`` rows a part, the same table on every rank from a shared seed). Modes alternate
run by run, so drifts of the host's load hit both alike. Rank 0 reports the median call
time, the CPU time per call of its process, and how many prepared programs its session
holds at the end (:attr:`p2pcoll.session.calls.Runner.programs`, at most 256). To compare
with another checkout, run the script with ``PYTHONPATH`` pointing at it.

``--inproc`` runs the ranks as tasks of one process instead (``p2pcoll.testing.run_ranks``
over ipc: the board all the same) and reports the process's CPU time per call and rank:
the work a call does, with no other process's scheduling in it, which on a loaded host
moves far less than the time a call takes between processes.
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


def worker(calls: int, rows: int, mode: str, inproc: int = 0) -> dict[str, float]:
    import numpy as np

    import p2pcoll
    from p2pcoll.testing import run_ranks

    result: dict[str, float] = {}

    async def body(g: p2pcoll.Group) -> None:
        p, r = g.world_size, g.rank
        rng = np.random.default_rng(2026)  # the same tables on every rank
        table = rng.integers(0, rows + 1, (p, p))
        data = np.arange((rows + 1) * 64, dtype=np.float32)
        times: list[float] = []
        await g.barrier()
        cpu = time.process_time()
        for _ in range(calls):
            if mode == "changing":
                table = rng.integers(0, rows + 1, (p, p))
            parts = [data[:table[r, j] * 64].reshape(-1, 64) for j in range(p)]
            t0 = time.perf_counter()
            await g.alltoall(parts)
            times.append(time.perf_counter() - t0)
        cpu = time.process_time() - cpu
        await g.barrier()
        if r == 0:
            result.update(median_us=statistics.median(times) * 1e6,
                          cpu_us=cpu / calls * 1e6 / (inproc or 1),
                          programs=len(g.session.runner.programs))

    async def alone() -> None:
        async with p2pcoll.join() as g:
            await body(g)

    if inproc:
        asyncio.run(run_ranks(inproc, body, transport="ipc"))
    else:
        asyncio.run(alone())
        print(json.dumps(result), flush=True)
    return result


def one_run(n: int, calls: int, rows: int, mode: str, inproc: bool) -> dict[str, float]:
    if inproc:
        return worker(calls, rows, mode, n)
    command = [sys.executable, "-m", "p2pcoll", "launch", "-n", str(n), "--insecure", "--",
               sys.executable, __file__, "--worker", mode, "--calls", str(calls),
               "--rows", str(rows)]
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    line = next(s for s in out.splitlines() if '"median_us"' in s)
    return json.loads(line[line.index("{"):])  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=4, help="processes (default: 4)")
    parser.add_argument("--calls", type=int, default=1000, help="calls per run (default: 1000)")
    parser.add_argument("--rows", type=int, default=300,
                        help="most rows of 64 float32 a part (default: 300)")
    parser.add_argument("--runs", type=int, default=3, help="runs per mode (default: 3)")
    parser.add_argument("--inproc", action="store_true",
                        help="ranks as tasks of this process: CPU time per call and rank")
    parser.add_argument("--worker", choices=["fixed", "changing"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.calls, args.rows, args.worker)
        return
    load = os.getloadavg()[0]
    results: dict[str, list[dict[str, float]]] = {"fixed": [], "changing": []}
    for i in range(args.runs):
        for mode in (("fixed", "changing") if i % 2 == 0 else ("changing", "fixed")):
            results[mode].append(one_run(args.n, args.calls, args.rows, mode, args.inproc))
    where = "ranks as tasks of one process" if args.inproc else "processes"
    print(f"p = {args.n} {where}, {args.calls} calls a run, {args.runs} runs a mode, load "
          f"{load:.1f} -> {os.getloadavg()[0]:.1f}; medians over runs\n")
    print("| lengths | time a call (us) | CPU a call (us) | programs kept |")
    print("|---|---|---|---|")
    for mode, rows in results.items():
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        print(f"| {mode} | {med['median_us']:.0f} | {med['cpu_us']:.0f} | "
              f"{med['programs']:.0f} |")


if __name__ == "__main__":
    main()
