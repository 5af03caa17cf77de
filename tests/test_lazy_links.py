"""Links on demand: a peer opens a link the first time it sends to a peer, so its links are
the overlay's (hellos and probes to r+1, r+2) and its schedules' partners. Real
peers as tasks of one process over ipc sockets, 20 of them (more than a shared-memory board
takes, so the group is sparse).

Failures with lazy links: a peer that dies (its sockets closed without a goodbye) is named
by everyone, including peers that never had a link to it and open one now; a peer that
leaves with a goodbye is told to the others by the peers it told, without failing data it
sent before (which may still be on its way when the news arrives).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import p2pcoll
from p2pcoll.testing import run_ranks
from p2pcoll.departures import overlay

N = 20


class Together:
    """The ranks (tasks of this process) wait for each other before they close their
    groups, so that nobody leaves (and tells the others) while they still measure."""

    def __init__(self, n: int) -> None:
        self.left = n
        self.all = asyncio.Event()

    def arrive(self) -> None:
        self.left -= 1
        if self.left == 0:
            self.all.set()

    async def done(self) -> None:
        self.arrive()
        await self.all.wait()


def links_after(strategy: str | None, together: Together) -> Callable[
        [p2pcoll.Group], Awaitable[tuple[int, set[int], int]]]:
    async def fn(g: p2pcoll.Group) -> tuple[int, set[int], int]:
        got = await g.allreduce(np.full(64, float(g.rank)), strategy=strategy)
        assert np.all(got == sum(range(g.world_size)))
        t = g.session.transport
        seen = t.links, set(t.routes.routes), t.probes
        await together.done()
        return seen
    return fn


@pytest.mark.parametrize("strategy", ["ring", "recursive_doubling", "rabenseifner"])
async def test_a_peer_links_only_to_its_partners_and_neighbours(strategy: str) -> None:
    results = await run_ranks(N, links_after(strategy, Together(N)), transport="ipc")
    bound = {"ring": 2, "recursive_doubling": 2 * math.ceil(math.log2(N)) + 4,
             "rabenseifner": 2 * math.ceil(math.log2(N)) + 4}[strategy]
    for rank, (count, peers, probes) in enumerate(results):
        assert probes == overlay.WATCHED
        assert count == len(peers) <= bound, (rank, sorted(peers))
        assert set(overlay.watched(rank, N)) <= peers  # the hellos went there
    if strategy == "ring":  # the hellos (r+1, r+2) and the ring's successor (r+1) only
        assert all(peers == set(overlay.watched(r, N)) for r, (_, peers, _) in
                   enumerate(results))


async def test_a_dead_peer_is_named_by_peers_that_never_linked_to_it() -> None:
    """Rank 9's sockets close without a goodbye (as a crash would); its watchers (7, 8) see
    their probes close, and the news reaches everyone; rank 0, which never had a link to
    rank 9, then sends to it (opening the link) and gets rank 9's PeerLost."""
    victim = 9
    died = asyncio.Event()
    together = Together(N - 1)
    others = Together(N - 2)  # rank 0's failed send breaks its group and tells the others:
    # it sends once they all have their errors

    async def fn(g: p2pcoll.Group) -> str:
        await g.allreduce(np.ones(4), strategy="ring")
        if g.rank == victim:
            await g.session.transport.aclose()  # no goodbye: gone as a crash would be
            died.set()
            return "died"
        await died.wait()
        if g.rank == 0:
            await others.all.wait()
            assert victim not in g.session.transport.routes.routes
            with pytest.raises(p2pcoll.PeerLost) as lost:
                await g.send(np.ones(3), victim, timeout=30)
        else:
            with pytest.raises(p2pcoll.PeerLost) as lost:
                await g.allreduce(np.ones(4), strategy="ring", timeout=30)
            await others.done()
        assert lost.value.rank == victim
        await together.done()
        return str(lost.value)

    results = await asyncio.wait_for(run_ranks(N, fn, transport="ipc"), 90)
    for rank, result in enumerate(results):
        if rank != victim:
            assert f"rank {victim}" in result, (rank, result)


async def test_a_goodbye_reaches_peers_it_was_not_sent_to_and_data_before_it_arrives() -> None:
    """Rank 3 sends rank 15 a message and leaves at once. Its goodbye goes to the peers it
    sent to (15 and its watchers); the others learn it from them: a later send to rank 3
    from rank 10 fails with "left the group", while rank 15, which the news may reach
    before rank 3's own link delivers, still receives the message."""
    leaver, reader, other = 3, 15, 10
    together = Together(N - 1)
    # rank 10's failed send breaks its group, which the others hear of: not before every
    # one of them is past the first allreduce
    first = Together(N - 1)

    async def fn(g: p2pcoll.Group) -> str:
        result = await part(g)
        if g.rank != leaver:
            await together.done()
        return result

    async def part(g: p2pcoll.Group) -> str:
        await g.allreduce(np.ones(4), strategy="ring")
        if g.rank == leaver:
            await g.send(np.arange(5.0), reader)
            return "left"
        first.arrive()
        if g.rank == reader:
            got = await g.recv(leaver, timeout=30)
            assert np.array_equal(got, np.arange(5.0))
            return "received"
        if g.rank == other:
            await first.all.wait()
            for _ in range(200):
                if leaver in g.session.peers.gone():
                    break
                await asyncio.sleep(0.05)
            with pytest.raises(p2pcoll.PeerLost, match=f"rank {leaver} left the group"):
                await g.send(np.ones(2), leaver, timeout=30)
            return "told"
        return "idle"

    results = await run_ranks(N, fn, transport="ipc")
    assert results[leaver] == "left" and results[reader] == "received"
    assert results[other] == "told"


def test_out_of_descriptors_is_an_error_that_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """libzmq says only "Too many open files" when a link cannot be opened; the mesh's
    socket factory names the limit and what to do."""
    import errno

    import zmq

    from p2pcoll.transport.sockets import SocketFactory

    factory = SocketFactory()

    def no_more(kind: int, **_: object) -> None:
        raise zmq.ZMQError(errno.EMFILE)

    monkeypatch.setattr(factory.context, "socket", no_more)
    with pytest.raises(OSError, match=r"run out of file descriptors \(soft limit \d+"):
        factory.mesh_link(b"0@secret@nonce")


# --- the link budget (P2PCOLL_MAX_LINKS): idle links closed and opened again ----------------

BUDGET = 4


def budget_peers(n: int, host_ids: bool = True) -> dict[str, object]:
    return {"max_links": BUDGET, "collective_timeout": 30, "transport": "tcp",
            "host_ids": [f"h{r}" for r in range(n)] if host_ids else None}


@pytest.mark.parametrize("hosts", ["own", "shared"])
async def test_a_root_under_the_budget_closes_links_and_results_stay_right(hosts: str) -> None:
    """Every rank in turn broadcasts (flat root strategy: the root sends to all) and gathers:
    each root churns its links through a budget of 4, and every result is right. On one
    host (20 peers: lanes, no board) links with a lane stay open, so a root may hold more."""
    n = 10 if hosts == "own" else 20
    together = Together(n)

    async def fn(g: p2pcoll.Group) -> dict[str, int]:
        t = g.session.transport
        most = 0
        for rounds in range(2):
            for root in range(n):
                data = np.arange(8.0) + root + 100 * rounds if g.rank == root else \
                    np.zeros(8)
                got = await g.broadcast(data, root=root, strategy="root")
                assert np.array_equal(got, np.arange(8.0) + root + 100 * rounds)
                gathered = await g.gather(np.full(3, float(g.rank)), root=root)
                if g.rank == root:
                    assert [int(a[0]) for a in gathered] == list(range(n))
                most = max(most, t.links)
        total = await g.allreduce(np.ones(4), strategy="ring")
        assert np.all(total == n)
        stats = g.stats()
        await together.done()
        return {"most": most, "opened": stats["links_opened"], "closed": stats["links_closed"],
                "open": t.links}

    kw = budget_peers(n, host_ids=hosts == "own")
    if hosts == "shared":
        kw["transport"] = "ipc"
    results = await run_ranks(n, fn, host_ids=kw.pop("host_ids"), **kw)
    for rank, r in enumerate(results):
        if hosts == "own":
            assert r["most"] <= BUDGET, (rank, r)  # nothing here pins more than the budget
        else:  # at most 8 lanes a peer (lane.MAX_LANES) pin theirs, the rest churn
            assert r["most"] <= BUDGET + 8, (rank, r)
        assert r["opened"] - r["closed"] == r["open"], (rank, r)
        assert r["closed"] > 0, (rank, r)  # each root sent to all others


async def test_messages_keep_their_order_across_a_closed_and_reopened_link() -> None:
    """Rank 0 sends to ranks 1..n-1 in turn, many rounds: with a budget of 4 nearly every
    send closes one link and opens another, and what arrives on the new link may overtake
    the tail of the old one; every receiver still gets every message, in order."""
    n, rounds, per = 8, 6, 5
    together = Together(n)

    async def fn(g: p2pcoll.Group) -> int:
        if g.rank == 0:
            for r in range(rounds):
                for dst in range(1, n):
                    for i in range(per):
                        await g.send(np.full(16, float(r * per + i)), dst, tag=7)
            closed = g.stats()["links_closed"]
        else:
            for k in range(rounds * per):
                got = await g.recv(0, tag=7)
                assert np.all(got == k), (g.rank, k, got[:2])
            closed = 0
        await together.done()
        return closed

    kw = budget_peers(n)
    results = await run_ranks(n, fn, host_ids=kw.pop("host_ids"), **kw)
    assert results[0] >= rounds * (n - 1 - BUDGET), results


async def test_an_inquiry_to_every_peer_keeps_the_budget(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 alone starts an allreduce and its deadline passes: it asks every other peer
    why (a control message to each, most over links it does not have). Under a budget of 4
    those go as room comes, a link opening as another drains, so rank 0 never holds more
    than the budget and one draining link; every peer still answers (all are named as not
    having started it) and nothing is lost."""
    from p2pcoll.session import blame

    # The inquiry ends once every peer answered; the half second its 1 s deadline gives it
    # was too short for eleven answers through four links on a loaded host.
    monkeypatch.setattr(blame, "inquiry_time", lambda limit: 30.0)
    n = 12
    together = Together(n)

    async def fn(g: p2pcoll.Group) -> dict[str, object]:
        routes = g.session.transport.routes
        most, error = 0, None
        if g.rank == 0:
            async def sample() -> None:
                nonlocal most
                while True:
                    most = max(most, len(routes.routes) + len(routes.draining))
                    await asyncio.sleep(0)

            sampler = asyncio.create_task(sample())
            try:
                await g.allreduce(np.ones(4), timeout=1.0)
            except p2pcoll.CollectiveTimeout as exc:
                error = str(exc)
            finally:
                sampler.cancel()
        stats = g.stats()
        await together.done()
        return {"most": most, "error": error, "closed": stats["links_closed"],
                "dropped": stats["messages_dropped"]}

    kw = budget_peers(n)
    results = await run_ranks(n, fn, host_ids=kw.pop("host_ids"), **kw)
    first = results[0]
    # Every peer answered: the one rank 0 waits for is blamed, the others listed.
    assert first["error"] is not None and "rank 1 has not started it" in first["error"], first
    assert f"not started: ranks {', '.join(map(str, range(2, n)))}" in first["error"], first
    assert "did not answer" not in first["error"], first
    assert first["closed"] >= n - 1 - BUDGET, first  # the inquiry churned its links
    assert first["most"] <= BUDGET + 1, first
    assert all(r["dropped"] == 0 for r in results), results


def test_a_bad_budget_is_refused_by_name() -> None:
    for bad in ("2", "-1", "x", "1.5"):
        with pytest.raises(p2pcoll.SettingsError, match="P2PCOLL_MAX_LINKS"):
            p2pcoll.Settings.resolve({"P2PCOLL_MAX_LINKS": bad})
    with pytest.raises(p2pcoll.SettingsError, match="max_links="):
        p2pcoll.Settings.resolve({}, max_links=3)
    assert p2pcoll.Settings.resolve({"P2PCOLL_MAX_LINKS": "0"}).max_links == 0
    assert p2pcoll.Settings.resolve({"P2PCOLL_MAX_LINKS": "4"}).max_links == 4


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 40), st.data())
def test_every_live_rank_stays_watched_whoever_has_gone(size: int, data: st.DataObject) -> None:
    gone = data.draw(st.sets(st.integers(0, size - 1), max_size=size - 1))
    live = [r for r in range(size) if r not in gone]
    watched_by: dict[int, set[int]] = {r: set() for r in live}
    for r in live:
        mine = overlay.watched(r, size, gone=gone)
        assert not set(mine) & gone and r not in mine
        for peer in mine:
            watched_by[peer].add(r)
    for r in live:
        assert watched_by[r] == set(overlay.watchers(r, size, gone=gone))
        assert len(watched_by[r]) == min(overlay.WATCHED, len(live) - 1)


async def test_a_run_of_consecutive_ranks_lost_at_once_is_found_one_after_another() -> None:
    """Ranks 5, 6 and 7 crash together: 7's watchers (5 and 6) are gone with it, so no probe
    of the formed group watches it. Rank 4, which watched 5 and 6, watches 7 and 8 in their
    place; its new probe cannot reach 7's port, and every survivor learns of all three well
    before the collective's deadline (60 s)."""
    victims = {5, 6, 7}
    died = asyncio.Event()
    together = Together(N - len(victims))
    crashed = Together(len(victims))

    async def fn(g: p2pcoll.Group) -> float:
        await g.allreduce(np.ones(4), strategy="ring")
        if g.rank in victims:
            await g.session.transport.aclose()  # no goodbye: gone as a crash would be
            await crashed.done()
            died.set()
            return 0.0
        await died.wait()
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(p2pcoll.PeerLost) as lost:
            await g.allreduce(np.ones(4), strategy="ring", timeout=60)
        assert lost.value.rank in victims
        while not victims <= set(g.session.peers.gone()) and loop.time() < start + 60:
            await asyncio.sleep(0.05)
        took = loop.time() - start
        await together.done()
        return took

    results = await asyncio.wait_for(
        run_ranks(N, fn, transport="ipc", heartbeat_timeout=2), 120)
    survivors = [t for r, t in enumerate(results) if r not in victims]
    assert max(survivors) < 30, survivors  # named by probes and news, not a deadline
