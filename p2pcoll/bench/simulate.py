"""``p2pcoll simulate``: the cost model's prediction for every strategy of a collective.

No peers run: every installed strategy's ``cost()`` (:mod:`p2pcoll.engine.costs`) is priced
with a link's latency (alpha), bandwidth (1/beta) and reduction rate (1/gamma), for one size
and over a sweep of sizes, which gives the crossovers: the sizes at which the fastest
strategy changes. ``--plot`` draws time against size per strategy (matplotlib).

Without a link given (``--latency``, ``--bandwidth``, ``--gamma``) the model is the one a
live group builds (:meth:`CostModel.for_group`): ``--transport ipc`` is P ranks on this host
(shared-memory rings, ``$P2PCOLL_SHM``, and its cores against P ranks), ``--transport tcp``
is P hosts; the settings (segment, depth) come from the environment as join's do. So "best"
is what ``auto`` runs in such a group, by the same function (:meth:`Registry.auto_name`), and
the table is sorted by the same prediction. With a link given, the ranks have a host each
on that link (every send a copy; no host contention).

Hosts. ``--hosts H --per-host K`` prices a group of H hosts with K ranks each (ranks
0..K-1 on the first): two levels, the ``ipc`` constants inside a host and the ``tcp`` ones
between hosts (a link given with ``--latency``/``--bandwidth``/``--gamma`` is then the link
between hosts), built by :meth:`CostModel.for_group` with the hosts as a roster gives them,
so "best" is again what auto runs (``hierarchical`` among the candidates). The table adds
each strategy's rounds across hosts and the bytes that leave the busiest host.

Units. Sizes are bytes with binary suffixes, as everywhere in p2pcoll (``4K`` = 4096,
``100MB`` = ``100M`` = 100 MiB, ``1.5G``). Times take ``ns``, ``us`` (or ``µs``), ``ms`` or
``s``. Rates are SI, as links are quoted: ``10Gbit`` (= ``10Gbit/s``, ``10Gbps``, ``10Gb/s``:
bits) or ``1.25GB/s`` (bytes); ``GiB/s`` and ``MiB/s`` are binary.
"""

from __future__ import annotations

import argparse
import itertools
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace

from ..engine.costs import (
    DEFAULT_CONSTANTS,
    TRANSPORTS,
    CostModel,
    load_constants,
)
from ..extras import needs
from ..registry import Registry, registry
from ..settings import Settings, format_bytes
from ..strategy import COLLECTIVES, Cost, Strategy

_NUMBER = r"\s*(\d+(?:\.\d*)?(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?)\s*"
_SIZE_UNITS = {"": 0, "B": 0, "K": 10, "M": 20, "G": 30, "T": 40}
_TIME_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0}
_SI = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
_BINARY = {"Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40}


def parse_size(text: str) -> int:
    """``"100MB"`` -> 104857600: bytes, K/M/G/T binary (``KB``, ``KiB`` alike)."""
    m = re.fullmatch(_NUMBER + r"([KMGT]?)(?:I?B)?\s*", text, re.IGNORECASE)
    if m is None:
        raise ValueError(f"{text!r} is not a size: expected bytes like 4096, 4K, 100MB, 1.5G")
    value = float(m.group(1)) * (1 << _SIZE_UNITS[m.group(2).upper()])
    if value != int(value):
        raise ValueError(f"{text!r} is not a whole number of bytes")
    return int(value)


def parse_time(text: str) -> float:
    """``"20us"`` -> 2e-05 seconds; the unit (ns, us, µs, ms, s) is required."""
    m = re.fullmatch(_NUMBER + r"([a-zµμ]*)\s*", text)
    if m is None or m.group(2) not in _TIME_UNITS:
        hint = " (a unit is required)" if m is not None and not m.group(2) else ""
        raise ValueError(f"{text!r} is not a time{hint}: expected a number and ns, us, ms or "
                         "s, like 20us, 0.5ms, 2e-5s")
    return float(m.group(1)) * _TIME_UNITS[m.group(2)]


def parse_rate(text: str) -> float:
    """Bytes per second: ``"10Gbit"`` -> 1.25e9, ``"1GB/s"`` -> 1e9, ``"1GiB/s"`` -> 2**30.

    ``bit``, ``b`` and ``bps`` are bits; ``B`` is bytes; ``/s`` is optional. Prefixes are SI
    (k, M, G, T) or binary (Ki, Mi, Gi, Ti).
    """
    m = re.fullmatch(_NUMBER + r"(Ki|Mi|Gi|Ti|[kKMGT]?)(bits?|bps|b|B)(?:/s|ps)?\s*", text)
    if m is None or (m.group(3) == "bps" and text.rstrip().endswith("/s")):
        raise ValueError(f"{text!r} is not a rate: expected a number, a prefix and bit or B, "
                         "like 10Gbit, 10Gbit/s, 1.25GB/s, 800MiB/s")
    prefix, unit = m.group(2), m.group(3)
    scale = _BINARY[prefix] if prefix in _BINARY else _SI[prefix]
    rate = float(m.group(1)) * scale / (1 if unit == "B" else 8)
    if rate <= 0:
        raise ValueError(f"{text!r}: a rate must be above 0")
    return rate


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--collective", default="allreduce", choices=COLLECTIVES,
                        help="the collective (default: allreduce)")
    parser.add_argument("-n", "--world-size", type=int, default=None, metavar="P",
                        help="number of ranks (default: 8, or H x K with --hosts/--per-host)")
    parser.add_argument("--hosts", type=int, default=None, metavar="H",
                        help="the ranks are on H hosts (ranks 0..K-1 on the first, and so on): "
                             "two levels, ipc constants inside a host and tcp between (the link "
                             "given by --latency/--bandwidth/--gamma is the one between hosts)")
    parser.add_argument("--per-host", type=int, default=None, metavar="K",
                        help="K ranks on each host (with --hosts; either one with -n gives the "
                             "other)")
    parser.add_argument("--size", default="1M", metavar="BYTES",
                        help="bytes of data (each rank's tensor; for allgather, gather and "
                             "scatter all the parts together), e.g. 4K, 100MB (default: 1M)")
    parser.add_argument("--latency", metavar="TIME",
                        help="alpha, the time per message, e.g. 20us (default: the transport's "
                             "constant)")
    parser.add_argument("--bandwidth", metavar="RATE",
                        help="1/beta, e.g. 10Gbit or 1.25GB/s (default: the transport's)")
    parser.add_argument("--gamma", metavar="RATE",
                        help="the reduction rate 1/gamma, e.g. 5GB/s (default: the transport's)")
    parser.add_argument("--transport", choices=TRANSPORTS, default="ipc",
                        help="ipc: the ranks share this host (its cores, shared memory), as "
                             "p2pcoll launch -n P runs them; tcp: a host each. Its constants fill "
                             "in what is not given (default: ipc)")
    parser.add_argument("--cost-model", metavar="FILE",
                        help="JSON file of constants (default: $P2PCOLL_COST_MODEL, else the "
                             "built-in ones)")
    parser.add_argument("--segment-bytes", default=None, metavar="BYTES",
                        help="the executor's pipeline segment (default: 1M)")
    parser.add_argument("--sweep", default="1K..1G", metavar="FROM..TO",
                        help="the sizes searched for crossovers (default: 1K..1G)")
    parser.add_argument("--plot", metavar="PATH",
                        help="write a PNG of time against size per strategy (matplotlib)")


@dataclass(frozen=True)
class Prediction:
    name: str
    cost: Cost | None
    seconds: float | None


def predict(reg: Registry, model: CostModel, collective: str, nbytes: int,
            size: int) -> list[Prediction]:
    """Every installed strategy of ``collective``, fastest first (no model: last)."""
    out = []
    for name, entry in sorted(reg.entries()[collective].items()):
        strategy: Strategy = entry.strategy
        cost = strategy.cost(model.workload(strategy, nbytes, size))
        out.append(Prediction(name, cost, model.predict(strategy, nbytes, size)))
    return sorted(out, key=lambda p: (p.seconds is None, p.seconds or 0.0, p.name))


def crossovers(reg: Registry, model: CostModel, collective: str, size: int,
               low: int, high: int) -> list[tuple[int, str]]:
    """``[(from_bytes, name), ...]``: the fastest strategy from each size on, over
    ``low..high`` (the first entry is ``low``); each change found to the byte by bisection."""
    def best(n: int) -> str:
        return reg.auto_name(collective, n, size, model)

    points = sorted({low, high, *(int(low * 2 ** (k / 4))
                                  for k in range(int(4 * math.log2(high / low)) + 1))})
    points = [n for n in points if low <= n <= high]
    out = [(points[0], best(points[0]))]
    for a, b in itertools.pairwise(points):
        if best(b) == best(a):
            continue
        lo, hi = a, b  # best(lo) == the one before, best(hi) differs
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if best(mid) == best(a) else (lo, mid)
        out.append((hi, best(hi)))
    return out


def _model(args: argparse.Namespace, environ: dict[str, str] | None = None) -> CostModel:
    """The model simulate prices with.

    No link given (no ``--latency``, ``--bandwidth`` or ``--gamma``): the model of a group of
    ``--world-size`` ranks joined with this environment, all on this host (``--transport
    ipc``: shared-memory rings, this host's cores) or one per host (``tcp``), built by
    :meth:`CostModel.for_group` as the group builds it, so "best" is what auto runs there.
    A link given: a network of that link, a host per rank (no shared memory, no contention).
    """
    settings = Settings.resolve(environ)
    path = args.cost_model or settings.cost_model
    table = load_constants(path, "--cost-model" if args.cost_model else "$P2PCOLL_COST_MODEL") \
        if path else dict(DEFAULT_CONSTANTS)
    if args.segment_bytes:
        segment = parse_size(args.segment_bytes)
        if segment < 1:
            raise ValueError("--segment-bytes must be at least 1")
        settings = replace(settings, segment_bytes=segment)
    hosts, per_host = layout(args)
    if hosts is not None and per_host is not None:
        if args.latency or args.bandwidth or args.gamma:  # the link between hosts
            base = table["tcp"]
            table["tcp"] = replace(
                base,
                alpha=parse_time(args.latency) if args.latency else base.alpha,
                beta=1 / parse_rate(args.bandwidth) if args.bandwidth else base.beta,
                gamma=1 / parse_rate(args.gamma) if args.gamma else base.gamma)
        names = [f"host{r // per_host}" for r in range(hosts * per_host)]
        endpoints = [("ipc" if r < per_host else "tcp") + f"://simulated/{r}"
                     for r in range(hosts * per_host)]
        return CostModel.for_group(settings, endpoints, 0, table, hosts=names)
    if not (args.latency or args.bandwidth or args.gamma):
        endpoints = [f"{args.transport}://simulated/{r}" for r in range(max(args.world_size, 1))]
        return CostModel.for_group(settings, endpoints, 0, table)
    base = table[args.transport]
    table[args.transport] = replace(
        base,
        alpha=parse_time(args.latency) if args.latency else base.alpha,
        beta=1 / parse_rate(args.bandwidth) if args.bandwidth else base.beta,
        gamma=1 / parse_rate(args.gamma) if args.gamma else base.gamma,
        repeat=1.0,  # a host per rank: every send a copy of its own
    )
    return CostModel.for_settings(settings, args.transport, table)


def layout(args: argparse.Namespace) -> tuple[int | None, int | None]:
    """(H hosts, K ranks per host) from ``--hosts``, ``--per-host`` and ``-n`` (either of
    the first two with ``-n`` gives the other), or (None, None) without them; sets
    ``args.world_size`` (default 8, or H x K). Raises ValueError when they disagree."""
    hosts, per_host, p = args.hosts, args.per_host, args.world_size
    for flag, value in (("--hosts", hosts), ("--per-host", per_host)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}")
    if hosts is None and per_host is None:
        args.world_size = 8 if p is None else p
        return None, None
    if hosts is None or per_host is None:
        given, flag = (hosts, "--hosts") if hosts is not None else (per_host, "--per-host")
        other = "--per-host" if hosts is not None else "--hosts"
        if p is None:
            raise ValueError(f"{flag} needs {other} or -n/--world-size")
        if p % given:
            raise ValueError(f"-n {p} ranks cannot be cut into {flag} {given} evenly; give "
                             f"{other} too")
        hosts, per_host = (given, p // given) if hosts is not None else (p // given, given)
    elif p is not None and p != hosts * per_host:
        raise ValueError(f"-n {p} disagrees with --hosts {hosts} x --per-host {per_host} = "
                         f"{hosts * per_host}")
    args.world_size = hosts * per_host
    return hosts, per_host


def _seconds(t: float) -> str:
    for scale, unit in ((1.0, "s"), (1e-3, "ms"), (1e-6, "us")):
        if t >= scale:
            return f"{t / scale:.4g} {unit}"
    return f"{t * 1e9:.4g} ns"


def _size(n: int) -> str:
    text = format_bytes(n)
    if text == str(n) and n >= 1 << 10:
        for shift, suffix in ((30, "G"), (20, "M"), (10, "K")):
            if n >= 1 << shift:
                return f"{n / (1 << shift):.3g}{suffix}"
    return text


def report(args: argparse.Namespace, reg: Registry = registry) -> str:
    """The text of ``p2pcoll simulate``. Raises ValueError on a bad option value."""
    hosts, per_host = layout(args)
    p, collective = args.world_size, args.collective
    if p < 1:
        raise ValueError(f"--world-size must be at least 1, got {p}")
    nbytes = parse_size(args.size)
    low, _, high = args.sweep.partition("..")
    if not high:
        raise ValueError(f"--sweep {args.sweep!r}: expected FROM..TO, like 1K..1G")
    low_b, high_b = max(parse_size(low), 1), parse_size(high)
    if high_b <= low_b:
        raise ValueError(f"--sweep {args.sweep!r}: TO must be larger than FROM")
    model = _model(args)
    c = model.constants
    rows = predict(reg, model, collective, nbytes, p)
    if not rows:
        raise ValueError(f"no {collective} strategy is installed")
    two = model.levels == 2 and model.between is not None
    where = f"{hosts} hosts x {per_host} ranks" if hosts is not None else f"{p} ranks"
    lines = [f"# p2pcoll simulate: {collective}, {where}, {_size(nbytes)} ({nbytes} B)"]
    if two:
        assert model.between is not None
        b = model.between
        lines += [
            (f"# inside a host (ipc): alpha {_seconds(c.alpha)}/message, beta "
             f"{c.beta * 1e9:.4g} ns/B ({1 / c.beta / 1e9:.4g} GB/s), gamma "
             f"{c.gamma * 1e9:.4g} ns/B"),
            (f"# between hosts (tcp): alpha {_seconds(b.alpha)}/message, beta "
             f"{b.beta * 1e9:.4g} ns/B ({1 / b.beta / 1e9:.4g} GB/s)"
             + (" (the link given)" if args.latency or args.bandwidth or args.gamma else "")),
        ]
    else:
        lines.append(
            f"# alpha {_seconds(c.alpha)}/message, beta {c.beta * 1e9:.4g} ns/B "
            f"({1 / c.beta / 1e9:.4g} GB/s), gamma {c.gamma * 1e9:.4g} ns/B "
            f"({1 / c.gamma / 1e9:.4g} GB/s) ({args.transport} constants where not given)")
    lines += [
        (f"# {model.local} of the ranks on this host of {model.cores} cores"
         + (", shared-memory rings" if c.repeat < 1 else "") if model.cores
         else "# a host per rank (the link given)"),
        (f"# segments of {_size(model.segment_bytes)}, {model.depth} in flight; "
        "time = rounds*alpha + sent*beta + reduced*gamma on the critical path, "
        "+ the host's CPU share when its ranks outnumber its cores"
        + ("; rounds and bytes across hosts at the tcp constants" if two else "")),
        (f"{'strategy':<20} {'time':>12} {'x best':>8} {'rounds':>10} {'sent (B)':>14} "
         f"{'reduced (B)':>14}"
         + (f" {'rounds across':>14} {'B leaving a host':>17}" if two else "")),
    ]
    fastest = rows[0].seconds
    for row in rows:
        if row.cost is None or row.seconds is None:
            lines.append(f"{row.name:<20} {'(no cost model)':>12}")
            continue
        ratio = row.seconds / fastest if fastest else 1.0
        line = (f"{row.name:<20} {_seconds(row.seconds):>12} {ratio:>7.2f}x "
                f"{row.cost.rounds:>10.4g} {row.cost.sent:>14.6g} {row.cost.reduced:>14.6g}")
        if two:
            _, across = model.split(reg.get(collective, row.name), row.cost, p)
            line += f" {across.rounds:>14.4g} {across.sent:>17.6g}"
        lines.append(line)
    best = reg.auto_name(collective, nbytes, p, model)
    lines.append(f"best: {best} (what auto picks with these constants)")
    changes = crossovers(reg, model, collective, p, low_b, high_b)
    spans = []
    for i, (start, name) in enumerate(changes):
        end = changes[i + 1][0] if i + 1 < len(changes) else None
        spans.append(f"{name} {_size(start)}..{_size(end - 1) if end else _size(high_b)}")
    lines.append(f"crossovers over {_size(low_b)}..{_size(high_b)}: " + "; ".join(spans))
    if args.plot:
        draw(args.plot, reg, model, collective, p, nbytes, low_b, high_b, changes)
        lines.append(f"plot: {args.plot}")
    return "\n".join(lines) + "\n"


def draw(path: str, reg: Registry, model: CostModel, collective: str, p: int, nbytes: int,
         low: int, high: int, changes: Sequence[tuple[int, str]]) -> None:
    """Write a PNG: predicted time against size (log-log), one line per strategy."""
    with needs("p2pcoll simulate --plot"):
        from matplotlib.figure import Figure
    sizes = sorted({int(low * 2 ** (k / 4)) for k in range(int(4 * math.log2(high / low)) + 1)}
                   | {high})
    fig = Figure(figsize=(8, 5), dpi=90, layout="constrained")
    ax = fig.subplots()
    for name, entry in sorted(reg.entries()[collective].items()):
        times = [model.predict(entry.strategy, n, p) for n in sizes]
        if any(t is None for t in times):
            continue
        ax.plot(sizes, [t * 1e6 for t in times if t is not None], label=name)
    ax.axvline(nbytes, color="gray", linestyle=":", label=f"--size {_size(nbytes)}")
    for start, _ in changes[1:]:
        ax.axvline(start, color="lightgray", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("size (bytes)")
    ax.set_ylabel("predicted time (us)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    c = model.constants
    fig.suptitle(f"{collective}, {p} ranks: alpha {_seconds(c.alpha)}, "
                 f"{1 / c.beta / 1e9:.3g} GB/s, gamma {1 / c.gamma / 1e9:.3g} GB/s")
    fig.savefig(path)


def main(args: argparse.Namespace) -> int:
    print(report(args), end="")
    return 0
