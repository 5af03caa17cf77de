"""Host-aware collectives on emulated hosts: hierarchical against flat strategies and Gloo.

Emulated hosts are network namespaces of ``tests/netns.py``'s lab on one switch: every
cable a token bucket of ``--rate`` (1 Gbit/s) each way and ``--delay`` (0.5 ms) one way
(netem where the kernel has it, else the lab's relay, which holds each TCP stream's bytes
that long). The peers of a host share its namespace and one ``P2PCOLL_HOST_ID``, so they
reach each other over ipc and shared memory, and the peers of other hosts over tcp only
(the namespaces share /dev/shm; the host id keeps them apart). Gloo
(``torch.distributed``, backend gloo) is started the same way, every rank in its host's
namespace, over tcp to all (Gloo has no shared-memory transport on CPU).

For each topology (``--topologies``, default 4x4 and 2x8: hosts x peers per host) and
size (16 MiB and 64 MiB of float32) it times:

- allreduce: ``hierarchical``, the flat ``ring`` and ``rabenseifner``, ``auto`` (what it
  picked is printed), and Gloo's ``all_reduce``;
- broadcast from rank 0: ``hierarchical``, ``binomial``, ``pipeline``,
  ``scatter_allgather``, ``auto``, and Gloo's ``broadcast``.

Every case runs once per pass, a warm-up pass and then ``--iterations`` timed ones (so a
change of the machine's load falls on all cases alike), each call after a barrier; a call's
time is the slowest rank's, and the table gives the median, as busbw (allreduce:
2(p-1)/p·n/t, broadcast: n/t, as nccl-tests counts it). The workers get a cost-model file
whose tcp constants are the emulated link's (alpha: the relay's round trip, beta: the
rate), so ``auto`` prices the topology it runs on.

Run as root (namespaces): ``python benchmarks/hierarchical_hosts.py`` (all of it: about 10
minutes on 2 cores), or ``--quick`` (16 MiB only, 2 iterations, a few minutes). Times on a
2-core machine running 16 peers are CPU-bound and noisy; the bytes are not.
``--allreduce``/``--broadcast`` choose the strategies (an empty list skips the collective),
and ``--plugin MODULE:CLASS`` registers a strategy class in every worker first, to compare
one that has no entry point (the module on ``PYTHONPATH``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import gloo_peer  # noqa: E402  # beside this file
import netns  # noqa: E402  # tests/netns.py, importable once tests/ is on the path
from peer_processes import peer_environment, run_to_end  # noqa: E402  # tests/, likewise

PORT = 29600
ALLREDUCE = ("hierarchical", "ring", "rabenseifner", "auto")
BROADCAST = ("hierarchical", "binomial", "pipeline", "scatter_allgather", "auto")
FLAT = {"ring", "rabenseifner", "recursive_doubling", "binomial", "pipeline",
        "scatter_allgather", "root", "direct", "reduce_broadcast"}


# --- the workers (one process per rank, in its host's namespace) ----------------------------


def cases(args: argparse.Namespace) -> list[tuple[str, str, int]]:
    """(collective, strategy, bytes) in the order every rank runs them."""
    out = []
    for nbytes in args.sizes:
        out += [("allreduce", s, nbytes) for s in args.allreduce]
        out += [("broadcast", s, nbytes) for s in args.broadcast]
    return out


def load_plugins(specs: list[str]) -> None:
    """Register each ``module:Class`` (importable from the worker: on ``PYTHONPATH``) as a
    strategy, for comparing one that has no entry point yet."""
    import importlib

    from p2pcoll.registry import registry

    for spec in specs:
        module, _, name = spec.partition(":")
        registry.register(getattr(importlib.import_module(module), name), f"--plugin {spec}")


async def p2pcoll_worker(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np

    import p2pcoll
    from p2pcoll.registry import registry

    load_plugins(args.plugin)
    report: dict[str, Any] = {"times": {}, "picked": {}}
    async with p2pcoll.join() as g:
        model = g.session.runner.costs()  # auto's model, as the group built it
        report["levels"] = model.levels
        data = {n: np.full(n // 4, 1.0 + g.rank, np.float32) for n in args.sizes}
        # Pass after pass over every case (the first a warm-up), so that a change in the
        # machine's load falls on all of them alike.
        for i in range(args.iterations + 1):
            for collective, strategy, nbytes in cases(args):
                x = data[nbytes]
                asked = None if strategy == "auto" else strategy
                if strategy == "auto":
                    report["picked"][f"{collective} {nbytes}"] = registry.auto_name(
                        collective, nbytes, g.world_size, model)
                await g.barrier()
                t = time.perf_counter()
                if collective == "allreduce":
                    await g.allreduce(x, out=x, strategy=asked)
                    x[:] = 1.0 + g.rank  # keep the values finite pass after pass
                else:
                    await g.broadcast(x, root=0, strategy=asked)
                elapsed = time.perf_counter() - t
                if i:
                    report["times"].setdefault(f"{collective} {strategy} {nbytes}",
                                               []).append(elapsed)
        stats = g.stats()
        report["by_strategy"] = stats["collectives_by_strategy"]
        await g.barrier()
    return report


def gloo_worker(args: argparse.Namespace) -> dict[str, Any]:
    # Passes as the p2pcoll workers run them, the refill timed with the allreduce as theirs.
    times = gloo_peer.time_collectives(netns.address(0), args.port, args.sizes,
                                       args.iterations, ("allreduce", "broadcast"),
                                       time_refill=True)
    return {"times": {f"{collective} gloo {nbytes}": ts
                      for (collective, nbytes), ts in times.items()}}


def worker(args: argparse.Namespace) -> int:
    report = gloo_worker(args) if args.worker == "gloo" else asyncio.run(p2pcoll_worker(args))
    print(json.dumps(report), flush=True)
    return 0


# --- the driver -----------------------------------------------------------------------------


def environment(rank: int, world: int, host: int, port: int, model: str) -> dict[str, str]:
    return peer_environment(
        f"tcp://{netns.address(0)}:{port}", world, rank, P2PCOLL_HOST_ID=f"host-{host}",
        OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="eth0", P2PCOLL_JOIN_TIMEOUT="300",
        P2PCOLL_TIMEOUT="600", P2PCOLL_COST_MODEL=model)


def run(lab: netns.Lab, args: argparse.Namespace, kind: str, hosts: int, per_host: int,
        port: int, model: str) -> list[dict[str, Any]]:
    """Run the ``kind`` workers (p2pcoll or gloo), ``per_host`` in each host's namespace;
    their reports in rank order."""
    world = hosts * per_host
    argv = [sys.executable, str(Path(__file__).resolve()), "--worker", kind, "--port",
            str(port), "--iterations", str(args.iterations),
            "--sizes", ",".join(str(n) for n in args.sizes),
            "--allreduce", ",".join(args.allreduce), "--broadcast", ",".join(args.broadcast),
            *(f"--plugin={spec}" for spec in args.plugin)]
    return run_to_end([lab.command(rank // per_host, argv) for rank in range(world)],
                      [environment(rank, world, rank // per_host, port, model)
                       for rank in range(world)],
                      args.timeout, cwd=ROOT, name=kind)


def medians(reports: list[dict[str, Any]]) -> dict[str, float]:
    """Per case, the median over iterations of the slowest rank's time."""
    out = {}
    for key in reports[0]["times"]:
        slowest = [max(r["times"][key][i] for r in reports)
                   for i in range(len(reports[0]["times"][key]))]
        out[key] = statistics.median(slowest)
    return out


def busbw(collective: str, nbytes: int, p: int, seconds: float) -> float:
    """GB/s as nccl-tests counts it."""
    factor = 2 * (p - 1) / p if collective == "allreduce" else 1.0
    return factor * nbytes / seconds / 1e9


def table(hosts: int, per_host: int, args: argparse.Namespace, times: dict[str, float],
          picked: dict[str, str]) -> list[str]:
    p = hosts * per_host
    lines = [f"\n{hosts} hosts x {per_host} peers (p = {p}), {args.rate} and {args.delay} "
             f"one way between hosts; median of {args.iterations}",
             f"{'collective':<10} {'size':>6} {'strategy':<20} {'time':>9} {'busbw GB/s':>11} "
             f"{'x best flat':>12} {'x gloo':>8}"]
    for nbytes in args.sizes:
        for collective, names in (("allreduce", args.allreduce),
                                  ("broadcast", args.broadcast)):
            got = {s: times[f"{collective} {s} {nbytes}"] for s in names}
            if not got:
                continue
            gloo = times.get(f"{collective} gloo {nbytes}")
            if gloo is not None:
                got["gloo"] = gloo
            flat = min((t for s, t in got.items() if s in FLAT), default=None)
            for s, t in got.items():
                name = s if s != "auto" else f"auto ({picked.get(f'{collective} {nbytes}')})"
                vs_flat = f"{flat / t:>11.2f}x" if flat else f"{'':>12}"
                vs_gloo = f"{gloo / t:>7.2f}x" if gloo else f"{'':>8}"
                lines.append(f"{collective:<10} {nbytes >> 20:>5}M {name:<20} "
                             f"{t * 1e3:>7.0f}ms {busbw(collective, nbytes, p, t):>11.3f} "
                             f"{vs_flat} {vs_gloo}")
            fastest = min(got.values())
            if "auto" in got:
                lines.append(f"{'':<10} {'':>6} auto within "
                             f"{100 * (got['auto'] / fastest - 1):.0f} % of the fastest measured")
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--topologies", default="4x4,2x8", help="HxK,...: hosts x peers")
    parser.add_argument("--sizes", default=None, help="bytes, comma-separated (16M,64M)")
    parser.add_argument("--iterations", type=int, default=None, help="timed calls per case")
    parser.add_argument("--rate", default="1gbit", help="each cable's rate each way (tc)")
    parser.add_argument("--delay", default="0.5ms", help="one-way delay per cable")
    parser.add_argument("--allreduce", default=",".join(ALLREDUCE),
                        help="allreduce strategies, comma-separated (auto: auto's pick)")
    parser.add_argument("--broadcast", default=",".join(BROADCAST),
                        help="broadcast strategies, comma-separated (empty: none)")
    parser.add_argument("--plugin", action="append", default=[], metavar="MODULE:CLASS",
                        help="register this strategy class in every worker first (the module "
                             "on PYTHONPATH), to compare one that has no entry point yet")
    parser.add_argument("--no-gloo", action="store_true", help="leave Gloo out")
    parser.add_argument("--quick", action="store_true", help="16 MiB only, 2 iterations")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    parser.add_argument("--worker", choices=("p2pcoll", "gloo"), help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=PORT, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.sizes is None:
        args.sizes = "16777216" if args.quick else "16777216,67108864"
    sizes = []
    for s in args.sizes.split(","):
        s = s.strip().upper()
        shift = {"K": 10, "M": 20, "G": 30}.get(s[-1:], 0)
        sizes.append(int(s[:-1] if shift else s) << shift)
    args.sizes = sizes
    args.allreduce = [s for s in args.allreduce.split(",") if s]
    args.broadcast = [s for s in args.broadcast.split(",") if s]
    if args.iterations is None:
        args.iterations = 2 if args.quick else 5
    return args


def cost_model(rate: str, delay: str) -> str:
    """A cost-model file whose tcp constants are the emulated link's: alpha one round trip
    plus the software's (the ipc default), beta the rate."""
    from slow_link import bits_per_second  # benchmarks/, beside this file

    from p2pcoll.engine.costs import DEFAULT_CONSTANTS

    beta = 8 / bits_per_second(rate)
    alpha = 2 * netns.seconds(delay) + DEFAULT_CONSTANTS["tcp"].alpha
    fd, path = tempfile.mkstemp(prefix="p2pcoll-hosts-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump({"tcp": {"alpha": alpha, "beta": beta}}, f)
    os.chmod(path, 0o644)
    return path


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        return worker(args)
    reason = netns.unavailable()
    if reason is not None:
        print(f"hierarchical_hosts: {reason}", file=sys.stderr)
        return 2
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    model = cost_model(args.rate, args.delay)
    started = time.monotonic()
    lines = [f"# hierarchical_hosts: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, "
             f"{os.cpu_count()} CPUs, cost model {Path(model).read_text()}"]
    port = args.port
    try:
        for topology in args.topologies.split(","):
            hosts, per_host = (int(x) for x in topology.lower().split("x"))
            with netns.Lab(hosts) as lab:
                how = lab.shape(args.rate, burst="512kbit", delay=args.delay, relay=True)
                t = time.monotonic()
                reports = run(lab, args, "p2pcoll", hosts, per_host, port, model)
                times = medians(reports)
                picked = reports[0]["picked"]
                print(f"hierarchical_hosts: {topology} p2pcoll took "
                      f"{time.monotonic() - t:.0f} s (delay by {how}); strategies "
                      f"{reports[0]['by_strategy']}", file=sys.stderr)
                if not args.no_gloo:
                    t = time.monotonic()
                    times.update(medians(run(lab, args, "gloo", hosts, per_host, port + 1,
                                             model)))
                    print(f"hierarchical_hosts: {topology} gloo took "
                          f"{time.monotonic() - t:.0f} s", file=sys.stderr)
                port += 2
            rows = table(hosts, per_host, args, times, picked)
            print("\n".join(rows), file=sys.stderr, flush=True)  # kept if a later one fails
            lines += rows
    finally:
        os.unlink(model)
    lines.append(f"\n({time.monotonic() - started:.0f} s in all; load average "
                 f"{os.getloadavg()[0]:.1f})")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
