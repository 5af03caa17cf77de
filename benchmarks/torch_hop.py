"""The torch backend's hop: what a torch call on "p2pcoll" costs beyond the group's own
collective, for a small allreduce.

    python benchmarks/torch_hop.py                    # 2 ranks, 4 KiB, 3 runs
    python benchmarks/torch_hop.py --bytes 65536 --nproc 2 --runs 5 --iters 500
    python benchmarks/torch_hop.py --op broadcast --bytes 1048576

Not a test: it prints a markdown table. Every run is one ``torchrun`` world of the p2pcoll
backend whose ranks take turns, in blocks of ``--iters`` calls, at four ways of making the
same allreduce (sum of float32, in place, Gloo's order as the backend runs it) on the same
group, fresh input before every call (outside the timed region):

- ``nop``: a coroutine that does nothing, handed to the loop thread and waited for (no
  collective): the bare round trip between the threads;
- ``loop``: ``await group.allreduce(...)`` timed inside one coroutine on the loop thread:
  the group's own time, no hop;
- ``submit``: the same coroutine handed from the main thread to the loop thread and waited
  for (``Runtime.run``, as :mod:`p2pcoll.blocking` does): one plain round trip;
- ``backend``: ``ProcessGroupP2PColl.allreduce([x]).wait()`` called directly: the backend's
  own path (its checks, the Work, the completion) without torch's dispatch;
- ``torch``: ``dist.all_reduce(x)``: what a torch user gets;
- ``queued``: the same with the caller's-thread start off (``DRIVE_BYTES`` -1): every call
  handed to the loop thread, as before 0.12.

``--op broadcast`` times ``broadcast`` (root 0) the same ways. Each way's voluntary context
switches per call (the process's, every thread's) are shown too: a hop between threads is
one or two of them, whatever the load.

A run's figure per way is rank 0's median call time; the table shows the median over the
runs and the median over the runs of each way's extra over the same run's ``loop`` (the
hop). On a virtual machine a thread's wake-up costs ~10 us when the two threads share a
CPU and ~50-100 us when they do not, so runs differ; the hop is paired run by run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WAYS = ("nop", "loop", "submit", "backend", "torch", "queued")


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from p2pcoll.integrations.torch import backend

    torch.set_num_threads(1)
    dist.init_process_group("p2pcoll")
    rank = dist.get_rank()
    pg: Any = dist.group.WORLD  # the ProcessGroupP2PColl itself (extended_api)
    group, runtime = pg.group, pg._runtime
    n = args.bytes // 4
    x = torch.empty(n, dtype=torch.float32)
    a = x.numpy()
    fresh = [torch.full((n,), float(rank + 1 + k)) for k in range(4)]
    times: dict[str, list[float]] = {w: [] for w in WAYS}
    switches: dict[str, int] = dict.fromkeys(WAYS, 0)
    bcast = args.op == "broadcast"

    async def collective() -> None:
        if bcast:
            await group.broadcast(a, 0)
        else:
            await group.allreduce(a, "sum", out=a)

    async def in_loop(count: int) -> list[float]:
        spent = []
        for i in range(count):
            x.copy_(fresh[i % 4])
            t0 = time.perf_counter()
            await collective()
            spent.append(time.perf_counter() - t0)
        return spent

    async def nop() -> None:
        pass

    def timed(call: object) -> list[float]:
        spent = []
        for i in range(args.iters):
            x.copy_(fresh[i % 4])
            t0 = time.perf_counter()
            call()  # type: ignore[operator]
            spent.append(time.perf_counter() - t0)
        return spent

    opts = dist.BroadcastOptions()
    torch_call = (lambda: dist.broadcast(x, 0)) if bcast else (lambda: dist.all_reduce(x))
    ways = {
        "nop": lambda: runtime.run(nop()),
        "submit": lambda: runtime.run(collective()),
        "backend": (lambda: pg.broadcast([x], opts).wait()) if bcast
        else (lambda: pg.allreduce([x]).wait()),
        "torch": torch_call,
        "queued": torch_call,
    }
    drive_bytes = backend.DRIVE_BYTES
    for block in range(args.blocks + 1):  # the first block of each way warms up
        for way in WAYS:
            backend.DRIVE_BYTES = -1 if way == "queued" else drive_bytes
            before = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
            spent = (runtime.run(in_loop(args.iters)) if way == "loop"
                     else timed(ways[way]))
            if block > 0:
                times[way] += spent
                switches[way] += resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - before
    if rank == 0:
        Path(args.out).write_text(json.dumps(
            {w: [statistics.median(t), switches[w] / len(t)] for w, t in times.items()}))
    dist.destroy_process_group()


def one_run(args: argparse.Namespace) -> dict[str, list[float]]:
    from p2pcoll.testing import free_port

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
               str(args.nproc), "--master-addr", "127.0.0.1", "--master-port",
               str(free_port()), __file__, "--worker", "--bytes", str(args.bytes),
               "--iters", str(args.iters), "--blocks", str(args.blocks), "--op", args.op,
               "--out", str(out)]
        env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1",
               "PYTHONPATH": str(ROOT)}
        done = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True,
                              timeout=600)
        if done.returncode != 0:
            raise SystemExit(f"run failed ({done.returncode}):\n{done.stdout[-3000:]}\n"
                             f"{done.stderr[-3000:]}")
        result: dict[str, list[float]] = json.loads(out.read_text())
        return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--bytes", type=int, default=4096)
    parser.add_argument("--op", choices=("allreduce", "broadcast"), default="allreduce")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--iters", type=int, default=200, help="calls per block")
    parser.add_argument("--blocks", type=int, default=3, help="timed blocks per way")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.bytes <= 0 or args.bytes % 4:
        parser.error("--bytes must be a positive multiple of 4")
    if args.worker:
        worker(args)
        return 0
    figures: dict[str, list[float]] = {w: [] for w in WAYS}
    csw: dict[str, list[float]] = {w: [] for w in WAYS}
    load = os.getloadavg()[0]
    for _ in range(args.runs):
        for way, (value, switches) in one_run(args).items():
            figures[way].append(value * 1e6)
            csw[way].append(switches)
    print(f"{args.op} of {args.bytes} B float32 on the p2pcoll backend, {args.nproc} ranks, "
          f"{args.blocks} x {args.iters} calls per way per run, median over {args.runs} runs "
          f"of rank 0's median call time; the hop: each run's figure minus the same run's "
          f"loop figure (then the median over runs); load average {load:.1f} before, "
          f"{os.getloadavg()[0]:.1f} after\n")
    print("| way | median µs | runs (µs) | hop over loop, µs | context switches a call |")
    print("|---|---:|---|---:|---:|")
    for way in WAYS:
        med = statistics.median(figures[way])
        runs = ", ".join(f"{v:.1f}" for v in figures[way])
        hops = [v - b for v, b in zip(figures[way], figures["loop"], strict=True)]
        extra = "" if way in ("loop", "nop") else f"+{statistics.median(hops):.1f}"
        print(f"| {way} | {med:.1f} | {runs} | {extra} | {statistics.median(csw[way]):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
