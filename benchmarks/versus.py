"""This tree against another checkout of p2pcoll (an earlier release), interleaved run by run.

    python benchmarks/versus.py --tree /path/to/p2pcoll-0.11.0            # every case, 10 rounds
    python benchmarks/versus.py --tree ../old --cases board,join --rounds 20

Not a test: it prints a markdown table. Each round runs every case once with each tree, in
alternating order (this, other; other, this; ...), so that drifts of the host's load hit
both alike; the table gives each tree's median over rounds, the ratio this/other and the
runs. Each checkout runs with ``PYTHONPATH`` set to it (and its ``plugins`` folder
seen as ``p2pcoll_plugins``), this one too (not whatever is installed). Run it on a quiet host: the cases
poll, and two ranks on a loaded 2-core host measure the scheduler.

Cases (all on this host):

- ``board``: 2 processes allreduce 4 KiB of float32 back to back (``--iters``), on the
  shared-memory board; rank 0's time per call.
- ``board-barrier``: the same calls, each after a barrier and timed alone, as ``p2pcoll
  bench`` times them: the median over calls of the slower rank's time. A call then starts
  with the partner late by the barrier's skew, and nothing of one call overlaps the next.
- ``messages``: the same over messages (``P2PCOLL_SHM=0``).
- ``large``: 64 MiB, ``--iters`` // 500 calls (at least 3).
- ``join``: ``p2pcoll launch -n 64`` of peers that import the package, then join and run
  one barrier: the time from the last peer's join call until every peer is through the
  barrier (``join``), and from the launch until then (``launch``: 64 imports included).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]  # this tree

LOOP = """
import asyncio, os, time
import numpy as np
import p2pcoll

async def main():
    n, iters = int(os.environ["VERSUS_COUNT"]), int(os.environ["VERSUS_ITERS"])
    separated = os.environ.get("VERSUS_BARRIER") == "1"
    async with p2pcoll.join() as g:
        x = np.ones(n, np.float32)
        for _ in range(max(iters // 10, 3)):
            if separated:
                await g.barrier()
            await g.allreduce(x)
        await g.barrier()
        if separated:
            times = []
            for _ in range(iters):
                await g.barrier()
                t = time.perf_counter()
                await g.allreduce(x)
                times.append(time.perf_counter() - t)
            slower = await g.allreduce(np.array(times), op="max")
            if g.rank == 0:
                print("PER_CALL", float(np.median(slower)), flush=True)
            return
        t = time.perf_counter()
        for _ in range(iters):
            await g.allreduce(x)
        if g.rank == 0:
            print("PER_CALL", (time.perf_counter() - t) / iters, flush=True)

asyncio.run(main())
"""

JOIN = """
import asyncio, os, sys, time
import p2pcoll
p2pcoll.join  # the package imported before the clock starts

async def main():
    began = time.time()
    async with p2pcoll.join(timeout=300) as g:
        await g.barrier()
        through, rank = time.time(), g.rank
    with open(os.path.join(sys.argv[1], f"joined-{rank}"), "w") as f:
        f.write(f"{began} {through}")

asyncio.run(main())
"""


def launch(env: dict[str, str], n: int, script: Path, *script_args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "p2pcoll", "launch", "-n", str(n), "--",
                           sys.executable, str(script), *script_args], env=env,
                          capture_output=True,
                          text=True, timeout=900, cwd=script.parent)
    if done.returncode:
        raise SystemExit(f"p2pcoll launch failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout


def loop_case(count: int, iters: int, extra: dict[str, str], folder: Path
              ) -> Callable[[dict[str, str]], dict[str, float]]:
    script = folder / "loop.py"
    script.write_text(LOOP)

    def run(env: dict[str, str]) -> dict[str, float]:
        out = launch({**env, **extra, "VERSUS_COUNT": str(count),
                      "VERSUS_ITERS": str(iters)}, 2, script)
        [per_call] = re.findall(r"PER_CALL (\S+)", out)
        return {"us": float(per_call) * 1e6}
    return run


def join_case(folder: Path) -> Callable[[dict[str, str]], dict[str, float]]:
    script = folder / "join.py"
    script.write_text(JOIN)

    def run(env: dict[str, str]) -> dict[str, float]:
        reports = folder / "joined"
        reports.mkdir(exist_ok=True)
        for old in reports.iterdir():
            old.unlink()
        started = time.time()
        launch(env, 64, script, str(reports))  # (each peer writes its clock readings)
        pairs = [tuple(map(float, f.read_text().split())) for f in reports.iterdir()]
        if len(pairs) != 64:
            raise SystemExit(f"only {len(pairs)} of 64 peers reported")
        last_call, through = max(a for a, _ in pairs), max(b for _, b in pairs)
        return {"join s": through - last_call, "launch s": through - started}
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", required=True, help="the other checkout of p2pcoll")
    parser.add_argument("--cases", default="board,board-barrier,messages,large,join",
                        help="comma-separated, of board, board-barrier, messages, large, join")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--iters", type=int, default=4000, help="calls per 4 KiB run")
    args = parser.parse_args()
    tree = Path(args.tree).resolve()
    if not (tree / "p2pcoll" / "__init__.py").exists():
        parser.error(f"--tree {tree}: no p2pcoll package there")
    with tempfile.TemporaryDirectory(prefix="versus-") as tmp:
        folder = Path(tmp)
        trees = {}
        base = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        for name, root in (("this", HERE), ("other", tree)):
            (folder / name / "p2pcoll_plugins").parent.mkdir()
            (folder / name / "p2pcoll_plugins").symlink_to(root / "plugins")
            trees[name] = {**base, "PYTHONPATH": f"{root}{os.pathsep}{folder / name}"}
        cases = {"board": loop_case(1024, args.iters, {}, folder),
                 "board-barrier": loop_case(1024, args.iters // 2, {"VERSUS_BARRIER": "1"},
                                            folder),
                 "messages": loop_case(1024, args.iters // 4, {"P2PCOLL_SHM": "0"}, folder),
                 "large": loop_case(16 << 20, max(args.iters // 500, 3), {}, folder),
                 "join": join_case(folder)}
        chosen = args.cases.split(",")
        unknown = set(chosen) - set(cases)
        if unknown:
            parser.error(f"--cases: unknown {sorted(unknown)}")
        figures: dict[tuple[str, str, str], list[float]] = {}
        loads = [os.getloadavg()[0]]
        for r in range(args.rounds):
            for case in chosen:
                for name in (("this", "other") if r % 2 == 0 else ("other", "this")):
                    for key, value in cases[case](trees[name]).items():
                        figures.setdefault((case, key, name), []).append(value)
            loads.append(os.getloadavg()[0])
            print(f"round {r + 1} of {args.rounds}", file=sys.stderr)
    print(f"this tree against {tree}, {args.rounds} interleaved rounds, load "
          f"{min(loads):.1f}-{max(loads):.1f}\n")
    print("| case | figure | this | other | this/other | this, runs | other, runs |")
    print("|---|---|---|---|---|---|---|")
    for case, key in dict.fromkeys((c, k) for c, k, _ in figures):
        mine, theirs = figures[case, key, "this"], figures[case, key, "other"]
        a, b = statistics.median(mine), statistics.median(theirs)
        print(f"| {case} | {key} | {a:.2f} | {b:.2f} | {a / b:.3f} | "
              f"{min(mine):.2f}-{max(mine):.2f} | {min(theirs):.2f}-{max(theirs):.2f} |")


if __name__ == "__main__":
    main()
