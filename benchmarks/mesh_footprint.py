"""What one peer costs as the group grows: descriptors, memory, links, heartbeats, detection.

    python benchmarks/mesh_footprint.py                        # p = 4, 16, 64 under ulimit -n 256
    python benchmarks/mesh_footprint.py --sizes 4 16 --nofile 1024
    python benchmarks/mesh_footprint.py --heartbeats 8 64      # idle traffic, counted (netns)
    python benchmarks/mesh_footprint.py --tree /tmp/old-tree   # the same of another checkout

Not a test: it prints tables. Every peer is a process of its own (this file again, with
``--worker``) on this host, started with ``RANK``/``WORLD_SIZE``/``P2PCOLL_RENDEZVOUS`` (as
``p2pcoll launch`` does) under a soft limit of ``--nofile`` open files.

**Footprint** (``--sizes``). Each peer joins, runs one 4 KiB and one 1 MiB allreduce
(``--strategy``; ``auto`` by default) and a barrier, then reports its open descriptors
(``/proc/self/fd``), its RSS, the data links it opened ("ar": after the two allreduces;
"links": after the barrier too) and the heartbeat probes it keeps. The table gives the
median and the largest over the peers, and the strategies rank 0 ran (``--detail K`` also
names the K peers with the most descriptors, and what the descriptors of the first of them
and of the median peer are: sockets, eventfds, pipes, shared-memory files). A size whose group does not form under the
limit is reported as failed, with the first peer's error.

**Heartbeats** (``--heartbeats``). The same group with every peer on a host of its own
(``P2PCOLL_HOST_ID``, so all traffic is TCP on the loopback, no shared memory), in a network
namespace of its own (``unshare -n``: nobody else's traffic on its loopback). After the
barrier every peer sits idle for ``--idle`` seconds, and the loopback's packet counter
(``/proc/net/dev``) is read at both ends of that window: what crosses it then is heartbeats
(ZMTP PING/PONG and their TCP acknowledgements) and nothing else. Packets per peer per
second is that count over the window and the size. It needs the right to create a network
namespace (root, or an unprivileged user namespace).

**Detection** (``--kill``, with either mode): after the measurement rank ``p // 2`` is
SIGKILLed (``--signal STOP``: frozen, so only heartbeats can tell) while the group is idle (no collective running), and every survivor reports when
the victim first appears among its peers' departures (``session.peers.gone()``); the table
gives the seconds from the kill to the median and to the last survivor (one monotonic clock
for every process of the machine).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NoReturn

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[1] / "tests"))

from peer_processes import PeerProcesses  # noqa: E402  # tests/, on the path above


# ---------------------------------------------------------------------------------------
# The worker: one peer.

def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _fd_kinds() -> dict[str, int]:
    """This process's descriptors by what they are: socket, eventfd (one per ZeroMQ
    socket's mailbox), epoll, pipe, shm (rings, lanes, the board), other."""
    kinds: dict[str, int] = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        kind = ("socket" if target.startswith("socket:") else
                "eventfd" if "eventfd" in target else
                "epoll" if "eventpoll" in target else
                "pipe" if target.startswith("pipe:") else
                "shm" if target.startswith("/dev/shm/") else "other")
        kinds[kind] = kinds.get(kind, 0) + 1
    return dict(sorted(kinds.items()))


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _say(**event: Any) -> None:
    print(json.dumps(event), flush=True)


async def _worker(where: Path, strategy: str | None, victim: int | None) -> None:
    import numpy as np

    import p2pcoll

    async with p2pcoll.join(timeout=600, collective_timeout=300) as g:
        r, p = g.rank, g.world_size
        small = await g.allreduce(np.full(1024, float(r), np.float32), strategy=strategy)
        large = await g.allreduce(np.full(1 << 18, float(r), np.float32), strategy=strategy)
        t = g.session.transport
        links_allreduce = getattr(t, "links", None)
        await g.barrier()
        right = bool(np.all(small == p * (p - 1) / 2) and np.all(large == p * (p - 1) / 2))
        probes = getattr(t, "probes", None)
        if probes is None:  # a tree without the overlay: one probe for every other peer
            probes = len(getattr(t, "_probes", {}) or ())
        _say(ready={"rank": r, "fds": _fds(), "kinds": _fd_kinds(), "rss": _rss(), "right": right,
                    "links": getattr(t, "links", None), "links_allreduce": links_allreduce,
                    "probes": probes, "used": g.stats().get("collectives_by_strategy"),
                    "package": os.path.dirname(p2pcoll.__file__)})
        while not (where / "go").exists():
            await asyncio.sleep(0.05)
        if victim is not None and r != victim:
            deadline = time.monotonic() + 120
            while victim not in g.session.peers.gone() and time.monotonic() < deadline:
                await asyncio.sleep(0.005)
            _say(named={"rank": r, "at": time.monotonic(),
                        "known": victim in g.session.peers.gone()})
        while not (where / "done").exists():
            await asyncio.sleep(0.05)


# ---------------------------------------------------------------------------------------
# The driver: one group of processes per size.

class Job(PeerProcesses):
    """``n`` peer processes of this file, under a soft limit of ``nofile`` descriptors;
    unlike a test's, :meth:`wait_for` raises RuntimeError (a size whose group fails is a row
    of the table)."""

    def __init__(self, n: int, args: argparse.Namespace, separate_hosts: bool) -> None:
        self.signal = signal.Signals[f"SIG{args.signal}"]
        self.dir = Path(tempfile.mkdtemp(prefix="mesh_footprint_"))
        tree = {"PYTHONPATH": os.pathsep.join([args.tree, os.environ.get("PYTHONPATH", "")])
                } if args.tree else {}
        argv = [sys.executable, str(HERE), "--worker", str(self.dir),
                "--strategy", args.strategy]
        if args.kill:
            argv += ["--victim", str(n // 2)]
        super().__init__(
            n, lambda r: argv,
            lambda r: {**tree, **({"P2PCOLL_HOST_ID": f"host-{r}"} if separate_hosts else {})},
            nofile=args.nofile, tail=1500, cwd=args.tree or None)

    def give_up(self, why: str, stderr: str | None = None) -> NoReturn:
        """Raise RuntimeError with ``why`` and the last line of the rank's stderr."""
        if stderr is None:
            raise RuntimeError(why)
        last = stderr.strip().splitlines()[-1:] or ["(no output)"]
        raise RuntimeError(f"{why}: {last[0]}")

    def touch(self, name: str) -> None:
        (self.dir / name).touch()

    def close(self) -> None:
        self.touch("go")
        self.touch("done")
        super().close()


def _lo_packets() -> int:
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "lo":
                return int(rest.split()[9])  # transmitted packets (= received, on lo)
    raise RuntimeError("no loopback interface in /proc/net/dev")


def _kill_and_time(job: Job) -> tuple[float, float, int]:
    """SIGKILL (or SIGSTOP) rank n // 2 of an idle group; seconds to the median and the last survivor
    that knows, and how many survivors knew within 120 s."""
    victim = job.n // 2
    survivors = [r for r in range(job.n) if r != victim]
    job.procs[victim].send_signal(job.signal)
    killed = time.monotonic()
    if job.signal == signal.SIGKILL:
        job.procs[victim].wait(timeout=30)
    job.touch("go")
    named = job.wait_for("named", survivors, timeout=180)
    job.procs[victim].kill()  # a stopped one too
    seconds = sorted(x["at"] - killed for x in named if x["known"])
    if not seconds:
        return float("nan"), float("nan"), 0
    return statistics.median(seconds), seconds[-1], len(seconds)


def footprint(args: argparse.Namespace) -> None:
    print(f"{'p':>4} {'fds med':>8} {'fds max':>8} {'fds/peer':>9} {'RSS MiB':>8} "
          f"{'ar med':>6} {'ar max':>6} {'links med':>9} {'links max':>9} {'probes':>7} {'right':>6}"
          + (f" {'named med s':>11} {'last s':>7} {'named':>6}" if args.kill else ""))
    for n in args.sizes:
        job = Job(n, args, separate_hosts=False)
        try:
            ready = job.wait_for("ready", list(range(n)), timeout=args.timeout)
            fds = sorted(x["fds"] for x in ready)
            links = sorted(x["links"] if x["links"] is not None else -1 for x in ready)
            ar = sorted(x["links_allreduce"] if x["links_allreduce"] is not None else -1
                        for x in ready)
            probes = sorted(x["probes"] for x in ready)
            rss = statistics.median(x["rss"] for x in ready) / 2**20
            right = all(x["right"] for x in ready)
            row = (f"{n:>4} {fds[n // 2]:>8} {fds[-1]:>8} {fds[n // 2] / max(1, n - 1):>9.1f} "
                   f"{rss:>8.1f} {ar[n // 2]:>6} {ar[-1]:>6} {links[n // 2]:>9} {links[-1]:>9} "
                   f"{probes[n // 2]:>7} "
                   f"{right!s:>6}")
            if args.kill:
                med, last, count = _kill_and_time(job)
                row += f" {med:>11.3f} {last:>7.3f} {count:>3}/{n - 1}"
            print(row, flush=True)
            if n == args.sizes[0]:
                print(f"     (package: {ready[0]['package']})", flush=True)
            print(f"     strategies (rank 0): {ready[0]['used']}", flush=True)
            if args.detail:
                top = sorted(ready, key=lambda x: -x["fds"])[:args.detail]
                print("     most descriptors: " + ", ".join(
                    f"rank {x['rank']} {x['fds']} fds {x['links']} links" for x in top))
                middle = sorted(ready, key=lambda x: x["fds"])[n // 2]
                for x in (top[0], middle):
                    print(f"     rank {x['rank']}'s descriptors: {x['kinds']}")
        except RuntimeError as exc:
            print(f"{n:>4} failed: {exc}", flush=True)
        finally:
            job.close()


def heartbeats(args: argparse.Namespace) -> None:
    print(f"{'p':>4} {'probes':>7} {'idle s':>7} {'lo packets':>11} {'per peer/s':>11}"
          + (f" {'named med s':>11} {'last s':>7} {'named':>6}" if args.kill else ""))
    for n in args.heartbeats:
        job = Job(n, args, separate_hosts=True)
        try:
            ready = job.wait_for("ready", list(range(n)), timeout=args.timeout)
            time.sleep(1.0)  # the last collective's acknowledgements
            before = _lo_packets()
            time.sleep(args.idle)
            packets = _lo_packets() - before
            probes = statistics.median(x["probes"] for x in ready)
            row = (f"{n:>4} {probes:>7g} {args.idle:>7g} {packets:>11} "
                   f"{packets / args.idle / n:>11.2f}")
            if args.kill:
                med, last, count = _kill_and_time(job)
                row += f" {med:>11.3f} {last:>7.3f} {count:>3}/{n - 1}"
            print(row, flush=True)
        except RuntimeError as exc:
            print(f"{n:>4} failed: {exc}", flush=True)
        finally:
            job.close()


def _in_own_netns() -> None:
    """Re-run this command in a network namespace of its own, loopback up."""
    if os.environ.get("MESH_FOOTPRINT_NETNS") == "1":
        return
    env = dict(os.environ, MESH_FOOTPRINT_NETNS="1")
    inner = "ip link set lo up && exec " + " ".join(
        [sys.executable, str(HERE), *(f"'{a}'" for a in sys.argv[1:])])
    for prefix in (["unshare", "-n"], ["unshare", "-rn"]):
        if subprocess.run([*prefix, "true"], check=False,
                          stderr=subprocess.DEVNULL).returncode == 0:
            sys.exit(subprocess.run([*prefix, "sh", "-c", inner], env=env,
                                    check=False).returncode)
    sys.exit("cannot create a network namespace (unshare -n / -rn) for --heartbeats")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="*", default=[4, 16, 64])
    parser.add_argument("--heartbeats", type=int, nargs="*", default=[],
                        help="sizes whose idle heartbeat traffic to count (e.g. 8 64)")
    parser.add_argument("--idle", type=float, default=10.0, help="seconds of idle window")
    parser.add_argument("--nofile", type=int, default=256, help="soft limit of open files")
    parser.add_argument("--strategy", default="auto")
    parser.add_argument("--kill", action="store_true", help="signal rank p // 2 and time it")
    parser.add_argument("--signal", choices=["KILL", "STOP"], default="KILL",
                        help="the signal --kill sends (STOP: a frozen peer, found by heartbeats)")
    parser.add_argument("--tree", default="", help="a checkout of p2pcoll to measure instead")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--detail", type=int, default=0,
                        help="also name this many peers with the most descriptors")
    parser.add_argument("--worker", default="", help=argparse.SUPPRESS)
    parser.add_argument("--victim", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        strategy = None if args.strategy == "auto" else args.strategy
        asyncio.run(_worker(Path(args.worker), strategy, args.victim))
        return
    if args.tree:
        args.tree = str(Path(args.tree).resolve())
    if args.heartbeats:
        _in_own_netns()
        heartbeats(args)
    elif args.sizes:
        footprint(args)


if __name__ == "__main__":
    main()
