"""``p2pcoll bench`` itself: options in; peers run; a table, JSON or a plot out."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from . import runner
from .options import bench_config, missing_extras, resolve_strategies
from .report import format_table, ratios, summarize


def main(args: argparse.Namespace) -> int:
    """Run the benchmark the options describe; print the table. Returns an exit code.

    ``args`` are the options :func:`p2pcoll.bench.options.configure_parser` adds. The
    p2pcoll peers run first, then each ``--compare`` library's, one after the other.
    """
    try:
        strategies = resolve_strategies(args.collective, args.strategy)
    except ValueError as exc:
        return _fail(str(exc))
    problem = missing_extras(args)
    if problem is not None:
        return _fail(problem)
    config = bench_config(args, strategies)
    rows: list[dict[str, Any]] = []
    compared: dict[str, list[dict[str, Any]]] = {}
    for library in ["p2pcoll", *config["compare"]]:
        code, raw = runner.run(library, config)
        if code != 0:
            which = "a peer" if library == "p2pcoll" else f"a {library} peer"
            print(f"p2pcoll bench: {which} failed (exit code {code})", file=sys.stderr)
            return code
        summary = [summarize(r, config, library) for r in raw]
        if library == "p2pcoll":
            rows = summary
        else:
            compared[library] = summary
    if args.plot is not None:
        from .plot import plot  # noqa: PLC0415 (matplotlib is optional)

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


def _fail(message: str) -> int:
    print(f"p2pcoll bench: {message}", file=sys.stderr)
    return 2
