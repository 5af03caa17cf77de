"""DDP step time on p2pcoll against Gloo: one model of about 25 M parameters, 2 and 4 ranks.

    python benchmarks/ddp_step.py                      # -n 2,4, 3 alternating runs each
    python benchmarks/ddp_step.py -n 2 --runs 5 --steps 20
    python benchmarks/ddp_step.py --base /tmp/old-tree   # also p2pcoll from another tree
    python benchmarks/ddp_step.py --floor               # also the step with no allreduce

Not a test: it prints a markdown table. Every run is one ``torchrun`` world on this host
(OMP_NUM_THREADS=1 per rank, as torchrun sets it, for every backend alike: each rank
computes on one intra-op thread, so with as many ranks as cores every core computes; the
table says how many threads torch had) training four Linear layers (25.2 M
float32 parameters, so 101 MB of gradients allreduced per step in DDP's 25 MB buckets)
on random data with SGD. The backends alternate run by run (gloo, p2pcoll, p2pcoll, gloo,
...; with ``--base``, three in a rotating order), so drifts of the host's load hit all
alike; the host's load average is printed before and after. A run's figure is the median over its
timed steps of the slowest rank's step time; the table shows, per world size, the median
over the runs of each backend and p2pcoll / Gloo (below 1: p2pcoll is faster).
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


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group(args.backend)
    rank = dist.get_rank()
    torch.manual_seed(0)
    width = 2048
    model = DistributedDataParallel(torch.nn.Sequential(
        torch.nn.Linear(width, 2 * width), torch.nn.ReLU(),
        torch.nn.Linear(2 * width, width), torch.nn.ReLU(),
        torch.nn.Linear(width, width), torch.nn.ReLU(),
        torch.nn.Linear(width, width)))
    if args.floor:  # the compute alone: DDP hands every bucket to a hook that sends nothing
        def nothing(state, bucket):  # type: ignore[no-untyped-def]  # torch reads annotations
            fut = torch.futures.Future()
            fut.set_result(bucket.buffer())
            return fut

        model.register_comm_hook(None, nothing)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(args.batch, width)
    times = []
    for step in range(args.warmup + args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
    mine = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)  # the slowest rank's time, step by step
    if rank == 0:
        Path(args.out).write_text(json.dumps(
            {"params": params, "median": statistics.median(mine.tolist()),
             "threads": torch.get_num_threads()}))
    dist.destroy_process_group()
    del model, opt


def run(backend: str, p: int, args: argparse.Namespace, tree: str | None = None,
        floor: bool = False) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(p),
               "--master-port", str(_port()), __file__, "--worker", "--backend", backend,
               "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--batch", str(args.batch), "--out", str(out)] + (["--floor"] if floor else [])
        env = {**os.environ, "PYTHONWARNINGS": "ignore"}
        if tree is not None:  # p2pcoll imported from that tree
            env["PYTHONPATH"] = os.pathsep.join([tree, *filter(None, [env.get("PYTHONPATH")])])
        done = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True,
                              timeout=600)
        if done.returncode != 0:
            raise SystemExit(f"{backend} p={p} failed:\n{done.stdout[-2000:]}\n"
                             f"{done.stderr[-2000:]}")
        result: dict[str, Any] = json.loads(out.read_text())
        return result


def _port() -> int:
    from p2pcoll.testing import free_port

    return free_port()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-n", default="2,4", help="world sizes")
    parser.add_argument("--runs", type=int, default=3, help="runs per backend and size")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16, help="samples per rank")
    parser.add_argument("--base", help="also run p2pcoll from this source tree (the old code)")
    parser.add_argument("--floor", action="store_true",
                        help="also time the step with no allreduce (Gloo world, DDP with a "
                             "comm hook that sends nothing): the compute's floor")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--backend", default="p2pcoll", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    names = (["gloo", "p2pcoll"] + (["base"] if args.base else [])
             + (["floor"] if args.floor else []))
    rows = []
    params = threads = 0
    print(f"load before: {_load()}", file=sys.stderr, flush=True)
    for p in (int(s) for s in args.n.split(",")):
        medians: dict[str, list[float]] = {k: [] for k in names}
        for i in range(args.runs):
            order = names[i % len(names):] + names[:i % len(names)]
            if i % 2:
                order.reverse()
            for name in order:
                backend, tree = ("p2pcoll", args.base) if name == "base" else (name, None)
                result = run("gloo" if name == "floor" else backend, p, args, tree,
                             floor=name == "floor")
                params, threads = result["params"], result["threads"]
                medians[name].append(result["median"])
                print(f"p={p} run {i} {name}: {result['median'] * 1e3:.1f} ms",
                      file=sys.stderr, flush=True)
        rows.append((p, {k: statistics.median(v) for k, v in medians.items()}, medians))
    print(f"DDP step, {params / 1e6:.1f} M parameters, batch {args.batch} per rank, "
          f"{threads} torch thread(s) per rank, {args.runs} alternating runs of {args.steps} "
          f"steps per backend; load after: {_load()}\n")
    base = " base step (ms) | base / Gloo |" if args.base else ""
    floor = " compute floor (ms) | floor / Gloo |" if args.floor else ""
    print(f"| ranks | Gloo step (ms) | p2pcoll step (ms) | p2pcoll / Gloo |{base}{floor} runs |")
    print("|---|---|---|---|" + ("---|---|" if args.base else "")
          + ("---|---|" if args.floor else "") + "---|")
    for p, med, m in rows:
        each = "; ".join(f"{k} " + " ".join(f"{v * 1e3:.0f}" for v in vs)
                         for k, vs in m.items())
        g = med["gloo"]
        cells = [f"{g * 1e3:.1f}", f"{med['p2pcoll'] * 1e3:.1f}", f"{med['p2pcoll'] / g:.2f}"]
        if args.base:
            cells += [f"{med['base'] * 1e3:.1f}", f"{med['base'] / g:.2f}"]
        if args.floor:
            cells += [f"{med['floor'] * 1e3:.1f}", f"{med['floor'] / g:.2f}"]
        print(f"| {p} | " + " | ".join(cells) + f" | {each} |")


def _load() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"

if __name__ == "__main__":
    main()
