"""Long paths in the cost model: what a path's round trip costs a strategy, and what the
connections' windows let through.

The textbook's cost of a round that sends a piece of ``s`` bytes over a path of rate ``B``
and round trip ``r`` is ``alpha + s / B`` with ``alpha`` about ``r / 2``, the one-way
latency (Thakur, Rabenseifner & Gropp 2005; Hockney's model). Two things make that matter
on a long path (1 Gbit/s and 100 ms holds 12.5 MB in flight, its bandwidth-delay product)
that a LAN never shows:

- **The latency per round.** Each step of a schedule waits for its messages to cross: a
  strategy of fewer steps (recursive halving's lg p, the direct exchange's 2) pays fewer
  round trips than the ring's 2(p - 1). The cost model's ``alpha`` (fitted on loopback) is
  the software's cost of a message; the probe's round trip crosses that software too (a
  ping is a message each way), so what a path adds per step is the part of half its round
  trip beyond ``alpha``: :func:`wire_seconds`, nothing on a LAN, whose round trips are
  within the software's.
  Segments in flight hide most of it: the executor runs a wave of ``n`` segments at once,
  so while one segment waits for a message to cross, the others' messages keep the links
  busy. A wave therefore takes the longer of its data with one step's latency after it
  (the last message's flight) and one segment's chain, every step's latency plus its share
  of the data (:func:`exposed_seconds`): on the lab's paths (64 MiB, 16 segments in
  flight) the ring's 6 half round trips hide under its 0.8 s of data, and only one shows.
- **The window.** One TCP connection keeps at most its window in flight, so it moves at most
  ``window / r`` whatever the line (:mod:`p2pcoll.transport.paths`); a link striped over
  ``k`` connections, ``k`` windows. How many a link takes under ``streams=auto`` follows the
  collective's program (:func:`p2pcoll.transport.paths.choose_streams` with the remote peers
  it sends to: a ring's one neighbour takes the host's 4, Rabenseifner's two partners 2
  each, a direct exchange's p - 1 peers 1 each; ``streams=k``: k). So a pair's rate is
  ``min(line, k * window / r)`` (:func:`window_rates`): on the lab's path (2.9 MB windows)
  the ring's 4 nearly fill the line, the direct exchange's 3 (one per pair) three quarters
  of it, Rabenseifner's 2 per pair less than half, and fewer rounds do not make that up.

A rank's messages of one step share its host's line (the sum of their times over their
pairs' rates, as :func:`p2pcoll.engine.costs.link_seconds` reads them), but each has its own
connections, so the windows bound each message alone: a step takes, for each rank, the
larger of the two (:func:`p2pcoll.engine.costs.link_seconds` with ``caps``).
"""

from __future__ import annotations

import itertools
from functools import lru_cache

from ..strategy import Context, Recv, Reduce, Send, Strategy
from ..transport.paths import choose_streams

__all__ = ["STEPS_READ", "destinations", "exposed_seconds", "step_seconds", "window_rates",
           "wire_seconds"]

STEPS_READ = 4096  # the most steps of a rank's schedule that wire_seconds() reads


@lru_cache(maxsize=256)
def destinations(strategy: Strategy, size: int) -> tuple[frozenset[int], ...]:
    """The ranks each rank's program sends to (root 0), as the executor tells its
    transport's paths (:meth:`p2pcoll.transport.base.Paths.drive`); cached."""
    out = []
    for rank in range(size):
        peers: set[int] = set()
        for step in itertools.islice(strategy.schedule(Context(rank, size, 0)), STEPS_READ):
            ops = (step,) if isinstance(step, (Send, Recv, Reduce)) else tuple(step)
            peers.update(op.to for op in ops if isinstance(op, Send))
        out.append(frozenset(peers))
    return tuple(out)


def window_rates(strategy: Strategy, size: int, rtts: tuple[tuple[float, ...], ...],
                 links: tuple[tuple[float, ...], ...], window: int, streams: int = 0,
                 hosts: tuple[int, ...] = ()) -> tuple[tuple[float, ...], ...] | None:
    """The most bytes/s the connections of each directed pair carry under ``strategy``:
    ``k * window / rtt``, ``k`` the connections the link takes (``streams``, or with 0 what
    ``auto`` chooses for the path and the peers the program sends to at once). Returns None
    when no window binds below its pair's rate in ``links`` (a LAN: the model is then
    today's), and infinity for pairs of one host (``hosts``) and pairs of no round trip.

    >>> from p2pcoll.strategy import Strategy
    >>> class Ring(Strategy):
    ...     name, collective = "r", "allreduce"
    ...     def schedule(self, ctx):
    ...         yield Send((ctx.rank + 1) % ctx.size)
    >>> rtts = ((0.0, 0.1), (0.1, 0.0))
    >>> window_rates(Ring(), 2, rtts, ((0.0, 1.25e8), (1.25e8, 0.0)), 2 << 20, streams=1)
    ((inf, 20971520.0), (20971520.0, inf))
    >>> window_rates(Ring(), 2, ((0.0, 2e-4), (2e-4, 0.0)), ((0.0, 1.25e8), (1.25e8, 0.0)),
    ...              2 << 20) is None  # 0.2 ms: the window is never the bound
    True
    """
    if window <= 0 or len(rtts) != size or len(links) != size:
        return None
    sends = destinations(strategy, size)
    inf = float("inf")
    rates = []
    binds = False
    for i in range(size):
        remote = [j for j in sends[i] if not hosts or hosts[j] != hosts[i]]
        sharing = max(1, len(remote))
        row = []
        for j in range(size):
            r = rtts[i][j]
            if i == j or not r > 0 or (hosts and hosts[i] == hosts[j]):
                row.append(inf)
                continue
            k = streams if streams > 0 else choose_streams(r, links[i][j],
                                                           window_bytes=window,
                                                           sharing=sharing)
            rate = k * window / r
            binds = binds or (j in sends[i] and rate < links[i][j])
            row.append(rate)
        rates.append(tuple(row))
    return tuple(rates) if binds else None


def exposed_seconds(steps: tuple[float, ...], data_s: float, segments: int,
                    waves: int = 1) -> float:
    """The seconds of latency a run shows beyond its data: per wave of ``segments``
    segments in flight at once (of ``waves``), the longer of one step's latency (the last
    message's flight after the data) and the chain of every step's latency less the data
    the other segments of the wave send meanwhile. ``steps``: each step's latency
    (:func:`step_seconds`); ``data_s``: the run's seconds of data over its links.

    A wave takes ``max(D + max(steps), sum(steps) + D / n)`` with ``D`` its data and ``n``
    its segments: the links carry the wave's data back to back while its segments keep
    them busy, and no segment finishes before its own chain. Without segments in flight
    (``n = 1``) that is the data plus every step's latency, the lockstep schedule.

    >>> round(exposed_seconds((0.05,) * 6, 0.8, 16), 3)  # a ring, 16 segments in flight
    0.05
    >>> round(exposed_seconds((0.05,) * 6, 0.8, 1), 3)  # one segment: every step shows
    0.3
    >>> exposed_seconds((), 0.8, 16)
    0.0
    """
    if not steps:
        return 0.0
    waves = max(1, waves)
    data = max(0.0, data_s) / waves
    n = max(1, segments)
    chain, one = sum(steps), max(steps)
    return waves * max(one, chain - data * (1 - 1 / n))


def wire_seconds(strategy: Strategy, size: int, rtts: tuple[tuple[float, ...], ...],
                 alpha: float) -> float:
    """The seconds one run of ``strategy``'s schedules (root 0) waits on its paths' latency
    when no segments in flight hide it (see :func:`exposed_seconds`), read in lockstep:
    each step waits for its slowest message to cross, half its pair's round trip beyond
    the ``alpha`` the model charges every message already (see the module docstring). 0
    when every round trip is within ``2 * alpha``.

    >>> from p2pcoll.strategy import Strategy
    >>> class Two(Strategy):
    ...     name, collective = "two", "allreduce"
    ...     def schedule(self, ctx):
    ...         yield Send(1 - ctx.rank)
    ...         yield Send(1 - ctx.rank)
    >>> round(wire_seconds(Two(), 2, ((0.0, 0.1), (0.1, 0.0)), 1e-3), 6)  # 2 x 49 ms
    0.098
    >>> wire_seconds(Two(), 2, ((0.0, 1e-3), (1e-3, 0.0)), 1e-3)  # a LAN: alpha covers it
    0.0
    """
    return sum(step_seconds(strategy, size, rtts, alpha))


@lru_cache(maxsize=256)
def step_seconds(strategy: Strategy, size: int, rtts: tuple[tuple[float, ...], ...],
                 alpha: float) -> tuple[float, ...]:
    """Per step of ``strategy``'s schedules (root 0) read in lockstep, what its slowest
    message waits on its path: half its pair's round trip beyond ``alpha``
    (:func:`wire_seconds` sums them); cached. Empty without round trips for ``size``."""
    if len(rtts) != size:
        return ()
    latest: list[float] = []  # per step, its slowest message's one-way wire time
    for rank in range(size):
        steps = strategy.schedule(Context(rank, size, 0))
        for i, step in enumerate(itertools.islice(steps, STEPS_READ)):
            ops = (step,) if isinstance(step, (Send, Recv, Reduce)) else tuple(step)
            wire = max((max(0.0, rtts[rank][op.to] / 2 - alpha) for op in ops
                        if isinstance(op, Send)), default=0.0)
            if i == len(latest):
                latest.append(wire)
            else:
                latest[i] = max(latest[i], wire)
    return tuple(latest)
