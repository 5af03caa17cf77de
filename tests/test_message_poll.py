"""A receive takes in what has come before it parks (what ``Transport.connect`` returns, issue 37).

The matcher calls the transport's poll (``Matcher.poll``) when the message it needs is not buffered yet:
what poll brings is returned without parking (no future, no turn of the event loop), an
abort or a departure it brings fails the receive at once, and a receive whose message has
not come parks as before. Over real sockets (tcp, ranks on different hosts, so no shared
memory), messages stay in their sender's order and results stay exact.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pytest

from p2pcoll.engine.matching import Key, Matcher
from p2pcoll.errors import P2PCollError, PeerLost
from p2pcoll.testing import run_ranks
from p2pcoll.transport.base import BytesPiece, Piece
from p2pcoll.transport.lane_poll import LanePoll
from p2pcoll.types import Membership, OpKey
from p2pcoll.wire import Header

GROUP = "g"


class _Record:
    """Departures with nobody gone, until :attr:`gone_rank` is set."""

    def __init__(self) -> None:
        self.membership = Membership(GROUP, 0, 0, 2, ("inproc://a", "inproc://b"))
        self.gone_rank: int | None = None

    def lost(self, rank: int) -> PeerLost | None:
        return PeerLost(f"rank {rank} is gone", rank) if rank == self.gone_rank else None

    def abandoned(self, rank: int, seq: int) -> bool:
        return rank == self.gone_rank

    def gone(self) -> Mapping[int, object]:
        return {} if self.gone_rank is None else {self.gone_rank: True}


def _message(seq: int, step: int = 0) -> tuple[Header, list[Piece]]:
    return Header("data", GROUP, 1, seq, 0, step, nbytes=[3]), [BytesPiece(b"abc")]


def _run_without_parking(matcher: Matcher, key: Key) -> object:
    """Run ``matcher.get(key)`` one step: its result if it returns without suspending."""
    coro = matcher.get(key)
    with pytest.raises(StopIteration) as stop:
        coro.send(None)
    return stop.value.value


def test_a_message_that_poll_brings_is_returned_without_parking() -> None:
    header, frames = _message(seq=0)
    polls: list[int] = []

    def poll() -> None:
        polls.append(1)
        matcher.put(header, frames)

    matcher = Matcher(_Record())
    matcher.poll = poll
    got = _run_without_parking(matcher, (OpKey(0), 0, 1, 0))
    assert got == (header, frames)
    assert polls == [1]
    assert matcher.stats() == {"buffered": 0, "waiting": 0}


def test_a_buffered_message_needs_no_poll() -> None:
    polls: list[int] = []
    matcher = Matcher(_Record())
    matcher.poll = lambda: polls.append(1)
    header, frames = _message(seq=0)
    matcher.put(header, frames)
    assert _run_without_parking(matcher, (OpKey(0), 0, 1, 0)) == (header, frames)
    assert polls == []


def test_an_abort_that_poll_brings_fails_the_receive_at_once() -> None:
    error = P2PCollError("rank 1 failed collective #0")
    matcher = Matcher(_Record())
    matcher.poll = lambda: matcher.fail(OpKey(0), error)
    coro = matcher.get((OpKey(0), 0, 1, 0))
    with pytest.raises(P2PCollError) as raised:
        coro.send(None)
    assert raised.value is error


def test_a_departure_that_poll_brings_fails_the_receive_at_once() -> None:
    record = _Record()

    def poll() -> None:
        record.gone_rank = 1

    matcher = Matcher(record)
    matcher.poll = poll
    coro = matcher.get((OpKey(0), 0, 1, 0))
    with pytest.raises(PeerLost):
        coro.send(None)


async def test_a_receive_whose_message_has_not_come_parks_and_gets_it_later() -> None:
    import asyncio

    matcher = Matcher(_Record())
    matcher.poll = lambda: None
    key = (OpKey(0), 0, 1, 0)
    task = asyncio.create_task(matcher.get(key))
    await asyncio.sleep(0)
    assert not task.done() and matcher.stats()["waiting"] == 1
    header, frames = _message(seq=0)
    matcher.put(header, frames)
    assert await task == (header, frames)


async def test_over_tcp_messages_keep_their_order_and_results_stay_exact() -> None:
    count = 200

    async def job(group):  # type: ignore[no-untyped-def]
        got = []
        if group.rank == 1:
            for i in range(count):
                await group.send(np.full(64, i, np.int64), dst=0)
        else:
            for _ in range(count):
                got.append(int((await group.recv(src=1))[0]))
        total = []
        for i in range(count):
            x = np.arange(1024, dtype=np.float32) * (group.rank + 1) + i
            total.append(await group.allreduce(x))
        return got, total, group.session.matcher.poll

    results = await run_ranks(2, job, host_ids=["a", "b"], transport="tcp")
    assert results[0][0] == list(range(count))
    for i in range(count):
        expected = np.arange(1024, dtype=np.float32) * 3 + 2 * i
        for rank in range(2):
            np.testing.assert_array_equal(results[rank][1][i], expected)
    for _, _, poll in results:
        # Lanes are on (no job key, two hosts): the ROUTER's poll and the lanes' together,
        # not a stand-in.
        assert isinstance(poll, LanePoll)
        assert type(poll._router.__self__).__name__ == "Router"  # type: ignore[attr-defined]
        assert poll() is None  # the group has closed: nothing to read, nothing raised
