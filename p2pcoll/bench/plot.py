"""``p2pcoll bench --plot PATH``: busbw and time against size as a PNG.

Needs matplotlib (the ``bench`` extra), imported only when a plot is drawn.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

from ..settings import format_bytes
from .report import factor_text

PEER_STYLES = {
    "gloo": {"color": "black", "linestyle": "--", "marker": "s", "linewidth": 2},
    "mpi": {"color": "dimgray", "linestyle": ":", "marker": "^", "linewidth": 2},
}


def plot(path: str, rows: Sequence[dict[str, Any]],
         compared: dict[str, list[dict[str, Any]]], config: dict[str, Any]) -> None:
    """Write a PNG: busbw (left) and time (right) against size, one line per strategy and one
    per compared library. Needs matplotlib (drawn with its Agg backend, no display)."""
    from matplotlib.figure import Figure

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
        ax.set_xticks(ticks, [format_bytes(s) for s in ticks])
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
        f"busbw = algbw x {factor_text(config['collective'])}"
    )
    # Few colours are drawn: a 64-colour palette keeps the file small enough to commit.
    canvas = io.BytesIO()
    fig.savefig(canvas, format="png")
    from PIL import Image

    with Image.open(canvas) as image:
        image.convert("RGB").quantize(colors=64).save(path, format="PNG", optimize=True)
