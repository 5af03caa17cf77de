"""The group's measured topology, and the ring ordered by it.

At join (and in the group a shrink makes) every rank measures its links to every other
(:func:`measure`), the ranks agree on the matrix with one allgather, and every rank solves
the same ring from it (:func:`p2pcoll.engine.ring_order.best_ring`, deterministic). The
probe, per ordered pair ``i -> j``, in ``p - 1`` rounds of shifted pairs (round s: rank r
measures its link to ``r + s`` while serving ``r - s``):

1. a ping of 8 bytes, answered: the round-trip time;
2. a *train* of up to :data:`PROBE_BYTES` in chunks of :data:`CHUNK_BYTES`: its head
   (:data:`HEAD` chunks), then, once the receiver has acked the first, as many more as
   the head's pace moves in :data:`REST_SECONDS`, then a marker that ends it. The
   receiver stamps each chunk's arrival on its own clock and, once every chunk has come,
   :data:`PAIR_SECONDS` have passed since the first came, or the train has ended, answers
   with its figure: the rate of the train's later half (:func:`train_rate`), after TCP's
   start-up has opened the window and the link's first large messages its stripes (a
   short probe of one or two payloads times those, not the line: on 1 Gbit/s and 10 ms it
   read 150 Mbit/s). No acks pace the train (a starved process's answers come late, and
   would time the CPU, not the link); its length is what bounds the time a slow link
   takes to carry it.

Bounds: every rank sends one peer at most a ping, ``PROBE_BYTES`` of train and a marker (a
peer that does not answer the first chunk: the head only), and answers each train with at
most three messages; a train longer than the receiver's is cut, and no message
is waited for past its round's share of the probe's deadline (:data:`PROBE_SECONDS`; round s
ends ``s / (p-1)`` of the way through, so a silent or very slow peer costs one share): a
link not measured in time counts as unknown, and so does a row a peer reports that is not
finite and positive (a peer that lies). With any link unknown the ring is rank order: the
probe never makes a group wait longer than its deadline plus one small allgather, and a lie
can only change which ring runs, never a result (every ring gives the rank-order ring's
bits: :mod:`p2pcoll.engine.ordered_ring`).

The probe runs when the group spans several hosts (the roster's) reached over tcp and has
3 to :data:`MAX_PROBED` ranks, or when asked:
``P2PCOLL_PROBE=1`` (``Settings.probe``); ``P2PCOLL_PROBE=0`` skips it (then the topology
has no measurements and the ring is rank order). The measured links also go to ``auto``'s
cost model, so that it sees a slow pair, and to the transport's paths, which size a link's
stripes and the pipeline's depth from them (:func:`price`).

``Group.allreduce`` and ``Group.allgather`` with the ``ring`` strategy (asked for, the
group's default, or auto's pick) run along the measured ring when it pays
(:func:`p2pcoll.engine.ordered_ring.pays`).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ..engine.window import pipeline_depth
from ..transport.paths import DEFAULT_BANDWIDTH_BPS
from ..types import OpKey, ReduceOp

if TYPE_CHECKING:
    from ..session.calls import Call
    from ..session.session import Session
    from ..settings import Settings
    from ..types import Membership

__all__ = ["PROBE_BYTES", "PROBE_SECONDS", "Topology", "Train", "measure", "ordered",
           "train_rate"]


class Group(Protocol):
    """What the probe uses of a :class:`p2pcoll.Group`."""

    settings: Settings

    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def membership(self) -> Membership: ...
    @property
    def session(self) -> Session: ...
    async def send(self, value: Any, dst: int, *, tag: int = 0,
                   timeout: float | None = None) -> None: ...
    async def recv(self, src: int, *, tag: int = 0, out: Any = None,
                   timeout: float | None = None) -> Any: ...
    async def allgather(self, array: np.ndarray, *, strategy: str | None = None,
                        timeout: float | None = None) -> list[np.ndarray]: ...

PROBE_BYTES = 8 << 20  # the most one train carries (per ordered pair)
CHUNK_BYTES = 512 << 10  # one message of a train
HEAD = 2  # chunks of a train sent before its receiver answers the first
REST_SECONDS = 1.0  # the rest of a train: what the head's pace moves in this long
PAIR_SECONDS = 0.25  # the longest a receiver times a train
BUNCHING = 4.0  # a train's later half moves at most this many times its mean rate
# The transport takes a figure (price) only where its product with the path's round trip is
# at most a quarter of a train, and the round trip is short: there the train ran past TCP's
# start-up. On a longer path it may not have, and the transport's assumption (10 Gbit/s)
# errs long. The round trip's bound matters because a train paced from its first chunks
# never leaves the start-up on a long path: there it reads its own pace (a 1 Gbit/s, 100 ms
# path read 2 MB/s, whose product is small), and sizing the links for it held a ring to
# a quarter of the line.
SHORT_PATH_BYTES = 2 << 20
SHORT_RTT_S = 0.02
PROBE_SECONDS = 10.0  # the whole probe's deadline on one rank
TAG = 0xFFFF_FFF0  # the probe's pings and payloads (it runs in join, before the caller's)
ACK = TAG + 1  # and its answers: a message late for its deadline confuses no other
MAX_PROBED = 16  # largest group probed unless asked (every pair: p(p-1) probes)
MAX_BANDWIDTH = 1e13  # bytes/s: a reported figure above this is a lie (80 Tbit/s)


@dataclass(frozen=True)
class Topology:
    """What the probe measured and the ring chosen from it.

    Attributes:
        ranks: the ranks measured, in rank order.
        rtt_s: ``rtt_s[i][j]``: round-trip seconds from rank i to rank j (0 on the
            diagonal; None: not measured).
        bandwidth_Bps: ``bandwidth_Bps[i][j]``: bytes/s from rank i to rank j (None: not
            measured).
        ring: the ring order the ring strategies run along (rank order when nothing was
            measured, when a link is unknown, or when reordering does not pay).
        measured_at: the Unix time of the measurement, or None.
        window_bytes: the bytes one connection keeps in flight, the least any rank's
            transport reported (:attr:`p2pcoll.transport.base.Paths.window`; None: not
            reported, or 0: no window binds). Not in :meth:`as_dict`.
    """

    ranks: tuple[int, ...]
    rtt_s: tuple[tuple[float | None, ...], ...]
    bandwidth_Bps: tuple[tuple[float | None, ...], ...]
    ring: tuple[int, ...]
    measured_at: float | None
    window_bytes: int | None = None

    @classmethod
    def unmeasured(cls, size: int) -> Topology:
        """No probe: rank order, nothing known."""
        empty = tuple(tuple(0.0 if i == j else None for j in range(size))
                      for i in range(size))
        return cls(tuple(range(size)), empty, empty, tuple(range(size)), None)

    @classmethod
    def from_rows(cls, rows: np.ndarray) -> Topology:
        """The topology from every rank's row of ``[rtt to 0..p-1, bandwidth to
        0..p-1, its clock, its window]`` (NaN: not measured; a row without the window, as
        from an older peer, says none): the same value on every rank that has the rows (the
        time is rank 0's, the window the least reported)."""
        p = rows.shape[0]
        windows = [float(w) for w in rows[:, 2 * p + 1]] if rows.shape[1] > 2 * p + 1 else []
        window = (int(min(windows)) if windows and all(math.isfinite(w) and w >= 0
                                                       for w in windows) else None)
        measured_at = _known(rows[0, 2 * p], math.inf)
        rtt = tuple(tuple(0.0 if i == j else _known(rows[i, j], math.inf)
                          for j in range(p)) for i in range(p))
        bandwidth = tuple(tuple(0.0 if i == j else _known(rows[i, p + j], MAX_BANDWIDTH)
                                for j in range(p)) for i in range(p))
        return cls(tuple(range(p)), rtt, bandwidth, choose_ring(bandwidth), measured_at,
                   window)

    def as_dict(self) -> dict[str, Any]:
        """The value of :meth:`p2pcoll.Group.topology`."""
        return {"ranks": list(self.ranks), "rtt_s": [list(r) for r in self.rtt_s],
                "bandwidth_Bps": [list(r) for r in self.bandwidth_Bps],
                "ring": list(self.ring), "measured_at": self.measured_at}


def _known(value: float, high: float) -> float | None:
    """A reported figure if it is plausible (finite, > 0, <= ``high``), else None."""
    v = float(value)
    return v if math.isfinite(v) and 0 < v <= high else None


def choose_ring(bandwidth: tuple[tuple[float | None, ...], ...]) -> tuple[int, ...]:
    """The ring for a matrix: rank order unless every link is known and the best ring's
    slowest hop is fast enough that the bytes it carries pay
    (:func:`p2pcoll.engine.ordered_ring.pays`)."""
    p = len(bandwidth)
    identity = tuple(range(p))
    if p < 3 or any(b is None for row in bandwidth for b in row):
        return identity
    # The ring's solver and the ordered ring: loaded only by a group that measured its links.
    from ..engine.ordered_ring import pays
    from ..engine.ring_order import best_ring, bottleneck
    m = [[float(b) if b is not None else 0.0 for b in row] for row in bandwidth]
    ring = best_ring(m)
    return ring if pays(bottleneck(ring, m), bottleneck(identity, m), ring) else identity


def price(group: Group, topology: Topology) -> None:
    """Give ``group``'s transport the bandwidth measured from this rank to each peer of a
    short path (:data:`SHORT_PATH_BYTES`, :data:`SHORT_RTT_S`; its paths: how many stripes
    a link takes under ``streams=auto``, how deep the pipeline runs;
    :mod:`p2pcoll.transport.paths`), and its cost model the measured links, so that
    ``auto`` sees a slow pair (:mod:`p2pcoll.engine.costs`, "Measured links"; nothing
    when a link is unknown), with the round trips, the connections' window and the
    streams setting, so that it sees a long path (:mod:`p2pcoll.engine.long_paths`): a
    long path's figure is taken as the transport takes it, not measured (the train timed
    TCP's start-up), and the pipeline's depth as the executor sets it from the paths."""
    bandwidth, rtt = topology.bandwidth_Bps, topology.rtt_s
    paths = group.session.transport.paths
    for peer, b in enumerate(bandwidth[group.rank]):
        if peer != group.rank and b is not None and _short(paths[peer][0], b):
            paths.measure(peer, None, b)  # the handshakes' round trip stays
    if any(b is None for i, row in enumerate(bandwidth) for j, b in enumerate(row) if i != j):
        return
    p = len(bandwidth)
    # As the transport and the executor see each path (the same on every rank: the
    # matrix is agreed): the figure of a short path, else the assumed bandwidth.
    seen = [[(rtt[i][j], b if _short(rtt[i][j], b) else None)
             for j, b in enumerate(row)] for i, row in enumerate(bandwidth)]
    links = tuple(tuple(0.0 if i == j else float(b if b is not None else DEFAULT_BANDWIDTH_BPS)
                        for j, (_, b) in enumerate(row)) for i, row in enumerate(seen))
    rtts = tuple(tuple(0.0 if i == j or rtt[i][j] is None else float(rtt[i][j] or 0.0)
                       for j in range(p)) for i in range(p))
    runner = group.session.runner
    model = runner.costs()
    depth = model.depth
    if group.settings.pipeline_depth is None:  # the executor's window follows the paths
        depth = pipeline_depth([f for row in seen for f in row], model.segment_bytes,
                               floor=model.depth)
    streams = group.settings.streams
    runner.use_costs(replace(model, links=links, ring=topology.ring, rtts=rtts,
                             window=topology.window_bytes or 0, depth=depth,
                             streams=0 if streams == "auto" else streams))


def _short(rtt_s: float | None, bandwidth_Bps: float | None) -> bool:
    """Whether a probe's figure of a path is taken (see :data:`SHORT_PATH_BYTES`)."""
    return (rtt_s is not None and bandwidth_Bps is not None and rtt_s <= SHORT_RTT_S
            and bandwidth_Bps * rtt_s <= SHORT_PATH_BYTES)


def wanted(group: Group) -> bool:
    """Whether ``group`` probes: as asked (``settings.probe``), else when it has 3 to
    :data:`MAX_PROBED` ranks over several hosts, reaches every peer directly over tcp (no
    relay: every rank's roster then says the same) and has no
    link budget below its peers (a ring of two has one order; the probe opens a link to
    every peer, which a larger group or a budget keeps from happening)."""
    asked = group.settings.probe
    if asked is not None:
        return asked and group.world_size > 1
    membership = group.membership
    budget = group.settings.max_links  # the probe opens a link to every peer
    return (3 <= group.world_size <= MAX_PROBED and len(set(membership.hosts)) > 1
            and all(e.startswith("tcp://") for e in membership.endpoints)
            and not 0 < budget < group.world_size - 1)


async def measure(group: Group, *, nbytes: int = PROBE_BYTES,
                  seconds: float = PROBE_SECONDS,
                  chunk_bytes: int = CHUNK_BYTES) -> Topology:
    """Probe every link of ``group`` and agree on the topology (see the module docstring).

    Every rank must call it at the same point (it ends with an allgather). ``nbytes``
    bounds each train (the bytes this rank sends one peer, pings and markers aside), in
    chunks of ``chunk_bytes``; ``seconds`` the whole probe.

    Raises:
        ValueError: ``chunk_bytes`` is not positive.
        PeerLost, CollectiveTimeout, GroupBroken: from the closing allgather.
    Cancellation: breaks the group if it happens during the allgather.
    """
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be > 0, got {chunk_bytes}")
    p, r = group.world_size, group.rank
    row = np.full(2 * p + 2, np.nan)
    row[2 * p + 1] = group.session.transport.paths.window
    loop = asyncio.get_running_loop()
    start = loop.time()
    chunk = max(1, min(chunk_bytes, nbytes))
    train = Train(chunk, max(1, nbytes // chunk))
    for s in range(1, p):
        to, frm = (r + s) % p, (r - s) % p
        # Round s ends by its share of the deadline: a silent peer costs one share.
        deadline = start + seconds * s / (p - 1)
        out, _ = await asyncio.gather(_time_link(group, to, train, deadline),
                                      _serve(group, frm, train, deadline))
        row[to], row[p + to] = out
    row[2 * p] = time.time()
    rows = await group.allgather(row)
    return Topology.from_rows(np.stack(rows))


@dataclass(frozen=True)
class Train:
    """One probe's train: up to ``chunks`` messages of ``chunk`` bytes, timed by the
    receiver for at most ``seconds`` from the first."""

    chunk: int
    chunks: int
    seconds: float = PAIR_SECONDS

    def done(self, arrivals: Sequence[tuple[float, int]]) -> bool:
        """Whether the receiver has timed enough: every chunk has come, or two have and
        ``seconds`` have passed since the first came (from the first, not the ping: a
        link's first large messages open its stripes, whose handshakes are not its rate;
        what is still slower meets the round's deadline and is unknown)."""
        return len(arrivals) >= self.chunks or (
            len(arrivals) >= 2 and arrivals[-1][0] - arrivals[0][0] >= self.seconds)


def train_rate(start: float, arrivals: Sequence[tuple[float, int]]) -> float:
    """Bytes/s of a train, from its receiver's clock alone: ``start`` when it answered the
    ping (the sender starts the train when that answer comes), ``arrivals`` each chunk's
    (arrival time, bytes), in order; NaN when nothing came or no time passed.

    The rate of the later half of the chunks, over the time since the earlier half's last
    came: TCP's start-up (its window doubling each round trip) and the handshakes of the
    stripes a link's first large messages open fall in the earlier half, so the later half
    moves at the window it opened, the path's rate when the train is long enough. A busy
    receiver that stamps several chunks at once would read them as instantaneous: the
    later half's time counts as at least 1/:data:`BUNCHING` of its share of the train's
    time since its first chunk came, so the rate is at most that many times the mean of
    the chunks after the first. One chunk alone is timed from ``start``.

    >>> train_rate(0.0, [(0.5, 100), (0.75, 100), (0.875, 100), (1.0, 100)])  # 2 in 1/4 s
    800.0
    >>> train_rate(0.0, [(0.5, 100)])  # one chunk: timed from the start
    200.0
    """
    m = len(arrivals)
    if m == 0:
        return math.nan
    if m == 1:
        took = arrivals[0][0] - start
        return arrivals[0][1] / took if took > 0 else math.nan
    half = m // 2
    later = sum(n for _, n in arrivals[half:])
    after_first = sum(n for _, n in arrivals[1:])
    total = arrivals[-1][0] - arrivals[0][0]
    if not total > 0 or not later > 0:
        return math.nan
    span = max(arrivals[-1][0] - arrivals[half - 1][0], total * later / after_first / BUNCHING)
    return later / span


async def _next(group: Group, src: int, tag: int, deadline: float) -> np.ndarray | None:
    """Rank ``src``'s next message with ``tag`` if it comes by ``deadline`` and is one
    array (else None: a pytree is received and dropped, a late one not consumed)."""
    session = group.session
    key = OpKey.transfer(src, group.rank, tag, session.transfers[(src, group.rank, tag)])
    left = deadline - asyncio.get_running_loop().time()
    if left <= 0:
        return None
    try:
        async with asyncio.timeout(left):
            await session.matcher.first_of_any({src: key})
    except TimeoutError:
        return None
    value = await group.recv(src, tag=tag)
    return value if isinstance(value, np.ndarray) else None


def _verdict(message: np.ndarray) -> float | None:
    """The receiver's figure if ``message`` is one (a float64), else None (an ack)."""
    if message.dtype == np.float64 and message.size == 1:
        return float(message[0])
    return None


async def _time_link(group: Group, to: int, train: Train, deadline: float
                     ) -> tuple[float, float]:
    """(round-trip seconds, bytes/s) from this rank to ``to``; NaN for what did not come
    back before ``deadline`` (the loop's clock; the times are the wall clock's, which a
    virtual clock's jumps do not move). The bytes/s are the receiver's figure
    (:func:`train_rate`) of the train: its head (:data:`HEAD` chunks), then, once the
    receiver has answered the first, the rest it would move in :data:`REST_SECONDS` at
    the head's pace (the whole train on a fast link, a few chunks on a slow one), then a
    marker that ends it."""
    ping = np.zeros(8, np.uint8)
    started = time.perf_counter()
    await group.send(ping, to, tag=TAG)
    if await _next(group, to, ACK, deadline) is None:
        return math.nan, math.nan
    rtt = time.perf_counter() - started
    payload = np.zeros(train.chunk, np.uint8)
    head = time.perf_counter()
    sent = min(HEAD, train.chunks)
    for _ in range(sent):
        await group.send(payload, to, tag=TAG)
    answer = await _next(group, to, ACK, deadline)
    figure = None if answer is None else _verdict(answer)
    if answer is not None and figure is None:  # the first chunk's ack: the rest
        pace = train.chunk / max(time.perf_counter() - head, 1e-6)
        rest = min(train.chunks - sent, int(pace * REST_SECONDS) // train.chunk)
        for _ in range(rest):
            await group.send(payload, to, tag=TAG)
        sent += rest
    await group.send(np.array([sent], np.int64), to, tag=TAG)  # the end of the train
    if answer is not None and figure is None:
        answer = await _next(group, to, ACK, deadline)
        figure = None if answer is None else _verdict(answer)
    return rtt, math.nan if figure is None else figure


async def _serve(group: Group, frm: int, train: Train, deadline: float) -> None:
    """Answer rank ``frm``'s ping, then the first chunk of its train with an ack, then
    with its figure once it has timed enough (:meth:`Train.done`) or the train ends; then
    take the chunks still on their way, up to the train's end, at most ``train.chunks``
    of them in all, until ``deadline``."""
    if await _next(group, frm, TAG, deadline) is None:
        return
    await group.send(np.zeros(1, np.uint8), frm, tag=ACK)
    start = time.perf_counter()
    arrivals: list[tuple[float, int]] = []
    timed = False
    for _ in range(train.chunks + 1):  # the chunks and the end: a longer train is cut
        message = await _next(group, frm, TAG, deadline)
        if message is None:  # late: no figure
            return
        ended = message.dtype != np.uint8  # the end of the train
        if not ended and not timed:
            arrivals.append((time.perf_counter(), message.nbytes))
        if not timed and (ended or train.done(arrivals)):
            timed = True
            figure = np.array([train_rate(start, arrivals)], np.float64)
            await group.send(figure, frm, tag=ACK)
        elif not timed and len(arrivals) == 1:
            await group.send(np.zeros(1, np.uint8), frm, tag=ACK)
        if ended:
            return


def ordered(group: Group, topology: Topology, call: Call) -> None:
    """Make ``call`` (an allreduce or an allgather) run along ``topology``'s ring when it
    is not rank order and the ring strategy runs it: the ordered ring
    (:mod:`p2pcoll.engine.ordered_ring`), which gives the rank-order ring's bits. An
    allreduce: built-in ops only (a custom op need not commute), one dtype, three ranks or
    more."""
    ring = topology.ring
    p = len(ring)  # every rank is on it (not group.world_size: two properties per call)
    if p < 3 or ring == tuple(range(p)):
        return
    flat = call.flat
    nbytes = sum(a.nbytes for a in flat)
    if group.session.runner.choose(call.collective, call.strategy, nbytes).name != "ring":
        return
    from ..engine.ordered_ring import ordered_allgather, ordered_ring
    if call.collective == "allgather":
        call.schedule = ordered_allgather(ring)
        return
    if not isinstance(call.op, ReduceOp) or not flat or len({a.dtype for a in flat}) != 1:
        return
    strategy = ordered_ring(ring, tuple(a.size for a in flat), group.rank)
    call.schedule = strategy
    call.flat = [*flat, np.empty(strategy.scratch_elements, flat[0].dtype)]
