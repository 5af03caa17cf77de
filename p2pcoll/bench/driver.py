"""``p2pcoll bench`` itself: options in; peers run; a table, JSON or a plot out; or, with
``--calibrate``, the cost model of this host (:mod:`p2pcoll.bench.calibrate`)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from contextlib import ExitStack
from typing import Any

from ..engine.costs import load_constants
from ..errors import SettingsError
from ..settings import Settings
from . import runner
from .load import cpu_load
from .options import (
    CALIBRATE_SIZES,
    bench_config,
    calibration_target,
    check_cost_model,
    missing_extras,
    parse_sizes,
    resolve_strategies,
)
from .report import format_table, ratios, summarize


def main(args: argparse.Namespace) -> int:
    """Run the benchmark the options describe; print the table. Returns an exit code.

    ``args`` are the options :func:`p2pcoll.bench.options.configure_parser` adds. The
    p2pcoll peers run first, then each ``--compare`` library's, one after the other.
    """
    if args.calibrate:
        return calibrate(args)
    try:
        check_cost_model(args)
        strategies = resolve_strategies(args.collective, args.strategy)
    except ValueError as exc:  # SettingsError included
        return _fail(str(exc))
    problem = missing_extras(args)
    if problem is not None:
        return _fail(problem)
    config = bench_config(args, strategies)
    rows: list[dict[str, Any]] = []
    compared: dict[str, list[dict[str, Any]]] = {}
    with ExitStack() as stack:
        try:  # every library runs beside the same load
            stack.enter_context(cpu_load(config["load"]))
        except OSError as exc:
            return _fail(f"cannot start the --load processes: {exc}")
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
        from .plot import plot

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


def calibrate(args: argparse.Namespace) -> int:
    """``--calibrate``: measure, fit, write the cost model, print the constants and how to
    use them. Every check runs before the first peer starts. Returns an exit code."""
    from . import calibrate as calibration

    try:
        path, where, transports = calibration_target(args)
        settings = Settings.resolve()  # the peers' segmentation, which shapes the workloads
    except (ValueError, SettingsError) as exc:
        return _fail(str(exc))
    sizes = args.sizes or parse_sizes(CALIBRATE_SIZES)
    plan = calibration.Plan(transports, tuple(sizes), args.iters, args.warmup,
                            args.dtype, args.secure)
    cores, load = len(os.sched_getaffinity(0)), os.getloadavg()[0]
    try:
        gamma, fits = calibration.calibrate(
            plan, settings, cores, lambda what: print(f"p2pcoll bench --calibrate: {what}",
                                                      file=sys.stderr, flush=True))
    except calibration.CalibrationFailed as exc:
        print(f"p2pcoll bench --calibrate: {exc}; nothing written to {path}", file=sys.stderr)
        return exc.code
    try:
        calibration.write(path, gamma, fits, where)
    except (OSError, SettingsError) as exc:
        return _fail(f"cannot write the cost model to {str(path)!r}: {exc}")
    print(calibration.format_report(plan, gamma, fits, cores, load,
                                   load_constants(path, where)), end="")
    print(f"\nwrote {path}; auto uses it in every process that has\n"
          f"export P2PCOLL_COST_MODEL={path}")
    return 0


def _fail(message: str) -> int:
    print(f"p2pcoll bench: {message}", file=sys.stderr)
    return 2
