"""Small collectives through torch.distributed: the "p2pcoll" backend against Gloo.

    python benchmarks/torch_small.py                          # 2 ranks, 3 runs per backend
    python benchmarks/torch_small.py --nproc 4 --runs 5 --sizes 4K,64K,1M --iters 300
    python benchmarks/torch_small.py --json                   # the figures as JSON
    python benchmarks/torch_small.py --ddp                    # then benchmarks/ddp_step.py
    python benchmarks/torch_small.py --sizes 4K,64K,1M,16M,64M  # the issue's sizes

Not a test: it prints a markdown table. Every run is one ``torchrun`` world on this host
(``--nproc`` ranks, env:// rendezvous on 127.0.0.1, ``GLOO_SOCKET_IFNAME=lo``,
``torch.set_num_threads(1)``) of one backend, which times ``dist.all_reduce`` (sum) and
``dist.broadcast`` (root 0) of float32 tensors of each size: ``--warmup`` untimed calls,
then ``--iters`` timed ones (fewer above 1 MiB: at most 256 MiB per op and size, at least
10 calls). Before each call the tensor is refilled with fresh values,
outside the timed region; no barrier separates the calls, so each rank times its own
calls back to back, as a training loop makes them. Backends alternate run by run
(p2pcoll, gloo, p2pcoll, gloo, ...), so drifts of the host's load hit both alike.

A run's figures per collective and size are the slowest rank's median and p99 call time
(each rank's own, then the largest over the ranks); the table shows the median over the
runs of each, per backend, and p2pcoll / Gloo (below 1: p2pcoll is faster).
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

ROOT = Path(__file__).resolve().parents[1]
BACKENDS = ("p2pcoll", "gloo")
OPS = ("all_reduce", "broadcast")


def parse_size(text: str) -> int:
    """Bytes from "4096", "4K", "64KiB", "1M"."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    number = t[:-1] if t[-1:] in "KMG" else t
    try:
        n = int(float(number) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 4K, 64K, 1M)") from None
    if n <= 0 or n % 4:
        raise argparse.ArgumentTypeError(f"size {text!r}: a positive multiple of 4 bytes")
    return n


def label(nbytes: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def calls(iters: int, nbytes: int) -> int:
    """Timed calls of a size: ``iters``, fewer for large sizes (see the module docstring)."""
    return max(10, min(iters, (256 << 20) // nbytes))


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


# --- one rank of one run ---------------------------------------------------------------


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(args.backend)
    rank, size = dist.get_rank(), dist.get_world_size()
    figures: dict[str, dict[str, list[float]]] = {}
    for op in OPS:
        for nbytes in args.sizes:
            n = nbytes // 4
            x = torch.empty(n, dtype=torch.float32)
            # Fresh inputs, made before timing; one per call would cost memory at large sizes.
            fresh = [torch.full((n,), float(rank + 1 + k), dtype=torch.float32)
                     for k in range(4)]
            times: list[float] = []
            iters = calls(args.iters, nbytes)
            for i in range(min(args.warmup, iters) + iters):
                x.copy_(fresh[i % len(fresh)])
                t0 = time.perf_counter()
                if op == "all_reduce":
                    dist.all_reduce(x)
                else:
                    dist.broadcast(x, src=0)
                t1 = time.perf_counter()
                if i >= min(args.warmup, iters):
                    times.append(t1 - t0)
                elif i == 0:
                    _check(op, x, size, rank)
            figures[f"{op} {nbytes}"] = {"median": [statistics.median(times)],
                                         "p99": [p99(times)]}
    # Every rank's figures to rank 0, after the timing (an all_reduce of MAX: the slowest).
    keys = sorted(figures)
    mine = torch.tensor([[figures[k]["median"][0], figures[k]["p99"][0]] for k in keys],
                        dtype=torch.float64)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    if rank == 0:
        Path(args.out).write_text(json.dumps(
            {k: {"median": row[0], "p99": row[1]} for k, row in zip(keys, mine.tolist())}))
    dist.destroy_process_group()


def _check(op: str, x: object, size: int, rank: int) -> None:
    """The first call's result, so a broken backend cannot post fast figures."""
    import torch

    assert isinstance(x, torch.Tensor)
    want = float(sum(range(1, size + 1))) if op == "all_reduce" else 1.0
    if not bool((x == want).all()):
        raise SystemExit(f"rank {rank}: {op} gave {x[:4].tolist()}..., expected {want}")


# --- the runs ----------------------------------------------------------------------------


def one_run(backend: str, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    from p2pcoll.testing import free_port

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
               str(args.nproc), "--master-addr", "127.0.0.1", "--master-port",
               str(free_port()), __file__, "--worker", "--backend", backend,
               "--sizes", ",".join(str(s) for s in args.sizes), "--iters", str(args.iters),
               "--warmup", str(args.warmup), "--out", str(out)]
        env = {**os.environ, "PYTHONWARNINGS": "ignore", "GLOO_SOCKET_IFNAME": "lo",
               "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        done = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True,
                              timeout=args.run_timeout)
        if done.returncode != 0:
            raise SystemExit(f"{backend} run failed ({done.returncode}):\n"
                             f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        result: dict[str, dict[str, float]] = json.loads(out.read_text())
        return result


def summarize(runs: dict[str, list[dict[str, dict[str, float]]]],
              args: argparse.Namespace) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for op in OPS:
        for nbytes in args.sizes:
            key = f"{op} {nbytes}"
            row: dict[str, object] = {"op": op, "bytes": nbytes}
            for backend in BACKENDS:
                for stat in ("median", "p99"):
                    each = [r[key][stat] * 1e6 for r in runs[backend]]
                    row[f"{backend}_{stat}_us"] = statistics.median(each)
                    row[f"{backend}_{stat}_runs_us"] = each
            for stat in ("median", "p99"):
                row[f"ratio_{stat}"] = (float(row[f"p2pcoll_{stat}_us"])  # type: ignore[arg-type]
                                        / float(row[f"gloo_{stat}_us"]))  # type: ignore[arg-type]
            rows.append(row)
    return rows


def table(rows: list[dict[str, object]], args: argparse.Namespace) -> str:
    lines = [f"torch.distributed, {args.nproc} ranks, float32, {args.iters} timed calls "
             f"after {args.warmup}, median over {args.runs} alternating runs of the slowest "
             f"rank's median (p99) call time; load average {args.load[0]:.1f} before, "
             f"{args.load[1]:.1f} after", "",
             "| op | size | p2pcoll µs (p99) | Gloo µs (p99) | p2pcoll / Gloo (p99) | "
             "runs p2pcoll | runs Gloo |",
             "|---|---|---:|---:|---:|---|---|"]
    for r in rows:
        each = {b: " ".join(f"{v:.0f}" for v in r[f"{b}_median_runs_us"])  # type: ignore[attr-defined]
                for b in BACKENDS}
        lines.append(
            f"| {r['op']} | {label(int(r['bytes']))} "  # type: ignore[call-overload]
            f"| {r['p2pcoll_median_us']:.0f} ({r['p2pcoll_p99_us']:.0f}) "
            f"| {r['gloo_median_us']:.0f} ({r['gloo_p99_us']:.0f}) "
            f"| {r['ratio_median']:.2f} ({r['ratio_p99']:.2f}) "
            f"| {each['p2pcoll']} | {each['gloo']} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nproc", type=int, default=2, help="ranks per run")
    parser.add_argument("--runs", type=int, default=3, help="runs per backend")
    parser.add_argument("--sizes", default="4K,64K",
                        help="comma-separated sizes in bytes (4K, 64K, 1M, 4096)")
    parser.add_argument("--iters", type=int, default=200, help="timed calls per op and size")
    parser.add_argument("--warmup", type=int, default=30, help="untimed calls first")
    parser.add_argument("--json", action="store_true", help="print JSON, not the table")
    parser.add_argument("--ddp", action="store_true",
                        help="then run benchmarks/ddp_step.py at the same world size and runs")
    parser.add_argument("--run-timeout", type=float, default=600, help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--backend", default="p2pcoll", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    if args.nproc < 1 or args.runs < 1 or args.iters < 1 or args.warmup < 1:
        parser.error("--nproc, --runs, --iters and --warmup must be at least 1")
    if args.worker:
        worker(args)
        return 0

    runs: dict[str, list[dict[str, dict[str, float]]]] = {b: [] for b in BACKENDS}
    before = os.getloadavg()[0]
    for i in range(args.runs):
        for backend in BACKENDS:
            runs[backend].append(one_run(backend, args))
            print(f"run {i} {backend} done", file=sys.stderr, flush=True)
    args.load = (before, os.getloadavg()[0])
    rows = summarize(runs, args)
    if args.json:
        print(json.dumps({"nproc": args.nproc, "runs": args.runs, "iters": args.iters,
                          "load": args.load, "rows": rows}, indent=1))
    else:
        print(table(rows, args))
    if args.ddp:
        sys.stdout.flush()
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ddp_step.py"), "-n",
                        str(args.nproc), "--runs", str(args.runs)], check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
