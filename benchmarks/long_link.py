"""Striped links on a long fat path: allreduce with ``streams=1``, ``streams=auto`` and Gloo.

    python benchmarks/long_link.py                          # 4 hosts, 1gbit, 50 ms one way
    python benchmarks/long_link.py --rate 1gbit --delay 50ms --sizes 16M,64M --iterations 5
    python benchmarks/long_link.py --rate 200mbit --delay 250ms --depths 4,link  # the window
    python benchmarks/long_link.py --loopback               # job key against plain sockets
    python benchmarks/long_link.py --strategy auto,ring,direct,auto:1 --streams auto
                                  # several strategies in one lab; NAME:K with K streams only
    python benchmarks/long_link.py --raw ring:6,direct:2   # and the lab's own ceiling

Not a test: it prints tables. Needs root, ``ip``/``tc`` and (where the kernel has no
netem) a C compiler and ``iptables``. Four hosts of their own (network namespaces,
``tests/netns.py``), one peer each (``P2PCOLL_HOST_ID=host-R``: tcp between all), every
cable a token bucket of ``--rate`` each way and ``--delay`` one way (netem, or where the
kernel has none the lab's packet delayer in its switch: TCP sees the real round trip; the
stream relay, which it does not, only where neither can run). In one run, each in a group of its own and pass after
pass over the sizes (a change in the machine's load falls on all alike): p2pcoll with
``P2PCOLL_STREAMS`` of each ``--streams`` value (and ``P2PCOLL_PIPELINE_DEPTH`` of each
``--depths`` value; ``link``: unset, the pipeline's window follows the path), then Gloo
(torch.distributed over tcp), and with ``--raw`` the lab's ceiling: plain TCP connections
moving each rank's bytes of the allreduce with no p2pcoll at all (``raw_streams.py``).
Times are the slowest rank's, medians over ``--iterations`` after a warm-up; bus bandwidth
as nccl-tests counts it (``2(p-1)/p * size / time``) and as a share of the cable's payload
rate (1448 bytes of 1514 per frame). The notes give, per run, the CPU the peers used (in
cores: their CPU seconds over the run's wall time) and the packet delayer's, and the load.

``--loopback`` runs two peers on this machine's loopback over tcp (separate host ids, no
shaping) with the job key and without, for each ``--streams`` value: the cost of CurveZMQ,
and how much spreading it over stripes (libzmq's I/O threads) wins back.
"""

from __future__ import annotations

import argparse
import asyncio
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

import gloo_peer  # noqa: E402  # beside this file
import netns  # noqa: E402  # tests/netns.py, importable once tests/ is on the path
from peer_processes import peer_environment, run_to_end  # noqa: E402  # tests/, likewise

PORT = 29650
PAYLOAD_PER_FRAME = 1448 / 1514


# --- the workers (one process per rank) ------------------------------------------------------

async def p2pcoll_worker(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np

    import p2pcoll

    report: dict[str, Any] = {"times": {}}
    async with p2pcoll.join() as g:
        data = {n: np.full(n // 4, 1.0 + g.rank, np.float32) for n in args.sizes}
        expected = sum(1.0 + r for r in range(g.world_size))
        for i in range(args.iterations + 1):  # the first pass warms up
            for nbytes in args.sizes:
                x = data[nbytes]
                await g.barrier()
                t = time.perf_counter()
                await g.allreduce(x, out=x, strategy=args.strategy)
                elapsed = time.perf_counter() - t
                if not (x[0] == expected and x[-1] == expected):
                    raise SystemExit(f"rank {g.rank}: wrong sum {x[0]}, {x[-1]}")
                x[:] = 1.0 + g.rank
                if i:
                    report["times"].setdefault(str(nbytes), []).append(elapsed)
        stats = g.stats()
        report["stats"] = {k: stats.get(k) for k in (
            "stripes_opened", "socket_buffers_capped", "links_opened")}
        report["picked"] = stats["collectives_by_strategy"]
        report["window"] = window(g)
        report["probe"] = probed(g.topology())
        await g.barrier()
    report["cpu_s"] = cpu_seconds()
    return report


def cpu_seconds() -> float:
    """This process's CPU time so far (all its threads: libzmq's and Gloo's too)."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def window(g: Any) -> str:
    """The round trips this rank measured to its peers and the pipeline depth they give."""
    from p2pcoll.engine.window import pipeline_depth

    paths = [g.session.transport.paths[peer] for peer in range(g.world_size) if peer != g.rank]
    rtts = ", ".join("-" if rtt is None else f"{rtt * 1e3:.0f}" for rtt, _ in paths)
    depth = g.settings.pipeline_depth or pipeline_depth(paths, g.settings.segment_bytes)
    return f"rtt {rtts} ms, depth {depth}"


def probed(topology: dict[str, Any]) -> str:
    """What the join's probe measured (the pairs' bandwidths, the ring), in a few words."""
    rates = [b for row in topology["bandwidth_Bps"] for b in row if b]
    if not rates:
        return "no probe"
    return (f"probe {min(rates) / 1e6:.0f}-{max(rates) / 1e6:.0f} MB/s per pair, "
            f"ring {topology['ring']}")


def gloo_worker(args: argparse.Namespace) -> dict[str, Any]:
    times = gloo_peer.time_collectives(os.environ["GLOO_ADDR"], args.port, args.sizes,
                                       args.iterations)
    return {"times": {str(nbytes): ts for (_, nbytes), ts in times.items()},
            "cpu_s": cpu_seconds()}


# --- the driver ------------------------------------------------------------------------------

def environment(rank: int, world: int, address: str, port: int,
                extra: dict[str, str]) -> dict[str, str]:
    return peer_environment(
        f"tcp://{address}:{port}", world, rank, P2PCOLL_HOST_ID=f"host-{rank}",
        P2PCOLL_TRANSPORT="tcp", OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="eth0",
        GLOO_ADDR=address, P2PCOLL_JOIN_TIMEOUT="300", P2PCOLL_TIMEOUT="600", **extra)


def run(args: argparse.Namespace, kind: str, world: int, port: int, extra: dict[str, str],
        lab: netns.Lab | None, strategy: str = "auto") -> list[dict[str, Any]]:
    """The ``kind`` workers (p2pcoll or gloo), one per host of ``lab`` (None: on this
    machine's loopback) running ``strategy``; their reports in rank order."""
    argv = ["nice", "-n", str(args.nice)] if args.nice else []
    argv += [sys.executable, str(Path(__file__).resolve()), "--worker", kind, "--port",
            str(port), "--iterations", str(args.iterations), "--strategy", strategy,
            "--sizes", ",".join(str(n) for n in args.sizes)]
    address = netns.address(0) if lab is not None else "127.0.0.1"
    envs = [environment(rank, world, address, port, extra) for rank in range(world)]
    if lab is None:
        for env in envs:
            env["GLOO_SOCKET_IFNAME"] = "lo"
    commands = [lab.command(rank, argv) if lab is not None else argv for rank in range(world)]
    delayer = lab.delayer.pid if lab is not None and lab.delayer is not None else None
    delayer_cpu, started = process_cpu(delayer), time.monotonic()
    before = wire(lab)
    reports = run_to_end(commands, envs, args.timeout, cwd=ROOT, name=kind)
    wall = time.monotonic() - started
    after = wire(lab)
    peers = sum(r.get("cpu_s", 0.0) for r in reports) / wall
    note = f"peers' CPU {peers:.2f} cores over {wall:.0f} s"
    if delayer is not None:
        note += (f", the delayer's {(process_cpu(delayer) - delayer_cpu) / wall:.2f} "
                 f"({after[2] - before[2]} packets)")
    reports[0]["cpu"] = (f"{note}, load {os.getloadavg()[0]:.1f}; {after[0] - before[0]} "
                         f"drops, {after[1] - before[1]} segments sent again")
    return reports


def wire(lab: netns.Lab | None) -> tuple[int, int, int]:
    """What the lab's wires have done so far: packets dropped (queues of the cables and the
    delayer), TCP segments sent again (all hosts), packets through the delayer."""
    if lab is None:
        return 0, 0, 0
    again = 0
    for host in lab.names:
        snmp = subprocess.run(["ip", "netns", "exec", host, "cat", "/proc/net/snmp"],
                              capture_output=True, text=True, check=True).stdout
        names, values = [line.split() for line in snmp.splitlines() if line.startswith("Tcp:")]
        again += int(values[names.index("RetransSegs")])
    queued = 0
    if lab.delayer is not None:
        table = subprocess.run(["ip", "netns", "exec", lab.switch, "cat",
                                "/proc/net/netfilter/nfnetlink_queue"],
                               capture_output=True, text=True, check=True).stdout.split()
        queued = int(table[7]) if len(table) > 7 else 0  # the queue's last packet id
    return lab.drops(), again, queued


def process_cpu(pid: int | None) -> float:
    """The CPU seconds process ``pid`` has used (0 for None or a process that is gone)."""
    if pid is None:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def raw(args: argparse.Namespace, lab: netns.Lab, world: int, pattern: str, k: str
        ) -> list[dict[str, Any]]:
    """The lab's ceiling (``raw_streams.py``): plain TCP moving a rank's bytes of the
    allreduce of the first size, ``k`` connections per pair, ``pattern`` ring or direct."""
    nbytes = 2 * (world - 1) * args.sizes[0] // world
    period = max(1.0, 4 * nbytes / 100e6)  # room for a pass at a quarter of 1 Gbit/s
    argv = ["nice", "-n", str(args.nice)] if args.nice else []
    argv += [sys.executable, "-c", "import sys, raw_streams; "
             "sys.exit(raw_streams.main(sys.argv[1:]))"]
    addresses = ",".join(netns.address(r) for r in range(world))
    start = time.time() + 5
    commands = [lab.command(rank, [*argv, str(rank), k, str(nbytes), str(args.iterations),
                                   pattern, addresses, str(start), str(period)])
                for rank in range(world)]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent))
    reports = run_to_end(commands, [env] * world, args.timeout, cwd=ROOT, name="raw")
    reports[0]["cpu"] = f"load {os.getloadavg()[0]:.1f}"
    return reports


def medians(reports: list[dict[str, Any]]) -> dict[int, float]:
    """Per size, the median over iterations of the slowest rank's time."""
    out = {}
    for key in reports[0]["times"]:
        slowest = [max(r["times"][key][i] for r in reports)
                   for i in range(len(reports[0]["times"][key]))]
        out[int(key)] = statistics.median(slowest)
    return out


def configurations(strategies: str, streams: list[str], depths: list[str]
                   ) -> list[tuple[str, str, str]]:
    """The runs of p2pcoll, in order: ``(strategy, streams, depth)`` for each strategy
    (comma-separated) with each ``--streams`` value and depth; a strategy written
    ``NAME:K`` runs with ``K`` streams only (``auto,ring:auto,auto:1``)."""
    out = []
    for item in (s.strip() for s in strategies.split(",") if s.strip()):
        name, _, k = item.partition(":")
        out += [(name, each, d) for each in ([k] if k else streams) for d in depths]
    return out


def busbw(nbytes: int, world: int, seconds: float) -> float:
    """Bytes per second as nccl-tests counts an allreduce's."""
    return 2 * (world - 1) / world * nbytes / seconds


def table(results: dict[str, dict[int, float]], world: int, line_Bps: float | None
          ) -> list[str]:
    names = list(results)
    lines = ["| size | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for n in sorted(next(iter(results.values()))):
        cells = []
        for name in names:
            t = results[name].get(n)
            if t is None:
                cells.append("-")
                continue
            bw = busbw(n, world, t)
            share = f", {bw / line_Bps:.0%}" if line_Bps else ""
            cells.append(f"{t * 1e3:.0f} ms ({bw / 1e6:.1f} MB/s{share})")
        lines.append(f"| {n >> 20} MiB | " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    from p2pcoll.bench.options import parse_sizes

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", default="1gbit", help="each cable's rate, each way (tc)")
    parser.add_argument("--delay", default="50ms", help="one-way delay per cable (tc time)")
    parser.add_argument("--burst", default="1mbit",
                        help="the token buckets' burst (1mbit: a 64 KiB GSO packet passes "
                        "whole, one packet for the lab's delayer rather than 45)")
    parser.add_argument("--sizes", type=parse_sizes, default=parse_sizes("64M"))
    parser.add_argument("--streams", default="1,auto",
                        help="P2PCOLL_STREAMS values, comma-separated (1,auto)")
    parser.add_argument("--depths", default="link",
                        help="P2PCOLL_PIPELINE_DEPTH values, comma-separated; link: unset, "
                             "the window follows the path (link)")
    parser.add_argument("--strategy", default="auto",
                        help="the allreduce strategies, comma-separated: each runs with "
                        "every --streams value (auto)")
    parser.add_argument("--iterations", type=int, default=5, help="timed passes (5)")
    parser.add_argument("--key", action="store_true", help="with a job key (CurveZMQ)")
    parser.add_argument("--loopback", action="store_true",
                        help="two peers on loopback, job key against plain sockets")
    parser.add_argument("--raw", default="",
                        help="the lab's ceiling too: plain TCP moving each rank's bytes of "
                        "the allreduce of the first size, PATTERN:K comma-separated "
                        "(ring:6,direct:2: K connections to the ring's next host or to "
                        "every peer; raw_streams.py)")
    parser.add_argument("--no-gloo", action="store_true", help="leave Gloo out")
    parser.add_argument("--set", action="append", default=[], metavar="VAR=VALUE",
                        help="a variable for every p2pcoll peer (repeatable)")
    parser.add_argument("--nice", type=int, default=0,
                        help="run every peer (p2pcoll's and Gloo's) at this niceness "
                        "(negative: ahead of the rest of a shared machine's load, as on "
                        "hosts of their own)")
    parser.add_argument("--sysctl", action="append", default=[], metavar="KEY=VALUE",
                        help="a setting of every host's network stack (repeatable), e.g. "
                        "net.ipv4.tcp_slow_start_after_idle=0")
    parser.add_argument("--timeout", type=float, default=3600.0)
    parser.add_argument("--worker", choices=("p2pcoll", "gloo"), help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=PORT, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        report = (gloo_worker(args) if args.worker == "gloo"
                  else asyncio.run(p2pcoll_worker(args)))
        print(json.dumps(report), flush=True)
        return 0
    extra = dict(item.partition("=")[::2] for item in args.set)
    streams = [s.strip() for s in args.streams.split(",") if s.strip()]
    depths = [d.strip() for d in args.depths.split(",") if d.strip()]
    load = os.getloadavg()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="p2pcoll-long-link-") as scratch:
        key = Path(scratch) / "job.key"
        subprocess.run([sys.executable, "-m", "p2pcoll", "keygen", str(key)], check=True,
                       capture_output=True)
        results: dict[str, dict[int, float]] = {}
        notes = []
        port = args.port
        if args.loopback:
            for secure in (False, True):
                for k in streams:
                    env = {**extra, "P2PCOLL_STREAMS": k}
                    if secure:
                        env["P2PCOLL_KEY_FILE"] = str(key)
                    name = f"{'key' if secure else 'plain'}, streams={k}"
                    reports = run(args, "p2pcoll", 2, port, env, None, args.strategy)
                    port += 1
                    results[name] = medians(reports)
                    notes.append(f"{name}: {reports[0]['stats']}")
            print("allreduce, p = 2 on loopback over tcp (two host ids); slowest rank, "
                  f"median of {args.iterations}; load {load[0]:.1f} before, "
                  f"{os.getloadavg()[0]:.1f} after\n")
            print("\n".join(table(results, 2, None)))
            for k in streams:
                plain, secure = results[f"plain, streams={k}"], results[f"key, streams={k}"]
                print(f"streams={k}: key / plain busbw "
                      + ", ".join(f"{n >> 20} MiB {plain[n] / secure[n]:.2f}x"
                                  for n in sorted(plain)))
        else:
            reason = netns.unavailable()
            if reason is not None:
                print(f"long_link: {reason}", file=sys.stderr)
                return 2
            from slow_link import bits_per_second  # (beside this file)

            line = bits_per_second(args.rate) * PAYLOAD_PER_FRAME / 8
            world = 4
            with netns.Lab(world) as lab:
                how = lab.shape(args.rate, burst=args.burst, delay=args.delay, relay=True)
                for setting in args.sysctl:
                    for host in lab.names:
                        subprocess.run(["ip", "netns", "exec", host, "sysctl", "-q", "-w",
                                        setting], check=True)
                for strategy, k, depth in configurations(args.strategy, streams, depths):
                    env = {**extra, "P2PCOLL_STREAMS": k}
                    name = f"streams={k}"
                    if "," in args.strategy:
                        name = f"{strategy}, {name}"
                    if depth != "link":
                        env["P2PCOLL_PIPELINE_DEPTH"] = depth
                    if len(depths) > 1:
                        name += f", depth {depth}"
                    if args.key:
                        env["P2PCOLL_KEY_FILE"] = str(key)
                    reports = run(args, "p2pcoll", world, port, env, lab, strategy)
                    port += 1
                    results[name] = medians(reports)
                    notes.append(f"{name}: rank 0 {reports[0]['stats']}, "
                                 f"{reports[0].get('window', '')}, "
                                 f"{reports[0].get('probe', '')}, "
                                 f"strategies {reports[0]['picked']}; {reports[0]['cpu']}")
                for item in (r.strip() for r in args.raw.split(",") if r.strip()):
                    pattern, _, k = item.partition(":")
                    reports = raw(args, lab, world, pattern, k or "1")
                    results[f"raw {pattern}:{k or 1}"] = {args.sizes[0]: statistics.median(
                        [max(r["times"][i] for r in reports)
                         for i in range(args.iterations)])}
                    notes.append(f"raw {pattern}:{k or 1}: {reports[0]['cpu']}")
                if not args.no_gloo:
                    reports = run(args, "gloo", world, port, {}, lab)
                    results["gloo"] = medians(reports)
                    notes.append(f"gloo: {reports[0]['cpu']}")
            print(f"allreduce, p = 4 hosts (network namespaces), every cable {args.rate} and "
                  f"{args.delay} one way ({how or 'no delay'}); tcp, "
                  f"{'job key' if args.key else 'plain sockets'}; strategy {args.strategy}; "
                  f"slowest rank, median of {args.iterations}; niceness {args.nice}; "
                  f"{' '.join(args.sysctl) + '; ' if args.sysctl else ''}"
                  f"load {load[0]:.1f} before, "
                  f"{os.getloadavg()[0]:.1f} after; % of the cable's payload rate "
                  f"({line / 1e6:.1f} MB/s)\n")
            print("\n".join(table(results, world, line)))
        print()
        print("\n".join(notes))
    print(f"\n({time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
