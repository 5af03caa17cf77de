"""The ring ordered by the measured topology: the same bits whatever the ring, the probe's
matrix and its bounds, ``P2PCOLL_PROBE=0`` and ``g.topology()``.

Multi-rank runs are memory groups on the virtual clock; the ring a test wants is given to
every rank as its topology (what the probe's agreement produces)."""

from __future__ import annotations

import asyncio
import itertools
import math
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest

import p2pcoll
from p2pcoll.api.topology import TAG, Topology, choose_ring, measure
from p2pcoll.engine.ordered_ring import (
    OrderedAllgather,
    OrderedRing,
    _path,
    factor,
    pays,
    starts,
)
from p2pcoll.strategy import Context
from p2pcoll.testing import memory_groups, run_virtual


def on_groups(p: int, fn: Callable[[p2pcoll.Group], Awaitable[Any]], **settings: Any
              ) -> list[Any]:
    async def main() -> list[Any]:
        groups = await memory_groups(p, **settings)
        try:
            return list(await asyncio.gather(*(fn(g) for g in groups)))
        finally:
            await asyncio.gather(*(g.close() for g in groups))
    return run_virtual(main())


def with_ring(g: p2pcoll.Group, ring: tuple[int, ...]) -> None:
    """Give ``g`` the topology whose ring is ``ring`` (as the probe would)."""
    p = g.world_size
    g._topology = Topology(tuple(range(p)), (), (), ring, 0.0)


def rings(p: int) -> list[tuple[int, ...]]:
    """Every ring from rank 0 (a few of them above 4 ranks; rank order first)."""
    every = [(0, *rest) for rest in itertools.permutations(range(1, p))]
    return every if p <= 4 else every[:: max(1, len(every) // 4)]


SIZES = (0, 1, 7, 1000)


@pytest.mark.parametrize("p", [3, 4, 5])
def test_results_are_bit_identical_whatever_the_ring(p: int) -> None:
    rng = np.random.default_rng(p)
    inputs = {
        (n, d): (rng.standard_normal((p, n)) * 10 ** rng.uniform(-3, 3, (p, n))).astype(d)
        for n in SIZES for d in (np.float32, np.float64, np.float16)}
    tree = {"a": rng.standard_normal((p, 5, 3)).astype(np.float32),
            "b": rng.standard_normal((p, 11)).astype(np.float32)}

    async def rank(g: p2pcoll.Group) -> dict[Any, bytes]:
        got: dict[Any, bytes] = {}
        for ring in rings(p):
            with_ring(g, ring)
            for (n, d), xs in inputs.items():
                for op in ("sum", "max", "avg") if d != np.float16 else ("sum",):
                    r = await g.allreduce(xs[g.rank], op, strategy="ring")
                    got[ring, n, d, op] = r.tobytes()
            r = await g.allreduce({k: v[g.rank] for k, v in tree.items()}, strategy="ring")
            got[ring, "tree"] = r["a"].tobytes() + r["b"].tobytes()
            ran = {pr.strategy.ring for pr in g.session.runner.programs.values()
                   if isinstance(pr.strategy, OrderedRing)}
            assert (ring in ran) == (ring != tuple(range(p)))  # it ran along this ring
        return got

    results = on_groups(p, rank)
    assert all(r == results[0] for r in results)  # every rank the same bits
    first = rings(p)[0]  # rank order: the plain ring
    assert first == tuple(range(p))
    for key, value in results[0].items():
        plain = (first, *key[1:])
        assert value == results[0][plain], f"ring {key[0]} differs from rank order: {key}"


def test_allgather_runs_along_the_ring() -> None:
    p = 5
    ring = (0, 3, 1, 4, 2)

    async def rank(g: p2pcoll.Group) -> list[bytes]:
        with_ring(g, ring)
        got = await g.allgather(np.arange(7, dtype=np.int64) * (g.rank + 1), strategy="ring")
        ran = [pr.strategy for pr in g.session.runner.programs.values()]
        assert any(isinstance(s, OrderedAllgather) and s.ring == ring for s in ran)
        return [a.tobytes() for a in got]

    for parts in on_groups(p, rank):
        assert parts == [(np.arange(7, dtype=np.int64) * (r + 1)).tobytes() for r in range(p)]


def test_the_ordered_ring_folds_on_the_way_where_the_chain_allows() -> None:
    # Rank order carries nothing: every hop one partial (3 hops x 4 chunks). Along
    # (0, 2, 1, 3) the best paths carry 15 contributions in all; carrying everything
    # would be 1 + 2 + 3 per chunk, 24.
    assert sum(len(h) for c in range(4) for h in _path((0, 1, 2, 3), c, c) or []) == 12
    ring = (0, 2, 1, 3)
    chosen = starts(ring)
    assert sorted(chosen) == [0, 1, 2, 3]
    assert sum(len(h) for c in range(4) for h in _path(ring, c, chosen[c]) or []) == 15
    for rank in range(4):
        steps = list(OrderedRing(ring, (8,), rank).schedule(Context(rank, 4)))
        right = ring[(ring.index(rank) + 1) % 4]
        assert all(op.to == right for step in steps for op in step
                   if isinstance(op, p2pcoll.strategy.Send))


@pytest.mark.parametrize("p", range(2, 8))
def test_every_ring_has_paths_that_fold_in_chain_order(p: int) -> None:
    for ring in rings(p):
        chosen = starts(ring)
        assert sorted(chosen) == list(range(p))  # every rank owns one chunk
        for c in range(p):
            assert _path(ring, c, chosen[c]) is not None


def test_choose_ring_pays_only_for_a_slow_pair() -> None:
    fast, slow = 1.25e8, 1.25e7
    m = [[0.0 if i == j else fast for j in range(4)] for i in range(4)]
    assert choose_ring(tuple(tuple(r) for r in m)) == (0, 1, 2, 3)
    m[0][1] = m[1][0] = slow
    assert choose_ring(tuple(tuple(r) for r in m)) == (0, 2, 1, 3)
    m[0][1] = m[1][0] = fast / 1.2  # noise, not a slow pair: not worth carrying
    assert choose_ring(tuple(tuple(r) for r in m)) == (0, 1, 2, 3)
    m[0][1] = m[1][0] = fast / 1.5  # 1.5x slower: worth its 1.125x the bytes
    assert choose_ring(tuple(tuple(r) for r in m)) == (0, 2, 1, 3)
    unknown = [list(r) for r in m]
    unknown[2][3] = None  # type: ignore[call-overload]
    assert choose_ring(tuple(tuple(r) for r in unknown)) == (0, 1, 2, 3)
    assert factor((0, 1, 2, 3)) == 1.0 and factor((0, 2, 1, 3)) == 1.125
    assert pays(10.0, 1.0, (0, 2, 1, 3)) and not pays(1.2, 1.0, (0, 2, 1, 3))
    assert not pays(10.0, 1.0, (0, 1))


def test_a_lying_row_falls_back_to_rank_order() -> None:
    p = 4
    rows = np.full((p, 2 * p + 1), 1e8)
    rows[0, p + 1] = 1e6  # a slow pair 0 -> 1 ...
    rows[1, p + 0] = 1e6
    assert Topology.from_rows(rows).ring == (0, 2, 1, 3)
    for lie in (np.inf, -5.0, np.nan, 1e30):
        lied = rows.copy()
        lied[3, p + 2] = lie  # ... and rank 3 reports nonsense: rank order
        t = Topology.from_rows(lied)
        assert t.ring == (0, 1, 2, 3)
        assert t.bandwidth_Bps[3][2] is None


def test_probe_measures_every_link_and_every_rank_agrees() -> None:
    async def rank(g: p2pcoll.Group) -> dict[str, Any]:
        return g.topology()

    tops = on_groups(3, rank, probe=True)
    assert all(t == tops[0] for t in tops)
    t = tops[0]
    # Which ring: whatever the noise of one process's links says; the same on every rank.
    assert t["ranks"] == [0, 1, 2] and sorted(t["ring"]) == [0, 1, 2]
    assert isinstance(t["measured_at"], float)
    for i, j in itertools.product(range(3), repeat=2):
        if i != j:
            assert t["rtt_s"][i][j] > 0 and t["bandwidth_Bps"][i][j] > 0


def test_probe_off_measures_nothing() -> None:
    async def rank(g: p2pcoll.Group) -> tuple[dict[str, Any], int]:
        return g.topology(), g.stats()["bytes_sent"]

    for t, sent in on_groups(3, rank, probe=False):
        assert t["ring"] == [0, 1, 2] and t["measured_at"] is None
        assert t["bandwidth_Bps"][0][1] is None and t["rtt_s"][1][0] is None
        assert sent == 0
    # On one host the default is not to probe either.
    for t, sent in on_groups(3, rank):
        assert t["measured_at"] is None and sent == 0


def test_env_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("P2PCOLL_PROBE", "0")
    assert p2pcoll.Settings.resolve().probe is False
    monkeypatch.setenv("P2PCOLL_PROBE", "1")
    assert p2pcoll.Settings.resolve().probe is True
    monkeypatch.setenv("P2PCOLL_PROBE", "maybe")
    with pytest.raises(p2pcoll.SettingsError, match="P2PCOLL_PROBE"):
        p2pcoll.Settings.resolve()


def test_probe_is_bounded_under_a_silent_peer() -> None:
    # Rank 2 never answers (it runs no probe): the others give up on their links to it at
    # the deadline, send no more than their bounded bytes, and fall back to rank order.
    nbytes, seconds = 4096, 2.0

    async def rank(g: p2pcoll.Group) -> tuple[Topology | None, int, float]:
        loop = asyncio.get_running_loop()
        started = loop.time()
        if g.rank == 2:
            await asyncio.sleep(seconds + 1)  # silent through the others' deadline
            rows = await g.allgather(np.full(2 * g.world_size + 2, np.nan))
            top = Topology.from_rows(np.stack(rows))
        else:
            top = await measure(g, nbytes=nbytes, seconds=seconds)
        return top, g.stats()["bytes_sent"], loop.time() - started

    results = on_groups(3, rank, probe=False)
    p = 3
    for top, sent, took in results:
        assert top is not None and top.ring == (0, 1, 2)
        assert took <= seconds + 1 + 0.5  # the deadline, then the allgather
        # Bytes sent: at most 2 payloads and a ping per peer, acks, and the allgather.
        assert sent <= (p - 1) * (2 * nbytes + 8 + 3) + 2 * p * 2 * p * 8
    t0 = results[0][0]
    assert t0 is not None
    assert t0.bandwidth_Bps[0][2] is None and t0.bandwidth_Bps[0][1] is not None
    assert math.isfinite(t0.rtt_s[1][0] or math.nan)
    assert TAG > 0


def test_auto_sees_the_slow_pair() -> None:
    from dataclasses import replace

    from p2pcoll.engine.costs import DEFAULT_CONSTANTS, CostModel
    from p2pcoll.registry import registry

    fast, slow = 1.25e8, 1.25e7
    links = [[0.0 if i == j else fast for j in range(4)] for i in range(4)]
    links[0][1] = links[1][0] = slow
    tcp = CostModel(DEFAULT_CONSTANTS["tcp"])
    even = replace(tcp, links=tuple(tuple(fast if i != j else 0.0 for j in range(4))
                                    for i in range(4)), ring=(0, 1, 2, 3))
    measured = replace(tcp, links=tuple(map(tuple, links)), ring=(0, 2, 1, 3))
    ring, rab = registry.get("allreduce", "ring"), registry.get("allreduce", "rabenseifner")
    n = 16 << 20
    # Even links: the ring costs its textbook bytes at the links' rate.
    assert even.predict(ring, n, 4) == pytest.approx(1.5 * n / fast, rel=0.05)
    # The slow pair: Rabenseifner's first round crosses it, the ordered ring does not; it
    # carries 15 of its chunks' contributions where rank order moves 12, then the
    # allgather's 3 chunks: (15/4 + 3)/4 of the data per rank.
    assert measured.predict(rab, n, 4) > 0.5 * n / slow
    assert measured.predict(ring, n, 4) == pytest.approx(1.6875 * n / fast, rel=0.05)
    assert registry.auto_name("allreduce", n, 4, measured) == "ring"
    # Rank order across the slow pair would cost ten times the bytes' time.
    rank_order = replace(measured, ring=(0, 1, 2, 3))
    assert rank_order.predict(ring, n, 4) == pytest.approx(1.5 * n / slow, rel=0.05)


def test_over_sockets_the_probe_agrees_and_the_ring_keeps_the_bits() -> None:
    # Three peers on "hosts" of their own (tcp between them): the group probes at join by
    # default, every rank reports the same matrix, and the ring allreduce, along whatever
    # ring the matrix gave, has the rank-order ring's bits.
    from p2pcoll.testing import run_ranks

    p = 3
    xs = [np.random.default_rng(r).standard_normal(1001).astype(np.float32) * 10 ** r
          for r in range(p)]
    expected = np.empty_like(xs[0])
    for c, idx in enumerate(np.array_split(np.arange(xs[0].size), p)):
        acc = xs[c][idx].copy()
        for k in range(1, p):
            acc += xs[(c + k) % p][idx]
        expected[idx] = acc

    async def rank(g: p2pcoll.Group) -> tuple[dict[str, Any], bytes, bytes]:
        top = g.topology()
        measured = await g.allreduce(xs[g.rank], strategy="ring")  # the probe's ring
        with_ring(g, (0, 2, 1))  # and the other ring of three, forced
        forced = await g.allreduce(xs[g.rank], strategy="ring")
        return top, measured.tobytes(), forced.tobytes()

    async def main() -> list[tuple[dict[str, Any], bytes, bytes]]:
        return await run_ranks(p, rank, transport="tcp", host_ids=["a", "b", "c"])

    results = asyncio.run(main())
    top = results[0][0]
    assert top["measured_at"] is not None
    assert all(r[0] == top for r in results)
    for _, measured, forced in results:
        assert measured == forced == expected.tobytes()
