"""What a training round costs in communication: fused buckets vs one allreduce per tensor.

    python benchmarks/training_bench.py                    # 2 and 4 peers, 1M and 25M params
    python benchmarks/training_bench.py --peers 2 --models 1M --rounds 3     # a quick look

Not a test: it prints a table. The driver starts the peers as processes with
:func:`p2pcoll.launch.launch` (re-running this file with ``--worker``); rank 0 writes the raw
times as JSON to a file the driver reads back.

The model is an MLP of 50 square float32 layers, a weight and a bias each: 100 tensors, of
about 1M parameters (width 141) or 25M parameters (width 707). For each world size and model:

- compute: one forward and backward pass over a batch of ``--batch`` rows (numpy, one thread
  per peer, since the peers share this machine's cores) that yields the 100 gradients;
- communication: ``allreduce_gradients`` of those gradients alone, per strategy, fused into
  buckets (the default size, and for "auto" also 1 MiB and 25 MiB) or not fused
  (``bucket_bytes=0``: one allreduce per tensor, all in flight together);
- fraction: communication / (compute + communication), the share of a sequential round spent
  communicating;
- overlap: a whole round through a ``GradientReducer`` whose backward pass hands over each
  layer's gradients as it produces them and lets the event loop run between layers.

Every timed round is preceded by a barrier; a round's time is that of its slowest rank, and
the tables show the median over ``--rounds`` rounds (after one warm-up round).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

LAYERS = 50
WIDTHS = {"1M": 141, "25M": 707}  # 50 * (w*w + w) parameters: 1.00M and 25.0M
STRATEGIES = ("ring", "recursive_doubling", "reduce_broadcast")
MiB = 1 << 20


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--peers", default="2,4", help="world sizes, comma-separated")
    parser.add_argument("--models", default="1M,25M", help=f"of {sorted(WIDTHS)}")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per measurement")
    parser.add_argument("--batch", type=int, default=32, help="rows per forward pass")
    parser.add_argument("--json", metavar="PATH", help="also write the raw results here")
    parser.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)
    return parser.parse_args()


# --- the model ---------------------------------------------------------------------------------


def make_params(width: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    params = {}
    for i in range(LAYERS):
        params[f"layer{i}.weight"] = (rng.normal(size=(width, width)) / np.sqrt(width)).astype(
            np.float32)
        params[f"layer{i}.bias"] = np.zeros(width, np.float32)
    return params


def forward(params: dict[str, np.ndarray], x: np.ndarray) -> list[np.ndarray]:
    acts = [x]
    for i in range(LAYERS):
        acts.append(np.tanh(acts[-1] @ params[f"layer{i}.weight"] + params[f"layer{i}.bias"]))
    return acts


def backward_layers(params: dict[str, np.ndarray], acts: list[np.ndarray]) -> Any:
    """Yield each layer's (name, gradient) pairs, last layer first, as backprop makes them."""
    delta = acts[-1] * (1 - acts[-1] ** 2) / len(acts[0])  # d(mean of sum(h^2)/2) via tanh
    for i in reversed(range(LAYERS)):
        yield [(f"layer{i}.weight", acts[i].T @ delta), (f"layer{i}.bias", delta.sum(axis=0))]
        delta = (delta @ params[f"layer{i}.weight"].T) * (1 - acts[i] ** 2)


def compute_gradients(params: dict[str, np.ndarray], x: np.ndarray) -> dict[str, np.ndarray]:
    grads = {}
    for layer in backward_layers(params, forward(params, x)):
        grads.update(layer)
    return grads


# --- the worker ---------------------------------------------------------------------------------


async def timed(g: Any, rounds: int, body: Any) -> float:
    """Median over rounds of the slowest rank's time of ``await body()``, in seconds."""
    times = []
    for i in range(rounds + 1):
        await g.barrier()
        start = time.perf_counter()
        await body()
        if i:  # the first round warms up
            times.append(time.perf_counter() - start)
    slowest = await g.allreduce(np.array(times), op="max")
    return float(np.median(slowest))


async def worker(out: str) -> None:
    import p2pcoll
    from p2pcoll import training

    spec = json.loads(os.environ["TRAINING_BENCH"])
    rows: list[dict[str, Any]] = []
    async with p2pcoll.join(collective_timeout=600) as g:
        for model in spec["models"]:
            params = make_params(WIDTHS[model])
            nparams = sum(p.size for p in params.values())
            x = np.random.default_rng(g.rank).normal(size=(spec["batch"], WIDTHS[model]))
            x = x.astype(np.float32)
            grads = compute_gradients(params, x)

            async def compute(params: Any = params, x: Any = x) -> None:
                compute_gradients(params, x)

            compute_s = await timed(g, spec["rounds"], compute)
            base = {"peers": g.world_size, "model": model, "params": nparams,
                    "tensors": len(params), "compute_s": compute_s}

            configs = [(s, b) for s in spec["strategies"] for b in (None, 0)]
            configs += [("auto", b) for b in (MiB, None, 25 * MiB)]
            for strategy, bucket in configs:
                async def communicate(strategy: str = strategy, bucket: Any = bucket,
                                      grads: Any = grads) -> None:
                    await training.allreduce_gradients(g, grads, strategy=strategy,
                                                       bucket_bytes=bucket)

                comm_s = await timed(g, spec["rounds"], communicate)
                plan = training.BucketPlan(
                    [training.TensorSpec.of(n, a) for n, a in sorted(grads.items())], bucket)
                rows.append({**base, "strategy": strategy, "bucket_bytes": plan.bucket_bytes,
                             "buckets": len(plan.buckets), "comm_s": comm_s})

            reducer = training.GradientReducer(g, params)

            async def overlapped(params: Any = params, x: Any = x,
                                 reducer: Any = reducer) -> None:
                async with reducer.start_round() as rnd:
                    for layer in backward_layers(params, forward(params, x)):
                        for name, grad in layer:
                            rnd.add(name, grad)
                        await asyncio.sleep(0)  # let full buckets make progress
                    await rnd.wait()

            round_s = await timed(g, spec["rounds"], overlapped)
            rows.append({**base, "strategy": "auto", "bucket_bytes": reducer.plan.bucket_bytes,
                         "buckets": len(reducer.plan.buckets), "overlap_round_s": round_s})
    if g.rank == 0:
        Path(out).write_text(json.dumps(rows))


# --- the driver ---------------------------------------------------------------------------------


def run(peers: int, spec: dict[str, Any]) -> list[dict[str, Any]]:
    from p2pcoll.launch import launch

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        env = {"TRAINING_BENCH": json.dumps(spec), "OMP_NUM_THREADS": "1",
               "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        code = launch(peers, [sys.executable, __file__, "--worker", out], extra_env=env,
                      prefix_output=True)
        if code != 0:
            raise SystemExit(f"the {peers} peers failed with exit code {code}")
        rows: list[dict[str, Any]] = json.loads(Path(out).read_text())
        return rows


def bucket_words(row: dict[str, Any]) -> str:
    if row["bucket_bytes"] == 0:
        return f"none ({row['buckets']} allreduces)"
    return f"{row['bucket_bytes'] / MiB:g} MiB ({row['buckets']})"


def print_tables(rows: list[dict[str, Any]]) -> None:
    comm = [r for r in rows if "comm_s" in r]
    print("\nCommunication per round: allreduce_gradients of 100 float32 tensors "
          "(median of the slowest rank)\n")
    print("| peers | model | strategy | fusion (buckets) | comm ms | compute ms | comm fraction |")
    print("|---|---|---|---|---|---|---|")
    for r in comm:
        frac = r["comm_s"] / (r["comm_s"] + r["compute_s"])
        print(f"| {r['peers']} | {r['model']} ({r['params'] / 1e6:.2f}M) | {r['strategy']} | "
              f"{bucket_words(r)} | {r['comm_s'] * 1e3:.1f} | {r['compute_s'] * 1e3:.1f} | "
              f"{frac:.0%} |")
    print("\nA whole round through GradientReducer, gradients handed over layer by layer\n")
    print("| peers | model | buckets | compute + comm ms (sequential, auto) | "
          "overlapped round ms |")
    print("|---|---|---|---|---|")
    for r in rows:
        if "overlap_round_s" not in r:
            continue
        seq = next(c for c in comm if c["peers"] == r["peers"] and c["model"] == r["model"]
                   and c["strategy"] == "auto" and c["bucket_bytes"] == r["bucket_bytes"])
        print(f"| {r['peers']} | {r['model']} | {bucket_words(r)} | "
              f"{(seq['comm_s'] + seq['compute_s']) * 1e3:.1f} | "
              f"{r['overlap_round_s'] * 1e3:.1f} |")


def main() -> int:
    args = parse_args()
    if args.worker:
        asyncio.run(worker(args.worker))
        return 0
    spec = {"models": args.models.split(","), "strategies": args.strategies.split(","),
            "rounds": args.rounds, "batch": args.batch}
    unknown = set(spec["models"]) - set(WIDTHS)
    if unknown:
        raise SystemExit(f"unknown models {sorted(unknown)}; choose from {sorted(WIDTHS)}")
    rows = []
    for peers in (int(p) for p in args.peers.split(",")):
        print(f"running {peers} peers ...", flush=True)
        rows += run(peers, spec)
    print_tables(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
