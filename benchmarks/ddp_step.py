"""DDP step time on p2pcoll against Gloo: one model of about 25 M parameters, 2 and 4 ranks.

    python benchmarks/ddp_step.py                      # -n 2,4, 3 alternating runs each
    python benchmarks/ddp_step.py -n 2 --runs 5 --steps 20

Not a test: it prints a markdown table. Every run is one ``torchrun`` world on this host
(OMP_NUM_THREADS=1 per rank, as torchrun sets it) training four Linear layers (25.2 M
float32 parameters, so 101 MB of gradients allreduced per step in DDP's 25 MB buckets)
on random data with SGD. The backends alternate run by run (gloo, p2pcoll, p2pcoll, gloo,
...), so drifts of the host's load hit both alike. A run's figure is the median over its
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
            {"params": params, "median": statistics.median(mine.tolist())}))
    dist.destroy_process_group()
    del model, opt


def run(backend: str, p: int, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(p),
               "--master-port", str(_port()), __file__, "--worker", "--backend", backend,
               "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--batch", str(args.batch), "--out", str(out)]
        env = {**os.environ, "PYTHONWARNINGS": "ignore"}
        done = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True,
                              timeout=600)
        if done.returncode != 0:
            raise SystemExit(f"{backend} p={p} failed:\n{done.stdout[-2000:]}\n"
                             f"{done.stderr[-2000:]}")
        return json.loads(out.read_text())


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
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--backend", default="p2pcoll", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    rows = []
    params = 0
    for p in (int(s) for s in args.n.split(",")):
        medians: dict[str, list[float]] = {"gloo": [], "p2pcoll": []}
        for i in range(args.runs):
            order = ("gloo", "p2pcoll") if i % 2 == 0 else ("p2pcoll", "gloo")
            for backend in order:
                result = run(backend, p, args)
                params = result["params"]
                medians[backend].append(result["median"])
                print(f"p={p} run {i} {backend}: {result['median'] * 1e3:.1f} ms",
                      file=sys.stderr, flush=True)
        g, c = statistics.median(medians["gloo"]), statistics.median(medians["p2pcoll"])
        rows.append((p, g, c, medians))
    print(f"DDP step, {params / 1e6:.1f} M parameters, batch {args.batch} per rank, "
          f"{args.runs} alternating runs of {args.steps} steps per backend\n")
    print("| ranks | Gloo step (ms) | p2pcoll step (ms) | p2pcoll / Gloo | runs, Gloo | "
          "runs, p2pcoll |")
    print("|---|---|---|---|---|---|")
    for p, g, c, m in rows:
        each = {k: " ".join(f"{v * 1e3:.0f}" for v in vs) for k, vs in m.items()}
        print(f"| {p} | {g * 1e3:.1f} | {c * 1e3:.1f} | {c / g:.2f} | {each['gloo']} | "
              f"{each['p2pcoll']} |")


if __name__ == "__main__":
    main()
