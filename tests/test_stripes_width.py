"""``streams=auto``'s width follows the collective that runs (issue 36, striped links).

A host's line carries the links to every remote peer a collective sends to at once: a ring
one (its right neighbour), a direct exchange all p - 1. The executor tells the transport the
program's destinations (``Paths.drive``), and each striped route takes its share of the
host's connections for that many peers (``choose_streams(sharing=k)``). The cost model
knows the same: the messages a rank sends in one step share its line, so on even links the
direct exchange is priced as the ring, not a third of it.

- the width for a program of k concurrent peers, and what a compiled program says it drives;
- ``Routes.drive`` counts only the remote peers (tcp, another host);
- four real peers over loopback tcp, each its own host, paths made long: a ring opens the
  host's share of stripes to its one neighbour, a direct exchange one per pair to all
  three, counted through ``stats()``, every result bit-identical;
- the measured-links price of the direct exchange, the ring and a root's broadcast, and
  even links read as one rate, whatever the probe's noise.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

import p2pcoll
import p2pcoll.transport.route as route_module
from p2pcoll.engine.costs import DEFAULT_CONSTANTS, CostModel, link_seconds
from p2pcoll.engine.plan import plan
from p2pcoll.engine.program import compile_program
from p2pcoll.registry import registry
from p2pcoll.strategy import Context
from p2pcoll.testing import free_port
from p2pcoll.transport.base import Counters
from p2pcoll.transport.paths import MAX_AUTO_STREAMS, choose_streams
from p2pcoll.transport.route import Routes

WINDOW = 2 << 20  # autotuned 4 MiB buffers: 2 MiB in flight per connection


def test_the_width_for_a_program_of_k_concurrent_peers() -> None:
    # 100 ms, bandwidth not measured (10 Gbit/s assumed: the cap decides): the host's
    # connections split among the peers sent to at once, one each at least.
    long = [choose_streams(0.1, None, window_bytes=WINDOW, sharing=k) for k in (1, 2, 3, 7)]
    assert long == [MAX_AUTO_STREAMS, 2, 1, 1] == [4, 2, 1, 1]
    # 1 Gbit/s measured: 12.5 MB over 2 MiB windows would be 6; the host keeps to 4.
    measured = [choose_streams(0.1, 125e6, window_bytes=WINDOW, sharing=k) for k in (1, 3)]
    assert measured == [4, 1]
    # A short path: one connection, however many peers.
    assert choose_streams(0.001, None, window_bytes=WINDOW, sharing=1) == 1


@pytest.mark.parametrize(("name", "drives"), [
    ("ring", {1}), ("direct", {1, 2, 3}), ("rabenseifner", {1, 2}),
    ("recursive_doubling", {1, 2})])
def test_a_program_says_which_peers_it_sends_to(name: str, drives: set[int]) -> None:
    strategy = registry.get("allreduce", name)
    nchunks = strategy.chunks(4)
    steps = plan(strategy, Context(0, 4, 0), nchunks)
    chunks = [[(0, c * 10, c * 10 + 10)] for c in range(nchunks)]
    program = compile_program(steps, chunks, [4], nseg=2, depth=4)
    assert program.destinations == frozenset(drives)
    assert program.destinations == frozenset(
        peer for kind, peer in zip(program.kind, program.peer) if kind & 1)


def _routes(endpoints: list[str], hosts: list[str]) -> Routes:
    routes = Routes(None, Counters(), 0, lambda r: None,  # type: ignore[arg-type]
                    lambda r, f: None, lambda p, e: None, streams="auto")
    routes.start(0, "s", "n", endpoints, (), b"", hosts)
    return routes


def test_drive_counts_the_remote_peers_only() -> None:
    # Peer 1 over tcp on another host; 2 over ipc; 3 over tcp on this host.
    routes = _routes(["tcp://a:1", "tcp://b:1", "ipc:///tmp/x", "tcp://a:2"],
                     ["h0", "h1", "h0", "h0"])
    assert routes.sharing == 0  # no collective has said yet
    routes.drive(frozenset({1, 2, 3}))
    assert routes.sharing == 1
    routes.drive(frozenset({2, 3}))  # nothing remote to send to: nothing changes
    assert routes.sharing == 1
    wide = _routes([f"tcp://h{r}:1" for r in range(5)], [f"h{r}" for r in range(5)])
    wide.drive(frozenset({1, 2, 3, 4}))
    assert wide.sharing == 4
    wide.drive(frozenset({1}))
    assert wide.sharing == 1


@pytest.fixture
def small_stripes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stripe messages of 1 KiB and more, in segments of 16 KiB; no probe at join (its
    payloads would open stripes of their own)."""
    monkeypatch.setattr(route_module, "STRIPE_BYTES", 1024)
    monkeypatch.setenv("P2PCOLL_SEGMENT_BYTES", "16K")
    monkeypatch.setenv("P2PCOLL_PROBE", "0")
    monkeypatch.setenv("P2PCOLL_TCP_LANES", "0")  # small messages stripe: not on TCP lanes


@pytest.mark.usefixtures("small_stripes")
async def test_the_stripes_follow_the_strategy_that_runs() -> None:
    """Four peers, each its own host, every path told 100 ms (bandwidth unmeasured): the
    ring opens its whole share (4 connections) to its one neighbour, the direct exchange
    then takes one to each of its three peers (the link), and the ring again widens back; the
    stripes opened, counted by stats(), are those and no more."""
    peers = 4
    x = np.arange(60_000, dtype=np.float32)
    expected = sum(x + r for r in range(peers))
    url = f"tcp://127.0.0.1:{free_port()}"

    async def rank(r: int) -> list[Any]:
        async with p2pcoll.join(url, world_size=peers, rank=r, transport="tcp",
                                host_id=f"host-{r}", timeout=30, streams="auto") as g:
            routes = g.session.transport.routes
            others = [p for p in range(peers) if p != r]
            for peer in others:
                routes.measure(peer, rtt_s=0.1)
            right = (r + 1) % peers
            seen = []
            for strategy in ("ring", "direct", "ring"):
                out = await g.allreduce(x + r, strategy=strategy)
                assert np.array_equal(out, expected), strategy
                widths = {p: routes.routes[p].width for p in others if p in routes.routes}
                seen.append((widths, g.stats()["stripes_opened"]))
            await g.barrier()
            return [right, seen]

    for right, seen in await asyncio.gather(*(rank(r) for r in range(peers))):
        (ring, ring_stripes), (direct, direct_stripes), (again, again_stripes) = seen
        assert ring[right] == MAX_AUTO_STREAMS and ring_stripes == MAX_AUTO_STREAMS - 1
        assert sorted(direct.values()) == [1, 1, 1]  # 3 peers at once: one each
        # The neighbour's stripes were open already; the others need none.
        assert direct_stripes == ring_stripes
        assert again[right] == MAX_AUTO_STREAMS and again_stripes == direct_stripes


def _even(bandwidth: float, p: int = 4) -> tuple[tuple[float, ...], ...]:
    return tuple(tuple(0.0 if i == j else bandwidth for j in range(p)) for i in range(p))


def test_concurrent_sends_share_the_senders_line_in_the_price() -> None:
    # Uneven links (read pair by pair): every pair at 120 MB/s but one at 40.
    links = [list(row) for row in _even(1.2e8)]
    links[2][3] = 4e7
    uneven = tuple(map(tuple, links))
    ring, direct = registry.get("allreduce", "ring"), registry.get("allreduce", "direct")
    # The ring's 6 steps of a quarter each wait for its slowest hop (2 -> 3); the direct
    # exchange's 2 steps each send three quarters from every rank, rank 2's at 2/3 of
    # the rate it had (a quarter at 120 MB/s, a quarter at 40, and a quarter at 120).
    assert link_seconds(ring, 4, uneven) == pytest.approx(6 * 0.25 / 4e7)
    assert link_seconds(direct, 4, uneven) == pytest.approx(
        2 * (0.5 / 1.2e8 + 0.25 / 4e7))
    # A root's broadcast sends the whole data to each of the three at once.
    root = registry.get("broadcast", "root")
    assert link_seconds(root, 4, _even(1.2e8)) * 1.2e8 == pytest.approx(3.0)


def test_auto_takes_no_pair_by_pair_noise_for_a_difference() -> None:
    """Even links as the probe reads them on a long path (tens of percent apart): priced
    as one rate, the direct exchange costs what the ring does, and auto takes neither
    by the noise: it took the direct exchange, which reached 72-79 % of the line where
    the ring reached 87 %."""
    ring, direct = registry.get("allreduce", "ring"), registry.get("allreduce", "direct")
    n = 64 << 20
    picks = set()
    for seed in range(20):
        rng = np.random.default_rng(seed)
        links = tuple(tuple(0.0 if i == j else float(rng.uniform(1.5e6, 2.5e6))
                            for j in range(4)) for i in range(4))
        model = CostModel(DEFAULT_CONSTANTS["tcp"], links=links, ring=(0, 1, 2, 3))
        assert model.predict(direct, n, 4) == pytest.approx(model.predict(ring, n, 4))
        picks.add(registry.auto_name("allreduce", n, 4, model))
    assert picks == {"rabenseifner"}  # the same bytes in 2 lg p rounds, not 2(p - 1)
