"""One slow pair among fast links: the ring ordered by the measured topology, against the
ring in rank order and Gloo.

    python benchmarks/slow_pair.py                  # 4 hosts, 1gbit, 5 ms, pair 0-1 at 100mbit
    python benchmarks/slow_pair.py --iterations 9 --size 64M --reference

Four emulated hosts (network namespaces of ``tests/netns.py``'s lab on one switch): every
cable a token bucket of ``--rate`` each way with ``--delay`` one way (netem where the
kernel has it, else the lab's relay that holds each TCP stream's bytes that long), and the
pair of hosts 0 and 1 limited to ``--slow`` each way (``Lab.limit_pair``: an htb class for
the other's address on each one's eth0). Then, each in groups of its own, one peer per host
(``P2PCOLL_HOST_ID`` per host, tcp):

- p2pcoll as it joins: it probes the links (``g.topology()``, printed) and ``ring`` runs
  along the measured ring; ``auto`` too (what it picked is printed);
- p2pcoll with ``P2PCOLL_PROBE=0``: ``ring`` in rank order, across the slow pair;
- Gloo (``torch.distributed``, backend gloo), ``all_reduce``;
- with ``--reference``, in a second lab with no slow pair: ``ring`` (what a slow pair no
  longer costs).

Each case: a warm-up, then ``--iterations`` calls after a barrier; a call's time is the
slowest rank's, the table gives the median and the bus bandwidth 2(p-1)/p·n/t (nccl-tests'
busbw), and the ratio to Gloo's measured in the same run. Every result is checked against
the exact sum (the inputs are small integers in float32). Needs root.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import gloo_peer  # noqa: E402  # beside this file
import netns  # noqa: E402  # tests/netns.py, importable once tests/ is on the path
from peer_processes import peer_environment, run_to_end  # noqa: E402  # tests/, likewise

WORLD = 4
PORT = 29700


# --- the workers (one process per rank, in its host's namespace) ----------------------------

async def p2pcoll_worker(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np

    import p2pcoll
    from p2pcoll.registry import registry

    report: dict[str, Any] = {"times": {}, "picked": {}}
    t = time.perf_counter()
    async with p2pcoll.join() as g:
        report["join_s"] = time.perf_counter() - t
        report["topology"] = g.topology()
        n = args.size // 4
        x = np.full(n, 1.0 + g.rank, np.float32)
        want = float(sum(1 + r for r in range(g.world_size)))
        model = g.session.runner.costs()
        report["picked"] = registry.auto_name("allreduce", args.size, g.world_size, model)
        for case in args.cases.split(","):
            asked = None if case == "auto" else case
            times = []
            for i in range(args.iterations + 1):
                await g.barrier()
                t = time.perf_counter()
                await g.allreduce(x, out=x, strategy=asked)
                elapsed = time.perf_counter() - t
                if not np.all(x == want):
                    raise SystemExit(f"rank {g.rank}: {case} gave a wrong sum")
                x[:] = 1.0 + g.rank
                if i:
                    times.append(elapsed)
            report["times"][case] = times
        report["by_strategy"] = g.stats()["collectives_by_strategy"]
        await g.barrier()
    return report


def gloo_worker(args: argparse.Namespace) -> dict[str, Any]:
    times = gloo_peer.time_collectives(netns.address(0), args.port, [args.size],
                                       args.iterations)
    return {"times": {"gloo": times["allreduce", args.size]}}


# --- the driver -----------------------------------------------------------------------------

def environment(rank: int, port: int, extra: dict[str, str]) -> dict[str, str]:
    return peer_environment(
        f"tcp://{netns.address(0)}:{port}", WORLD, rank, P2PCOLL_HOST_ID=f"host-{rank}",
        P2PCOLL_TRANSPORT="tcp", OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="eth0",
        P2PCOLL_JOIN_TIMEOUT="300", P2PCOLL_TIMEOUT="600", **extra)


def run(lab: netns.Lab, args: argparse.Namespace, kind: str, port: int, cases: str,
        extra: dict[str, str]) -> list[dict[str, Any]]:
    """The ``kind`` workers (p2pcoll or gloo) on the lab's hosts; their reports by rank."""
    argv = [sys.executable, str(Path(__file__).resolve()), "--worker", kind, "--port",
            str(port), "--iterations", str(args.iterations), "--size", str(args.size),
            "--cases", cases]
    return run_to_end([lab.command(rank, argv) for rank in range(WORLD)],
                      [environment(rank, port, extra) for rank in range(WORLD)],
                      args.timeout, cwd=ROOT, name=kind)


def slowest(reports: list[dict[str, Any]], case: str) -> list[float]:
    """Each iteration's time: the slowest rank's."""
    return [max(column) for column in zip(*(r["times"][case] for r in reports), strict=True)]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--slow", default="100mbit", help="the pair 0-1's rate")
    parser.add_argument("--delay", default="5ms", help="one way, every link (none: no delay)")
    parser.add_argument("--size", type=lambda s: int(s[:-1]) << 20 if s[-1] in "Mm"
                        else int(s), default=16 << 20)
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--port", type=int, default=PORT)
    parser.add_argument("--reference", action="store_true",
                        help="also time the ring with no slow pair, in a lab of its own")
    parser.add_argument("--set", action="append", default=[], metavar="VAR=VALUE",
                        help="a variable for every p2pcoll peer (P2PCOLL_PIPELINE_DEPTH=8)")
    parser.add_argument("--cases", default="ring,auto", help=argparse.SUPPRESS)
    parser.add_argument("--worker", choices=("p2pcoll", "gloo"), help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        report = (gloo_worker(args) if args.worker == "gloo"
                  else asyncio.run(p2pcoll_worker(args)))
        print(json.dumps(report), flush=True)
        return 0
    reason = netns.unavailable()
    if reason is not None:
        print(f"slow_pair: {reason}", file=sys.stderr)
        return 2
    started = time.monotonic()
    times: dict[str, list[float]] = {}
    with netns.Lab(WORLD) as lab:
        delay = None if args.delay in ("", "0", "none") else args.delay
        how = lab.shape(args.rate, burst="512kbit", delay=delay, relay=True) or "none"
        lab.limit_pair(0, 1, args.slow, args.rate)
        extra = dict(v.split("=", 1) for v in args.set)
        measured = run(lab, args, "p2pcoll", args.port, "ring,auto,rabenseifner", extra)
        for case in ("ring", "auto", "rabenseifner"):
            times[f"p2pcoll {case}, measured ring"] = slowest(measured, case)
        plain = run(lab, args, "p2pcoll", args.port + 1, "ring",
                    {**extra, "P2PCOLL_PROBE": "0"})
        times["p2pcoll ring, rank order (P2PCOLL_PROBE=0)"] = slowest(plain, "ring")
        gloo = run(lab, args, "gloo", args.port + 2, "", {})
        times["gloo"] = slowest(gloo, "gloo")
    if args.reference:
        with netns.Lab(WORLD) as lab:  # the same, with no slow pair
            lab.shape(args.rate, burst="512kbit", delay=delay, relay=True)
            fast = run(lab, args, "p2pcoll", args.port + 3, "ring",
                       {**extra, "P2PCOLL_PROBE": "0"})
            times["p2pcoll ring, no slow pair (reference)"] = slowest(fast, "ring")
    top = measured[0]["topology"]
    p, n = WORLD, args.size
    gloo_t = statistics.median(times["gloo"])
    lines = [
        f"# slow_pair: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} CPUs",
        f"allreduce of {n >> 20} MiB float32, p = {p} hosts, every link {args.rate} and "
        f"{args.delay} one way (delay by {how}), the pair 0-1 at {args.slow}"
        f"{'; peers with ' + ' '.join(args.set) if args.set else ''}; median of "
        f"{args.iterations} after a warm-up, slowest rank",
        "",
        "| case | median ms | busbw Gbit/s | x Gloo |",
        "|---|---|---|---|",
    ]
    for case, ts in times.items():
        t = statistics.median(ts)
        busbw = 2 * (p - 1) / p * n / t * 8 / 1e9
        lines.append(f"| {case} | {t * 1e3:.0f} | {busbw:.2f} | {gloo_t / t:.2f}x |")
    lines += [
        "",
        f"measured ring {top['ring']}; auto picked {measured[0]['picked']}; join with the "
        f"probe {statistics.median(r['join_s'] for r in measured):.2f} s, without "
        f"{statistics.median(r['join_s'] for r in plain):.2f} s",
        "bandwidth Mbit/s (row: from): " + "; ".join(
            " ".join("-" if b is None or i == j else f"{b * 8 / 1e6:.0f}"
                     for j, b in enumerate(row))
            for i, row in enumerate(top["bandwidth_Bps"])),
        f"strategies run: {measured[0]['by_strategy']}",
        f"({time.monotonic() - started:.0f} s in all; load average "
        f"{os.getloadavg()[0]:.1f})",
    ]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
