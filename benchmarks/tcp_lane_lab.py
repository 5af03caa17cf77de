"""Small allreduces between hosts of their own, with TCP lanes and without.

    sudo python benchmarks/tcp_lane_lab.py [--hosts 2] [--sizes 4K,64K] [--iters 300] \
        [--rounds 3]

Each peer runs on a host of its own, a network namespace of a lab (``tests/netns.py``: a
bridge, veth cables, 198.18.0.R+1), started with ``ip netns exec`` and joined over tcp
without a job key, with ``P2PCOLL_HOST_ID`` of its own so that p2pcoll sees separate hosts.
The bench worker (``p2pcoll.bench.worker``, as ``p2pcoll bench`` runs it) times auto's
allreduce at each size; rounds alternate ``P2PCOLL_TCP_LANES=1`` and ``=0``, and the table
gives the median of the rounds' medians (time of the slowest rank per call, and CPU per
call of the peer that used most). Needs root and iproute2.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import netns  # noqa: E402  # tests/netns.py, importable once tests/ is on the path

from p2pcoll.bench.report import summarize  # noqa: E402

PORT = 29500
FOREIGN = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")
FOREIGN_PREFIXES = ("P2PCOLL_", "SLURM_", "OMPI_", "PMIX_", "TORCHELASTIC_")


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def run_peers(lab: netns.Lab, hosts: int, config: dict[str, Any], lanes: bool,
              out: Path) -> list[dict[str, Any]]:
    """The bench worker on every host of ``lab``; rank 0's rows."""
    argv = [sys.executable, "-m", "p2pcoll.bench.worker", "--out", str(out),
            "--config", json.dumps(config)]
    procs = []
    for r in range(hosts):
        env = {k: v for k, v in os.environ.items()
               if k not in FOREIGN and not k.startswith(FOREIGN_PREFIXES)}
        env.update(P2PCOLL_RENDEZVOUS=f"tcp://{netns.address(0)}:{PORT}",
                   WORLD_SIZE=str(hosts), RANK=str(r), P2PCOLL_TRANSPORT="tcp",
                   P2PCOLL_HOST_ID=f"lab-host-{r}", P2PCOLL_TCP_LANES=str(int(lanes)),
                   PYTHONPATH=str(ROOT))
        procs.append(subprocess.Popen(lab.command(r, argv), env=env, cwd=ROOT,
                                      stdin=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                      text=True))
    try:
        for r, proc in enumerate(procs):
            _, err = proc.communicate(timeout=600)
            if proc.returncode != 0:
                raise SystemExit(f"tcp_lane_lab: rank {r} exited with {proc.returncode}:\n"
                                 f"{err[-3000:]}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    with open(out, encoding="utf-8") as f:
        return list(json.load(f)["rows"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--sizes", default="4K,64K")
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    reason = netns.unavailable()
    if reason is not None:
        raise SystemExit(f"tcp_lane_lab: {reason}")
    sizes = [_size(s) for s in args.sizes.split(",")]
    config = {"collective": "allreduce", "strategies": ["auto"], "world_size": args.hosts,
              "sizes": sizes, "dtype": "float32", "iters": args.iters,
              "warmup": args.warmup, "pipelined": 0, "transport": "tcp", "secure": False,
              "compare": []}
    found: dict[tuple[bool, int], list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="p2pcoll-tcp-lane-lab-") as scratch, \
            netns.Lab(args.hosts) as lab:
        for round_ in range(args.rounds):
            for lanes in (True, False):
                load = open("/proc/loadavg", encoding="ascii").read().split()[0]
                started = time.monotonic()
                rows = run_peers(lab, args.hosts, config, lanes, Path(scratch) / "rows.json")
                times = []
                for row in (summarize(raw, config) for raw in rows):
                    found.setdefault((lanes, row["size"]), []).append(
                        (row["time_us"], row["cpu_us"]))
                    times.append(f"{row['size'] >> 10} KiB {row['time_us']:.0f} us")
                print(f"# round {round_ + 1}, lanes {'on' if lanes else 'off'}: load {load}, "
                      f"{time.monotonic() - started:.0f} s: {', '.join(times)}", flush=True)
    print("| p | size | TCP lanes: time (cpu) us | ZeroMQ links: time (cpu) us | ratio |")
    print("|---|---|---|---|---|")
    for nbytes in sizes:
        on, off = found[(True, nbytes)], found[(False, nbytes)]
        t_on = statistics.median(t for t, _ in on)
        t_off = statistics.median(t for t, _ in off)
        c_on = statistics.median(c for _, c in on)
        c_off = statistics.median(c for _, c in off)
        print(f"| {args.hosts} | {nbytes >> 10} KiB | {t_on:.1f} ({c_on:.0f}) | "
              f"{t_off:.1f} ({c_off:.0f}) | {t_on / t_off:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
