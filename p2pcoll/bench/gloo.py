"""The Gloo side of ``p2pcoll bench --compare gloo``: the same measurement, torch.distributed.

The driver (:mod:`p2pcoll.bench.runner`) starts ``world_size`` copies of

    python -m p2pcoll.bench.gloo --out PATH --config JSON

with :func:`p2pcoll.launch.launch` (which sets ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT``) and ``GLOO_SOCKET_IFNAME=lo``, after the p2pcoll peers have finished. Each
copy calls ``torch.set_num_threads(1)``, joins a Gloo process group at
``tcp://MASTER_ADDR:MASTER_PORT`` and, for every size, measures exactly as the p2pcoll worker
does (:func:`p2pcoll.bench.measure.measure_blocking`): the input is allocated once (rank r's
filled with r + 1) and refilled before each iteration; ``warmup`` untimed collectives;
``iters`` timed ones, each after ``dist.barrier()``, timed with ``time.perf_counter()``
around the collective alone; the per-iteration times reduced with ``max`` over the ranks
after the loop; the last result checked; the peak RSS noted; then ``pipelined`` collectives
started together (``async_op=True``) and waited for, the time divided by their number.

The collectives are torch's in-place or preallocated forms: ``all_reduce`` (in place),
``broadcast`` and ``reduce`` from/to rank 0 (in place), ``all_gather_single`` into one
preallocated tensor, ``reduce_scatter_single`` (``reduce_scatter`` with a list of parts when
the count does not divide evenly), summing; ``all_to_all_single`` with split sizes (part j of
``numpy.array_split`` to rank j) into one preallocated tensor.

Rank 0 writes the raw rows (the same fields as the p2pcoll worker's, strategy ``"gloo"``) as
JSON to ``PATH``.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import numpy as np

from .measure import (
    ROOT,
    blocking_result,
    fill_value,
    measure_blocking,
    worker_options,
    write_rows,
)

TIMEOUT = timedelta(seconds=300)  # Gloo's own deadline for each collective

warnings.filterwarnings("ignore", category=FutureWarning, module="torch")


class _Collective:
    """One Gloo collective on buffers of its own (a :class:`.measure.BlockingCollective`)."""

    def __init__(self, dist: Any, torch: Any, collective: str, count: int, dtype: str) -> None:
        self._dist, self._collective = dist, collective
        self._rank, self._p = dist.get_rank(), dist.get_world_size()
        self._value = fill_value(self._rank)
        self.x = np.full(count, self._value, dtype=dtype)
        self._input = torch.from_numpy(self.x)
        self._output = None
        self._parts: list[Any] = []
        if collective == "allgather":
            self._output = torch.empty(self._p * count, dtype=self._input.dtype)
        elif collective == "reduce_scatter":
            self._parts = list(torch.tensor_split(self._input, self._p))
            self._output = torch.empty_like(self._parts[self._rank])
        elif collective == "alltoall":  # part j (numpy.array_split) to rank j
            self._splits = [len(a) for a in np.array_split(self.x, self._p)]
            self._output = torch.empty(self._splits[self._rank] * self._p,
                                       dtype=self._input.dtype)

    def refill(self) -> None:
        self.x.fill(self._value)

    def start(self, wait: bool = True) -> Any:
        dist, c, x, async_op = self._dist, self._collective, self._input, not wait
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
        if c == "alltoall":
            mine = self._splits[self._rank]
            return dist.all_to_all_single(self._output, x, [mine] * self._p, self._splits,
                                          async_op=async_op)
        raise ValueError(f"unknown collective {c!r}")

    def result(self) -> Any:
        output = self._output.numpy() if self._output is not None else None
        return blocking_result(self._collective, self._rank, self._p, self.x, output)


def bench_size(dist: Any, torch: Any, config: dict[str, Any], nbytes: int) -> dict[str, Any]:
    """Time one size the way the p2pcoll worker does; returns the raw row (max over ranks)."""

    def slowest(values: list[float]) -> list[float]:
        if not values:
            return []
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return [float(v) for v in t.tolist()]

    return measure_blocking(
        config, nbytes, dist.get_rank(), dist.get_world_size(), "gloo",
        lambda count: _Collective(dist, torch, config["collective"], count, config["dtype"]),
        dist.barrier, slowest,
    )


def main(argv: Sequence[str] | None = None) -> int:
    out, config = worker_options(
        "python -m p2pcoll.bench.gloo",
        "Gloo worker of `p2pcoll bench --compare gloo` (started by the launcher).",
        argv,
    )

    import torch
    import torch.distributed as dist

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
            write_rows(out, rows)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
