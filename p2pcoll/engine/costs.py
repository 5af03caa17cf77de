"""The alpha-beta-gamma cost model: constants per transport, and the predicted time of a
strategy (Thakur, Rabenseifner & Gropp 2005).

A strategy's ``cost(work)`` (:class:`p2pcoll.strategy.Cost`) counts, on the critical path
of one collective, the messages sent one after the other (``rounds``), the bytes sent
(``sent``) and the bytes reduced (``reduced``). With the constants of the link

    alpha   seconds per message (software overhead and wake-ups, not only the wire)
    beta    seconds per byte sent (the inverse of the bandwidth, copies included)
    gamma   seconds per byte reduced (numpy's ufunc over the received piece)
    repeat  the fraction of alpha and beta paid by a message that repeats one sent to
            another peer in the same step (a root's sends of one chunk; ``Cost.repeats``):
            1 over sockets, where each send is a copy and one port serialises them; 0
            over the shared-memory rings, where the piece is copied in once, every peer
            reads it and the latencies overlap

the prediction is ``(rounds - (1-repeat)*repeats)*alpha + (sent - (1-repeat)*repeated)*beta
+ reduced*gamma``.

Two levels. When the group spans several hosts (``Membership.hosts``, as host numbers
:attr:`CostModel.hosts`), messages inside a host are charged the ``ipc`` constants and
messages between hosts the ``tcp`` ones (:attr:`CostModel.between`): the ``ipc`` and ``tcp``
entries of a cost-model file are the two levels, so files written before keep loading and
mean the same. A strategy that knows the hosts says which part of its critical path crosses
them (``Cost.remote_rounds``, ``Cost.remote_sent``: the bytes leaving a host through its
one network link, ``plugins/hierarchical.py``). For one that does not (the flat ones) the
model reads its schedule in lockstep (:func:`crossing`): a step in which any message crosses
hosts is a round between hosts (the step waits for its slowest link; a ring on H hosts
crosses in every step), and the bytes that leave a host in such a step are those of all its
ranks sending at once, since they share the host's link.

Measured links. After the group's probe (:mod:`p2pcoll.api.topology`) the model holds the
bandwidth of every directed pair (:attr:`CostModel.links`) and the ring the ring strategy
runs along (:attr:`CostModel.ring`). Then the beta term of a strategy is read off its
schedule in lockstep (:func:`link_seconds`): each step takes as long as its slowest
message, a message's bytes over its pair's bandwidth, so a strategy that crosses a slow
pair pays for it; a rank's messages of one step share its host's line, so they take the
sum of their times (a direct exchange's p - 1 at once go no faster than a ring's one).
Links even within the probe's noise (:data:`EVEN`) are priced as one rate, the textbook
bytes over it; the ring along a ring other than rank order is priced as the carried
ring (:class:`~p2pcoll.engine.ordered_ring.OrderedRing`, more bytes) over the slowest hop
of that ring, and the ring allgather as the ring along it. This is how ``auto`` sees a slow pair.

Long paths. With the measured round trips (:attr:`CostModel.rtts`), the window of one
connection (:attr:`CostModel.window`) and the connections per link
(:attr:`CostModel.streams`, 0 for ``auto``), two more terms (:mod:`.long_paths`): every
step of the schedule waits for half its slowest pair's round trip beyond alpha
(:func:`~.long_paths.wire_seconds`), of which the segments in flight hide all but what
:func:`~.long_paths.exposed_seconds` leaves (one step's, when they keep the links busy),
and each message moves at most at its connections' windows over the round trip,
``k * window / rtt`` (:func:`~.long_paths.window_rates`: the ring's 4 connections nearly
fill a 1 Gbit/s, 100 ms path, Rabenseifner's 2 per pair less than half of it). On a LAN
neither binds and the prediction is the one above.

One term is not the textbook's: when more ranks share a host than it has cores, they queue
for the CPU, and then what all of them do counts, not only the critical path. With
``overhead`` the CPU seconds of one message, a host of ``cores`` cores running ``local`` of
the ``p`` ranks adds ``overhead * (messages sent by all ranks) * (local / p) / cores`` (the
messages from ``traffic()``). That is what makes the star (``reduce_broadcast``: 2(p-1)
messages in all) beat recursive doubling (p lg p) with 4 peers on 2 cores.

The :class:`Workload` a
strategy sees is built here from the data size, the group size and the executor's settings
(pipeline segments, their depth, the message cap) with the executor's own
:class:`~p2pcoll.engine.layout.Layout`, so the segment count is the one the executor uses.

Constants are per transport: ``ipc`` (peers of one host: ipc sockets, large pieces through
the shared-memory rings) and ``tcp``. The defaults were measured on the development machine
(2 vCPUs, loopback; ``benchmarks/README.md``, ``p2pcoll bench -n 2 --strategy
recursive_doubling``, and ``benchmarks/auto_accuracy.py --fit``): a 4 KiB exchange costs
0.4-1 ms, which is mostly alpha; 16 and 64 MiB give beta + gamma; numpy's float32 add runs at
~5 GB/s out of cache (gamma). A JSON
file named by ``$P2PCOLL_COST_MODEL`` (``join(cost_model=...)``) overrides any of them::

    {"ipc": {"alpha": 3e-4, "beta": 3e-10, "gamma": 2e-10, "overhead": 3e-4},
     "tcp": {"alpha": 4e-4, "beta": 2.5e-9}}

Missing transports or fields keep their defaults; anything else in the file is an error
(``repeat`` must lie in 0..1). With ``P2PCOLL_SHM=0`` the ipc links carry every piece over
their sockets, and their ``repeat`` is taken as 1.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any, cast

import numpy as np

from ..errors import SettingsError
from ..settings_env import DEFAULT_PIPELINE_DEPTH
from ..strategy import ALL, Context, Cost, Recv, Reduce, Send, Strategy, Workload, host_numbers
from .layout import Extent, Layout
from .long_paths import exposed_seconds, step_seconds, window_rates

TRANSPORTS = ("ipc", "tcp")
FIELDS = ("alpha", "beta", "gamma", "overhead", "repeat")
PARTS = frozenset({"allgather", "gather", "scatter"})  # one chunk per rank, chunk r rank r's


@dataclass(frozen=True)
class Constants:
    """The constants of one transport: seconds per message, per byte sent, per byte reduced;
    CPU seconds per message (``overhead``) and the share of alpha and beta a repeat pays."""

    alpha: float
    beta: float
    gamma: float
    overhead: float = 0.0  # CPU seconds per message, for hosts with more ranks than cores
    repeat: float = 1.0  # 0: peers read one copy of a piece sent to several (shared memory)

    def describe(self) -> str:
        return (f"alpha {self.alpha * 1e6:g} us/message, beta {self.beta * 1e9:g} ns/B "
                f"({1 / self.beta / 1e9:.3g} GB/s), gamma {self.gamma * 1e9:g} ns/B, "
                f"repeat {self.repeat:g}")

    def time(self, cost: Cost) -> float:
        """The seconds ``cost`` predicts with these constants (no host term)."""
        return cost.time(self.alpha, self.beta, self.gamma, self.repeat)


# Measured here (see the module docstring). ipc: alpha, beta and overhead fitted
# (benchmarks/auto_accuracy.py --fit, two runs of p = 2..4 x 4K..16M on 2 busy cores: alpha
# 505-683 us, beta 0.23-0.24 ns/B, overhead 400-426 us); numpy's add gives gamma. tcp over
# loopback moved 16 MiB in 50-54 ms with or without CurveZMQ (4 MiB in 15 ms), about 3 ns/B
# with the reduction; its 4 KiB exchanges took 1.0-1.2x ipc's. repeat: a root's pieces go
# into its shared-memory ring once for all readers (transport/shm.py); sockets copy each.
DEFAULT_CONSTANTS: Mapping[str, Constants] = {
    "ipc": Constants(alpha=500e-6, beta=0.25e-9, gamma=0.20e-9, overhead=400e-6, repeat=0.0),
    "tcp": Constants(alpha=600e-6, beta=2.5e-9, gamma=0.20e-9, overhead=400e-6, repeat=1.0),
}


def load_constants(path: str | Path, where: str = "$P2PCOLL_COST_MODEL") -> dict[str, Constants]:
    """The constants of every transport: the defaults, overridden by the JSON file ``path``.

    Raises:
        SettingsError: the file is missing, not JSON, or holds something other than
            ``{transport: {alpha|beta|gamma|overhead: seconds >= 0}}``; names ``where``
            and the file.
    """
    allowed = ("a JSON file like {\"ipc\": {\"alpha\": 3e-4, \"beta\": 3e-10, "
               "\"gamma\": 2e-10}, \"tcp\": {...}} (seconds per message, per byte; "
               "repeat a fraction 0..1)")
    try:
        data: Any = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise SettingsError(f"{where}={str(path)!r}: cannot read the cost model: {exc}",
                            name=where, value=str(path), allowed=allowed) from exc
    out = dict(DEFAULT_CONSTANTS)
    if not isinstance(data, dict):
        raise _bad(where, path, f"the top level is {type(data).__name__}, not an object", allowed)
    for transport, fields in data.items():
        if transport not in TRANSPORTS:
            raise _bad(where, path, f"unknown transport {transport!r} (known: "
                       f"{', '.join(TRANSPORTS)})", allowed)
        if not isinstance(fields, dict):
            raise _bad(where, path, f"{transport!r} is not an object", allowed)
        values: dict[str, float] = {}
        for name, value in fields.items():
            if name not in FIELDS:
                raise _bad(where, path, f"unknown field {transport}.{name}", allowed)
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or not math.isfinite(value) or value < 0):
                raise _bad(where, path, f"{transport}.{name} = {value!r} is not a number of "
                           "seconds >= 0", allowed)
            if name == "repeat" and value > 1:
                raise _bad(where, path, f"{transport}.repeat = {value!r} is not a fraction "
                           "from 0 to 1", allowed)
            values[name] = float(value)
        out[transport] = replace(out[transport], **values)
    return out


def _bad(where: str, path: str | Path, problem: str, allowed: str) -> SettingsError:
    return SettingsError(f"{where}={str(path)!r}: {problem}", name=where, value=str(path),
                         allowed=allowed)


@dataclass(frozen=True)
class CostModel:
    """Predicts the time of a strategy from its cost, one transport's constants and the
    executor's segmentation settings (those of :class:`p2pcoll.Settings`); ``local`` ranks
    of the group share a host of ``cores`` cores (0: not known, no contention term)."""

    constants: Constants = DEFAULT_CONSTANTS["ipc"]
    segment_bytes: int = 1 << 20
    depth: int = 4
    max_message_bytes: int = 256 << 20
    local: int = 1
    cores: int = 0
    between: Constants | None = None  # the constants between hosts (None: one level)
    hosts: tuple[int, ...] = ()  # the host number of every rank (empty: one host)
    # The measured bytes/s of every directed pair, and the ring the ring strategy runs
    # along (empty: not measured; see "Measured links" above).
    links: tuple[tuple[float, ...], ...] = ()
    ring: tuple[int, ...] = ()
    # The measured round trip of every directed pair (seconds; empty: not measured), the
    # bytes one connection keeps in flight (0: no window binds) and the connections per
    # link (0: auto): the long-path terms (see "Long paths" above).
    rtts: tuple[tuple[float, ...], ...] = ()
    window: int = 0
    streams: int = 0

    @property
    def levels(self) -> int:
        """2 when the group spans several hosts and the model has constants between them,
        else 1."""
        return 2 if self.between is not None and len(set(self.hosts)) > 1 else 1

    @property
    def shared_hosts(self) -> bool:
        """Two levels, and a host with several ranks: where a strategy that ``needs_hosts``
        (a hierarchical one) is not just a flat one."""
        return self.levels == 2 and len(set(self.hosts)) < len(self.hosts)

    @classmethod
    def for_settings(cls, settings: Any, transport: str = "ipc",
                     constants: Mapping[str, Constants] | None = None, *, local: int = 1,
                     cores: int = 0) -> CostModel:
        """The model of a group with ``settings`` whose links are ``transport``; the
        constants from ``constants`` (else the file of ``settings.cost_model``, if any,
        else the defaults). Raises SettingsError on a bad file."""
        if constants is None:
            path = getattr(settings, "cost_model", None)
            constants = load_constants(path) if path else DEFAULT_CONSTANTS
        chosen = constants[transport]
        if not getattr(settings, "shm", True):  # no rings: every send is a copy of its own
            chosen = replace(chosen, repeat=1.0)
        return cls(chosen, settings.segment_bytes,
                   settings.pipeline_depth or DEFAULT_PIPELINE_DEPTH,
                   settings.max_message_bytes, local, cores)

    @classmethod
    def for_group(cls, settings: Any, endpoints: Sequence[str], rank: int,
                  constants: Mapping[str, Constants] | None = None, *,
                  cores: int | None = None, hosts: Sequence[str] = ()) -> CostModel:
        """auto's model for the group whose peers listen at ``endpoints``, seen from
        ``rank``. With ``hosts`` (the roster's host of every rank) naming several hosts, two
        levels: ipc constants inside a host, tcp between hosts, the ranks of the busiest
        host against its ``cores`` (the same on every rank, so every rank picks alike).
        Otherwise one: tcp constants if any other peer is reached over tcp, else ipc; the
        ranks of this host (those not reached over tcp) against its ``cores`` (default: the
        CPUs this process may run on). A live group and ``p2pcoll simulate`` both build
        their model here, so what simulate says auto picks is what a group of that shape
        runs. Raises SettingsError on a bad constants file."""
        if cores is None:
            cores = len(os.sched_getaffinity(0))
        numbers = host_numbers(hosts) if len(hosts) == len(endpoints) else ()
        if len(set(numbers)) > 1:
            if constants is None:
                path = getattr(settings, "cost_model", None)
                constants = load_constants(path) if path else DEFAULT_CONSTANTS
            # The busiest host's ranks, not this rank's: every rank must price alike, or
            # ranks of uneven hosts would pick different strategies.
            busiest = max(numbers.count(h) for h in set(numbers))
            inside = cls.for_settings(settings, "ipc", constants, local=busiest, cores=cores)
            return replace(inside, between=constants["tcp"], hosts=numbers)
        remote = sum(e.startswith("tcp://") for r, e in enumerate(endpoints) if r != rank)
        return cls.for_settings(settings, "tcp" if remote else "ipc", constants,
                                local=len(endpoints) - remote, cores=cores)

    def workload(self, strategy: Strategy, nbytes: int, size: int,
                 itemsize: int = 1) -> Workload:
        """What ``strategy`` would be given for ``nbytes`` of data on ``size`` ranks."""
        return _workload(self, strategy.collective, strategy.chunks(size), nbytes, size,
                         itemsize, strategy.whole_messages)

    def predict(self, strategy: Strategy, nbytes: int, size: int,
                itemsize: int = 1) -> float | None:
        """Predicted seconds of ``strategy``, or None when it declares no cost model."""
        work = self.workload(strategy, nbytes, size, itemsize)
        cost = strategy.cost(work)
        if cost is None:
            return None
        if len(self.links) == size and size > 1:
            return self._measured(strategy, cost, work)
        if self.levels == 2 and len(self.hosts) == size:
            inside, between = self.split(strategy, cost, size)
            assert self.between is not None
            return (self.constants.time(inside) + self.between.time(between)
                    + self.contention(strategy, work))
        return self.constants.time(cost) + self.contention(strategy, work)

    def _measured(self, strategy: Strategy, cost: Cost, work: Workload) -> float:
        """The time of ``cost`` over the measured links: alpha and gamma as between hosts,
        the bytes as :func:`link_seconds` reads them (see "Measured links" above)."""
        constants = self.between or self.constants
        size, nbytes = work.size, work.nbytes
        ring = self.ring if len(self.ring) == size else tuple(range(size))
        if (strategy.collective == "allreduce" and strategy.name == "ring"
                and ring != tuple(range(size))):
            from .ordered_ring import OrderedRing  # the ring the group runs instead
            carried = OrderedRing(ring, (max(nbytes // work.itemsize, 1),), 0).cost(work)
            data = carried.sent / max(self._slowest_hop(strategy, ring), 1.0)
            return (carried.rounds * constants.alpha + data + carried.reduced * constants.gamma
                    + self._wire(strategy, work, constants.alpha, data))
        if (strategy.collective == "allgather" and strategy.name == "ring"
                and ring != tuple(range(size))):
            data = cost.sent / max(self._slowest_hop(strategy, ring), 1.0)
            return (cost.rounds * constants.alpha + data
                    + self._wire(strategy, work, constants.alpha, data))
        even = even_rate(self.links)
        lines = (self.links if even is None
                 else tuple((even,) * size for _ in range(size)))
        hosts = self.hosts if len(self.hosts) == size else ()
        caps = window_rates(strategy, size, self.rtts, lines, self.window, self.streams,
                            hosts)
        if caps is not None:  # a window binds below its line: per message, in lockstep
            seconds = link_seconds(strategy, size, lines, caps) * nbytes
        elif even is not None:
            seconds = cost.sent / even
        else:
            seconds = link_seconds(strategy, size, self.links) * nbytes
        return (cost.rounds * constants.alpha + self._wire(strategy, work, constants.alpha,
                                                           seconds)
                + seconds + cost.reduced * constants.gamma + self.contention(strategy, work))

    def _slowest_hop(self, strategy: Strategy, ring: tuple[int, ...]) -> float:
        """Bytes/s of the slowest hop of ``ring``: its pair's link, or less where the
        connections' windows bind it (:func:`~.long_paths.window_rates`; a ring sends to
        one peer at a time, whatever its order)."""
        size = len(ring)
        caps = window_rates(strategy, size, self.rtts, self.links, self.window, self.streams,
                            self.hosts if len(self.hosts) == size else ())
        hops = [(ring[k], ring[(k + 1) % size]) for k in range(size)]
        return min(min(self.links[a][b], caps[a][b] if caps is not None else self.links[a][b])
                   for a, b in hops)

    def _wire(self, strategy: Strategy, work: Workload, alpha: float, data_s: float) -> float:
        """The paths' latency beyond alpha that the segments in flight do not hide, with
        ``data_s`` the seconds of the data (see "Long paths")."""
        if len(self.rtts) != work.size:
            return 0.0
        return exposed_seconds(step_seconds(strategy, work.size, self.rtts, alpha), data_s,
                               min(work.segments, work.depth), work.waves)

    def split(self, strategy: Strategy, cost: Cost, size: int) -> tuple[Cost, Cost]:
        """``cost`` as (the part inside hosts, the part between hosts): as the strategy
        declares it (``Cost.remote_rounds``), else as :func:`crossing` reads its schedule."""
        if cost.remote_rounds is not None:
            rounds, sent = cost.remote_rounds, cost.remote_sent
            local_sent = max(cost.sent - sent, 0.0)
        else:
            rounds_share, bytes_share, sharing = crossing(strategy, size, self.hosts)
            rounds = cost.rounds * rounds_share
            local_sent = cost.sent * (1 - bytes_share)
            sent = cost.sent * bytes_share * sharing
        inside = Cost(cost.rounds - rounds, local_sent, cost.reduced, cost.repeats,
                      min(cost.repeated, local_sent))
        return inside, Cost(rounds, sent)

    def contention(self, strategy: Strategy, work: Workload) -> float:
        """The host term: CPU time of this host's share of all messages, over its cores,
        when its ranks outnumber its cores (else, or without ``traffic()``, 0)."""
        local = min(self.local, work.size)
        if not self.cores or local <= self.cores or not self.constants.overhead:
            return 0.0
        traffic = strategy.traffic(work)
        if traffic is None:
            return 0.0
        share = local / work.size
        return self.constants.overhead * sum(traffic.messages) * share / self.cores

    def best(self, strategies: Iterable[Strategy], nbytes: int, size: int) -> Strategy | None:
        """The strategy with the lowest predicted time, or None when none of them declares
        a cost model. Of strategies within a millionth of the lowest time (at p = 2 the
        ring, Rabenseifner and the direct exchange are one algorithm), the first given."""
        timed = [(t, s) for s in strategies if (t := self.predict(s, nbytes, size)) is not None]
        if not timed:
            return None
        fastest = min(t for t, _ in timed)
        return next(s for t, s in timed if t <= fastest * (1 + 1e-6))


SCANNED = 64  # steps of each rank that crossing() reads


@lru_cache(maxsize=256)
def crossing(strategy: Strategy, size: int, hosts: tuple[int, ...]) -> tuple[float, float, float]:
    """How a strategy that does not know hosts crosses them, read off its schedules (root 0)
    in lockstep: step i of every rank together is one round of the critical path, which
    waits for its slowest message. Returns (the share of rounds in which some message
    crosses hosts; the share of the critical path's bytes sent in those rounds, a step's
    bytes being the most one rank sends in it; how many times more bytes leave the busiest
    host in those rounds than one rank sends, as its ranks share its link). Chunks count as
    equal. Reads the first :data:`SCANNED` steps of every rank (the shares of a longer
    schedule are those of its first rounds: a ring's rounds are all alike), so it costs
    O(p * SCANNED) however long the schedule; cached."""
    nchunks = size if strategy.collective in PARTS else strategy.chunks(size)
    schedules = []
    for rank in range(size):
        ctx = Context(rank, size, 0, hosts)
        schedules.append([(step,) if isinstance(step, (Send, Recv, Reduce)) else tuple(step)
                          for step in itertools.islice(strategy.schedule(ctx), SCANNED)])

    def units(chunk: Any) -> int:
        if chunk is ALL:
            return nchunks
        return len(chunk) if isinstance(chunk, (range, tuple)) else 1

    local_rounds = remote_rounds = 0
    local_bytes = remote_bytes = host_bytes = 0
    for i in range(max((len(s) for s in schedules), default=0)):
        most_local = most_remote = 0
        leaving: dict[int, int] = {}
        for rank, steps in enumerate(schedules):
            if i >= len(steps):
                continue
            out = 0
            for op in steps[i]:
                if not isinstance(op, Send):
                    continue
                u = units(op.chunk)
                if hosts[op.to] != hosts[rank]:
                    out += u
                else:
                    most_local = max(most_local, u)
            if out:
                most_remote = max(most_remote, out)
                leaving[hosts[rank]] = leaving.get(hosts[rank], 0) + out
        if leaving:
            remote_rounds += 1
            remote_bytes += most_remote
            host_bytes += max(leaving.values())
        elif most_local:
            local_rounds += 1
            local_bytes += most_local
    rounds = local_rounds + remote_rounds
    total = local_bytes + remote_bytes
    return (remote_rounds / rounds if rounds else 0.0,
            remote_bytes / total if total else 0.0,
            host_bytes / remote_bytes if remote_bytes else 1.0)


EVEN = 2.0
"""Measured links whose rates lie within this factor of each other are taken as one rate, the
median: the probe's figures of even links scatter by tens of percent (on a long path its
train times TCP's start-up, not the line), and read pair by pair that noise would
decide between strategies that move the same bytes (the direct exchange sums three pairs'
figures where the ring meets the slowest of four). A slow pair (10x) stands out of it."""


@lru_cache(maxsize=256)
def even_rate(links: tuple[tuple[float, ...], ...]) -> float | None:
    """The one rate (bytes/s) of ``links`` if they are even (see :data:`EVEN`), else None.

    >>> even_rate(((0.0, 2e6, 2.4e6), (1.6e6, 0.0, 2e6), (2e6, 2.2e6, 0.0)))
    2000000.0
    >>> even_rate(((0.0, 1.25e8), (1.25e7, 0.0))) is None
    True
    """
    rates = sorted(b for i, row in enumerate(links) for j, b in enumerate(row) if i != j)
    if not rates or rates[0] <= 0 or rates[-1] > EVEN * rates[0]:
        return None
    return float(statistics.median(rates))


@lru_cache(maxsize=256)
def link_seconds(strategy: Strategy, size: int, links: tuple[tuple[float, ...], ...],
                 caps: tuple[tuple[float, ...], ...] | None = None) -> float:
    """Seconds per byte of data that ``strategy`` spends on the measured ``links`` (bytes/s
    of every directed pair), its schedules (root 0) read in lockstep: each step takes its
    slowest rank's time. A message of u of the c chunks takes ``u / c / links[i][j]`` per
    byte of data, and the messages a rank sends in one step share its line, as those one
    rank receives share its own: the probe measures one pair at a time, so a pair's figure
    is what the line gives it alone, and messages sent (or taken in) at once take the sum
    of their times (exact where the host's line binds, an upper bound where the pair's
    path does). So a direct exchange, p - 1 messages at once, moves no faster than a ring.
    The first :data:`SCANNED` steps of every rank are read, the rest taken as alike;
    cached. With ``caps`` (bytes/s each pair's connections carry at most: their windows,
    :func:`~.long_paths.window_rates`), a message also takes at least its bytes over its
    pair's cap, alone: a rank's step takes the larger of its line's sum and that."""
    nchunks = size if strategy.collective in PARTS else strategy.chunks(size)
    schedules = []
    for rank in range(size):
        steps = strategy.schedule(Context(rank, size, 0))
        schedules.append([(step,) if isinstance(step, (Send, Recv, Reduce)) else tuple(step)
                          for step in itertools.islice(steps, SCANNED)])
    total = 0.0
    for i in range(max((len(s) for s in schedules), default=0)):
        sending = [0.0] * size  # each rank's seconds per byte of data in this step, out
        taking = [0.0] * size  # and in
        windowed = [0.0] * size  # its slowest message through its connections' windows
        for rank, steps in enumerate(schedules):
            if i >= len(steps):
                continue
            for op in steps[i]:
                if isinstance(op, Send):
                    u = (nchunks if op.chunk is ALL else len(op.chunk)
                         if isinstance(op.chunk, (range, tuple)) else 1)
                    seconds = u / nchunks / max(links[rank][op.to], 1.0)
                    sending[rank] += seconds
                    taking[op.to] += seconds
                    if caps is not None:
                        alone = u / nchunks / max(caps[rank][op.to], 1.0)
                        windowed[rank] = max(windowed[rank], alone)
                        windowed[op.to] = max(windowed[op.to], alone)
        total += max(max(sending), max(taking), max(windowed))
    return total


@lru_cache(maxsize=4096)
def _workload(model: CostModel, collective: str, nchunks: int, nbytes: int, size: int,
              itemsize: int, whole: bool = False) -> Workload:
    elements = nbytes // itemsize
    if collective == "barrier":
        layout = Layout([], [[]])
    elif collective in PARTS or collective == "alltoall":
        # p equal parts: the data is what every rank has together (alltoall: sends)
        elements -= elements % size
        part = Extent(elements // size, itemsize)
        layout = Layout.parts(cast(list[np.ndarray], [part] * size))
    else:
        layout = Layout.split(cast(list[np.ndarray], [Extent(elements, itemsize)]), nchunks)
    segments = layout.segment(model.segment_bytes, model.max_message_bytes, whole=whole)
    hosts = model.hosts if len(model.hosts) == size else ()
    return Workload(size, elements * itemsize, itemsize, segments, model.depth, hosts)


__all__ = ["DEFAULT_CONSTANTS", "EVEN", "TRANSPORTS", "Constants", "CostModel", "crossing",
           "even_rate", "link_seconds", "load_constants"]
