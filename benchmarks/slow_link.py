"""How each allreduce strategy behaves on a slow link: 4 hosts on a switch of slow cables.

    python benchmarks/slow_link.py                           # 100mbit, 4K..16M, 5 iterations
    python benchmarks/slow_link.py --rate 1gbit --sizes 64K,1M,16M
    python benchmarks/slow_link.py --delay 5ms               # needs the kernel's netem

Not a test: it prints markdown tables. Needs root and ``ip``/``tc`` (iproute2). The four
peers run on hosts of their own, network namespaces joined by a bridge (``tests/netns.py``,
which makes and removes them; nothing changes in this machine's own network), and every
cable is a token bucket of ``--rate`` in each direction (``tc ... tbf`` on the host's end
and on the switch's), so a host sends at most ``--rate`` and receives at most ``--rate`` in
all. ``--delay`` adds a one-way delay to what each host sends (``netem``).

Each peer is the worker of ``p2pcoll bench`` (``python -m p2pcoll.bench.worker``), started
with ``ip netns exec`` on its host and joined over tcp at rank 0's address with a fresh job
key (``--insecure``: plain sockets), so the times are measured as the bench measures them:
after a barrier, the slowest rank of each iteration, the median over ``--iters``, the last
result checked against the exact sum. Each strategy runs in a group of its own, so that the
cables' counters (bytes, and packets the buckets dropped) before and after are its own: the
last table sets the bytes through the busiest cable against the model's.

Next to each time is the textbook alpha-beta cost of the strategy (ANCHORS.md, section 3)
for p = 4 (a power of two, so no folding):

    ring                2(p-1)·α + 2(p-1)/p·n·β
    recursive_doubling   lg p·α  +   lg p·n·β
    reduce_broadcast       2·α  +  2(p-1)·n·β     (rank 0 receives, then sends, (p-1)·n)
    rabenseifner       2 lg p·α  + 2(p-1)/p·n·β

with β the time per byte of the cable (``--rate``, of which TCP/IP over Ethernet carries
1448 payload bytes in each 1514-byte frame) and α fitted to the smallest size's times (least
squares over the strategies, once the β term is taken off). γ, the cost of adding, is left
out: numpy adds at about 15 GB/s here, a thousand times the cable. ``--set VAR=VALUE``
gives every peer a variable (``P2PCOLL_PIPELINE_DEPTH=16``, ...), to try settings on the link.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import netns  # noqa: E402  # tests/netns.py, importable once tests/ is on the path

WORLD = 4
PORT = 29500
STRATEGIES = ("ring", "recursive_doubling", "reduce_broadcast", "rabenseifner")
PAYLOAD_PER_FRAME = 1448 / 1514  # TCP payload per byte of an Ethernet frame (MTU 1500, tc)
FOREIGN = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")
FOREIGN_PREFIXES = ("P2PCOLL_", "SLURM_", "OMPI_", "PMIX_", "TORCHELASTIC_")

_RATE = re.compile(r"(\d+(?:\.\d+)?)([kmgt]?)(bit|bps)", re.IGNORECASE)
_SI = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def bits_per_second(rate: str) -> float:
    """A ``tc`` rate (``100mbit``; ``12mbps`` is bytes per second, as in tc) in bit/s."""
    match = _RATE.fullmatch(rate.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"{rate!r}: expected a tc rate such as 100mbit")
    value = float(match.group(1)) * _SI[match.group(2).lower()]
    return value * (8 if match.group(3).lower() == "bps" else 1)


def cost_terms(strategy: str, p: int) -> tuple[float, float]:
    """(messages on the critical path, bytes on the busiest cable per byte of input): the
    α and β coefficients of the strategy's textbook cost for ``p`` ranks, a power of two."""
    lg = math.log2(p)
    return {
        "ring": (2 * (p - 1), 2 * (p - 1) / p),
        "recursive_doubling": (lg, lg),
        "reduce_broadcast": (2, 2 * (p - 1)),
        "rabenseifner": (2 * lg, 2 * (p - 1) / p),
    }[strategy]


def cable_bytes(strategy: str, p: int) -> float:
    """Bytes through the busiest cable, in its busier direction, per byte of input. Equal to
    the β coefficient where every rank sends and receives at once; reduce_broadcast's rank 0
    receives (p-1)·n and then sends as much, so its cable carries half its β coefficient
    each way (and the two halves may overlap, where the data goes in segments)."""
    return (p - 1) if strategy == "reduce_broadcast" else cost_terms(strategy, p)[1]


def _environment(rank: int, key: Path | None, extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in FOREIGN and not k.startswith(FOREIGN_PREFIXES)}
    env.update(extra)
    env.update(P2PCOLL_RENDEZVOUS=f"tcp://{netns.address(0)}:{PORT}", WORLD_SIZE=str(WORLD),
               RANK=str(rank), P2PCOLL_TRANSPORT="tcp")
    if key is not None:
        env["P2PCOLL_KEY_FILE"] = str(key)
    return env


def run_peers(lab: netns.Lab, config: dict[str, Any], key: Path | None, out: Path,
              timeout: float, extra: dict[str, str]) -> list[dict[str, Any]]:
    """The bench worker on every host of ``lab``; returns rank 0's raw rows."""
    argv = [sys.executable, "-m", "p2pcoll.bench.worker", "--out", str(out),
            "--config", json.dumps(config)]
    procs = [subprocess.Popen(lab.command(r, argv), env=_environment(r, key, extra), cwd=ROOT,
                              stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for r in range(WORLD)]
    deadline = time.monotonic() + timeout
    try:
        for r, proc in enumerate(procs):
            try:
                _, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise SystemExit(f"slow_link: rank {r} still running after {timeout:g}s") \
                    from None
            if proc.returncode != 0:
                raise SystemExit(f"slow_link: rank {r} exited with {proc.returncode}:\n"
                                 f"{err[-3000:]}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    with open(out, encoding="utf-8") as f:
        return list(json.load(f)["rows"])


def _size(nbytes: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.0f}" if ms >= 100 else f"{ms:.1f}" if ms >= 10 else f"{ms:.2f}"


@dataclass
class Traffic:
    """What the cables saw while one strategy ran (every size, warm-ups and barriers too)."""

    busiest: int = 0  # bytes through the busiest cable in its busier direction (frames)
    drops: int = 0  # packets the token buckets dropped


def measure_traffic(lab: netns.Lab, run: Callable[[], list[dict[str, Any]]]
                    ) -> tuple[list[dict[str, Any]], Traffic]:
    """``run()``'s rows, and what the cables of ``lab`` carried meanwhile."""
    before = [lab.counters(r) for r in range(lab.hosts)]
    drops = lab.drops()
    rows = run()
    moved = [max(sent - b[0], received - b[1])
             for (sent, received), b in zip((lab.counters(r) for r in range(lab.hosts)),
                                            before, strict=True)]
    return rows, Traffic(max(moved), lab.drops() - drops)


def report(rows: list[dict[str, Any]], strategies: list[str], rate: float,
           args: argparse.Namespace, traffic: dict[str, Traffic]) -> str:
    """The markdown tables: measured times against the alpha-beta model, bus bandwidth, and
    the bytes on the busiest cable against the model's."""
    beta = 8 / (rate * PAYLOAD_PER_FRAME)  # seconds per payload byte on one cable
    median = {(r["strategy"], r["size"]): statistics.median(r["times"]) for r in rows}
    sizes = sorted({r["size"] for r in rows})
    smallest = sizes[0]
    # α by least squares over the strategies at the smallest size, the β term taken off.
    terms = {s: cost_terms(s, WORLD) for s in strategies}
    num = sum(terms[s][0] * (median[s, smallest] - terms[s][1] * smallest * beta)
              for s in strategies)
    alpha = max(0.0, num / sum(terms[s][0] ** 2 for s in strategies))

    def model(s: str, n: int) -> float:
        return terms[s][0] * alpha + terms[s][1] * n * beta

    head = "| size | " + " | ".join(strategies) + " |"
    rule = "|---|" + "---|" * len(strategies)
    shaping = f"tbf rate {args.rate} burst {args.burst} latency {args.latency}"
    if args.delay:
        shaping += f", netem delay {args.delay}"
    if args.set:
        shaping += f"; peers with {' '.join(args.set)}"
    lines = [
        (f"allreduce, p = {WORLD} hosts (network namespaces) on a switch, every cable "
         f"{shaping} each way; tcp, {'plain sockets' if args.insecure else 'job key (CurveZMQ)'}; "
         f"float32; median of {args.iters} iterations after {args.warmup} warm-up, slowest rank"),
        "",
        ("Time in ms, measured (alpha-beta model): "
         f"β = {beta * 1e9:.1f} ns/B ({args.rate} at {PAYLOAD_PER_FRAME:.3f} payload), "
         f"α = {alpha * 1e3:.2f} ms (fitted at {_size(smallest)})"),
        "",
        head, rule,
    ]
    for n in sizes:
        cells = [f"{_ms(median[s, n])} ({_ms(model(s, n))})" for s in strategies]
        lines.append(f"| {_size(n)} | " + " | ".join(cells) + " |")
    factor = 2 * (WORLD - 1) / WORLD
    lines += ["", (f"Bus bandwidth, MB/s (nccl-tests: size / time x {factor:g}); the cable "
                   f"carries {rate * PAYLOAD_PER_FRAME / 8e6:.2f} MB/s of payload each way"), "",
              head, rule]
    for n in sizes:
        cells = [f"{n * factor / median[s, n] / 1e6:.2f}" for s in strategies]
        lines.append(f"| {_size(n)} | " + " | ".join(cells) + " |")
    # Every size ran warmup + iters times; the counters count whole frames (and the ACKs).
    offered = sum(sizes) * (args.warmup + args.iters)
    largest = sizes[-1]
    lines += ["", ("Bytes through the busiest cable (one direction), per byte of input: by "
                   "the model, and as counted on the cables (Ethernet frames, "
                   f"ACKs and barriers included; {1 / PAYLOAD_PER_FRAME:.3f}x for framing "
                   f"alone); how busy that cable was at {_size(largest)}; packets dropped"),
              "", "| strategy | model | counted | busy | drops |", "|---|---|---|---|---|"]
    for s in strategies:
        counted = traffic[s].busiest / offered
        busy = counted * largest * 8 / rate / median[s, largest]
        lines.append(f"| {s} | {cable_bytes(s, WORLD):.3g} | {counted:.3f} | {busy:.0%} "
                     f"| {traffic[s].drops} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from p2pcoll.bench.options import parse_sizes

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", default="100mbit", help="each cable's rate, each way (tc)")
    parser.add_argument("--burst", default="32kbit", help="the token bucket's size (tc)")
    parser.add_argument("--latency", default="50ms",
                        help="the longest a packet may wait in the bucket's queue (tc)")
    parser.add_argument("--delay", default=None, help="one-way delay per cable, e.g. 5ms")
    parser.add_argument("--sizes", type=parse_sizes, default=parse_sizes("4K,64K,1M,16M"),
                        help="bytes per rank, comma-separated (4K,64K,1M,16M)")
    parser.add_argument("--strategies", default=",".join(STRATEGIES),
                        help="allreduce strategies, comma-separated (the four built-ins)")
    parser.add_argument("--iters", type=int, default=5, help="timed iterations per row (5)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed ones first (1)")
    parser.add_argument("--insecure", action="store_true", help="no job key: plain sockets")
    parser.add_argument("--set", action="append", default=[], metavar="VAR=VALUE",
                        help="a variable for every peer, e.g. P2PCOLL_PIPELINE_DEPTH=8 "
                             "(repeatable; the peers see no other P2PCOLL_ variable)")
    parser.add_argument("--timeout", type=float, default=3600.0,
                        help="seconds the whole run may take (3600)")
    args = parser.parse_args(argv)
    rate = bits_per_second(args.rate)
    extra = dict(item.partition("=")[::2] for item in args.set)
    if any(not name for name in extra):
        parser.error("--set takes VAR=VALUE")
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = set(strategies) - set(STRATEGIES)
    if unknown:
        parser.error(f"no cost model for {sorted(unknown)}; choose from {', '.join(STRATEGIES)}")
    reason = netns.unavailable()
    if reason is not None:
        print(f"slow_link: {reason}", file=sys.stderr)
        return 2
    config = {
        "collective": "allreduce", "strategies": strategies, "world_size": WORLD,
        "sizes": list(args.sizes), "dtype": "float32", "iters": args.iters,
        "warmup": args.warmup, "pipelined": 0, "transport": "tcp",
        "secure": not args.insecure, "compare": [],
    }
    try:
        with tempfile.TemporaryDirectory(prefix="p2pcoll-slow-link-") as scratch, \
                netns.Lab(WORLD) as lab:
            lab.shape(args.rate, burst=args.burst, latency=args.latency, delay=args.delay)
            key = None
            if not args.insecure:
                key = Path(scratch) / "job.key"
                subprocess.run([sys.executable, "-m", "p2pcoll", "keygen", str(key)],
                               check=True, capture_output=True)
            # One group per strategy, so that each one's traffic is its own.
            started = time.monotonic()
            rows, traffic = [], {}
            for strategy in strategies:
                found, traffic[strategy] = measure_traffic(lab, lambda s=strategy: run_peers(
                    lab, {**config, "strategies": [s]}, key, Path(scratch) / "rows.json",
                    args.timeout - (time.monotonic() - started), extra))
                rows += found
            took = time.monotonic() - started
    except netns.LabError as exc:
        print(f"slow_link: {exc}", file=sys.stderr)
        return 2
    print(report(rows, strategies, rate, args, traffic))
    print(f"\n({took:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
