"""The Gloo side of ``p2pcoll bench --compare gloo``: the same measurement, torch.distributed.

The driver in :mod:`p2pcoll.bench` starts ``world_size`` copies of

    python -m p2pcoll.bench_gloo --out PATH --config JSON

with :func:`p2pcoll.launch.launch` (which sets ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT``) and ``GLOO_SOCKET_IFNAME=lo``, after the p2pcoll peers have finished. Each
copy calls ``torch.set_num_threads(1)``, joins a Gloo process group at
``tcp://MASTER_ADDR:MASTER_PORT`` and, for every size, measures exactly as the p2pcoll worker
does: the input is allocated once (rank r's filled with r + 1) and refilled before each
iteration; ``warmup`` untimed collectives; ``iters`` timed ones, each after
``dist.barrier()``, timed with ``time.perf_counter()`` around the collective alone; the
per-iteration times reduced with ``max`` over the ranks after the loop; the last result
checked; the peak RSS noted; then ``pipelined`` collectives started together
(``async_op=True``) and waited for, the time divided by their number.

The collectives are torch's in-place or preallocated forms: ``all_reduce`` (in place),
``broadcast`` and ``reduce`` from/to rank 0 (in place), ``all_gather_single`` into one
preallocated tensor, ``reduce_scatter_single`` (``reduce_scatter`` with a list of parts when
the count does not divide evenly), summing.

Rank 0 writes the raw rows (the same fields as the p2pcoll worker's, strategy ``"gloo"``) as
JSON to ``PATH``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import numpy as np

from .bench import ROOT, check_result, fill_value, peak_rss, reset_peak_rss

TIMEOUT = timedelta(seconds=300)  # Gloo's own deadline for each collective

warnings.filterwarnings("ignore", category=FutureWarning, module="torch")


class _Collective:
    """One collective on buffers of its own: ``start()`` runs it, ``result()`` reads it."""

    def __init__(self, dist: Any, torch: Any, collective: str, count: int, dtype: str,
                 rank: int, p: int) -> None:
        self._dist, self._collective, self._rank, self._p = dist, collective, rank, p
        self._value = fill_value(rank)
        self.x = np.full(count, self._value, dtype=dtype)
        self._input = torch.from_numpy(self.x)
        self._output = None
        self._parts: list[Any] = []
        if collective == "allgather":
            self._output = torch.empty(p * count, dtype=self._input.dtype)
        elif collective == "reduce_scatter":
            self._parts = list(torch.tensor_split(self._input, p))
            self._output = torch.empty_like(self._parts[rank])

    def refill(self) -> None:
        self.x.fill(self._value)

    def start(self, async_op: bool = False) -> Any:
        """Run the collective (wait for it unless ``async_op``); returns its torch Work."""
        dist, c, x = self._dist, self._collective, self._input
        if c == "allreduce":
            return dist.all_reduce(x, async_op=async_op)
        if c == "broadcast":
            return dist.broadcast(x, src=ROOT, async_op=async_op)
        if c == "reduce":
            return dist.reduce(x, dst=ROOT, async_op=async_op)
        if c == "allgather":
            gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            return gather(self._output, x, async_op=async_op)
        if c == "reduce_scatter":
            if x.numel() % self._p == 0:
                scatter = (getattr(dist, "reduce_scatter_single", None)
                           or dist.reduce_scatter_tensor)
                return scatter(self._output, x, async_op=async_op)
            return dist.reduce_scatter(self._output, self._parts, async_op=async_op)
        raise ValueError(f"unknown collective {c!r}")

    def result(self) -> Any:
        """What the p2pcoll worker's call would return, as numpy, for ``check_result``."""
        c = self._collective
        if c == "reduce" and self._rank != ROOT:
            return None
        if c == "allgather":
            assert self._output is not None
            return list(self._output.numpy().reshape(self._p, -1))
        if c == "reduce_scatter":
            assert self._output is not None
            return self._output.numpy()
        return self.x


def _slowest(dist: Any, torch: Any, values: list[float]) -> list[float]:
    if not values:
        return []
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [float(v) for v in t.tolist()]


def bench_size(dist: Any, torch: Any, config: dict[str, Any], nbytes: int) -> dict[str, Any]:
    """Time one size the way ``p2pcoll.bench`` does; returns the raw row (max over ranks)."""
    collective, dtype = config["collective"], config["dtype"]
    rank, p = dist.get_rank(), dist.get_world_size()
    itemsize = np.dtype(dtype).itemsize
    count = nbytes // itemsize

    rss_before, rss_reset = reset_peak_rss()
    op = _Collective(dist, torch, collective, count, dtype, rank, p)

    for _ in range(config["warmup"]):
        op.refill()
        dist.barrier()
        op.start()

    times = []
    for _ in range(config["iters"]):
        op.refill()
        dist.barrier()
        t0 = time.perf_counter()
        op.start()
        times.append(time.perf_counter() - t0)
    check_result(collective, op.result(), rank, p, count, dtype)
    rss_peak = peak_rss()

    k = config["pipelined"]
    ops = [op, *(_Collective(dist, torch, collective, count, dtype, rank, p)
                 for _ in range(k - 1))][:k]
    pipelined = []
    if k:
        for _ in range(max(3, config["iters"] // k)):
            for each in ops:
                each.refill()
            dist.barrier()
            t0 = time.perf_counter()
            works = [each.start(async_op=True) for each in ops]
            for work in works:
                work.wait()
            pipelined.append((time.perf_counter() - t0) / k)

    rss = _slowest(dist, torch, [rss_before, rss_peak])
    return {
        "strategy": "gloo",
        "chosen": "gloo",
        "size": count * itemsize,
        "count": count,
        "times": _slowest(dist, torch, times),
        "pipelined": _slowest(dist, torch, pipelined),
        "rss_before": int(rss[0]),
        "rss_peak": int(rss[1]),
        "rss_reset": rss_reset,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m p2pcoll.bench_gloo",
        description="Gloo worker of `p2pcoll bench --compare gloo` (started by the launcher).",
    )
    parser.add_argument("--out", required=True, help="where rank 0 writes the raw rows")
    parser.add_argument("--config", required=True, help="the bench configuration, as JSON")
    args = parser.parse_args(argv)
    config = json.loads(args.config)

    import torch  # noqa: PLC0415 (optional dependency: the bench extra)
    import torch.distributed as dist  # noqa: PLC0415

    torch.set_num_threads(1)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world_size != config["world_size"]:
        raise SystemExit(f"WORLD_SIZE={world_size}, but the configuration says "
                         f"{config['world_size']}")
    address = f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    dist.init_process_group("gloo", init_method=address, rank=rank, world_size=world_size,
                            timeout=TIMEOUT)
    try:
        rows = [bench_size(dist, torch, config, nbytes) for nbytes in config["sizes"]]
        if rank == 0:
            with open(args.out, "w", encoding="utf-8") as f:
                json.dump({"rows": rows}, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
