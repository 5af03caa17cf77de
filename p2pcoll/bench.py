"""``p2pcoll bench``: time one collective between peer processes, nccl-tests style.

The driver (:func:`main`) starts ``world_size`` worker processes with :func:`p2pcoll.launch.launch`
(``python -m p2pcoll.bench --worker ...``). The workers join one group and, for every
strategy and every size:

1. allocate the input once (rank r's array is filled with r + 1);
2. run ``warmup`` untimed collectives;
3. run ``iters`` timed ones: ``await g.barrier()``, then time the collective alone with
   ``time.perf_counter()``; the per-iteration times are reduced with ``max`` over the ranks
   once after the loop, so an iteration's time is its slowest rank's;
4. time ``pipelined`` collectives started together with ``asyncio.gather`` (after a
   barrier, slowest rank again) and divide by their number: the time per operation when
   operations are issued back to back;
5. check the last result against the value it must have.

Rank 0 writes the raw times as JSON to a file the driver named; the driver turns them into
rows (median, min, p10-p90 spread, algbw, busbw) and prints a table, or writes them as JSON.

Bandwidths follow nccl-tests: ``algbw = S / time`` with S the bytes of the collective's data
(the tensor each rank passes; for allgather, the gathered result: world_size times each
rank's part, as nccl-tests counts it), and ``busbw = algbw * factor`` with factor
``2(p-1)/p`` for allreduce, ``(p-1)/p`` for allgather and reduce_scatter, 1 for broadcast and
reduce. busbw is comparable across world sizes and strategies.

With ``--transport inproc`` the peers cannot be processes (an inproc endpoint lives in one
process), so they run as tasks in this process's event loop instead.
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import gc
import json
import os
import re
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

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


def main(args: argparse.Namespace) -> int:
    """Run the benchmark the options describe; print the table. Returns an exit code."""
    try:
        strategies = resolve_strategies(args.collective, args.strategy)
    except ValueError as exc:
        print(f"p2pcoll bench: {exc}", file=sys.stderr)
        return 2
    config = _config(args, strategies)
    fd, out_path = tempfile.mkstemp(prefix="p2pcoll-bench-", suffix=".json")
    os.close(fd)
    try:
        if args.transport == "inproc":
            code = asyncio.run(_run_inproc(config, out_path))
        else:
            code = _run_processes(config, out_path)
        if code != 0:
            print(f"p2pcoll bench: a peer failed (exit code {code})", file=sys.stderr)
            return code
        with open(out_path, encoding="utf-8") as f:
            raw = json.load(f)
    finally:
        os.unlink(out_path)
    rows = [summarize(r, config) for r in raw["rows"]]
    if args.json is not None:
        doc = json.dumps({"config": config, "rows": rows}, indent=2)
        if args.json == "-":
            print(doc)
            return 0
        with open(args.json, "w", encoding="utf-8") as f:
            f.write(doc + "\n")
    print(format_table(rows, config), end="")
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
    }


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


# --- the worker ---------------------------------------------------------------------------

Call = Callable[[Any], Awaitable[Any]]


def _collective_call(g: Any, collective: str, strategy: str | None) -> Call:
    """``call(x)`` runs the collective once on input ``x``."""
    if collective == "allreduce":
        return lambda x: g.allreduce(x, strategy=strategy)
    if collective == "broadcast":
        return lambda x: g.broadcast(x, root=ROOT, strategy=strategy)
    if collective == "reduce":
        return lambda x: g.reduce(x, root=ROOT, strategy=strategy)
    if collective == "allgather":
        return lambda x: g.allgather(x, strategy=strategy)
    if collective == "reduce_scatter":
        return lambda x: g.reduce_scatter(x, strategy=strategy)
    raise ValueError(f"unknown collective {collective!r}")


def _check(collective: str, result: Any, rank: int, p: int, count: int, dtype: str) -> None:
    """Raise AssertionError unless ``result`` is what rank ``rank`` must get."""
    total = p * (p + 1) // 2  # rank r passes r + 1
    expected: list[tuple[int, int]] | None  # (value, length) of each array, None for no result
    if collective == "reduce" and rank != ROOT:
        expected = None
    elif collective == "allgather":
        expected = [(r + 1, count) for r in range(p)]
    elif collective == "broadcast":
        expected = [(ROOT + 1, count)]
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


async def _slowest(g: Any, times: list[float]) -> list[float]:
    """Each entry's maximum over the ranks (one collective for the whole list)."""
    if not times:
        return []
    result = await g.allreduce(np.array(times, dtype=np.float64), op="max")
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

    # The input, allocated once. A broadcast fills the non-roots' buffer in place; each of
    # the pipelined broadcasts gets a buffer of its own.
    x = np.full(count, g.rank + 1, dtype=dtype)
    k = config["pipelined"]
    inputs = [x] * k
    if collective == "broadcast" and g.rank != ROOT:
        inputs = [np.full(count, g.rank + 1, dtype=dtype) for _ in range(k)]
    gc.collect()

    for _ in range(config["warmup"]):
        await g.barrier()
        await call(x)

    times = []
    result = None
    for _ in range(config["iters"]):
        await g.barrier()
        t0 = time.perf_counter()
        result = await call(x)
        times.append(time.perf_counter() - t0)
    _check(collective, result, g.rank, p, count, dtype)
    del result

    pipelined = []
    if k:
        for _ in range(max(3, config["iters"] // k)):
            await g.barrier()
            t0 = time.perf_counter()
            await asyncio.gather(*(call(inp) for inp in inputs))
            pipelined.append((time.perf_counter() - t0) / k)

    return {
        "strategy": strategy,
        "chosen": chosen,
        "size": count * itemsize,
        "count": count,
        "times": await _slowest(g, times),
        "pipelined": await _slowest(g, pipelined),
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


def summarize(raw: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """One output row from a worker's raw times (seconds, slowest rank per iteration)."""
    collective, p = config["collective"], config["world_size"]
    times = np.array(raw["times"]) * 1e6
    median = float(np.median(times))
    moved = data_bytes(collective, raw["size"], p)
    algbw = moved / (median * 1e-6) / GB if median > 0 else 0.0
    row = {
        "collective": collective,
        "world_size": p,
        "transport": config["transport"],
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
    }
    if raw["pipelined"]:
        per_op = float(np.median(raw["pipelined"])) * 1e6
        row["pipelined_us"] = per_op
        if per_op > 0:
            row["pipelined_busbw_gbps"] = (
                moved / (per_op * 1e-6) / GB * bus_factor(collective, p)
            )
    return row


COLUMNS = (  # (title, unit, width)
    ("size", "(B)", 9), ("count", "(elems)", 11), ("type", "", 8), ("strategy", "", 24),
    ("time", "(us)", 10), ("min", "(us)", 10), ("p10-p90", "(us)", 19),
    ("algbw", "(GB/s)", 9), ("busbw", "(GB/s)", 9), ("pipelined", "(us/op)", 10),
)


def format_table(rows: Sequence[dict[str, Any]], config: dict[str, Any]) -> str:
    """The rows as an nccl-tests-style text table, one block per strategy."""
    c, p = config["collective"], config["world_size"]
    where = ("tasks in one process" if config["transport"] == "inproc"
             else f"processes, {config['transport']}")
    size_note = ("size = each rank's part; algbw counts the gathered world_size x size bytes"
                 if c == "allgather" else "size = bytes of the tensor each rank passes")
    root_note = f", root {ROOT}" if c in ("broadcast", "reduce") else ""
    lines = [
        f"# p2pcoll bench: {c}{root_note}, {p} peers ({where}), {config['dtype']}, "
        f"{config['iters']} iters after {config['warmup']} warmup",
        f"# {size_note}",
        "# time: median over iterations of the slowest rank (each iteration starts after a "
        "barrier); min, p10-p90 the same",
        f"# busbw = algbw x {_factor_text(c)} (nccl-tests); pipelined: {config['pipelined']} "
        "collectives started together, time per collective",
        "#",
        "#" + "".join(f"{t:>{w}}" for t, _, w in COLUMNS)[1:],
        "#" + "".join(f"{u:>{w}}" for _, u, w in COLUMNS)[1:],
    ]
    previous = None
    for row in rows:
        if previous is not None and row["strategy"] != previous:
            lines.append("")
        previous = row["strategy"]
        name = row["strategy"]
        if name == "auto":
            name = f"auto:{row['chosen']}"
        pipe = row["pipelined_us"]
        cells = (
            format_size(row["size"]), str(row["count"]), row["dtype"], name,
            _us(row["time_us"]), _us(row["min_us"]),
            f"{_us(row['p10_us'])}-{_us(row['p90_us'])}",
            f"{row['algbw_gbps']:.4f}", f"{row['busbw_gbps']:.4f}",
            "-" if pipe is None else _us(pipe),
        )
        lines.append("".join(f"{v:>{w}}" for v, (_, _, w) in zip(cells, COLUMNS, strict=True)))
    return "\n".join(lines) + "\n"


def _factor_text(collective: str) -> str:
    return {"allreduce": "2(p-1)/p", "allgather": "(p-1)/p",
            "reduce_scatter": "(p-1)/p"}.get(collective, "1")


def _us(value: float) -> str:
    return f"{value:.1f}" if value < 10_000 else f"{value:.0f}"


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
