"""An honest client's re-sent join is never taken for a flood (issue 23; helper G's runs of
64 processes saw one honest peer in about eight runs rejected by the rate bound).

A client re-sends its join every ``RESEND`` seconds while it waits. Whatever delays those
re-sends on their way (a host that binds its port late: ZeroMQ queues what the client sends
until it connects; a server whose event loop stalls: the socket queues them) delivers them
in one burst, larger than the rate bound's burst once the delay is long enough (at the
default 20 per second, a host that binds 11 s after a peer started gets 22 copies of its
join at once). Over the bound, the server takes a request that repeats the last one of its
connection byte for byte for a re-send of it: not handled (the answer to the first stands),
counted, not refused. A connection that sends many distinct requests, or garbage, is still
held to ``P2PCOLL_RENDEZVOUS_RATE`` and told so by name.

Each test makes the burst happen for certain: a rate bound of 3 requests per second (an
honest client sends 2) and a delay of 2.5 s queue five or six copies of a join; one test
runs the default bound of 20 and a host 11 s late, as G's runs had it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import zmq
import zmq.asyncio

from p2pcoll.rendezvous import RendezvousServer
from p2pcoll.rendezvous.client import rendezvous
from p2pcoll.rendezvous.protocol import RESEND
from p2pcoll.settings import RendezvousLimits
from p2pcoll.testing import free_port
from p2pcoll.types import Membership
from p2pcoll.wire import WIRE_VERSION

TIGHT = RendezvousLimits(rate=3.0)  # bursts of 3: just above an honest client's 2 per second
DELAY_S = 2.5  # how long the re-sends are held up: five or six of them queue


def first(host: str, endpoints: list[str]) -> str:
    return endpoints[0]


async def client(url: str, rank: int, world_size: int = 2) -> Membership:
    return await rendezvous(url, endpoints=[f"tcp://127.0.0.1:{10000 + rank}"],
                            world_size=world_size, rank=rank, timeout=30.0,
                            host_id="here", choose=first)


@pytest.mark.parametrize(("limits", "late_s"), [
    pytest.param(TIGHT, DELAY_S, id="rate-3"),
    pytest.param(RendezvousLimits(), 11.0, id="default-rate", marks=pytest.mark.slow),
])
async def test_a_host_that_binds_late_gets_every_resend_at_once_and_forms(
        limits: RendezvousLimits, late_s: float) -> None:
    """The peers start first and re-send while nothing listens; ZeroMQ delivers what
    queued the moment the host binds. (Before: the host's bucket, of 3 or of 20, rejected
    rank 1: "more than 20 requests per second from this connection".)"""
    url = f"tcp://127.0.0.1:{free_port()}"
    early = asyncio.create_task(client(url, rank=1))
    await asyncio.sleep(late_s)
    server = RendezvousServer(url, limits=limits)
    server.bind()
    queued = int(late_s / RESEND)  # at least
    try:
        deadline = time.monotonic() + 30
        while server.stats()["requests"] < queued and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)
        stats = server.stats()  # the burst has been read...
        assert stats["requests"] > limits.rate, stats
        assert stats["peers"] == 1 and stats["dropped"] == 0, stats  # ...as one request
        assert stats["resends"] >= 1, stats  # over the bound: copies, not refused
        members = await asyncio.gather(early, client(url, rank=0))
    finally:
        early.cancel()
        await asyncio.gather(early, return_exceptions=True)
        await server.aclose()
    assert [m.rank for m in members] == [1, 0]
    assert members[0].group_id == members[1].group_id


def _serve_in_a_thread(server: RendezvousServer) -> tuple[asyncio.AbstractEventLoop, str,
                                                           threading.Thread]:
    """Run ``server`` in an event loop of its own, in a thread, so that its loop can be
    stalled while the clients' loop (the test's) goes on."""
    loop = asyncio.new_event_loop()
    bound: list[str] = []
    ready = threading.Event()

    def run() -> None:
        asyncio.set_event_loop(loop)

        async def start() -> None:
            bound.append(server.bind())
            ready.set()

        loop.run_until_complete(start())
        loop.run_forever()
        loop.run_until_complete(server.aclose())
        loop.close()

    thread = threading.Thread(target=run, name="rendezvous", daemon=True)
    thread.start()
    assert ready.wait(30), "the rendezvous thread did not start"
    return loop, bound[0], thread


@pytest.fixture
def stallable() -> Iterator[tuple[RendezvousServer, asyncio.AbstractEventLoop, str]]:
    server = RendezvousServer("tcp://127.0.0.1:0", limits=TIGHT)
    loop, url, thread = _serve_in_a_thread(server)
    try:
        yield server, loop, url
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)


async def test_a_server_whose_loop_stalls_reads_the_resends_in_one_burst(
        stallable: tuple[RendezvousServer, asyncio.AbstractEventLoop, str]) -> None:
    """The server's loop is held (as 64 processes on 2 cores held it) while a registered
    peer keeps re-sending; the queued copies arrive together. (Before: rejected.)"""
    server, loop, url = stallable
    waiter = asyncio.create_task(client(url, rank=1))
    try:
        while server.stats()["peers"] == 0:  # registered: its re-sends now queue
            await asyncio.sleep(0.05)
        requests = server.stats()["requests"]
        loop.call_soon_threadsafe(time.sleep, DELAY_S)  # the stall
        await asyncio.sleep(DELAY_S + 1.0)  # the stall ends and the burst is read
        stats = server.stats()
        assert stats["requests"] - requests >= 5, stats  # the burst came
        assert stats["peers"] == 1 and stats["dropped"] == 0, stats
        assert stats["resends"] >= 1, stats  # over the bound: copies, not refused
        assert not waiter.done(), "the waiting peer was rejected"
        members = await asyncio.gather(waiter, client(url, rank=0))
    finally:
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
    assert sorted(m.rank for m in members) == [0, 1]


# --- one connection, raw requests ---------------------------------------------------------

def _join(**fields: Any) -> bytes:
    return msgpack.packb({"v": WIRE_VERSION, "op": "join", "job": "", "rank": 1,
                          "world_size": 2, "endpoints": ["tcp://127.0.0.1:1"], "host": "here",
                          "pid": 1, "token": "t", "heartbeat": 5.0, "order": None,
                          "min": None, "max": None, **fields})


async def _burst(url: str, requests: list[bytes], listen: float = 1.5
                 ) -> list[dict[str, Any]]:
    """Send ``requests`` at once from one connection; the replies that come back."""
    sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(url)
    try:
        for raw in requests:
            await sock.send(raw)
        replies = []
        while await sock.poll(int(listen * 1000)):
            replies.append(msgpack.unpackb(await sock.recv(), raw=False))
        return replies
    finally:
        sock.close()


async def test_a_burst_of_one_request_is_answered_as_that_request_once() -> None:
    """200 copies of one join at the default bound (bursts of 20): the peer is registered
    once and told its status for each copy within the bound; the others are counted as
    re-sends, not handled, and nothing is refused."""
    server = RendezvousServer("tcp://127.0.0.1:0")
    url = server.bind()
    try:
        replies = await _burst(url, [_join()] * 200)
        stats = server.stats()
    finally:
        await server.aclose()
    assert replies and all(r["op"] == "status" for r in replies), replies
    assert replies[0]["arrived"] == 1 and replies[0]["missing"] == [0]
    assert 20 <= len(replies) < 150, len(replies)  # a burst of 20, and what refilled meanwhile
    assert stats["requests"] == 200 and stats["peers"] == 1 and stats["dropped"] == 0, stats
    assert stats["resends"] == 200 - len(replies), stats


async def test_a_flood_of_distinct_requests_is_held_to_the_rate_and_told() -> None:
    """200 different requests (joins for different jobs) from one connection: the first
    20 are handled, then the connection is over the bound, which the error names."""
    server = RendezvousServer("tcp://127.0.0.1:0")
    url = server.bind()
    try:
        replies = await _burst(url, [_join(job=f"job-{i}") for i in range(200)])
        stats = server.stats()
    finally:
        await server.aclose()
    errors = [r for r in replies if r["op"] == "error"]
    answered = len(replies) - len(errors)
    assert errors and all("P2PCOLL_RENDEZVOUS_RATE" in e["reason"]
                          and "more than 20 requests per second" in e["reason"]
                          for e in errors), errors
    assert 20 <= answered < 150, answered  # a burst of 20, and what refilled meanwhile
    assert stats["dropped"] == 200 - answered, stats


async def test_a_flood_of_garbage_is_held_to_the_rate_and_told() -> None:
    """Garbage (different every time, so no copy of a request) is dropped unanswered while
    under the bound; over it, the connection is told which bound it passed."""
    server = RendezvousServer("tcp://127.0.0.1:0")
    url = server.bind()
    try:
        replies = await _burst(url, [b"\xc1garbage %d" % i for i in range(200)])
        stats = server.stats()
    finally:
        await server.aclose()
    assert replies and all(r["op"] == "error" and "P2PCOLL_RENDEZVOUS_RATE" in r["reason"]
                           for r in replies), replies
    assert stats["dropped"] == 200 and stats["peers"] == 0, stats


async def test_a_changed_request_is_a_new_one() -> None:
    """A request is a re-send only while it repeats the connection's last one: a client
    that alternates two requests is over the bound, and told."""
    server = RendezvousServer("tcp://127.0.0.1:0", limits=TIGHT)
    url = server.bind()
    try:
        replies = await _burst(url, [_join(), _join(order=7)] * 10)
    finally:
        await server.aclose()
    assert any(r["op"] == "error" and "P2PCOLL_RENDEZVOUS_RATE" in r["reason"]
               for r in replies), replies

