"""Draw a p2pcoll timeline as a PNG: one band per rank, its sends, receives and reductions.

    python benchmarks/timeline_png.py                      # run a 4-rank ring allreduce, draw it
    python benchmarks/timeline_png.py --trace trace.json   # draw a timeline you recorded

Without ``--trace`` it records one: ``p2pcoll launch -n 4`` with ``P2PCOLL_TIMELINE`` runs a
few ring allreduces of ``--size`` bytes (4 MiB: each rank's chunk is one 1 MiB segment, so
the picture is the textbook one, 3 reduce-scatter steps then 3 allgather steps) and draws
the last of them. Each rank has three rows: what it sends (the transport taking the
message), what it receives (from the moment it waits until the piece is there: long bars
are waiting for the left neighbour) and what it reduces or copies; bars are coloured by the
step of the strategy, and arrows join each send to the receive it feeds. The README's
picture is made with the defaults. Needs matplotlib (``pip install 'p2pcoll[bench]'``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

from p2pcoll.engine.timeline import events
from p2pcoll.settings import parse_bytes

JOB = textwrap.dedent("""
    import asyncio, sys
    import numpy as np
    import p2pcoll

    async def main():
        async with p2pcoll.join(strategies={"allreduce": "ring"}) as g:
            x = np.ones(int(sys.argv[1]) // 4, dtype=np.float32)
            for _ in range(int(sys.argv[2])):
                await g.allreduce(x)

    asyncio.run(main())
""")
ROWS = ("send", "recv", "reduce/copy")  # the timeline's tracks 1..3, top to bottom


def record(size: int, repeat: int, world_size: int, folder: Path) -> Path:
    """Run the ring allreduces under ``p2pcoll launch`` with a timeline; its path."""
    trace, job = folder / "ring.json", folder / "job.py"
    job.write_text(JOB)
    env = {**os.environ, "P2PCOLL_TIMELINE": str(trace)}
    subprocess.run([sys.executable, "-m", "p2pcoll", "launch", "-n", str(world_size), "--",
                    sys.executable, str(job), str(size), str(repeat)], env=env, check=True)
    return trace


def last_collective(trace: list[dict[str, Any]]) -> dict[int, tuple[float, float]]:
    """Each rank's span (start, end) of the last collective, by track."""
    spans = [e for e in trace if e.get("ph") == "X" and e.get("tid") == 0]
    seq = max(e["args"]["seq"] for e in spans)
    return {e["pid"]: (e["ts"], e["ts"] + e["dur"]) for e in spans if e["args"]["seq"] == seq}


def draw(trace: list[dict[str, Any]], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    window = last_collective(trace)
    start = min(a for a, _ in window.values())
    end = max(b for _, b in window.values())

    def within(e: dict[str, Any]) -> bool:
        a, b = window.get(e["pid"], (0.0, -1.0))
        return a <= e["ts"] <= b

    names = {e["pid"]: e["args"]["name"] for e in trace
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    pids = sorted(names)
    inside = [e for e in trace if e.get("ph") == "X" and e.get("tid") in (1, 2, 3)
              and within(e)]
    steps = max((e["args"].get("step", 0) for e in inside), default=0) + 1
    colours = plt.get_cmap("viridis", max(steps, 2))
    fig, ax = plt.subplots(figsize=(11, 1.1 + 0.9 * len(pids)))
    row_of: dict[tuple[int, int], float] = {}
    labels, ticks = [], []
    for band, pid in enumerate(pids):
        for k, row in enumerate(ROWS):
            y = (len(pids) - 1 - band) * (len(ROWS) + 1) + (len(ROWS) - 1 - k)
            row_of[(pid, k + 1)] = y
            ticks.append(y)
            labels.append(f"{names[pid]}  {row}")
    ms = 1e-3
    for e in inside:
        y = row_of[(e["pid"], e["tid"])]
        left, width = (e["ts"] - start) * ms, max(e["dur"] * ms, 0.002)
        ax.barh(y, width, left=left, height=0.8, color=colours(e["args"].get("step", 0)),
                edgecolor="black", linewidth=0.3)
    by_id: dict[int, dict[str, tuple[float, float]]] = {}
    for e in trace:
        if e.get("ph") in ("s", "f") and within(e):
            by_id.setdefault(e["id"], {})[e["ph"]] = ((e["ts"] - start) * ms,
                                                       row_of[(e["pid"], e["tid"])])
    for ends in by_id.values():
        if "s" in ends and "f" in ends:
            (x0, y0), (x1, y1) = ends["s"], ends["f"]
            ax.annotate("", xy=(x1, y1), xytext=(x0, y0),
                        arrowprops={"arrowstyle": "->", "color": "0.4", "lw": 0.6})
    ax.set_yticks(ticks, labels, fontsize=8)
    ax.set_xlim(0, (end - start) * ms)
    ax.set_xlabel("milliseconds since the collective started")
    ax.set_title(title, fontsize=10)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colours(s)) for s in range(steps)]
    ax.legend(handles, [f"step {s}" for s in range(steps)], fontsize=7, ncol=min(steps, 8),
              loc="upper center", bbox_to_anchor=(0.5, -0.18), frameon=False)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, help="a merged timeline to draw (default: record one)")
    parser.add_argument("--size", type=parse_bytes, default=parse_bytes("4M"),
                        help="bytes per rank of the recorded allreduce (default 4M)")
    parser.add_argument("-n", "--world-size", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=5,
                        help="allreduces recorded; the last is drawn (default 5)")
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("timeline_ring_p4.png"))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        trace = args.trace or record(args.size, args.repeat, args.world_size, Path(tmp))
        loaded = list(events(trace))
        title = (f"{trace.name}: last collective" if args.trace else
                 f"ring allreduce of {args.size >> 20} MiB per rank, {args.world_size} ranks "
                 "(p2pcoll timeline)")
        draw(loaded, args.out, title)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
