"""What the flight recorder costs: a 4 KiB allreduce at p=2 on the shared-memory board,
with the record on (``P2PCOLL_FLIGHT_RECORD`` 2000, the default) and off (0).

    python benchmarks/flight_overhead.py                    # 10 alternating runs per mode
    python benchmarks/flight_overhead.py --runs 20 --iters 5000
    python benchmarks/flight_overhead.py --count            # bytecodes a call, on and off

Not a test: it prints a markdown table. Each run is two processes on this host (auto puts
4 KiB on the board) that allreduce ``--bytes`` of float32 ``--iters`` times after a
warm-up; rank 0 reports the median call time and the CPU time per call (its process's,
which a loaded host disturbs less than the wall clock). Modes alternate run by run (on,
off, off, on, ...), so drifts of the host's load hit both alike; the table shows the
median over runs of each mode, the ratio on/off, the load average before and after, and
the median of the ratios of the runs side by side (run i of each mode).

``--count`` is the measure a loaded host does not disturb: the Python bytecodes a call
executes (``sys.settrace`` opcode events, every frame of the process), on and off, in a
group of one in this process (the recorder's path is the same as on the board).
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

MODES = {"on": "2000", "off": "0"}


def worker(rank: int, url: str, nbytes: int, iters: int) -> None:
    import numpy as np

    import p2pcoll

    x = np.ones(nbytes // 4, dtype=np.float32)
    warmup = max(iters // 10, 100)
    times: list[float] = []

    async def run() -> float:
        async with p2pcoll.join(url, world_size=2, rank=rank, timeout=60) as g:
            for _ in range(warmup):
                await g.allreduce(x)
            cpu = time.process_time()
            for _ in range(iters):
                t0 = time.perf_counter()
                await g.allreduce(x)
                times.append(time.perf_counter() - t0)
            cpu = time.process_time() - cpu
            await g.barrier()
            return cpu

    cpu = asyncio.run(run())
    if rank == 0:
        print(json.dumps({"median_us": statistics.median(times) * 1e6,
                          "cpu_us": cpu / iters * 1e6}))


def bytecodes(record: str, iters: int) -> float:
    """Python bytecodes executed per 4 KiB allreduce in a group of one (``--count``)."""
    from types import FrameType
    from typing import Any

    import numpy as np

    from p2pcoll.testing import memory_groups

    count = 0

    def opcode(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal count
        if event == "opcode":
            count += 1
        return opcode

    def call(frame: FrameType, event: str, arg: Any) -> Any:
        frame.f_trace_opcodes = True
        return opcode

    async def go() -> None:
        [g] = await memory_groups(1, flight_record=int(record))
        x = np.ones(1024, np.float32)
        for _ in range(300):  # programs prepared, caches warm
            await g.allreduce(x)
        sys.settrace(call)
        for _ in range(iters):
            await g.allreduce(x)
        sys.settrace(None)
        await g.close()

    asyncio.run(go())
    return count / iters


def run(mode: str, nbytes: int, iters: int) -> dict[str, float]:
    from p2pcoll.testing import free_port

    url = f"tcp://127.0.0.1:{free_port()}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("P2PCOLL_")}
    env.update(P2PCOLL_FLIGHT_RECORD=MODES[mode], OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(r), url,
                               str(nbytes), str(iters)], env=env, stdout=subprocess.PIPE,
                              text=True) for r in range(2)]
    out = [p.communicate(timeout=600)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"a worker failed: {[p.returncode for p in procs]}")
    return dict(json.loads(out[0]))


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        rank, url, nbytes, iters = sys.argv[2:6]
        worker(int(rank), url, int(nbytes), int(iters))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10, help="runs per mode")
    parser.add_argument("--iters", type=int, default=5000, help="timed calls per run")
    parser.add_argument("--bytes", type=int, default=4096, help="bytes per rank")
    parser.add_argument("--count", action="store_true",
                        help="count the bytecodes a call executes, on and off, and stop")
    args = parser.parse_args()
    if args.count:
        counts = {m: bytecodes(MODES[m], 2000) for m in MODES}
        print(f"bytecodes per call: on {counts['on']:.1f}, off {counts['off']:.1f}, "
              f"the recorder {counts['on'] - counts['off']:.1f}")
        return
    load_before = os.getloadavg()[0]
    got: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    for i in range(args.runs):
        for mode in (("on", "off") if i % 2 == 0 else ("off", "on")):
            got[mode].append(run(mode, args.bytes, args.iters))
    load_after = os.getloadavg()[0]
    medians = {m: {k: statistics.median(r[k] for r in got[m]) for k in ("median_us", "cpu_us")}
               for m in MODES}
    print(f"| record | call time (us), median of {args.runs} run medians | CPU per call (us) |"
          f" runs: call time (us) |")
    print("|---|---|---|---|")
    for m in MODES:
        runs = ", ".join(f"{r['median_us']:.1f}" for r in got[m])
        print(f"| {m} | {medians[m]['median_us']:.1f} | {medians[m]['cpu_us']:.1f} | {runs} |")
    print(f"\non/off: call time {medians['on']['median_us'] / medians['off']['median_us']:.3f}, "
          f"CPU {medians['on']['cpu_us'] / medians['off']['cpu_us']:.3f}; load average "
          f"{load_before:.2f} before, {load_after:.2f} after ({os.cpu_count()} cores)")
    # Run i of each mode ran side by side: their ratio is what a change of the host's
    # state between runs (a loaded host makes a run 10x slower, or not) disturbs least.
    for k, what in (("median_us", "call time"), ("cpu_us", "CPU")):
        pairs = sorted(on[k] / off[k] for on, off in zip(got["on"], got["off"], strict=True))
        print(f"on/off run by run, {what}: median {statistics.median(pairs):.3f} "
              f"(quartiles {_quartiles(pairs)})")


def _quartiles(values: list[float]) -> str:
    if len(values) < 2:
        return "-"
    q1, _, q3 = statistics.quantiles(values, n=4)
    return f"{q1:.3f}-{q3:.3f}"


if __name__ == "__main__":
    main()
