"""One deadline watchdog per group instead of a timer per collective, and no future for a
message nobody waits for: the deadlines still fire, in order, each naming its collective;
cancellation from outside is still a cancellation; nothing piles up."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
import pytest

import p2pcoll
from p2pcoll.testing import memory_groups, run_ranks


async def test_concurrent_collectives_expire_in_order_each_with_its_own_timeout() -> None:
    async def fn(g: p2pcoll.Group) -> Any:
        if g.rank == 1:
            await asyncio.sleep(2.5)  # never takes part
            return None
        started = time.monotonic()

        async def one(limit: float) -> tuple[float, BaseException]:
            try:
                await g.allreduce(np.ones(4), strategy="ring", timeout=limit)
            except p2pcoll.P2PCollError as exc:
                return time.monotonic() - started, exc
            raise AssertionError("no timeout")

        # Started together, shortest deadline last: the watchdog orders them.
        return await asyncio.gather(one(1.2), one(0.9), one(0.3))

    results = await run_ranks(2, fn, transport="ipc", return_exceptions=True)
    ends = results[0]
    first = ends[2][1]
    assert isinstance(first, p2pcoll.CollectiveTimeout), repr(first)
    assert first.seq == 2 and "timed out after 0.3s" in str(first)
    assert 0.25 < ends[2][0] < 0.3 + 1.2, ends  # its own deadline (plus the inquiry)
    for _, err in ends[:2]:  # the group broke at the first: the others end with it
        assert isinstance(err, p2pcoll.P2PCollError)


async def test_an_outside_cancellation_is_not_a_timeout() -> None:
    groups = await memory_groups(2, collective_timeout=30)
    try:
        task = asyncio.create_task(groups[0].allreduce(np.ones(3)))  # rank 1 never comes
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert groups[0].state is p2pcoll.GroupState.BROKEN
        assert not isinstance(groups[0].cause, p2pcoll.CollectiveTimeout)
    finally:
        await asyncio.gather(*(g.close() for g in groups))


async def test_ten_thousand_collectives_leave_nothing_behind() -> None:
    groups = await memory_groups(2)
    try:
        async def rank(g: p2pcoll.Group) -> tuple[int, int, int]:
            x = np.ones(2, np.int64)
            for _ in range(5000):
                await g.allreduce(x, out=x)
            for _ in range(5000):
                await g.send(x, dst=1 - g.rank) if g.rank == 0 else await g.recv(src=0)
            loop = asyncio.get_running_loop()
            matcher = g.session.matcher
            return (len(g._failures._watchdog), len(loop._scheduled),  # type: ignore[attr-defined]
                    len(matcher._first) + len(matcher._first_header))

        for watched, timers, firsts in await asyncio.gather(*(rank(g) for g in groups)):
            assert watched == 0 and firsts == 0
            assert timers <= 4  # the watchdog's one timer and the transports' own
    finally:
        await asyncio.gather(*(g.close() for g in groups))


async def test_a_plain_allreduce_creates_no_future_for_its_first_message() -> None:
    groups = await memory_groups(3)
    try:
        async def rank(g: p2pcoll.Group) -> int:
            await g.allreduce(np.ones(4), strategy="ring")
            return len(g.session.matcher._first)

        assert await asyncio.gather(*(rank(g) for g in groups)) == [0, 0, 0]
    finally:
        await asyncio.gather(*(g.close() for g in groups))


async def test_no_timeout_means_no_deadline() -> None:
    import math

    groups = await memory_groups(2, collective_timeout=math.inf)
    try:
        await asyncio.gather(*(g.allreduce(np.ones(2)) for g in groups))
        assert all(len(g._failures._watchdog) == 0 for g in groups)
    finally:
        await asyncio.gather(*(g.close() for g in groups))
