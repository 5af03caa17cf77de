"""Errors of failed collectives in the user's terms (issue 35): what the first line of the
message says, and no internal exception chain in the traceback the user sees."""

from __future__ import annotations

import asyncio
import traceback

import numpy as np
import pytest

import p2pcoll
from p2pcoll.rendezvous import RendezvousServer
from p2pcoll.testing import memory_groups
from p2pcoll.transport.memory import MemoryNetwork
from p2pcoll.types import OpKey
from p2pcoll.wire.header import readable_data
from conftest import until_waiting


def first_line(err: BaseException) -> str:
    return str(err).splitlines()[0]


def shown(err: BaseException) -> str:
    """The traceback as the user sees it."""
    return "".join(traceback.format_exception(err))


async def test_a_dtype_mismatch_names_numpy_types_not_type_codes() -> None:
    groups = await memory_groups(2, collective_timeout=30)
    try:
        errors = await asyncio.gather(
            groups[0].allreduce(np.ones(4, np.float32)),
            groups[1].allreduce(np.ones(4, np.float64)), return_exceptions=True)
    finally:
        await asyncio.gather(*(g.close() for g in groups))
    for err in errors:
        assert isinstance(err, p2pcoll.CollectiveMismatch), repr(err)
        line = first_line(err)
        assert ("data: rank 0 has float32[4], rank 1 has float64[4]" in line
                or "data: rank 1 has float64[4], rank 0 has float32[4]" in line), line
        assert "<f" not in line and "*|" not in line, line


@pytest.mark.parametrize(("data", "text"), [
    ("*|<f4(4,)", "float32[4]"),
    ("*|<i8(2, 3),|u1(0,)", "int64[2, 3], uint8[0]"),
    ("*|<f8()", "float64 scalar"),
    ("['t', ['*', '*']]|<f2(2,),<c8(1,)", "float16[2], complex64[1] in pytree ['t', ['*', '*']]"),
    ("3 arrays, layout digest 0011", "3 arrays, layout digest 0011"),
    ("*|<x9(1,)", "'*|<x9(1,)'"),  # not what describe_data writes: shown as it came
])
def test_signature_data_reads_in_numpy_names(data: str, text: str) -> None:
    assert readable_data(data) == text


async def test_a_killed_peer_is_gone_without_closing_and_no_cancellation_shows() -> None:
    network = MemoryNetwork()
    groups = await memory_groups(2, network=network, collective_timeout=30)
    try:
        running = asyncio.create_task(groups[0].allreduce(np.ones(4)))
        await until_waiting(groups[0], 0)
        network.cut(groups[0].membership.endpoints[1])
        with pytest.raises(p2pcoll.PeerLost) as caught:
            await running
    finally:
        await asyncio.gather(*(g.close() for g in groups))
    line = first_line(caught.value)
    assert line.startswith("rank 1 (mem://") and "is gone without closing the group: its " \
        "process was killed or crashed, or it stopped answering" in line, line
    assert caught.value.rank == 1
    assert "CancelledError" not in shown(caught.value)


async def test_a_peer_that_closes_normally_says_so() -> None:
    groups = await memory_groups(2, collective_timeout=30)
    try:
        running = asyncio.create_task(groups[0].allreduce(np.ones(4)))
        await until_waiting(groups[0], 0)
        await groups[1].close()
        with pytest.raises(p2pcoll.PeerLost) as caught:
            await running
    finally:
        await asyncio.gather(*(g.close() for g in groups))
    assert first_line(caught.value) == "rank 1 left the group: it closed it normally"
    assert caught.value.how == "closed" and caught.value.rank == 1
    assert "CancelledError" not in shown(caught.value)


@pytest.mark.parametrize("in_flight", [False, True])
async def test_a_peer_whose_program_crashed_is_named_as_crashed(in_flight: bool) -> None:
    """Rank 1's program raises inside ``async with join(...)`` (while in a collective of
    its own, or between two); rank 0's allreduce says that rank 1 crashed, and why."""
    server = RendezvousServer("tcp://127.0.0.1:0")
    url = server.bind()
    waiting = asyncio.Event()
    receives: list[asyncio.Task[object]] = []
    crashers: list[p2pcoll.Group] = []

    async def survivor() -> BaseException:
        async with p2pcoll.join(url, world_size=2, rank=0, timeout=30,
                                collective_timeout=30) as g:
            await g.barrier()
            running = asyncio.create_task(g.allreduce(np.ones(4), strategy="ring"))
            await until_waiting(g, 1)
            waiting.set()
            with pytest.raises(p2pcoll.PeerLost) as caught:
                await running
            return caught.value

    async def crasher() -> None:
        async with p2pcoll.join(url, world_size=2, rank=1, timeout=30,
                                collective_timeout=30) as g:
            crashers.append(g)
            await g.barrier()
            await waiting.wait()
            if in_flight:  # a receive from rank 0, which never sends
                receives.append(asyncio.create_task(g.recv(0, tag=5)))
                while not g.session.matcher.waiting_on(OpKey.transfer(0, 1, 5, 0)):
                    await asyncio.sleep(0.005)
            raise ValueError("boom\nsecond line")

    try:
        results = await asyncio.gather(survivor(), crasher(), return_exceptions=True)
    finally:
        await server.aclose()
    err, crashed = results
    for receive in receives:  # ended by the close, here
        with pytest.raises(p2pcoll.GroupBroken):
            await receive
    assert isinstance(crashed, ValueError), repr(crashed)
    assert isinstance(err, p2pcoll.PeerLost), repr(err)
    expected = ("rank 1 crashed (ValueError: boom) during recv #0 from rank 0 to rank 1 "
                "with tag 5" if in_flight
                else "rank 1 crashed (ValueError: boom) and closed the group")
    assert expected in first_line(err), first_line(err)
    assert err.rank == 1 and err.origin == 1  # reported by rank 1 itself
    own = crashers[0].cause  # what rank 1 itself says broke its group
    assert isinstance(own, p2pcoll.PeerLost) and own.how == "crashed" and own.origin is None
    assert "CancelledError" not in shown(err)
