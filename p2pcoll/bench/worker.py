"""The p2pcoll peer of ``p2pcoll bench``.

The driver starts ``world_size`` copies of

    python -m p2pcoll.bench.worker --out PATH --config JSON

with :func:`p2pcoll.launch.launch` (or, with ``--transport inproc``, runs :func:`run_worker`
as tasks of its own event loop). The peers join one group and, for every strategy and every
size (:func:`bench_size`):

1. allocate the input once (rank r's array is filled with r + 1);
2. run ``warmup`` untimed collectives;
3. run ``iters`` timed ones: refill the input with r + 1 (outside the timed region: an
   allreduce runs in place, ``out=x``, as Gloo's does, and a broadcast writes into the
   non-roots' input), ``await g.barrier()``, then time the collective alone with
   ``time.perf_counter()``, and the CPU time the process used meanwhile (every thread's:
   ``time.process_time()``); the per-iteration times are reduced with ``max`` over the ranks
   once after the loop, so an iteration's time is its slowest rank's, its CPU time that of
   the rank that used most;
4. check the last result against the value it must have, and note the peak resident set size
   since just before the input was allocated (the peak is reset there on Linux);
5. time ``pipelined`` collectives started together with ``asyncio.gather`` (after a
   barrier, slowest rank again) and divide by their number: the time per operation when
   operations are issued back to back.

Rank 0 writes the raw rows to PATH. The Gloo and MPI workers measure the same way
(:func:`p2pcoll.bench.measure.measure_blocking`).
"""

from __future__ import annotations

import asyncio
import faulthandler
import os
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np

from .. import join
from .measure import (
    ROOT,
    check_result,
    element_count,
    fill_value,
    peak_rss,
    pipelined_rounds,
    raw_row,
    reset_peak_rss,
    worker_options,
    write_rows,
)

CLOSE_GRACE = 10.0  # seconds a worker waits for its group to close once results are out

Call = Callable[[Any], Awaitable[Any]]


def _collective_call(g: Any, collective: str, strategy: str | None) -> Call:
    """``call(x)`` runs the collective once on input ``x`` (allreduce and broadcast in place)."""
    if collective == "allreduce":
        return lambda x: g.allreduce(x, strategy=strategy, out=x)
    if collective == "broadcast":
        return lambda x: g.broadcast(x, root=ROOT, strategy=strategy)
    if collective == "reduce":
        return lambda x: g.reduce(x, root=ROOT, strategy=strategy)
    if collective == "allgather":
        return lambda x: g.allgather(x, strategy=strategy)
    if collective == "reduce_scatter":
        return lambda x: g.reduce_scatter(x, strategy=strategy)
    if collective == "alltoall":
        return _alltoall_call(g, strategy)
    raise ValueError(f"unknown collective {collective!r}")


def _alltoall_call(g: Any, strategy: str | None) -> Call:
    """Part j of x (``numpy.array_split``) to rank j, received into buffers allocated once
    per size (as Gloo's output tensor is; the pipelined calls share them)."""
    outs: dict[int, list[np.ndarray]] = {}

    def call(x: np.ndarray) -> Awaitable[Any]:
        p = g.world_size
        out = outs.get(x.size)
        if out is None:
            n = len(np.array_split(x, p)[g.rank])
            out = outs[x.size] = [np.empty(n, x.dtype) for _ in range(p)]
        return g.alltoall(np.array_split(x, p), strategy=strategy, out=out)  # type: ignore[no-any-return]

    return call


async def _slowest(g: Any, values: list[float]) -> list[float]:
    """Each entry's maximum over the ranks (one collective for the whole list)."""
    if not values:
        return []
    result = await g.allreduce(np.array(values, dtype=np.float64), op="max")
    return [float(t) for t in result]


async def bench_size(
    g: Any, config: dict[str, Any], strategy: str, nbytes: int
) -> dict[str, Any]:
    """Time one strategy and size on group ``g``; returns the raw row (max over the ranks)."""
    collective, dtype = config["collective"], config["dtype"]
    count = element_count(nbytes, dtype)
    requested = None if strategy == "auto" else strategy
    call = _collective_call(g, collective, requested)
    value = fill_value(g.rank)

    rss_before, rss_reset = reset_peak_rss()
    x = np.full(count, value, dtype=dtype)  # the input, allocated once, refilled every time

    ran = dict(g.stats()["collectives_by_strategy"].get(collective, {}))
    for _ in range(max(1, config["warmup"])):
        x.fill(value)
        await g.barrier()
        await call(x)
    # What the group ran it with (its own choice and model, or the board: "shm").
    now = g.stats()["collectives_by_strategy"][collective]
    chosen = max(now, key=lambda name: now[name] - ran.get(name, 0))

    times, cpu = [], []
    result = None
    for _ in range(config["iters"]):
        x.fill(value)
        await g.barrier()
        c0 = time.process_time()
        t0 = time.perf_counter()
        result = await call(x)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    check_result(collective, result, g.rank, g.world_size, count, dtype)
    rss_peak = peak_rss()
    del result

    # Collectives that write into their input (allreduce, broadcast) get a buffer each.
    k = config["pipelined"]
    inputs = [x] * k
    if collective in ("allreduce", "broadcast"):
        inputs = [x, *(np.full(count, value, dtype=dtype) for _ in range(k - 1))][:k]
    pipelined = []
    if k:
        for _ in range(pipelined_rounds(config["iters"], k)):
            for inp in inputs:
                inp.fill(value)
            await g.barrier()
            t0 = time.perf_counter()
            await asyncio.gather(*(call(inp) for inp in inputs))
            pipelined.append((time.perf_counter() - t0) / k)

    rss = await _slowest(g, [rss_before, rss_peak])
    return raw_row(strategy, chosen, count, dtype, await _slowest(g, times),
                   await _slowest(g, pipelined), rss, rss_reset, await _slowest(g, cpu))


async def run_worker(g: Any, config: dict[str, Any]) -> list[dict[str, Any]]:
    """Run every strategy x size of ``config`` on group ``g``; returns the raw rows."""
    rows = []
    for strategy in config["strategies"]:
        for nbytes in config["sizes"]:
            rows.append(await bench_size(g, config, strategy, nbytes))
    return rows


async def _run(config: dict[str, Any], out_path: str) -> None:
    async with join() as g:
        rows = await run_worker(g, config)
        if g.rank == 0:
            write_rows(out_path, rows)
        # The results are safe now; leaving the group must not hold them hostage. Closing
        # makes blocking libzmq calls, so only a thread can notice that it is stuck.
        watchdog = threading.Timer(CLOSE_GRACE, _abandon_close, args=(g.rank,))
        watchdog.daemon = True
        watchdog.start()
    watchdog.cancel()


def _abandon_close(rank: int) -> None:
    print(f"p2pcoll bench: rank {rank} still closing its group after {CLOSE_GRACE:g}s; "
          "exiting without it. Where it was stuck:", file=sys.stderr, flush=True)
    faulthandler.dump_traceback(sys.stderr, all_threads=True)
    os._exit(0)


def main(argv: Sequence[str] | None = None) -> int:
    out, config = worker_options(
        "python -m p2pcoll.bench.worker",
        "p2pcoll worker of `p2pcoll bench` (started by the launcher).",
        argv,
    )
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 PID` shows where a worker is stuck
    asyncio.run(_run(config, out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
