"""A joiner healed from every survivor against one sender, over emulated thin uplinks.

Emulated hosts are network namespaces of ``tests/netns.py``'s lab on one switch (every peer
its own host and ``P2PCOLL_HOST_ID``, over tcp). The survivors' uplinks (their eth0) are
token buckets of ``--uplink`` (110 Mbit/s), the joiner's downlink (its switch port) one of
``--downlink`` (500 Mbit/s); everything else runs at the veth's speed.

Two runs, each a group formed for it:

- striped: ``--survivors`` (4) sources and the joiner; :func:`p2pcoll.training.heal` with
  every survivor a source, each sending its 1/S of the state;
- one sender: one source and the joiner, the same heal with one source (the bytes
  :func:`~p2pcoll.training.broadcast_parameters` from one member sends, checked the same way).

The state is ``--mib`` MiB (1024) of float32, two leaves (parameters and momentum). While
the heal runs, each source keeps training: it runs the heal as a task and goes on with its
steps (``--step-ms`` holding the event loop's thread, as a training step does: by default
with the CPU free, as a step on an accelerator leaves it, or ``--step cpu``, numpy matrix
products, which on a 2-core machine running 5 peers measures the cores more than the heal); its step time before the heal and during it is reported (median). After
the heal every rank checks the replicas (``check_replicas``): the joiner's state must be
bit-identical to the sources'.

Run as root: ``python benchmarks/heal.py`` (about 2.5 minutes at 1 GiB; ``--mib 256`` for a
quarter). On a shared machine give the peers ``--nice -10``: five peers, the lab's bridge
and everything else on 2 cores otherwise starve the joiner, which must take 55 MB/s (the
heal's CPU: about 3.5 s on the joiner and 0.9 s on each source per GiB, hashing included). Figures: the heal's time on the joiner (from the start of the heal to its state
written), the sources' step times, and the targets (striped <= 25 s at 1 GiB; one sender
needs >= 8 * size / uplink).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import netns  # noqa: E402  # tests/netns.py, importable once tests/ is on the path
from peer_processes import clean_environment, run_to_end  # noqa: E402  # tests/, likewise

PORT = 29650


# --- the worker: one peer ----------------------------------------------------------------------


def make_state(mib: int, source: bool) -> dict[str, Any]:
    import numpy as np

    n = (mib << 20) // 8  # two float32 leaves
    if source:  # the same bits on every source, different from a joiner's
        base = np.arange(n, dtype=np.float32)
        return {"params": base * np.float32(1e-3), "velocity": base * np.float32(-2e-4)}
    # A joiner's own initial weights: written, so its memory is there (as a model's is).
    return {"params": np.full(n, -1, np.float32), "velocity": np.full(n, -1, np.float32)}


def training_step(work: list[Any], count: int, kind: str) -> None:
    """One step on the loop's thread: ``count`` matrix products ("cpu"), or a wait of
    ``count`` ms holding the thread but not the CPU, as a step on an accelerator does
    ("sleep")."""
    if kind == "sleep":
        time.sleep(count / 1e3)
        return
    a, b = work
    for _ in range(count):
        a @ b


async def worker(args: argparse.Namespace) -> None:
    import numpy as np

    import p2pcoll
    from p2pcoll import training

    rank, world = args.rank, args.world
    joiner = world - 1
    sources = list(range(world - 1))
    url = f"tcp://{netns.address(0)}:{PORT}"
    rng = np.random.default_rng(rank)
    work = [rng.random((256, 256), dtype=np.float32) for _ in range(2)]
    count = round(args.step_ms)
    if rank != joiner and args.step == "cpu":  # matrix products per step for --step-ms
        start = time.perf_counter()
        training_step(work, 20, "cpu")
        each = (time.perf_counter() - start) / 20
        count = max(1, round(args.step_ms / 1e3 / each))
    state = make_state(args.mib, rank != joiner)
    async with p2pcoll.join(url, world_size=world, rank=rank, timeout=120,
                            collective_timeout=900) as g:
        before: list[float] = []
        if rank != joiner:
            for _ in range(30):
                t = time.perf_counter()
                training_step(work, count, args.step)
                before.append(time.perf_counter() - t)
                await asyncio.sleep(0)
        await g.barrier()
        started, cpu = time.perf_counter(), time.process_time()
        healing = asyncio.create_task(training.heal(g, state, sources))
        during: list[float] = []
        if rank != joiner:  # keep training while serving
            while not healing.done():
                t = time.perf_counter()
                training_step(work, count, args.step)
                during.append(time.perf_counter() - t)
                await asyncio.sleep(0)
        report = await healing
        seconds = time.perf_counter() - started
        cpu = time.process_time() - cpu  # every thread of the process: hashing, zmq's I/O
        await training.check_replicas(g, state)  # raises ReplicaDivergence if they differ
        row = {"rank": rank, "world": world, "seconds": seconds, "step_before":
               statistics.median(before) if before else None,
               "step_during": statistics.median(during) if during else None,
               "steps_during": len(during), "cpu": cpu, "received": report.received,
               "ranges": report.ranges, "identical": True}
        print(json.dumps(row), flush=True)


# --- the parent: the lab and the runs ----------------------------------------------------------


def environment(rank: int) -> dict[str, str]:
    return dict(clean_environment(), P2PCOLL_TRANSPORT="tcp",
                P2PCOLL_HOST_ID=f"heal-host-{rank}", OMP_NUM_THREADS="1",
                OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=str(ROOT))


def run(lab: netns.Lab, hosts: list[int], args: argparse.Namespace) -> list[dict[str, Any]]:
    """One group: rank r on host ``hosts[r]``, the last the joiner. Rows by rank."""
    world = len(hosts)
    commands = []
    for rank, host in enumerate(hosts):
        argv = ["nice", "-n", str(args.nice)] if args.nice else []
        argv += [sys.executable, str(Path(__file__).resolve()), "worker", "--rank", str(rank),
                "--world", str(world), "--mib", str(args.mib), "--step-ms", str(args.step_ms), "--step", args.step]
        commands.append(lab.command(host, argv))
    try:
        return run_to_end(commands, [environment(rank) for rank in range(world)],
                          args.timeout, cwd=ROOT)
    except RuntimeError as exc:  # a rank failed or hung: say which, without a traceback
        raise SystemExit(f"heal: {exc}") from None


def shape(lab: netns.Lab, survivors: int, uplink: str, downlink: str) -> None:
    tbf = ["tbf", "burst", "256kb", "latency", "100ms"]
    for r in range(survivors):
        netns._run("tc", "-n", lab.names[r], "qdisc", "add", "dev", "eth0", "root",
                   tbf[0], "rate", uplink, *tbf[1:])
    netns._run("tc", "-n", lab.switch, "qdisc", "add", "dev", f"p{survivors}", "root",
               tbf[0], "rate", downlink, *tbf[1:])


def summary(name: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    joiner = rows[-1]
    sources = rows[:-1]
    before = statistics.median(r["step_before"] for r in sources)
    during = statistics.median(r["step_during"] for r in sources if r["step_during"])
    return {"run": name, "sources": len(sources), "seconds": round(joiner["seconds"], 2),
            "step_before_ms": round(before * 1e3, 2), "step_during_ms": round(during * 1e3, 2),
            "step_ratio": round(during / before, 3), "ranges": joiner["ranges"],
            "cpu_joiner_s": round(joiner["cpu"], 2),
            "cpu_sources_s": round(sum(r["cpu"] for r in sources), 2),
            "identical": all(r["identical"] for r in rows)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command")
    w = sub.add_parser("worker")
    w.add_argument("--rank", type=int, required=True)
    w.add_argument("--world", type=int, required=True)
    for p in (parser, w):
        p.add_argument("--mib", type=int, default=1024)
        p.add_argument("--step-ms", type=float, default=25.0)
        p.add_argument("--step", choices=("sleep", "cpu"), default="sleep",
                       help="a source's training step: an accelerator's (the thread held, "
                       "the CPU free) or numpy's (5 peers on this machine's cores)")
    parser.add_argument("--survivors", type=int, default=4)
    parser.add_argument("--uplink", default="110mbit")
    parser.add_argument("--downlink", default="500mbit")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--skip-one", action="store_true", help="only the striped run")
    parser.add_argument("--nice", type=int, default=0,
                        help="run the peers at this niceness (negative: ahead of the rest of "
                        "a shared machine's load, as on hosts of their own)")
    args = parser.parse_args(argv)
    if args.command == "worker":
        asyncio.run(worker(args))
        return 0
    why = netns.unavailable()
    if why:
        raise SystemExit(f"heal: {why}")
    s = args.survivors
    results = []
    with netns.Lab(s + 1) as lab:
        shape(lab, s, args.uplink, args.downlink)
        load = os.getloadavg()[0]
        results.append(summary("striped", run(lab, list(range(s + 1)), args)))
        print(json.dumps(results[-1]), flush=True)
        if not args.skip_one:
            results.append(summary("one sender", run(lab, [0, s], args)))
            print(json.dumps(results[-1]), flush=True)
    print(f"\nheal of {args.mib} MiB, uplinks {args.uplink}, joiner's downlink "
          f"{args.downlink}, {args.step} steps of {args.step_ms:g} ms, niceness {args.nice}, "
          f"load {load:.2f} at the start")
    print("| run | sources | heal (s) | step before (ms) | step during (ms) | ratio | "
          "CPU s: joiner, sources | identical |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['run']} | {r['sources']} | {r['seconds']} | {r['step_before_ms']} | "
              f"{r['step_during_ms']} | {r['step_ratio']} | {r['cpu_joiner_s']}, "
              f"{r['cpu_sources_s']} | {r['identical']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
