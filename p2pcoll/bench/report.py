"""The numbers of ``p2pcoll bench``: raw rows -> summary rows, ratios, the text table.

A worker's raw row holds the per-iteration times of one strategy and size, each already the
slowest rank's (:func:`p2pcoll.bench.measure.raw_row`). :func:`summarize` turns it into an
output row: the median, min and p10-p90 spread and the p99 of the times, the median CPU time
per call, algbw, busbw, the pipelined time per operation and the peak RSS.

Bandwidths follow nccl-tests: ``algbw = S / time`` with S the bytes of the collective's data
(:func:`data_bytes`: the tensor each rank passes; for allgather, the gathered result:
world_size times each rank's part, as nccl-tests counts it), and ``busbw = algbw * factor``
(:func:`bus_factor`) with factor ``2(p-1)/p`` for allreduce, ``(p-1)/p`` for allgather and
reduce_scatter, 1 for broadcast and reduce. busbw is comparable across world sizes and
strategies.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..settings import format_bytes
from .measure import ROOT

GB = 1e9  # nccl-tests reports GB/s with GB = 1e9 bytes
MIB = 1 << 20


def bus_factor(collective: str, world_size: int) -> float:
    """nccl-tests' busbw / algbw ratio for a collective on ``world_size`` ranks."""
    p = world_size
    if collective == "allreduce":
        return 2 * (p - 1) / p
    if collective in ("allgather", "reduce_scatter", "alltoall"):
        return (p - 1) / p
    if collective in ("broadcast", "reduce"):
        return 1.0
    raise ValueError(f"unknown collective {collective!r}")


def factor_text(collective: str) -> str:
    """:func:`bus_factor` as a formula, for titles."""
    return {"allreduce": "2(p-1)/p", "allgather": "(p-1)/p",
            "reduce_scatter": "(p-1)/p", "alltoall": "(p-1)/p"}.get(collective, "1")


def data_bytes(collective: str, nbytes: int, world_size: int) -> int:
    """S in ``algbw = S / time``: the tensor's bytes; for allgather, the gathered result."""
    return nbytes * world_size if collective == "allgather" else nbytes


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
        # CPU time per call: median over iterations of the rank that used most (every
        # thread of its process: waiting that polls shows here, sleeping does not).
        "cpu_us": float(np.median(raw["cpu"])) * 1e6 if raw.get("cpu") else None,
        "min_us": float(times.min()),
        "p10_us": float(np.percentile(times, 10)),
        "p90_us": float(np.percentile(times, 90)),
        "p99_us": float(np.percentile(times, 99)),
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
            "cpu_us": row["cpu_us"],
            "peer_cpu_us": other["cpu_us"],
            "busbw_gbps": row["busbw_gbps"],
            "peer_busbw_gbps": other["busbw_gbps"],
            "busbw_ratio": _ratio(row["busbw_gbps"], other["busbw_gbps"]),
        })
    return out


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


COLUMNS = (  # (title, unit, width)
    ("size", "(B)", 9), ("count", "(elems)", 11), ("type", "", 8), ("strategy", "", 24),
    ("time", "(us)", 10), ("cpu", "(us)", 9), ("min", "(us)", 10), ("p10-p90", "(us)", 19),
    ("p99", "(us)", 9),
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
                 if c == "allgather" else "size = bytes each rank sends, one 1/p part to "
                 "every rank (itself too)" if c == "alltoall"
                 else "size = bytes of the tensor each rank passes")
    root_note = f", root {ROOT}" if c in ("broadcast", "reduce") else ""
    in_place = {"allreduce": "; allreduce runs in place (out=x)",
                "broadcast": "; broadcast writes into the non-roots' input"}.get(c, "")
    peers = "".join(f"; {peer} after it" for peer in compared)
    load = config.get("load", 0)
    if load:
        peers += f"; beside {load} CPU-bound process{'es' if load > 1 else ''} (--load)"
    lines = [
        (f"# p2pcoll bench: {c}{root_note}, {p} peers ({where}){peers}, {config['dtype']}, "
         f"{config['iters']} iters after {config['warmup']} warmup"),
        f"# {size_note}",
        ("# time: median over iterations of the slowest rank (each iteration starts after a "
         "barrier); min, p10-p90 and p99 the same"),
        ("# cpu: median over iterations of the CPU time one call used in the peer process "
         "that used most (all its threads)"),
        f"# the input is refilled before each iteration, outside the timed region{in_place}",
        (f"# busbw = algbw x {factor_text(c)} (nccl-tests); pipelined: {config['pipelined']} "
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
            format_bytes(row["size"]), str(row["count"]), row["dtype"], _row_name(row),
            _us(row["time_us"]), _cpu(row["cpu_us"]), _us(row["min_us"]),
            f"{_us(row['p10_us'])}-{_us(row['p90_us'])}", _us(row["p99_us"]),
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
            f"#   {name:>24} {format_bytes(row['size']):>5}: peak {peak / MIB:.0f} MiB = "
            f"{peak / row['size']:.1f}x the tensor; before {before / MIB:.0f} MiB; growth "
            f"{(peak - before) / MIB:.0f} MiB = {(peak - before) / row['size']:.1f}x{reset}"
        )
    return lines


RATIO_COLUMNS = (  # (title, unit, width)
    ("size", "(B)", 9), ("strategy", "", 24), ("time", "(us)", 10), ("{peer} time", "(us)", 11),
    ("ratio", "time", 8), ("cpu", "(us)", 9), ("{peer} cpu", "(us)", 10),
    ("busbw", "(GB/s)", 9), ("{peer} busbw", "(GB/s)", 12),
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
            format_bytes(pair["size"]), name, _us(pair["time_us"]), _us(pair["peer_time_us"]),
            _times(pair["time_ratio"]), _cpu(pair["cpu_us"]), _cpu(pair["peer_cpu_us"]),
            f"{pair['busbw_gbps']:.4f}",
            f"{pair['peer_busbw_gbps']:.4f}", _times(pair["busbw_ratio"]),
        )
        lines.append("".join(f"{v:>{w}}" for v, (_, _, w) in zip(cells, columns, strict=True)))
    return lines


def _times(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def _cpu(value: float | None) -> str:
    return "-" if value is None else _us(value)


def _us(value: float) -> str:
    return f"{value:.1f}" if value < 10_000 else f"{value:.0f}"
