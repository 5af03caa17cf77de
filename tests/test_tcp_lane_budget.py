"""TCP lanes under a link budget (``max_links``): a lane goes with its link when the budget
closes the link, and a new one opens with the next link (its hello names a new token).
Real peers on "different hosts" (tcp only, lanes on) in one process, talking to partners
that change all the time: every message arrives, in order, and no peer holds more links
or lanes than its budget."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

import numpy as np
import pytest

import p2pcoll
from p2pcoll.testing import run_ranks
from p2pcoll.transport import tcp_lane

BUDGET = 4


@pytest.fixture(autouse=True)
def tcp_lanes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("P2PCOLL_TCP_LANES", "1")
    monkeypatch.setenv("P2PCOLL_SHM", "0")


def _peers(n: int) -> dict[str, object]:
    return {"max_links": BUDGET, "collective_timeout": 30, "transport": "tcp",
            "host_ids": [f"h{r}" for r in range(n)]}


def _held(g: p2pcoll.Group) -> tuple[int, int, int]:
    """(links open, and draining too, this peer's lanes to others open)."""
    t = g.session.transport
    far = t._local.far
    return t.links, t.routes.held(), 0 if far is None else len(far.out)


async def test_partners_that_change_keep_links_and_lanes_within_the_budget() -> None:
    """Round k: rank r sends ``per`` messages to r + k and receives as many from r - k,
    twice over, for every shift k: links open and close for the budget all the time, and
    lanes with them. Every message is exact and in order; no peer ever holds more than
    its budget of links or lanes; some messages did go on lanes."""
    n, per = 8, 12
    done = asyncio.Event()
    finished = [0]

    async def fn(g: p2pcoll.Group) -> dict[str, int]:
        most_links = most_held = most_lanes = 0

        def sample() -> None:
            nonlocal most_links, most_held, most_lanes
            links, held, lanes = _held(g)
            most_links, most_held = max(most_links, links), max(most_held, held)
            most_lanes = max(most_lanes, lanes)

        for shift in range(1, n):
            for again in range(2):
                dst, src = (g.rank + shift) % n, (g.rank - shift) % n
                stamp = 1000 * shift + 100 * again

                async def send() -> None:
                    for i in range(per):
                        await g.send(np.full(32, float(stamp + i + g.rank)), dst, tag=3)
                        sample()

                async def receive() -> None:
                    for i in range(per):
                        got = await g.recv(src, tag=3)
                        assert np.all(got == stamp + i + src), (g.rank, src, i, got[:2])
                        sample()

                await asyncio.gather(send(), receive())
        total = await g.allreduce(np.ones(4), strategy="ring")
        assert np.all(total == n)
        stats = g.stats()
        finished[0] += 1
        if finished[0] == n:
            done.set()
        await done.wait()
        return {"links": most_links, "held": most_held, "lanes": most_lanes,
                "closed": stats["links_closed"],
                "on_lanes": stats["messages_sent_lane"],
                "dropped": stats["messages_dropped"], "refused": stats["links_refused"]}

    kw = _peers(n)
    results = await run_ranks(n, fn, host_ids=kw.pop("host_ids"), **kw)
    for rank, r in enumerate(results):
        assert r["links"] <= BUDGET, (rank, r)
        assert r["held"] <= BUDGET + 1, (rank, r)  # and at most one link draining
        assert r["lanes"] <= BUDGET, (rank, r)
        assert r["closed"] > 0, (rank, r)
        assert r["dropped"] == 0 and r["refused"] == 0, (rank, r)
    assert sum(r["on_lanes"] for r in results) > 0, results


async def test_a_root_sending_in_turn_keeps_order_across_lanes_that_close_and_reopen() -> None:
    """Rank 0 sends to ranks 1..n-1 in turn, many rounds, each message waited for by its
    receiver before the next round: nearly every round closes links (and their lanes) and
    opens others, and each new link's lane is connected anew. Every receiver gets every
    message in order, and messages went on lanes in later rounds too (new lanes)."""
    n, rounds, per = 7, 6, 8
    done = asyncio.Event()
    finished = [0]

    async def fn(g: p2pcoll.Group) -> dict[str, int]:
        lanes_by_round = []
        most_links = 0
        for r in range(rounds):
            if g.rank == 0:
                for dst in range(1, n):
                    for i in range(per):
                        await g.send(np.full(8, float(r * per + i)), dst, tag=5)
                        most_links = max(most_links, _held(g)[0])
                        assert _held(g)[1] <= BUDGET + 1  # and at most one draining
                lanes_by_round.append(g.stats()["messages_sent_lane"])
            else:
                for i in range(per):
                    got = await g.recv(0, tag=5)
                    assert np.all(got == r * per + i), (g.rank, r, i, got[:2])
            await g.barrier()  # the lanes of the next round connect while links churn
        stats = g.stats()
        finished[0] += 1
        if finished[0] == n:
            done.set()
        await done.wait()
        late = lanes_by_round[-1] - lanes_by_round[rounds // 2] if lanes_by_round else 0
        return {"links": most_links, "closed": stats["links_closed"], "late": late,
                "dropped": stats["messages_dropped"]}

    kw = _peers(n)
    results = await run_ranks(n, fn, host_ids=kw.pop("host_ids"), **kw)
    root = results[0]
    assert root["links"] <= BUDGET, root
    assert root["closed"] >= rounds * (n - 1 - BUDGET), root
    assert root["late"] > 0, root  # lanes opened again after their links had closed
    assert all(r["dropped"] == 0 for r in results), results


async def _until(check: Callable[[], bool]) -> None:
    for _ in range(1000):
        if check():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("not within 5 s")


async def test_a_retired_lane_ends_quietly_after_its_records_and_a_new_token_opens_another(
) -> None:
    """Two peers' TcpLanes over real sockets: a lane named and retired before its receiver
    connected ends at once, quietly; the next token gives a working lane; a lane retired
    with records in it hands them all on before it ends; no side is told of a failure or
    counts a refusal, whichever closes first."""
    told: list[object] = []
    got: list[bytes] = []
    a = tcp_lane.TcpLanes(0, {1: "tcp://127.0.0.1:1"}, "tcp://127.0.0.1:0",
                          arrived=told.append, broken=lambda *w: told.append(w),
                          inbound=lambda *_: None, refused=lambda: told.append("refused"))

    def arrived(peer: int) -> None:
        while (record := b.into[peer].read()) is not None:
            got.append(bytes(record[0]))

    b = tcp_lane.TcpLanes(1, {0: "tcp://127.0.0.1:1"}, "tcp://127.0.0.1:0",
                          arrived=arrived, broken=lambda *w: told.append(w),
                          inbound=lambda *_: None, refused=lambda: told.append("refused"))
    try:
        stale = a.announce(1)["tcp_lane"]
        a.retire(1)  # before b connected: the lane its token gets ends at once
        b.accept(0, stale)
        await _until(lambda: 0 in b.into and b.into[0].closed)
        assert a.ready(1) is None
        fresh = a.announce(1)["tcp_lane"]
        assert fresh != stale
        b.accept(0, fresh)
        b.accept(0, fresh)  # the same hello again: nothing new
        await _until(lambda: a.ready(1) is not None)
        out = a.ready(1)
        assert out is not None
        for i in range(50):
            assert out.write([b"m%d" % i])
        a.retire(1)  # its records are read before it ends
        assert a.ready(1) is None and not out.write([b"late"])
        await _until(lambda: out.closed and b.into[0].closed)
        assert got == [b"m%d" % i for i in range(50)]
        again = a.announce(1)["tcp_lane"]
        b.accept(0, again)
        await _until(lambda: a.ready(1) is not None)
        assert told == [], told
    finally:
        a.close()
        b.close()


async def test_a_retired_lane_whose_receiver_never_closes_is_closed_after_a_while(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A receiver that keeps its end of a retired lane open (never reads its end, never
    closes) does not hold the sender's socket for ever: it goes after RETIRED_S."""
    monkeypatch.setattr(tcp_lane, "RETIRED_S", 0.2)
    told: list[object] = []
    a = tcp_lane.TcpLanes(0, {1: "tcp://127.0.0.1:1"}, "tcp://127.0.0.1:0",
                          arrived=told.append, broken=lambda *w: told.append(w),
                          inbound=lambda *_: None, refused=lambda: told.append("refused"))
    port, token = a.announce(1)["tcp_lane"].split(":")
    raw = socket.create_connection(("127.0.0.1", int(port)))
    try:
        raw.sendall(tcp_lane.MAGIC + bytes.fromhex(token))
        await _until(lambda: a.ready(1) is not None)
        out = a.ready(1)
        assert out is not None and out.write([b"never read"])
        a.retire(1)
        await asyncio.sleep(0.05)
        assert not out.closed  # it waits for the receiver's end for a while
        await _until(lambda: out.closed)
        assert a._retiring == [] and told == [], told
    finally:
        raw.close()
        a.close()
