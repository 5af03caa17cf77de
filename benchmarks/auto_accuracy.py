"""How well "auto" (the cost model) picks the fastest allreduce strategy, measured.

    python benchmarks/auto_accuracy.py                          # p = 2, 3, 4; 4K..16M
    python benchmarks/auto_accuracy.py -n 2,4 --sizes 4K,1M --iters 10
    python benchmarks/auto_accuracy.py --from-json /tmp/aa      # re-read an earlier run

Not a test: it prints markdown tables. For every world size it runs ``p2pcoll bench -n P
--strategy all --json`` (peers as processes of this host, transport ``auto``: ipc, large
pieces through shared memory), so every installed allreduce strategy is timed the way the
bench times it (median over iterations of the slowest rank, each after a barrier). Then, per
(p, size), it sets the fastest measured strategy against the one auto picks from the cost
model (the ipc constants of ``p2pcoll.engine.costs``, or ``$P2PCOLL_COST_MODEL``) and the
one the hand-tuned thresholds that the model replaced would have picked, and reports how
often each was the fastest and how much slower it was when not. The last table is the
model's error: predicted / measured time of every strategy. ``--fit`` also fits alpha, beta and
overhead to the measured times (least squares of the relative error, gamma kept: the fit of
``p2pcoll bench --calibrate``, :func:`p2pcoll.bench.calibrate.fit`) and reports auto's picks
with those: what constants calibrated on every strategy would do here.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from p2pcoll.bench.calibrate import Sample
from p2pcoll.bench.calibrate import fit as calibration_fit
from p2pcoll.engine.costs import CostModel, load_constants
from p2pcoll.registry import registry
from p2pcoll.settings import Settings, format_bytes, parse_bytes

SHORT = {"recursive_doubling": "rd", "rabenseifner": "rab", "reduce_broadcast": "rb",
         "ring": "ring", "direct": "direct"}


def thresholds(nbytes: int, p: int) -> str:
    """What auto picked before the cost model (p2pcoll 0.4's hand-tuned rules)."""
    if 2 < p <= 4 and nbytes <= 64 << 10:
        return "reduce_broadcast"
    return "recursive_doubling" if nbytes <= 1 << 20 else "rabenseifner"


def measure(p: int, sizes: list[int], iters: int, out: Path) -> None:
    command = [sys.executable, "-m", "p2pcoll", "bench", "-n", str(p), "--strategy", "all",
               "--sizes", ",".join(format_bytes(s) for s in sizes), "--iters", str(iters),
               "--pipelined", "0", "--json", str(out)]
    print(f"# {' '.join(command[2:])}", file=sys.stderr, flush=True)
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--world-sizes", default="2,3,4")
    parser.add_argument("--sizes", default="4K,64K,256K,1M,4M,16M")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--from-json", type=Path, help="a directory of an earlier run")
    parser.add_argument("--fit", action="store_true",
                        help="also report auto with alpha, beta and overhead fitted to these times")
    parser.add_argument("--keep", type=Path, default=Path("/tmp/auto_accuracy"),
                        help="where the bench's JSON goes (default /tmp/auto_accuracy)")
    args = parser.parse_args()
    world_sizes = [int(x) for x in args.world_sizes.split(",")]
    sizes = [parse_bytes(s) for s in args.sizes.split(",")]
    where = args.from_json or args.keep
    if args.from_json is None:
        where.mkdir(parents=True, exist_ok=True)
        for p in world_sizes:
            measure(p, sizes, args.iters, where / f"p{p}.json")

    settings = Settings.resolve()
    constants = load_constants(settings.cost_model) if settings.cost_model else None
    # The group's own model: all its ranks on this host, against this host's cores.
    cores = len(os.sched_getaffinity(0))
    base = CostModel.for_settings(settings, "ipc", constants, cores=cores)
    measured = {p: json.loads((where / f"p{p}.json").read_text()) for p in world_sizes}
    report(base, measured)
    if args.fit:
        fitted = fit(base, measured)
        print("\n## With alpha, beta and overhead fitted to these times\n")
        report(fitted, measured)
    return 0


def fit(base: CostModel, measured: dict[int, dict]) -> CostModel:
    """alpha, beta and overhead minimising the squared relative error of the predictions
    (gamma kept; non-negative least squares): ``p2pcoll bench --calibrate``'s fit."""
    samples = [Sample(registry.get("allreduce", row["strategy"]), p, row["size"],
                      row["time_us"] * 1e-6)
               for p, data in measured.items() for row in data["rows"]]
    result = calibration_fit(samples, base)
    print(f"\nfit: {result.quality()}")
    return replace(base, constants=result.constants)


def report(base: CostModel, runs: dict[int, dict]) -> None:
    rows, errors = [], {}
    for p, data in runs.items():
        model = replace(base, local=p)
        times: dict[int, dict[str, float]] = {}
        for row in data["rows"]:
            times.setdefault(row["size"], {})[row["strategy"]] = row["time_us"] * 1e-6
        for n, by_name in sorted(times.items()):
            fastest = min(by_name, key=by_name.__getitem__)
            auto = registry.auto_name("allreduce", n, p, model)
            old = thresholds(n, p)
            rows.append((p, n, fastest, by_name, auto, old))
            for name, took in by_name.items():
                predicted = model.predict(registry.get("allreduce", name), n, p)
                if predicted is not None:
                    errors.setdefault(name, []).append((p, n, predicted / took))

    def verdict(name: str, by_name: dict[str, float], fastest: str) -> str:
        if name not in by_name:
            return f"{SHORT.get(name, name)} (not measured)"
        slower = by_name[name] / by_name[fastest]
        return f"{SHORT.get(name, name)} " + ("**best**" if name == fastest else
                                             f"{slower:.2f}x")

    c = base.constants
    print(f"Allreduce: auto (cost model: alpha {c.alpha * 1e6:.0f} us, beta {c.beta * 1e9:.3g} "
          f"ns/B, gamma {c.gamma * 1e9:.3g} ns/B, overhead {c.overhead * 1e6:.0f} us on "
          f"{base.cores} cores) against the fastest measured strategy and against "
          "the old thresholds; time of the pick / time of the fastest\n")
    print("| p | size | fastest (time) | auto (model) | old thresholds |")
    print("|---|---|---|---|---|")
    for p, n, fastest, by_name, auto, old in rows:
        print(f"| {p} | {format_bytes(n)} | {SHORT.get(fastest, fastest)} "
              f"({by_name[fastest] * 1e6:.0f} us) | {verdict(auto, by_name, fastest)} | "
              f"{verdict(old, by_name, fastest)} |")
    for label, index in (("auto (model)", 4), ("old thresholds", 5)):
        picks = [(r[index], r[3], r[2]) for r in rows if r[index] in r[3]]
        hits = sum(name == fastest for name, _, fastest in picks)
        off = [by[name] / by[fastest] for name, by, fastest in picks if name != fastest]
        mean_all = statistics.fmean(by[name] / by[fastest] for name, by, fastest in picks)
        worst = f", worst {max(off):.2f}x, median miss {statistics.median(off):.2f}x" if off \
            else ""
        print(f"\n{label}: fastest in {hits} of {len(picks)}; mean time / fastest "
              f"{mean_all:.2f}x{worst}")

    print("\nModel error: predicted / measured time (1.00 = exact), per strategy\n")
    print("| strategy | " + " | ".join(f"p={p} {format_bytes(n)}" for p, n, *_ in rows) + " |")
    print("|---|" + "---|" * len(rows))
    for name, cells in sorted(errors.items()):
        got = {(p, n): r for p, n, r in cells}
        print(f"| {name} | " + " | ".join(
            f"{got[p, n]:.2f}" if (p, n) in got else "" for p, n, *_ in rows) + " |")
    every = [abs(math.log(r)) for cells in errors.values() for _, _, r in cells]
    print(f"\nmedian |error| factor {math.exp(statistics.median(every)):.2f}x, "
          f"worst {math.exp(max(every)):.2f}x over {len(every)} points")


if __name__ == "__main__":
    raise SystemExit(main())
