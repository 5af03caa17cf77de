"""The probe's train: its figure as a pure function of the receiver's stamps (TCP's start-up
left out), and its bounds under a peer that lies, stalls or floods.

Multi-rank runs are memory groups on the virtual clock; the misbehaving peer is a rank whose
half of the probe is replaced by one that speaks the protocol badly."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest

import p2pcoll
from p2pcoll.api import topology
from p2pcoll.api.topology import ACK, HEAD, TAG, Topology, Train, measure, train_rate
from p2pcoll.testing import memory_groups, run_virtual

MiB = 1 << 20


def slow_start(chunks: int, chunk: int, rate: float, rtt: float,
               initial: float = 14_600) -> list[tuple[float, int]]:
    """Arrival stamps of a train over a path of ``rate`` bytes/s and ``rtt`` seconds whose
    TCP window starts at ``initial`` bytes and doubles every round trip (a fluid model):
    chunk i arrives when the bytes delivered reach i * chunk (half a round trip after the
    start, when the first byte arrives)."""
    stamps, delivered, t, dt = [], 0.0, rtt / 2, rtt / 1000
    for i in range(1, chunks + 1):
        while delivered < i * chunk:
            window = initial * 2 ** ((t - rtt / 2) / rtt)
            delivered += min(rate, window / rtt) * dt
            t += dt
        stamps.append((t, chunk))
    return stamps


@pytest.mark.parametrize(("rate", "rtt"), [(125e6, 0.010), (12.5e6, 0.010), (125e6, 0.002)])
def test_the_trains_figure_is_the_line_rate_not_tcps_start_up(rate: float, rtt: float) -> None:
    arrivals = slow_start(8, MiB, rate, rtt)
    whole_train = 8 * MiB / arrivals[-1][0]  # what one timed payload of it would read
    assert train_rate(0.0, arrivals) == pytest.approx(rate, rel=0.03)
    if rate * rtt > 1e6:  # a product of a megabyte or more: the start-up is most of it
        assert whole_train < 0.65 * rate


def test_the_figure_of_a_train_the_receiver_stamped_at_once_is_bounded() -> None:
    # A busy receiver stamps the later chunks together: at most BUNCHING x the mean of
    # the chunks after the first (the first may wait for the stripes' handshakes: 5 s).
    arrivals = [(5.1, MiB), (5.3, MiB), (5.3, MiB), (5.3, MiB)]
    mean = 3 * MiB / 0.2
    assert train_rate(0.0, arrivals) == pytest.approx(topology.BUNCHING * mean)
    assert math.isnan(train_rate(0.0, []))
    assert math.isnan(train_rate(1.0, [(1.0, MiB)]))  # no time passed
    assert math.isnan(train_rate(0.0, [(1.0, MiB), (1.0, MiB)]))
    assert train_rate(0.0, [(2.0, MiB)]) == MiB / 2  # one chunk: from the start


def test_a_train_is_timed_until_every_chunk_came_or_its_seconds_passed() -> None:
    train = Train(MiB, 4, seconds=0.5)
    assert not train.done([])
    assert not train.done([(0.1, MiB), (0.2, MiB)])
    assert train.done([(0.1, MiB), (0.6, MiB)])  # half a second: a slow link
    # Seconds count from the first chunk: a first chunk late for its stripes' handshakes
    # is no reason to stop.
    assert not train.done([(3.0, MiB)])
    assert train.done([(t, MiB) for t in (0.01, 0.02, 0.03, 0.04)])


# --- misbehaving peers ---------------------------------------------------------------------

Serve = Callable[[Any, int, Train, float], Awaitable[None]]
Time = Callable[[Any, int, Train, float], Awaitable[tuple[float, float]]]


def probe_with(p: int, liar: int, monkeypatch: pytest.MonkeyPatch, *, serve: Serve | None = None,
               time_link: Time | None = None, nbytes: int = 64 << 10, chunk: int = 4 << 10,
               seconds: float = 2.0) -> list[tuple[Topology, int, float]]:
    """Every rank probes; rank ``liar`` serves and times with the given replacements."""
    real_serve, real_time = topology._serve, topology._time_link

    async def serving(g: Any, frm: int, train: Train, deadline: float) -> None:
        fn = serve if serve is not None and g.rank == liar else real_serve
        await fn(g, frm, train, deadline)

    async def timing(g: Any, to: int, train: Train, deadline: float) -> tuple[float, float]:
        fn = time_link if time_link is not None and g.rank == liar else real_time
        return await fn(g, to, train, deadline)

    monkeypatch.setattr(topology, "_serve", serving)
    monkeypatch.setattr(topology, "_time_link", timing)

    async def rank(g: p2pcoll.Group) -> tuple[Topology, int, float]:
        loop = asyncio.get_running_loop()
        started = loop.time()
        top = await measure(g, nbytes=nbytes, seconds=seconds, chunk_bytes=chunk)
        return top, g.stats()["bytes_sent"], loop.time() - started

    async def main() -> list[tuple[Topology, int, float]]:
        groups = await memory_groups(p, probe=False)
        try:
            return list(await asyncio.gather(*(rank(g) for g in groups)))
        finally:
            await asyncio.gather(*(g.close() for g in groups))
    return run_virtual(main())


def sent_bound(p: int, nbytes: int, chunk: int) -> int:
    """What an honest rank sends: per peer a ping, its train, the end marker, an answer per
    chunk received (and one for the ping); the allgather of the rows."""
    answers = (nbytes // chunk + 1) * 8
    return (p - 1) * (8 + nbytes + 8 + answers) + 2 * p * 2 * p * 8


@pytest.mark.parametrize("lie", [math.inf, 1e30, -5.0, math.nan, 0.0])
def test_a_receiver_that_lies_about_the_rate_gives_rank_order(
        lie: float, monkeypatch: pytest.MonkeyPatch) -> None:
    # Rank 1 answers rank 0's ping, then its first chunk with a figure that is no rate.
    async def lying(g: Any, frm: int, train: Train, deadline: float) -> None:
        if await topology._next(g, frm, TAG, deadline) is None:
            return
        await g.send(np.zeros(1, np.uint8), frm, tag=ACK)
        if await topology._next(g, frm, TAG, deadline) is not None:
            await g.send(np.array([lie], np.float64), frm, tag=ACK)
        while (m := await topology._next(g, frm, TAG, deadline)) is not None and (
                m.dtype == np.uint8):
            pass  # the rest of the train, up to its end

    p, nbytes, chunk = 4, 64 << 10, 4 << 10
    results = probe_with(p, 1, monkeypatch, serve=lying, nbytes=nbytes, chunk=chunk)
    for top, _, took in results:
        assert top.bandwidth_Bps[0][1] is None  # rank 0's link to the liar: unknown
        assert top.bandwidth_Bps[1][2] is not None  # the liar's own links: measured
        assert top.ring == (0, 1, 2, 3)
        assert took < 2.0
    assert all(sent <= sent_bound(p, nbytes, chunk) for _, sent, _ in results)


def test_a_receiver_that_stops_answering_holds_at_most_a_window(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Rank 1 answers the ping and then nothing: rank 0 sends it the train's head only (the
    # rest follows the first chunk's answer), gives up at the round's deadline, and the
    # ring is rank order.
    async def stalled(g: Any, frm: int, train: Train, deadline: float) -> None:
        if await topology._next(g, frm, TAG, deadline) is not None:
            await g.send(np.zeros(1, np.uint8), frm, tag=ACK)
        await asyncio.sleep(max(0.0, deadline - asyncio.get_running_loop().time()))

    p, nbytes, chunk, seconds = 3, 256 << 10, 4 << 10, 2.0
    results = probe_with(p, 1, monkeypatch, serve=stalled, nbytes=nbytes, chunk=chunk,
                         seconds=seconds)
    top, sent, took = results[0]
    assert top.bandwidth_Bps[0][1] is None and top.rtt_s[0][1] is not None
    assert top.ring == (0, 1, 2)
    # To rank 1: a ping, a window of chunks, the end; to rank 2: at most its whole train.
    assert sent < nbytes + HEAD * chunk + 4096 < 2 * nbytes
    assert all(t <= seconds + 0.5 for _, _, t in results)


def test_a_sender_that_floods_is_cut_at_the_trains_length(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Rank 2 sends rank 0 three trains' worth without waiting for answers and no end: rank 0
    # takes at most its train's chunks, answers, and leaves by the deadline with a figure
    # for that link; every other link is measured as usual.
    async def flooding(g: Any, to: int, train: Train, deadline: float) -> tuple[float, float]:
        await g.send(np.zeros(8, np.uint8), to, tag=TAG)
        for _ in range(3 * train.chunks):
            await g.send(np.zeros(train.chunk, np.uint8), to, tag=TAG)
        return math.nan, math.nan

    p, nbytes, chunk, seconds = 3, 64 << 10, 4 << 10, 2.0
    results = probe_with(p, 2, monkeypatch, time_link=flooding, nbytes=nbytes, chunk=chunk,
                         seconds=seconds)
    for top, _, took in results:
        assert took <= seconds + 0.5
        assert top.bandwidth_Bps[2][0] is None and top.ring == (0, 1, 2)
        assert top.bandwidth_Bps[0][1] is not None and top.bandwidth_Bps[1][2] is not None
    assert results[0][1] <= sent_bound(p, nbytes, chunk)


def test_chunk_bytes_must_be_positive() -> None:
    async def main() -> None:
        groups = await memory_groups(2, probe=False)
        try:
            with pytest.raises(ValueError, match="chunk_bytes"):
                await measure(groups[0], chunk_bytes=0)
        finally:
            await asyncio.gather(*(g.close() for g in groups))
    run_virtual(main())


class FakePaths:
    """A transport's paths (:class:`p2pcoll.transport.base.Paths`) as :func:`topology.price`
    sees them: 0 -> 1 and 0 -> 3 of 10 ms, 0 -> 2 of 100 ms; what it is told, kept."""

    window = 0

    def __init__(self) -> None:
        self.told: list[tuple[int, float | None, float | None]] = []

    def __getitem__(self, peer: int) -> tuple[float | None, float | None]:
        return {1: 0.01, 2: 0.1, 3: 0.01}[peer], None

    def drive(self, peers: frozenset[int]) -> None:
        pass

    def measure(self, peer: int, rtt_s: float | None = None,
                bandwidth_Bps: float | None = None) -> None:
        self.told.append((peer, rtt_s, bandwidth_Bps))


def told_and_links(rows: np.ndarray) -> tuple[list[Any], tuple[Any, ...]]:
    """What :func:`topology.price` tells rank 0's :class:`FakePaths` of ``rows``, and the
    links its cost model takes."""

    async def main() -> tuple[list[Any], tuple[Any, ...]]:
        groups = await memory_groups(4, probe=False)
        try:
            g = groups[0]
            paths = FakePaths()
            g.session.transport.paths = paths
            topology.price(g, Topology.from_rows(rows))
            return paths.told, g.session.runner.costs().links
        finally:
            await asyncio.gather(*(g.close() for g in groups))
    return run_virtual(main())


@pytest.mark.parametrize("over_100ms", [125e6, 2e6])
def test_the_transport_takes_the_figures_of_short_paths_only(over_100ms: float) -> None:
    # A 1 Gbit/s path of 10 ms (a product of 1.25 MB, within what a train keeps in flight)
    # goes to the transport's paths; one of 100 ms and an unknown one do not: at 1 Gbit/s
    # (12.5 MB: the train may not have left TCP's start-up) nor read at the start-up's own
    # pace (2 MB/s: a small product, but a round trip too long to trust it). The cost model
    # takes no matrix with a link unknown.
    fast = 125e6
    rows = np.full((4, 9), fast)
    rows[0, 4 + 3] = np.nan  # 0 -> 3 not measured
    rows[0, 4 + 2] = over_100ms
    told, links = told_and_links(rows)
    assert told == [(1, None, fast)]
    assert links == ()  # a link unknown: the cost model keeps its constants


def test_a_train_that_ends_early_is_timed_by_what_came(monkeypatch: pytest.MonkeyPatch) -> None:
    # Rank 0 sends ranks 1 and 2 only the head of its train, then the end: each answers the
    # first chunk, then with a figure from the two chunks when the end comes (not at its
    # deadline).
    got: list[float] = []

    async def short(g: Any, to: int, train: Train, deadline: float) -> tuple[float, float]:
        await g.send(np.zeros(8, np.uint8), to, tag=TAG)
        await topology._next(g, to, ACK, deadline)
        for _ in range(HEAD):
            await g.send(np.zeros(train.chunk, np.uint8), to, tag=TAG)
        first = await topology._next(g, to, ACK, deadline)
        await g.send(np.array([HEAD], np.int64), to, tag=TAG)
        figure = await topology._next(g, to, ACK, deadline)
        assert first is not None and topology._verdict(first) is None  # an ack
        assert figure is not None
        got.append(topology._verdict(figure) or math.nan)
        return 1e-3, got[-1]

    results = probe_with(3, 0, monkeypatch, time_link=short, seconds=30.0)
    assert len(got) == 2 and min(got) > 0
    for top, _, took in results:
        assert top.bandwidth_Bps[0][1:] == tuple(got) and took < 10.0
