"""What the flight recorder costs: a 4 KiB allreduce at p=2 on the shared-memory board,
with the record on (``P2PCOLL_FLIGHT_RECORD`` 2000, the default) and off (0).

    python benchmarks/flight_overhead.py                    # 10 alternating runs per mode
    python benchmarks/flight_overhead.py --runs 20 --iters 5000

Not a test: it prints a markdown table. Each run is one ``p2pcoll bench --sizes 4K`` (two
processes; auto puts 4 KiB on the board) whose figure is the median call time on rank 0.
Modes alternate run by run (on, off, off, on, ...), so drifts of the host's load hit both
alike; the table shows the median over runs of each mode, their ratio, and the load
average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

MODES = {"on": "2000", "off": "0"}


def run(mode: str, size: str, iters: int) -> float:
    env = dict(os.environ, P2PCOLL_FLIGHT_RECORD=MODES[mode])
    done = subprocess.run(
        [sys.executable, "-m", "p2pcoll", "bench", "--sizes", size, "--iters", str(iters),
         "--warmup", str(max(iters // 10, 50)), "--pipelined", "0", "--json", "-"],
        env=env, capture_output=True, text=True, timeout=600, check=True)
    rows = json.loads(done.stdout)["rows"]
    return float(rows[0]["time_us"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10, help="runs per mode")
    parser.add_argument("--iters", type=int, default=3000, help="timed calls per run")
    parser.add_argument("--size", default="4K", help="bytes per rank")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    times: dict[str, list[float]] = {m: [] for m in MODES}
    for i in range(args.runs):
        order = ("on", "off") if i % 2 == 0 else ("off", "on")
        for mode in order:
            times[mode].append(run(mode, args.size, args.iters))
    load_after = os.getloadavg()[0]
    on, off = (statistics.median(times[m]) for m in ("on", "off"))
    print(f"| record | median of {args.runs} run medians (us) | runs (us) |")
    print("|---|---|---|")
    for mode in MODES:
        runs = ", ".join(f"{t:.1f}" for t in times[mode])
        print(f"| {mode} | {statistics.median(times[mode]):.1f} | {runs} |")
    print(f"\non/off: {on / off:.3f}; load average {load_before:.2f} before, "
          f"{load_after:.2f} after ({os.cpu_count()} cores)")


if __name__ == "__main__":
    main()
