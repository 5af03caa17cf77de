"""What every worker of ``p2pcoll bench`` shares, so that each library is measured the same way.

- The command line of a worker, ``--out PATH --config JSON`` (:func:`worker_options`), and
  what it leaves behind: rank 0 writes the raw rows to PATH (:func:`write_rows`), the driver
  reads them back (:func:`read_rows`).
- The data: rank r's input is filled with :func:`fill_value` (r + 1), and
  :func:`check_result` knows what each rank must get back.
- The peak resident set size: :func:`reset_peak_rss` before the input is allocated,
  :func:`peak_rss` after the timed loop.
- The timing loop of a blocking library (:func:`measure_blocking`, for the Gloo and MPI
  workers). It follows the p2pcoll worker's asynchronous loop
  (:func:`p2pcoll.bench.worker.bench_size`) step for step; both end in :func:`raw_row`.

This module imports nothing of the compared libraries: each worker hands it its own
collective (a :class:`BlockingCollective`), barrier and max-over-ranks.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

ROOT = 0  # root of broadcast and reduce


# --- a worker's command line and output -----------------------------------------------------


def worker_options(
    prog: str, description: str, argv: Sequence[str] | None
) -> tuple[str, dict[str, Any]]:
    """The command line of a worker: where rank 0 writes the raw rows, and the bench
    configuration (:func:`p2pcoll.bench.options.bench_config`)."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--out", required=True, help="where rank 0 writes the raw rows")
    parser.add_argument("--config", required=True, help="the bench configuration, as JSON")
    args = parser.parse_args(argv)
    return args.out, json.loads(args.config)


def write_rows(path: str, rows: list[dict[str, Any]]) -> None:
    """Rank 0 of a worker: hand its raw rows to the driver."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"rows": rows}, f)


def read_rows(path: str) -> list[dict[str, Any]]:
    """The raw rows :func:`write_rows` wrote to ``path``."""
    with open(path, encoding="utf-8") as f:
        return list(json.load(f)["rows"])


# --- the data and the result it must give ---------------------------------------------------


def fill_value(rank: int) -> int:
    """Rank r passes an array filled with r + 1."""
    return rank + 1


def blocking_result(collective: str, rank: int, p: int, data: np.ndarray,
                    output: np.ndarray | None) -> Any:
    """What a compared library's collective left as its result, in the form
    :func:`check_result` takes: ``data`` is the in-place buffer, ``output`` the separate
    one that allgather and reduce_scatter write (as numpy arrays)."""
    if collective == "reduce" and rank != ROOT:
        return None
    if collective == "allgather":
        assert output is not None
        return list(output.reshape(p, -1))
    if collective == "alltoall":
        assert output is not None
        return np.array_split(output, p)
    if collective == "reduce_scatter":
        assert output is not None
        return output
    return data


def element_count(nbytes: int, dtype: str) -> int:
    """Elements of ``dtype`` in ``nbytes`` (rounded down; the row reports the bytes used)."""
    return nbytes // np.dtype(dtype).itemsize


def check_result(collective: str, result: Any, rank: int, p: int, count: int,
                 dtype: str) -> None:
    """Raise AssertionError unless ``result`` is what rank ``rank`` must get.

    ``result`` is an array; for allgather a list of the p parts; None for reduce on a non-root.
    """
    total = sum(fill_value(r) for r in range(p))
    expected: list[tuple[int, int]] | None  # (value, length) of each array, None for no result
    if collective == "reduce" and rank != ROOT:
        expected = None
    elif collective == "allgather":
        expected = [(fill_value(r), count) for r in range(p)]
    elif collective == "alltoall":  # part r of every rank's count elements, from each
        part = len(np.array_split(np.empty(count, np.uint8), p)[rank])
        expected = [(fill_value(r), part) for r in range(p)]
    elif collective == "broadcast":
        expected = [(fill_value(ROOT), count)]
    elif collective == "reduce_scatter":
        q, extra = divmod(count, p)
        expected = [(total, q + (rank < extra))]
    else:  # allreduce, reduce on the root
        expected = [(total, count)]
    if expected is None:
        ok = result is None
    else:
        arrays = result if collective in ("allgather", "alltoall") else [result]
        ok = len(arrays) == len(expected) and all(
            a.shape == (n,) and bool(np.all(a == np.array(value).astype(dtype)))
            for a, (value, n) in zip(arrays, expected, strict=True)
        )
    if not ok:
        raise AssertionError(f"rank {rank}: wrong {collective} result for {count} elements")


# --- peak resident set size -----------------------------------------------------------------


def reset_peak_rss() -> tuple[int, bool]:
    """Start measuring the peak resident set size afresh (Linux: ``/proc/self/clear_refs``).

    Returns:
        (the resident set size now in bytes, whether the peak was reset). Where it cannot be
        reset, :func:`peak_rss` keeps reporting the whole process's peak.
    """
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")  # resets the "high water mark" of the RSS to the current RSS
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE"), True
    except (OSError, ValueError, IndexError):
        return peak_rss(), False


def peak_rss() -> int:
    """Bytes: ``getrusage(RUSAGE_SELF).ru_maxrss`` (KiB on Linux, bytes on macOS)."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


# --- the timing loop ------------------------------------------------------------------------


def pipelined_rounds(iters: int, k: int) -> int:
    """How many times the ``k`` collectives of the pipelined figure are started together."""
    return max(3, iters // k)


def raw_row(strategy: str, chosen: str, count: int, dtype: str, times: list[float],
            pipelined: list[float], rss: list[float], rss_reset: bool,
            cpu: list[float]) -> dict[str, Any]:
    """What a worker reports for one strategy and size; every list is already the maximum
    over the ranks (``rss``: the RSS before the input was allocated, then the peak; ``cpu``:
    the CPU seconds each timed iteration used in the process, all its threads)."""
    return {
        "strategy": strategy,
        "chosen": chosen,
        "size": count * np.dtype(dtype).itemsize,
        "count": count,
        "times": times,
        "cpu": cpu,
        "pipelined": pipelined,
        "rss_before": int(rss[0]),
        "rss_peak": int(rss[1]),
        "rss_reset": rss_reset,
    }


class BlockingCollective(Protocol):
    """One collective of a compared library on buffers of its own (:func:`measure_blocking`)."""

    def refill(self) -> None:
        """Write this rank's input value into the input again."""

    def start(self, wait: bool = True) -> Any:
        """Run the collective once and wait for it; or, if not ``wait``, start it and return
        something with a ``wait()`` method."""

    def result(self) -> Any:
        """What the p2pcoll call would return (numpy arrays), for :func:`check_result`."""


def measure_blocking(
    config: dict[str, Any], nbytes: int, rank: int, p: int, name: str,
    new: Callable[[int], BlockingCollective], barrier: Callable[[], None],
    slowest: Callable[[list[float]], list[float]],
) -> dict[str, Any]:
    """Time one size of a blocking library's collective exactly as the p2pcoll worker does.

    Args:
        config: the bench configuration (collective, dtype, iters, warmup, pipelined).
        nbytes: bytes of each rank's input.
        rank, p: this process's rank and the world size.
        name: the row's strategy name (the library's).
        new: ``new(count)`` allocates one collective on ``count`` elements, input filled.
        barrier: the library's barrier.
        slowest: each entry's maximum over the ranks.

    Returns:
        The raw row (:func:`raw_row`).
    """
    collective, dtype = config["collective"], config["dtype"]
    count = element_count(nbytes, dtype)

    rss_before, rss_reset = reset_peak_rss()
    op = new(count)

    for _ in range(config["warmup"]):
        op.refill()
        barrier()
        op.start()

    times, cpu = [], []
    for _ in range(config["iters"]):
        op.refill()
        barrier()
        c0 = time.process_time()
        t0 = time.perf_counter()
        op.start()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    check_result(collective, op.result(), rank, p, count, dtype)
    rss_peak = peak_rss()

    k = config["pipelined"]
    ops = [op, *(new(count) for _ in range(k - 1))][:k]
    pipelined = []
    if k:
        for _ in range(pipelined_rounds(config["iters"], k)):
            for each in ops:
                each.refill()
            barrier()
            t0 = time.perf_counter()
            pending = [each.start(wait=False) for each in ops]
            for request in pending:
                request.wait()
            pipelined.append((time.perf_counter() - t0) / k)

    return raw_row(name, name, count, dtype, slowest(times), slowest(pipelined),
                   slowest([rss_before, rss_peak]), rss_reset, slowest(cpu))
