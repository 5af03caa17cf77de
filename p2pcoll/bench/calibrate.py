"""``p2pcoll bench --calibrate``: this host's cost-model constants, measured and fitted.

auto predicts a strategy's time as ``rounds*alpha + sent*beta + reduced*gamma`` plus the
host term ``overhead * messages / cores`` (see :mod:`p2pcoll.engine.costs`). Calibration
measures the four constants of each transport the way :class:`~p2pcoll.engine.costs.CostModel`
uses them, then writes them in the format of :func:`~p2pcoll.engine.costs.load_constants`:

1. gamma, seconds per byte reduced: numpy's add of one array into another of
   :data:`GAMMA_BYTES` (out of cache, as the executor folds received pieces into a large
   tensor), the median of ``iters`` runs. The same for both transports: it is this CPU's.
2. alpha and beta: two peers time allreduce by recursive doubling, which at p = 2 is one
   message each way per wave of segments (rounds = waves, sent = reduced = n), at every
   size: the small sizes are mostly alpha, the large ones beta.
3. overhead, CPU seconds per message (ipc only, and only when this host has fewer than
   :data:`CROWD` cores, so that the ranks queue for the CPU): :data:`CROWD` peers time the
   ring, recursive doubling and the star at the sizes below 1 MiB, whose message counts
   differ. A group over tcp has its peers on other hosts, so the term never applies to tcp.
4. :func:`fit`: the fields that minimise the squared relative error of the predictions
   over every timed run, by nonnegative least squares (also what
   ``benchmarks/auto_accuracy.py --fit`` uses).

The peers are those of ``p2pcoll bench`` (:mod:`p2pcoll.bench.worker`, started by
:mod:`p2pcoll.bench.runner` as processes of this host: ``ipc``, with the shared-memory
rings, or ``tcp`` over loopback), so a time is a median over iterations of the slowest rank.
They run without ``$P2PCOLL_COST_MODEL``: the file may not exist yet, and they name their
strategies. tcp over loopback is this host's software cost; between hosts the wire adds to
it.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..engine.costs import (
    DEFAULT_CONSTANTS,
    FIELDS,
    Constants,
    CostModel,
    load_constants,
)
from ..registry import registry
from ..settings import Settings, format_bytes
from ..strategy import Strategy
from . import runner
from .options import COST_MODEL_VARIABLE, bench_config
from .report import summarize

GAMMA_BYTES = 16 << 20  # numpy's add over this much, well out of cache
CROWD = 4  # peers of the host-term run (made only on hosts with fewer cores)
EXCHANGE = "recursive_doubling"  # at p = 2: one message each way per wave
CROWDED = ("recursive_doubling", "ring", "reduce_broadcast")  # 8, 24 and 6 messages at p = 4
SMALL = 1 << 20  # the host-term run times the sizes below this (mostly alpha and overhead)
FITTED = ("alpha", "beta", "overhead")  # gamma is measured directly
# The constants the time is linear in; ``repeat`` (a transport's property) is kept as given.
LINEAR = ("alpha", "beta", "gamma", "overhead")


class CalibrationFailed(Exception):
    """Nothing can be written: the peers of a run did not exit cleanly, or the times do
    not determine a constant. ``code`` is the exit code to leave with."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


# --- fitting --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """One timed collective: ``strategy`` on ``size`` ranks, all of them on this host,
    ``nbytes`` per rank, in ``seconds`` (the median over iterations of the slowest rank)."""

    strategy: Strategy
    size: int
    nbytes: int
    seconds: float


@dataclass(frozen=True)
class Fit:
    """The constants that best predict ``samples``.

    Attributes:
        constants: the fitted fields, and the model's own values of the others.
        fitted: the fields the samples determine (one that no sample depends on, such as
            overhead when no run had more ranks than cores, keeps the model's value).
        samples: the samples with a cost model, in order.
        predicted: the fitted model's seconds for each of them.
    """

    constants: Constants
    fitted: tuple[str, ...]
    samples: tuple[Sample, ...]
    predicted: tuple[float, ...]

    def errors(self) -> list[float]:
        """predicted / measured, per sample."""
        return [p / s.seconds for p, s in zip(self.predicted, self.samples, strict=True)]

    def quality(self) -> str:
        """The median and worst factor between predicted and measured, either way."""
        factors = [max(e, 1 / e) if e > 0 else float("inf") for e in self.errors()]
        return (f"median error {statistics.median(factors):.2f}x, worst {max(factors):.2f}x "
                f"over {len(factors)} runs (predicted against measured, either way)")


def fit(samples: Sequence[Sample], model: CostModel, fields: Sequence[str] = FITTED) -> Fit:
    """The ``fields`` of ``model.constants`` that minimise the squared relative error of the
    predicted times of ``samples``, each at least 0; the other constants are kept.

    Each sample's model has all its ranks on this host (``local = size``) against
    ``model.cores`` (0: no host term, and overhead is not fitted). Strategies without a
    cost model are left out.

    Raises:
        ValueError: no sample has a cost model, or ``fields`` names no constant.
    """
    unknown = set(fields) - set(LINEAR)
    if unknown or not fields:
        raise ValueError(f"cannot fit {sorted(unknown) or 'nothing'}; the constants that "
                         f"can be fitted are {', '.join(LINEAR)}")
    used, rows, rhs = [], [], []
    repeat = model.constants.repeat
    for sample in samples:
        local = replace(model, local=sample.size)
        work = local.workload(sample.strategy, sample.nbytes, sample.size)
        cost = sample.strategy.cost(work)
        if cost is None:
            continue
        per_message = replace(local, constants=replace(local.constants, overhead=1.0))
        terms = {"alpha": cost.messages(repeat), "beta": cost.charged(repeat),
                 "gamma": cost.reduced,
                 "overhead": per_message.contention(sample.strategy, work)}
        known = sum(terms[f] * getattr(model.constants, f) for f in LINEAR if f not in fields)
        # Relative error: each sample's equation divided by its measured time, so that the
        # small sizes (alpha) weigh as much as the large ones (beta).
        rows.append([terms[f] / sample.seconds for f in fields])
        rhs.append(1.0 - known / sample.seconds)
        used.append(sample)
    if not used:
        raise ValueError("no timed strategy declares a cost model")
    a, b = np.array(rows), np.array(rhs)
    free = [j for j in range(len(fields)) if a[:, j].any()]
    solution = nonnegative_least_squares(a[:, free], b)
    values = {fields[j]: float(x) for j, x in zip(free, solution, strict=True)}
    fitted = replace(model, constants=replace(model.constants, **values))
    predicted = tuple(replace(fitted, local=s.size).predict(s.strategy, s.nbytes, s.size) or 0.0
                      for s in used)
    return Fit(fitted.constants, tuple(fields[j] for j in free), tuple(used), predicted)


def nonnegative_least_squares(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``x >= 0`` minimising ``|a x - b|``, exactly, for a few columns.

    The solution is the unconstrained least-squares solution on the columns where it is
    not 0, so it is the best of those over every subset of columns whose solution is
    nonnegative (2^k subsets; k is 3 here). Columns are scaled to unit norm first: they
    count messages and bytes, orders of magnitude apart.
    """
    k = a.shape[1]
    norms = np.linalg.norm(a, axis=0)
    norms[norms == 0] = 1.0
    scaled = a / norms
    best, best_residual = np.zeros(k), float(np.linalg.norm(b))
    for n in range(1, k + 1):
        for columns in itertools.combinations(range(k), n):
            part = np.linalg.lstsq(scaled[:, columns], b, rcond=None)[0]
            if (part < 0).any():
                continue
            x = np.zeros(k)
            x[list(columns)] = part
            residual = float(np.linalg.norm(scaled @ x - b))
            if residual < best_residual:
                best, best_residual = x, residual
    weights: np.ndarray = best / norms
    return weights


# --- measuring ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """What to measure: the transports, each rank's tensor sizes, iterations per size
    (after ``warmup`` untimed ones), the element type, and CurveZMQ or not (as
    ``p2pcoll bench``'s options say)."""

    transports: tuple[str, ...]
    sizes: tuple[int, ...]
    iters: int
    warmup: int
    dtype: str
    secure: bool

    def runs(self, transport: str, cores: int) -> list[tuple[int, tuple[str, ...], list[int]]]:
        """(peers, strategies, sizes) of each run of peers for ``transport``."""
        out: list[tuple[int, tuple[str, ...], list[int]]] = [(2, (EXCHANGE,), list(self.sizes))]
        if transport == "ipc" and cores < CROWD:
            small = [n for n in self.sizes if n < SMALL] or [min(self.sizes)]
            out.append((CROWD, CROWDED, small))
        return out


def measure_gamma(dtype: str, iters: int, nbytes: int = GAMMA_BYTES) -> float:
    """Seconds per byte of ``numpy.add(dst, src, out=dst)`` over ``nbytes`` of ``dtype``."""
    count = max(nbytes // np.dtype(dtype).itemsize, 1)
    dst, src = np.ones(count, dtype), np.ones(count, dtype)
    np.add(dst, src, out=dst)  # the pages are touched before the clock starts
    times = []
    for _ in range(max(iters, 5)):
        t0 = time.perf_counter()
        np.add(dst, src, out=dst)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / dst.nbytes


def calibrate(plan: Plan, settings: Settings, cores: int,
              say: Callable[[str], None] = lambda _: None) -> tuple[float, dict[str, Fit]]:
    """Measure and fit the constants of every transport of ``plan``.

    ``settings`` are the peers' (their segment size and pipeline depth shape the
    workloads); ``cores`` this host's; ``say`` hears what runs now.

    Returns:
        (gamma, ``{transport: Fit}``).

    Raises:
        CalibrationFailed: the peers of a run did not exit 0 (their code), or the times
            of a transport fit alpha or beta to 0 (code 1: they do not determine it).
    """
    say(f"numpy add of {format_bytes(GAMMA_BYTES)} {plan.dtype} (gamma)")
    gamma = measure_gamma(plan.dtype, plan.iters)
    fits = {}
    for transport in plan.transports:
        samples: list[Sample] = []
        for peers, strategies, sizes in plan.runs(transport, cores):
            say(f"{peers} peers over {transport}: {', '.join(strategies)} at "
                f"{','.join(format_bytes(n) for n in sizes)}")
            samples.extend(_time(plan, transport, peers, strategies, sizes))
        start = {transport: replace(DEFAULT_CONSTANTS[transport], gamma=gamma)}
        model = CostModel.for_settings(settings, transport, start,
                                       cores=cores if transport == "ipc" else 0)
        fits[transport] = result = fit(samples, model)
        for field in ("alpha", "beta"):
            if getattr(result.constants, field) <= 0:
                raise CalibrationFailed(
                    f"the {transport} times do not determine {field} (the fit makes it 0: "
                    f"{result.quality()}); time larger --sizes (up to 16M) or more --iters, "
                    "on a quieter host", 1)
    return gamma, fits


def _time(plan: Plan, transport: str, peers: int, strategies: Sequence[str],
          sizes: list[int]) -> list[Sample]:
    options = argparse.Namespace(collective="allreduce", world_size=peers, sizes=sizes,
                                 dtype=plan.dtype, iters=plan.iters, warmup=plan.warmup,
                                 pipelined=0, transport=transport, secure=plan.secure)
    config = bench_config(options, strategies)
    with _unset(COST_MODEL_VARIABLE):
        code, raw = runner.run("p2pcoll", config)
    if code != 0:
        raise CalibrationFailed(f"{peers} peers over {transport} failed (exit code {code})", code)
    return [Sample(registry.get("allreduce", row["strategy"]), peers, row["size"],
                   summarize(row, config)["time_us"] * 1e-6) for row in raw]


@contextlib.contextmanager
def _unset(variable: str) -> Iterator[None]:
    """``$variable`` unset while the peers start (they inherit this environment)."""
    value = os.environ.pop(variable, None)
    try:
        yield
    finally:
        if value is not None:
            os.environ[variable] = value


# --- the file and the report --------------------------------------------------------------


def write(path: Path, gamma: float, fits: dict[str, Fit], where: str) -> dict[str, Any]:
    """Write the measured constants to ``path`` (atomically) and return the document.

    A transport that was measured gets its fitted fields and gamma, rounded to three
    digits; what the file held otherwise (other transports, fields not fitted) stays.
    The file is read back with :func:`load_constants` (``where`` names it in errors).
    """
    doc: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    for transport, result in fits.items():
        measured = {f: getattr(result.constants, f) for f in result.fitted}
        measured["gamma"] = gamma
        fields = {**doc.get(transport, {}), **{f: float(f"{v:.3g}") for f, v in measured.items()}}
        doc[transport] = {f: fields[f] for f in FIELDS if f in fields}
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(json.dumps(doc, indent=1) + "\n")
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
    load_constants(path, where)
    return doc


def format_report(plan: Plan, gamma: float, fits: dict[str, Fit], cores: int, load: float,
                  constants: dict[str, Constants]) -> str:
    """Every run's measured and predicted time, then the constants of each transport
    (``constants``: those now in the file) against the defaults, and the fit's quality.
    ``load``: this host's load average before the peers started."""
    lines = [
        (f"# p2pcoll bench --calibrate: allreduce, {plan.dtype}, {plan.iters} iters after "
         f"{plan.warmup} warmup, peers as processes of this host ({cores} cores)"),
        "# time: median over iterations of the slowest rank; predicted: with the fitted constants",
        f"# gamma: numpy add over {format_bytes(GAMMA_BYTES)}: {gamma * 1e9:.3g} ns/B",
    ]
    if load > cores / 2:
        lines.append(f"# note: load average {load:.1f} on {cores} cores before the run: other "
                     "jobs shared the CPU, and their share is in these times")
    lines += [
        "#",
        (f"#{'transport':>9}{'peers':>6}{'strategy':>20}{'size':>7}{'time':>12}"
         f"{'predicted':>12}{'ratio':>7}"),
    ]
    for transport, result in fits.items():
        for sample, predicted, error in zip(result.samples, result.predicted, result.errors(),
                                            strict=True):
            lines.append(f"{transport:>10}{sample.size:>6}{sample.strategy.name:>20}"
                         f"{format_bytes(sample.nbytes):>7}{_us(sample.seconds):>12}"
                         f"{_us(predicted):>12}{error:>7.2f}")
    lines.append("")
    for transport, result in fits.items():
        c, default = constants[transport], DEFAULT_CONSTANTS[transport]
        kept = "" if "overhead" in result.fitted else " (not measured: kept)"
        lines += [
            f"{transport}: {c.describe()}; overhead {c.overhead * 1e6:.3g} us/message{kept}",
            f"     defaults: {default.describe()}; overhead {default.overhead * 1e6:.3g} us",
            f"     fit: {result.quality()}",
        ]
    return "\n".join(lines) + "\n"


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.1f} us" if seconds < 0.01 else f"{seconds * 1e3:.2f} ms"


__all__ = ["CalibrationFailed", "Fit", "Plan", "Sample", "calibrate", "fit", "format_report",
           "measure_gamma", "nonnegative_least_squares", "write"]
