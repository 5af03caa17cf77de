"""``p2pcoll bench``: time one collective between peer processes, nccl-tests style.

The driver (:func:`main`) starts ``world_size`` worker processes with :func:`p2pcoll.launch.launch`
(``python -m p2pcoll.bench --worker ...``). The workers join one group and, for every
strategy and every size:

1. allocate the input once (rank r's array is filled with r + 1);
2. run ``warmup`` untimed collectives;
3. run ``iters`` timed ones: refill the input with r + 1 (outside the timed region: an
   allreduce runs in place, ``out=x``, as Gloo's does, and a broadcast writes into the
   non-roots' input), ``await g.barrier()``, then time the collective alone with
   ``time.perf_counter()``; the per-iteration times are reduced with ``max`` over the ranks
   once after the loop, so an iteration's time is its slowest rank's;
4. check the last result against the value it must have, and note the peak resident set size
   since just before the input was allocated (the peak is reset there on Linux);
5. time ``pipelined`` collectives started together with ``asyncio.gather`` (after a
   barrier, slowest rank again) and divide by their number: the time per operation when
   operations are issued back to back.

Rank 0 writes the raw times as JSON to a file the driver named; the driver turns them into
rows (median, min, p10-p90 spread, algbw, busbw, peak RSS) and prints a table, or writes them
as JSON.

``--compare gloo`` then runs the same measurement with torch.distributed's Gloo backend
(:mod:`p2pcoll.bench_gloo`, started by the same launcher, same sizes, dtype, world size,
iterations and warmup) and prints Gloo's rows and, per p2pcoll row, the ratios to Gloo's row
of the same size. ``--compare mpi`` does the same with mpi4py over Open MPI's TCP transport
(:mod:`p2pcoll.bench_mpi`, started by ``mpirun``). Both share :func:`measure_blocking`.
``--plot PATH`` draws busbw (and time) against size as a PNG. Gloo and the plot need the
``bench`` extra (torch, matplotlib); MPI needs ``pip install 'p2pcoll[mpi]'``.

Bandwidths follow nccl-tests: ``algbw = S / time`` with S the bytes of the collective's data
(the tensor each rank passes; for allgather, the gathered result: world_size times each
rank's part, as nccl-tests counts it), and ``busbw = algbw * factor`` with factor
``2(p-1)/p`` for allreduce, ``(p-1)/p`` for allgather and reduce_scatter, 1 for broadcast and
reduce. busbw is comparable across world sizes and strategies.

With ``--transport inproc`` the peers cannot be processes (an inproc endpoint lives in one
process), so they run as tasks in this process's event loop instead (and the peak RSS is
that of the whole process).
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import functools
import gc
import importlib.util
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

import numpy as np

from .registry import available_strategies, registry
from .types import check_dtype

COLLECTIVES = ("allreduce", "broadcast", "reduce", "allgather", "reduce_scatter")
TRANSPORTS = ("auto", "tcp", "ipc", "inproc")
ROOT = 0  # root of broadcast and reduce
DEFAULT_SIZES = "4K,64K,1M,16M"
SUFFIXES = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
GB = 1e9  # nccl-tests reports GB/s with GB = 1e9 bytes
CLOSE_GRACE = 10.0  # seconds a worker waits for its group to close once results are out


# --- sizes and bandwidth ------------------------------------------------------------------


def parse_size(text: str) -> int:
    """``"4K"`` -> 4096; suffixes K, M, G are powers of 1024 (``KiB`` and ``KB`` also read)."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(?:I?B)?\s*", text.upper())
    if m is None:
        raise ValueError(f"bad size {text!r}: expected bytes such as 4096, 4K, 1M or 2G")
    return int(m.group(1)) * SUFFIXES[m.group(2)]


def parse_sizes(text: str) -> list[int]:
    """A comma-separated list of sizes, e.g. ``"4K,64K,1M"``."""
    try:
        sizes = [parse_size(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not sizes:
        raise argparse.ArgumentTypeError("no sizes given")
    return sizes


def format_size(nbytes: int) -> str:
    """4096 -> ``"4K"``; sizes that are no whole number of K/M/G stay in bytes."""
    for suffix in ("G", "M", "K"):
        unit = SUFFIXES[suffix]
        if nbytes >= unit and nbytes % unit == 0:
            return f"{nbytes // unit}{suffix}"
    return str(nbytes)


def bus_factor(collective: str, world_size: int) -> float:
    """nccl-tests' busbw / algbw ratio for a collective on ``world_size`` ranks."""
    p = world_size
    if collective == "allreduce":
        return 2 * (p - 1) / p
    if collective in ("allgather", "reduce_scatter"):
        return (p - 1) / p
    if collective in ("broadcast", "reduce"):
        return 1.0
    raise ValueError(f"unknown collective {collective!r}")


def data_bytes(collective: str, nbytes: int, world_size: int) -> int:
    """S in ``algbw = S / time``: the tensor's bytes; for allgather, the gathered result."""
    return nbytes * world_size if collective == "allgather" else nbytes


def _dtype(text: str) -> str:
    try:
        return check_dtype(np.dtype(text)).name
    except TypeError as exc:  # a dtype p2pcoll does not send
        raise argparse.ArgumentTypeError(str(exc)) from None
    except Exception:
        raise argparse.ArgumentTypeError(f"unknown dtype {text!r}") from None


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected 0 or more, got {text}")
    return value


# --- command line -------------------------------------------------------------------------

BENCH_EXTRA = "pip install 'p2pcoll[bench]'"
MPI_INSTALL = "pip install 'p2pcoll[mpi]'"
PEERS = {  # --compare NAME: (what its worker needs: (module or program, how to install it))
    "gloo": (("torch", BENCH_EXTRA),),
    "mpi": (("mpi4py", MPI_INSTALL), ("mpirun", MPI_INSTALL)),
}


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``p2pcoll bench`` to ``parser``."""
    parser.add_argument("--collective", choices=COLLECTIVES, default="allreduce",
                        help="the collective to time (default: allreduce)")
    parser.add_argument("--strategy", default="auto", metavar="NAME|all|auto",
                        help="a strategy name (or several, comma-separated), 'all' (every "
                             "installed strategy of the collective, one table block each) or "
                             "'auto' (default: the library's own choice per size)")
    parser.add_argument("-n", "--world-size", type=_positive, default=2, metavar="N",
                        help="number of peer processes (default: 2)")
    parser.add_argument("--sizes", type=parse_sizes, default=parse_sizes(DEFAULT_SIZES),
                        metavar="LIST",
                        help="bytes of each rank's tensor, comma-separated, K/M/G = 2^10/2^20/"
                             f"2^30 (default: {DEFAULT_SIZES}); for allgather, each rank's part")
    parser.add_argument("--dtype", type=_dtype, default="float32",
                        help="element type (default: float32)")
    parser.add_argument("--iters", type=_positive, default=20,
                        help="timed iterations per size (default: 20)")
    parser.add_argument("--warmup", type=_non_negative, default=3,
                        help="untimed iterations per size before timing (default: 3)")
    parser.add_argument("--pipelined", type=_non_negative, default=4, metavar="K",
                        help="collectives issued together for the pipelined figure "
                             "(default: 4; 0 skips it)")
    parser.add_argument("--transport", choices=TRANSPORTS,
                        default=os.environ.get("P2PCOLL_TRANSPORT") or "auto",
                        help="between the peer processes: auto (ipc on one host), tcp or ipc "
                             "(default: $P2PCOLL_TRANSPORT, else auto); inproc runs the peers "
                             "as tasks in this process")
    parser.add_argument("--compare", choices=tuple(PEERS), action="append", default=[],
                        metavar="|".join(PEERS),
                        help="after p2pcoll, time the same collective, sizes and world size "
                             "with torch.distributed's Gloo backend (processes started the same "
                             "way) or mpi4py over Open MPI's TCP transport (started by mpirun) and "
                             f"print the ratios per row; gloo needs {BENCH_EXTRA}, mpi needs "
                             f"{MPI_INSTALL}; may be given twice"),
    parser.add_argument("--plot", metavar="PATH", default=None,
                        help="draw busbw and time against size as a PNG at PATH, one line per "
                             f"strategy and compared library; needs matplotlib ({BENCH_EXTRA})")
    parser.add_argument("--json", metavar="PATH", default=None,
                        help="also write the rows as JSON to PATH ('-' for stdout, no table)")


def resolve_strategies(collective: str, requested: str) -> list[str]:
    """The strategy names to run: ``all`` expands, unknown names raise ``ValueError``."""
    installed = available_strategies()[collective]
    if requested == "all":
        return installed
    names = [name.strip() for name in requested.split(",") if name.strip()]
    for name in names:
        if name != "auto" and name not in installed:
            raise ValueError(
                f"no {collective} strategy named {name!r}; available: "
                + ", ".join(["auto", "all", *installed])
            )
    return names or ["auto"]


def missing_extras(args: argparse.Namespace) -> str | None:
    """Why the options cannot run here (an optional dependency is absent), or None."""
    needs = [(f"--compare {peer}", what, install) for peer in args.compare
             for what, install in PEERS[peer]]
    if args.plot is not None:
        needs.append(("--plot", "matplotlib", BENCH_EXTRA))
    for option, what, install in needs:
        found = shutil.which(what) is not None if what == "mpirun" else _importable(what)
        if not found:
            return f"{option} needs {what}, which is not installed: {install}"
    return None


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # ValueError: sys.modules[module] is None
        return False


def main(args: argparse.Namespace) -> int:
    """Run the benchmark the options describe; print the table. Returns an exit code."""
    try:
        strategies = resolve_strategies(args.collective, args.strategy)
    except ValueError as exc:
        print(f"p2pcoll bench: {exc}", file=sys.stderr)
        return 2
    problem = missing_extras(args)
    if problem is not None:
        print(f"p2pcoll bench: {problem}", file=sys.stderr)
        return 2
    config = _config(args, strategies)
    if config["transport"] == "inproc":
        code, raw = _collect(lambda path: asyncio.run(_run_inproc(config, path)))
    else:
        code, raw = _collect(lambda path: _run_processes(config, path))
    if code != 0:
        print(f"p2pcoll bench: a peer failed (exit code {code})", file=sys.stderr)
        return code
    rows = [summarize(r, config, "p2pcoll") for r in raw]
    compared: dict[str, list[dict[str, Any]]] = {}
    for peer in config["compare"]:
        code, raw = _collect(functools.partial(_run_peer, peer, config))
        if code != 0:
            print(f"p2pcoll bench: a {peer} peer failed (exit code {code})", file=sys.stderr)
            return code
        compared[peer] = [summarize(r, config, peer) for r in raw]
    if args.plot is not None:
        plot(args.plot, rows, compared, config)
    if args.json is not None:
        doc = json.dumps({"config": config, "rows": rows, "compare": compared,
                          "ratios": {peer: ratios(rows, theirs)
                                     for peer, theirs in compared.items()}}, indent=2)
        if args.json == "-":
            print(doc)
            return 0
        with open(args.json, "w", encoding="utf-8") as f:
            f.write(doc + "\n")
    print(format_table(rows, config, compared), end="")
    return 0


def _config(args: argparse.Namespace, strategies: Sequence[str]) -> dict[str, Any]:
    return {
        "collective": args.collective,
        "strategies": list(strategies),
        "world_size": args.world_size,
        "sizes": list(args.sizes),
        "dtype": args.dtype,
        "iters": args.iters,
        "warmup": args.warmup,
        "pipelined": args.pipelined,
        "transport": args.transport,
        "compare": list(dict.fromkeys(getattr(args, "compare", None) or [])),
    }


def _collect(run: Callable[[str], int]) -> tuple[int, list[dict[str, Any]]]:
    """``run(path)`` has rank 0 write its raw rows to ``path``: (exit code, those rows)."""
    fd, path = tempfile.mkstemp(prefix="p2pcoll-bench-", suffix=".json")
    os.close(fd)
    try:
        code = run(path)
        if code != 0:
            return code, []
        with open(path, encoding="utf-8") as f:
            return 0, list(json.load(f)["rows"])
    finally:
        os.unlink(path)


def _run_processes(config: dict[str, Any], out_path: str) -> int:
    from .launch import launch  # noqa: PLC0415 (the launcher is only needed here)

    command = [
        sys.executable, "-m", "p2pcoll.bench", "--worker", "--out", out_path,
        "--collective", config["collective"],
        "--strategy", ",".join(config["strategies"]),
        "-n", str(config["world_size"]),
        "--sizes", ",".join(str(s) for s in config["sizes"]),
        "--dtype", config["dtype"],
        "--iters", str(config["iters"]),
        "--warmup", str(config["warmup"]),
        "--pipelined", str(config["pipelined"]),
        "--transport", config["transport"],
    ]
    return launch(config["world_size"], command, prefix_output=False,
                  extra_env={"P2PCOLL_TRANSPORT": config["transport"]})


async def _run_inproc(config: dict[str, Any], out_path: str) -> int:
    from .testing import run_ranks  # noqa: PLC0415

    results = await run_ranks(config["world_size"], lambda g: run_worker(g, config),
                              transport="inproc")
    _write_json(out_path, {"rows": results[0]})
    return 0


def _run_peer(peer: str, config: dict[str, Any], out_path: str) -> int:
    """Run the ``--compare`` worker of ``peer`` as ``world_size`` processes."""
    if peer == "mpi":  # MPI ranks need MPI's own launcher
        from . import bench_mpi  # noqa: PLC0415

        command = bench_mpi.command(config["world_size"], out_path, config)
        return subprocess.run(command, env={**os.environ, **bench_mpi.environment()},
                              stdin=subprocess.DEVNULL, check=False).returncode
    from .launch import launch  # noqa: PLC0415

    command = [sys.executable, "-m", "p2pcoll.bench_gloo", "--out", out_path,
               "--config", json.dumps(config)]
    # Gloo picks its interface by resolving the hostname unless told; the peers are local.
    return launch(config["world_size"], command, prefix_output=False,
                  extra_env={"GLOO_SOCKET_IFNAME": "lo"})


# --- what every worker does ---------------------------------------------------------------
# Shared with the workers of --compare, so that both sides check and measure the same way.


def fill_value(rank: int) -> int:
    """Rank r passes an array filled with r + 1."""
    return rank + 1


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
        arrays = result if collective == "allgather" else [result]
        ok = len(arrays) == len(expected) and all(
            a.shape == (n,) and bool(np.all(a == np.array(value).astype(dtype)))
            for a, (value, n) in zip(arrays, expected, strict=True)
        )
    if not ok:
        raise AssertionError(f"rank {rank}: wrong {collective} result for {count} elements")


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
    import resource  # noqa: PLC0415 (POSIX only)

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


class BlockingCollective(Protocol):
    """One collective of a --compare library on buffers of its own (:func:`measure_blocking`)."""

    def refill(self) -> None:
        """Write this rank's input value into the input again."""

    def start(self, wait: bool = True) -> Any:
        """Run the collective once and wait for it; or, if not ``wait``, start it and return
        something with a ``wait()`` method."""

    def result(self) -> Any:
        """What the p2pcoll call would return (numpy arrays), for :func:`check_result`."""


def worker_options(
    prog: str, description: str, argv: Sequence[str] | None
) -> tuple[str, dict[str, Any]]:
    """The command line of a compared library's worker: where rank 0 writes the raw rows,
    and the bench configuration."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--out", required=True, help="where rank 0 writes the raw rows")
    parser.add_argument("--config", required=True, help="the bench configuration, as JSON")
    args = parser.parse_args(argv)
    return args.out, json.loads(args.config)


def write_rows(path: str, rows: list[dict[str, Any]]) -> None:
    """Rank 0 of a compared library's worker: hand its rows to the bench command."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"rows": rows}, f)


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
        The raw row (the fields of the p2pcoll worker's rows).
    """
    collective, dtype = config["collective"], config["dtype"]
    itemsize = np.dtype(dtype).itemsize
    count = nbytes // itemsize

    rss_before, rss_reset = reset_peak_rss()
    op = new(count)

    for _ in range(config["warmup"]):
        op.refill()
        barrier()
        op.start()

    times = []
    for _ in range(config["iters"]):
        op.refill()
        barrier()
        t0 = time.perf_counter()
        op.start()
        times.append(time.perf_counter() - t0)
    check_result(collective, op.result(), rank, p, count, dtype)
    rss_peak = peak_rss()

    k = config["pipelined"]
    ops = [op, *(new(count) for _ in range(k - 1))][:k]
    pipelined = []
    if k:
        for _ in range(max(3, config["iters"] // k)):
            for each in ops:
                each.refill()
            barrier()
            t0 = time.perf_counter()
            pending = [each.start(wait=False) for each in ops]
            for request in pending:
                request.wait()
            pipelined.append((time.perf_counter() - t0) / k)

    rss = slowest([rss_before, rss_peak])
    return {
        "strategy": name,
        "chosen": name,
        "size": count * itemsize,
        "count": count,
        "times": slowest(times),
        "pipelined": slowest(pipelined),
        "rss_before": int(rss[0]),
        "rss_peak": int(rss[1]),
        "rss_reset": rss_reset,
    }


# --- the p2pcoll worker -------------------------------------------------------------------

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
    raise ValueError(f"unknown collective {collective!r}")


async def _slowest(g: Any, values: list[float]) -> list[float]:
    """Each entry's maximum over the ranks (one collective for the whole list)."""
    if not values:
        return []
    result = await g.allreduce(np.array(values, dtype=np.float64), op="max")
    return [float(t) for t in result]


async def _bench_size(
    g: Any, config: dict[str, Any], strategy: str, nbytes: int
) -> dict[str, Any]:
    collective, dtype, p = config["collective"], config["dtype"], g.world_size
    itemsize = np.dtype(dtype).itemsize
    count = nbytes // itemsize
    requested = None if strategy == "auto" else strategy
    chosen = registry.choose(collective, requested, None,
                             data_bytes(collective, count * itemsize, p), p).name
    call = _collective_call(g, collective, requested)
    value = fill_value(g.rank)

    rss_before, rss_reset = reset_peak_rss()
    x = np.full(count, value, dtype=dtype)  # the input, allocated once, refilled every time

    for _ in range(config["warmup"]):
        x.fill(value)
        await g.barrier()
        await call(x)

    times = []
    result = None
    for _ in range(config["iters"]):
        x.fill(value)
        await g.barrier()
        t0 = time.perf_counter()
        result = await call(x)
        times.append(time.perf_counter() - t0)
    check_result(collective, result, g.rank, p, count, dtype)
    rss_peak = peak_rss()
    del result

    # Collectives that write into their input (allreduce, broadcast) get a buffer each.
    k = config["pipelined"]
    inputs = [x] * k
    if collective in ("allreduce", "broadcast"):
        inputs = [x, *(np.full(count, value, dtype=dtype) for _ in range(k - 1))][:k]
    pipelined = []
    if k:
        for _ in range(max(3, config["iters"] // k)):
            for inp in inputs:
                inp.fill(value)
            await g.barrier()
            t0 = time.perf_counter()
            await asyncio.gather(*(call(inp) for inp in inputs))
            pipelined.append((time.perf_counter() - t0) / k)

    rss = await _slowest(g, [rss_before, rss_peak])
    return {
        "strategy": strategy,
        "chosen": chosen,
        "size": count * itemsize,
        "count": count,
        "times": await _slowest(g, times),
        "pipelined": await _slowest(g, pipelined),
        "rss_before": int(rss[0]),
        "rss_peak": int(rss[1]),
        "rss_reset": rss_reset,
    }


async def run_worker(g: Any, config: dict[str, Any]) -> list[dict[str, Any]]:
    """Run every strategy x size of ``config`` on group ``g``; returns the raw rows."""
    rows = []
    for strategy in config["strategies"]:
        for nbytes in config["sizes"]:
            rows.append(await _bench_size(g, config, strategy, nbytes))
    return rows


async def _worker(config: dict[str, Any], out_path: str) -> None:
    from . import join  # noqa: PLC0415

    async with join() as g:
        rows = await run_worker(g, config)
        if g.rank == 0:
            _write_json(out_path, {"rows": rows})
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


def _write_json(path: str, doc: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f)


# --- results ------------------------------------------------------------------------------

MIB = 1 << 20


def summarize(raw: dict[str, Any], config: dict[str, Any],
              library: str = "p2pcoll") -> dict[str, Any]:
    """One output row from a worker's raw times (seconds, slowest rank per iteration)."""
    collective, p = config["collective"], config["world_size"]
    times = np.array(raw["times"]) * 1e6
    median = float(np.median(times))
    moved = data_bytes(collective, raw["size"], p)
    algbw = moved / (median * 1e-6) / GB if median > 0 else 0.0
    row = {
        "library": library,
        "collective": collective,
        "world_size": p,
        "transport": config["transport"] if library == "p2pcoll" else "tcp",
        "size": raw["size"],
        "count": raw["count"],
        "dtype": config["dtype"],
        "strategy": raw["strategy"],
        "chosen": raw["chosen"],
        "time_us": median,
        "min_us": float(times.min()),
        "p10_us": float(np.percentile(times, 10)),
        "p90_us": float(np.percentile(times, 90)),
        "algbw_gbps": algbw,
        "busbw_gbps": algbw * bus_factor(collective, p),
        "pipelined_us": None,
        "pipelined_busbw_gbps": None,
        "iters": len(times),
        # Peak RSS of the largest peer while the row was timed; "before": just before the
        # input was allocated. Without a reset the peak is the process's whole lifetime's.
        "rss_peak_bytes": raw.get("rss_peak"),
        "rss_before_bytes": raw.get("rss_before"),
        "rss_peak_reset": raw.get("rss_reset"),
    }
    if raw["pipelined"]:
        per_op = float(np.median(raw["pipelined"])) * 1e6
        row["pipelined_us"] = per_op
        if per_op > 0:
            row["pipelined_busbw_gbps"] = (
                moved / (per_op * 1e-6) / GB * bus_factor(collective, p)
            )
    return row


def ratios(rows: Sequence[dict[str, Any]],
           theirs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per p2pcoll row, the ratios p2pcoll / peer of time and busbw at the same size."""
    by_size = {row["size"]: row for row in theirs}
    out = []
    for row in rows:
        other = by_size.get(row["size"])
        if other is None:
            continue
        out.append({
            "size": row["size"],
            "strategy": row["strategy"],
            "chosen": row["chosen"],
            "time_us": row["time_us"],
            "peer_time_us": other["time_us"],
            "time_ratio": _ratio(row["time_us"], other["time_us"]),
            "busbw_gbps": row["busbw_gbps"],
            "peer_busbw_gbps": other["busbw_gbps"],
            "busbw_ratio": _ratio(row["busbw_gbps"], other["busbw_gbps"]),
        })
    return out


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


COLUMNS = (  # (title, unit, width)
    ("size", "(B)", 9), ("count", "(elems)", 11), ("type", "", 8), ("strategy", "", 24),
    ("time", "(us)", 10), ("min", "(us)", 10), ("p10-p90", "(us)", 19),
    ("algbw", "(GB/s)", 9), ("busbw", "(GB/s)", 9), ("pipelined", "(us/op)", 10),
    ("peak rss", "(MiB)", 9),
)


def format_table(rows: Sequence[dict[str, Any]], config: dict[str, Any],
                 compared: dict[str, list[dict[str, Any]]] | None = None) -> str:
    """The rows as an nccl-tests-style text table, one block per strategy.

    Rows of compared libraries (``compared``: name -> rows) follow as blocks of their own,
    then one table of ratios per library.
    """
    compared = compared or {}
    c, p = config["collective"], config["world_size"]
    where = ("tasks in one process" if config["transport"] == "inproc"
             else f"processes, {config['transport']}")
    size_note = ("size = each rank's part; algbw counts the gathered world_size x size bytes"
                 if c == "allgather" else "size = bytes of the tensor each rank passes")
    root_note = f", root {ROOT}" if c in ("broadcast", "reduce") else ""
    in_place = {"allreduce": "; allreduce runs in place (out=x)",
                "broadcast": "; broadcast writes into the non-roots' input"}.get(c, "")
    peers = "".join(f"; {peer} after it" for peer in compared)
    lines = [
        (f"# p2pcoll bench: {c}{root_note}, {p} peers ({where}){peers}, {config['dtype']}, "
         f"{config['iters']} iters after {config['warmup']} warmup"),
        f"# {size_note}",
        ("# time: median over iterations of the slowest rank (each iteration starts after a "
         "barrier); min, p10-p90 the same"),
        f"# the input is refilled before each iteration, outside the timed region{in_place}",
        (f"# busbw = algbw x {_factor_text(c)} (nccl-tests); pipelined: {config['pipelined']} "
         "collectives started together, time per collective"),
        "# peak rss: the largest peer's peak resident set size while the row was timed",
        "#",
        "#" + "".join(f"{t:>{w}}" for t, _, w in COLUMNS)[1:],
        "#" + "".join(f"{u:>{w}}" for _, u, w in COLUMNS)[1:],
    ]
    previous = None
    all_rows = [*rows, *(row for theirs in compared.values() for row in theirs)]
    for row in all_rows:
        block = (row["library"], row["strategy"])
        if previous is not None and block != previous:
            lines.append("")
        previous = block
        pipe, rss = row["pipelined_us"], row["rss_peak_bytes"]
        cells = (
            format_size(row["size"]), str(row["count"]), row["dtype"], _row_name(row),
            _us(row["time_us"]), _us(row["min_us"]),
            f"{_us(row['p10_us'])}-{_us(row['p90_us'])}",
            f"{row['algbw_gbps']:.4f}", f"{row['busbw_gbps']:.4f}",
            "-" if pipe is None else _us(pipe),
            "-" if rss is None else f"{rss / MIB:.0f}",
        )
        lines.append("".join(f"{v:>{w}}" for v, (_, _, w) in zip(cells, COLUMNS, strict=True)))
    lines.extend(_memory_notes(all_rows))
    for peer, theirs in compared.items():
        lines.append("")
        lines.extend(_ratio_table(peer, ratios(rows, theirs)))
    return "\n".join(lines) + "\n"


def _row_name(row: dict[str, Any]) -> str:
    if row["library"] != "p2pcoll":
        return str(row["library"])
    if row["strategy"] == "auto":
        return f"auto:{row['chosen']}"
    return str(row["strategy"])


def _memory_notes(rows: Sequence[dict[str, Any]]) -> list[str]:
    """One line per block: the peak RSS at its largest size (1 MiB or more) against that size."""
    largest: dict[tuple[str, str], dict[str, Any]] = {}
    for row in rows:
        block = (row["library"], _row_name(row))
        if row["rss_peak_bytes"] and row["size"] >= MIB and (
                block not in largest or row["size"] >= largest[block]["size"]):
            largest[block] = row
    if not largest:
        return []
    lines = ["#", ("# peak RSS of the largest peer at the largest size (before = just before "
                  "the input was allocated; growth = peak - before):")]
    for (_, name), row in largest.items():
        peak = row["rss_peak_bytes"]
        before = min(row["rss_before_bytes"] or 0, peak)
        reset = "" if row["rss_peak_reset"] else " (not reset: the process's lifetime peak)"
        lines.append(
            f"#   {name:>24} {format_size(row['size']):>5}: peak {peak / MIB:.0f} MiB = "
            f"{peak / row['size']:.1f}x the tensor; before {before / MIB:.0f} MiB; growth "
            f"{(peak - before) / MIB:.0f} MiB = {(peak - before) / row['size']:.1f}x{reset}"
        )
    return lines


RATIO_COLUMNS = (  # (title, unit, width)
    ("size", "(B)", 9), ("strategy", "", 24), ("time", "(us)", 10), ("{peer} time", "(us)", 11),
    ("ratio", "time", 8), ("busbw", "(GB/s)", 9), ("{peer} busbw", "(GB/s)", 12),
    ("ratio", "busbw", 8),
)


def _ratio_table(peer: str, pairs: Sequence[dict[str, Any]]) -> list[str]:
    columns = [(t.format(peer=peer), u, w) for t, u, w in RATIO_COLUMNS]
    lines = [
        (f"# p2pcoll vs {peer}, same sizes, one after the other in this run: ratio = p2pcoll / "
         f"{peer} (time ratio < 1 and busbw ratio > 1: p2pcoll is faster)"),
        "#" + "".join(f"{t:>{w}}" for t, _, w in columns)[1:],
        "#" + "".join(f"{u:>{w}}" for _, u, w in columns)[1:],
    ]
    previous = None
    for pair in pairs:
        if previous is not None and pair["strategy"] != previous:
            lines.append("")
        previous = pair["strategy"]
        name = pair["strategy"]
        if name == "auto":
            name = f"auto:{pair['chosen']}"
        cells = (
            format_size(pair["size"]), name, _us(pair["time_us"]), _us(pair["peer_time_us"]),
            _times(pair["time_ratio"]), f"{pair['busbw_gbps']:.4f}",
            f"{pair['peer_busbw_gbps']:.4f}", _times(pair["busbw_ratio"]),
        )
        lines.append("".join(f"{v:>{w}}" for v, (_, _, w) in zip(cells, columns, strict=True)))
    return lines


def _times(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def _factor_text(collective: str) -> str:
    return {"allreduce": "2(p-1)/p", "allgather": "(p-1)/p",
            "reduce_scatter": "(p-1)/p"}.get(collective, "1")


def _us(value: float) -> str:
    return f"{value:.1f}" if value < 10_000 else f"{value:.0f}"


# --- the plot -----------------------------------------------------------------------------


PEER_STYLES = {
    "gloo": {"color": "black", "linestyle": "--", "marker": "s", "linewidth": 2},
    "mpi": {"color": "dimgray", "linestyle": ":", "marker": "^", "linewidth": 2},
}


def plot(path: str, rows: Sequence[dict[str, Any]],
         compared: dict[str, list[dict[str, Any]]], config: dict[str, Any]) -> None:
    """Write a PNG: busbw (left) and time (right) against size, one line per strategy and one
    per compared library. Needs matplotlib (drawn with its Agg backend, no display)."""
    from matplotlib.figure import Figure  # noqa: PLC0415 (optional dependency)

    lines: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        lines.setdefault(f"p2pcoll {row['strategy']}", []).append(row)
    for peer, theirs in compared.items():
        lines[peer] = list(theirs)

    fig = Figure(figsize=(11, 4.4), dpi=90, layout="constrained")
    ax_bw, ax_time = fig.subplots(1, 2)
    for label, points in lines.items():
        points = sorted(points, key=lambda r: r["size"])
        sizes = [r["size"] for r in points]
        style = PEER_STYLES.get(label, {"marker": "o"}) if label in compared else {"marker": "o"}
        ax_bw.plot(sizes, [r["busbw_gbps"] for r in points], label=label, **style)
        ax_time.plot(sizes, [r["time_us"] for r in points], label=label, **style)
    ticks = sorted({r["size"] for points in lines.values() for r in points})
    for ax in (ax_bw, ax_time):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [format_size(s) for s in ticks])
        ax.minorticks_off()
        ax.set_xlabel("size (bytes per rank)")
        ax.grid(True, alpha=0.3)
    ax_bw.set_ylabel("busbw (GB/s, higher is better)")
    ax_bw.set_ylim(bottom=0)
    ax_time.set_yscale("log")
    ax_time.set_ylabel("time (us, lower is better)")
    ax_bw.legend(fontsize="small")
    where = ("peers as tasks of one process" if config["transport"] == "inproc"
             else f"transport {config['transport']}")
    fig.suptitle(
        f"{config['collective']}, {config['world_size']} peers, {config['dtype']} (p2pcoll: "
        f"{where}): median of {config['iters']} iterations, slowest rank; "
        f"busbw = algbw x {_factor_text(config['collective'])}"
    )
    # Few colours are drawn: a 64-colour palette keeps the file small enough to commit.
    canvas = io.BytesIO()
    fig.savefig(canvas, format="png")
    from PIL import Image  # noqa: PLC0415 (pillow comes with matplotlib)

    with Image.open(canvas) as image:
        image.convert("RGB").quantize(colors=64).save(path, format="PNG", optimize=True)


# --- python -m p2pcoll.bench --------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m p2pcoll.bench",
        description="Time a collective between peer processes (nccl-tests style).",
    )
    configure_parser(parser)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    return parser


def _main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if not args.worker:
        return main(args)
    config = _config(args, resolve_strategies(args.collective, args.strategy))
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 PID` shows where a worker is stuck
    asyncio.run(_worker(config, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
