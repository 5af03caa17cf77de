"""Where a small allreduce's microseconds go, per layer, through the supported seam only.

    python benchmarks/profile_small.py                    # 4 KiB, p = 2, 2000 calls per phase
    python benchmarks/profile_small.py --size 64K --iterations 500 --json profile.json
    PYTHONPATH=/path/to/old/tree python benchmarks/profile_small.py --plain   # a before figure

Not a test: it prints a table. The raw stack's costs (pyzmq, a lane, the board, numpy)
are in ``benchmarks/floors.py``; this measures p2pcoll on top of them.

The driver (this process) runs, for ``strategy`` auto (small collectives of one host go on
the shared-memory board) and ``ring`` (messages, through the executor), ``p2pcoll launch
-n 2`` of this file as ``--worker``. Each rank joins, warms up, then:

1. runs ``--iterations`` allreduces of ``--size`` bytes of float32 back to back, fresh input
   each call: wall time per call (``perf_counter``: mean, p50, p99) and main-thread CPU per call
   (``time.thread_time``), and, through the transport's ``sent``/``delivered`` hooks, the
   data messages per call;
2. runs as many again with the executor's primitives (``executor.wire``) timed: time in
   sends, waiting for receives and folding in, per call;
3. runs as many again under cProfile and splits the main thread's own time by the file each
   function lives in (a builtin's by its callers' files): ``board`` (engine/board_path, transport/board), ``executor``
   (engine/executor, matching, plan, layout), ``transport`` (transport/*, wire/*),
   ``API`` (api/*, session/*, and the rest of p2pcoll), ``event loop`` (asyncio, selectors),
   ``numpy``, ``other``. cProfile inflates every figure; read the shares.

``--plain`` runs only step 1 (without the hooks) and the world of one: the public API
alone, so the same script measures a version of p2pcoll from before the seam.

A world of one (``p2pcoll.testing.run_ranks(1, ...)``, no peers, no messages) gives p2pcoll's
own per-call cost. Nothing private is patched: hooks and primitives are the seam
(:mod:`p2pcoll.transport.base`, :class:`p2pcoll.engine.executor.Wire`).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import pstats
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

import p2pcoll
from p2pcoll.testing import run_ranks

LAYERS = ("board", "executor", "transport", "API", "event loop", "numpy", "other")
_FILES = (  # (path fragment, layer): the first that matches a function's file wins
    ("p2pcoll/engine/board_path", "board"), ("p2pcoll/transport/board", "board"),
    ("p2pcoll/engine/executor", "executor"), ("p2pcoll/engine/matching", "executor"),
    ("p2pcoll/engine/plan", "executor"), ("p2pcoll/engine/layout", "executor"),
    ("p2pcoll/transport/", "transport"), ("p2pcoll/wire/", "transport"), ("zmq/", "transport"),
    ("p2pcoll/", "API"), ("asyncio/", "event loop"), ("selectors", "event loop"),
    ("numpy/", "numpy"), ("msgpack/", "transport"),
)


def size_arg(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20}
    n = int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)
    if n <= 0 or n % 4:
        raise argparse.ArgumentTypeError(f"size {text!r}: a positive multiple of 4 bytes")
    return n


def layer_of(filename: str) -> str | None:
    """The layer of a function by its file; None for builtins and generated code."""
    if filename == "~" or filename.startswith("<"):
        return None
    for fragment, layer in _FILES:
        if fragment in filename:
            return layer
    return "other"


def own_time_by_layer(profiler: cProfile.Profile) -> dict[str, float]:
    """The profiled seconds of own time per layer; a builtin's (``len``, ``dict.get``,
    ``epoll.poll``, a dataclass's ``__init__``) go to the layers of its callers."""
    by_layer = dict.fromkeys(LAYERS, 0.0)
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    for (filename, _, _), (_, _, own, _, callers) in stats.items():
        layer = layer_of(filename)
        if layer is not None:
            by_layer[layer] += own
            continue
        for (caller, _, _), (_, _, from_caller, _) in callers.items():
            by_layer[layer_of(caller) or "other"] += from_caller
    return by_layer


async def timed_loop(g: p2pcoll.Group, x: np.ndarray, n: int, strategy: str | None
                     ) -> tuple[list[float], float]:
    """Each of ``n`` allreduces' wall seconds (fresh input each call), and the main
    thread's CPU seconds for all of them."""
    clock, times = time.perf_counter, []
    cpu = time.thread_time()
    for i in range(n):
        x.fill(i)
        t = clock()
        await g.allreduce(x, out=x, strategy=strategy)
        times.append(clock() - t)
    return times, time.thread_time() - cpu


def summary(rank: int, times: list[float], cpu: float) -> dict[str, Any]:
    p50, p99 = np.quantile(times, [0.5, 0.99]) * 1e6
    n = len(times)
    return {"rank": rank, "wall_us": sum(times) / n * 1e6, "p50_us": float(p50),
            "p99_us": float(p99), "cpu_us": cpu / n * 1e6}


def timed_wire(wire: Any, spent: dict[str, float]) -> Any:
    """``wire`` with the seconds spent in each primitive added into ``spent``."""
    from p2pcoll.engine.executor import Wire  # here: --plain runs versions without it

    clock = time.perf_counter

    async def send_many(*args: Any, **kwargs: Any) -> Any:
        t = clock()
        try:
            return await wire.send_many(*args, **kwargs)
        finally:
            spent["send"] += clock() - t

    async def get(key: Any) -> Any:
        t = clock()
        try:
            return await wire.get(key)
        finally:
            spent["receive"] += clock() - t

    def combine(*args: Any) -> None:
        t = clock()
        wire.combine(*args)
        spent["fold"] += clock() - t

    return Wire(send_many, get, combine)


async def profile(g: p2pcoll.Group, size: int, n: int, strategy: str | None, plain: bool
                  ) -> dict[str, Any]:
    x = np.zeros(size // 4, np.float32)
    await timed_loop(g, x, max(n // 10, 20), strategy)  # warm up: programs, pages, caches
    if plain:
        await g.barrier()
        return summary(g.rank, *await timed_loop(g, x, n, strategy))
    transport, executor = g.session.transport, g.session.executor
    messages = [0]

    def count(peer: int, header: Any, nbytes: int) -> None:
        messages[0] += 1

    await g.barrier()
    transport.sent = count
    result = summary(g.rank, *await timed_loop(g, x, n, strategy))
    transport.sent = None
    spent = dict.fromkeys(("send", "receive", "fold"), 0.0)
    executor.wire, untimed = timed_wire(executor.wire, spent), executor.wire
    await g.barrier()
    await timed_loop(g, x, n, strategy)
    executor.wire = untimed
    await g.barrier()
    profiler = cProfile.Profile()
    profiler.enable()
    await timed_loop(g, x, n, strategy)
    profiler.disable()
    by_layer = own_time_by_layer(profiler)
    return {**result, "messages": messages[0] / n,
            "wire_us": {k: v / n * 1e6 for k, v in spent.items()},
            "layers_us": {k: v / n * 1e6 for k, v in by_layer.items()}}


def worker(args: argparse.Namespace) -> None:
    async def main() -> None:
        async with p2pcoll.join() as g:
            result = await profile(g, args.size, args.iterations, args.strategy, args.plain)
            print("PROFILE " + json.dumps(result), flush=True)

    asyncio.run(main())


def launch(args: argparse.Namespace, strategy: str | None) -> list[dict[str, Any]]:
    command = [sys.executable, "-m", "p2pcoll", "launch", "-n", "2", "--", sys.executable,
               str(Path(__file__).resolve()), "--worker", "--size", str(args.size),
               "--iterations", str(args.iterations)] + (["--plain"] if args.plain else [])
    if strategy is not None:
        command += ["--strategy", strategy]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode != 0:
        sys.exit(f"profile_small: the ranks failed ({done.returncode}):\n{done.stderr}")
    rows = [json.loads(line.split("PROFILE ", 1)[1]) for line in done.stdout.splitlines()
            if "PROFILE " in line]
    return sorted(rows, key=lambda r: r["rank"])


def world_of_one(size: int, n: int) -> float:
    """Microseconds per call of an allreduce in a group of one (no peers)."""
    async def work(g: p2pcoll.Group) -> float:
        x = np.zeros(size // 4, np.float32)
        await timed_loop(g, x, max(n // 10, 20), None)
        return sum((await timed_loop(g, x, n, None))[0]) / n * 1e6

    return asyncio.run(run_ranks(1, work))[0]


def table(args: argparse.Namespace, runs: dict[str, list[dict[str, Any]]], one: float) -> str:
    def cell(values: list[float]) -> str:
        return " / ".join(f"{v:.1f}" for v in values)

    names = list(runs)
    lines = [f"allreduce of {args.size} bytes, p = 2 (under p2pcoll launch), "
             f"{args.iterations} calls per phase; cells: rank 0 / rank 1", "",
             "| | " + " | ".join(f"strategy {s}" for s in names) + " |",
             "|---|" + "---|" * len(names)]

    def row(label: str, pick: Any) -> None:
        lines.append(f"| {label} | " + " | ".join(cell([pick(r) for r in runs[s]])
                                                 for s in names) + " |")

    row("wall us/call (mean)", lambda r: r["wall_us"])
    row("wall us/call p50", lambda r: r["p50_us"])
    row("wall us/call p99", lambda r: r["p99_us"])
    row("main-thread CPU us/call", lambda r: r["cpu_us"])
    if not args.plain:
        row("data messages sent/call", lambda r: r["messages"])
        for part in ("send", "receive", "fold"):
            row(f"executor {part} us/call (seam)", lambda r, p=part: r["wire_us"][p])
        for layer in LAYERS:
            row(f"cProfile own time: {layer} us/call", lambda r, k=layer: r["layers_us"][k])
    lines += ["", f"world of one: {one:.1f} us/call (run_ranks(1, ...), {args.iterations} calls)"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=size_arg, default=4096, help="bytes per rank (4K)")
    parser.add_argument("--iterations", type=int, default=2000, help="calls per phase")
    parser.add_argument("--strategy", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--plain", action="store_true",
                        help="wall and CPU per call only, through the public API")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    if args.iterations < 1:
        parser.error("--iterations must be at least 1")
    if args.worker:
        worker(args)
        return
    runs = {"auto": launch(args, None), "ring": launch(args, "ring")}
    one = statistics.median(world_of_one(args.size, args.iterations) for _ in range(3))
    print(table(args, runs, one))
    if args.json:
        args.json.write_text(json.dumps({"size": args.size, "runs": runs, "world_of_one_us": one},
                                        indent=1))


if __name__ == "__main__":
    main()
