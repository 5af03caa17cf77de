"""One deadline watchdog per group instead of a timer per collective, and no future for a
message nobody waits for: the deadlines still fire, in order, each naming its collective;
cancellation from outside is still a cancellation; nothing piles up."""

from __future__ import annotations

import asyncio
import gc
import time
import weakref
from typing import Any

import numpy as np
import pytest

import p2pcoll
from p2pcoll.testing import memory_groups, run_ranks
from p2pcoll.types import OpKey


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


@pytest.mark.slow
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
            # a constant few, whatever the count of collectives: per group the watchdog's
            # timer, the departures machine's tick and the memory probes' (one per watched
            # peer)
            assert timers <= 8
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


async def test_a_timeout_names_the_rank_that_never_calls() -> None:
    groups = await memory_groups(3, collective_timeout=0.5)
    try:
        calls = [g.allreduce(np.ones(5), strategy="ring") for g in groups[:2]]  # rank 2 never
        errors = await asyncio.gather(*calls, return_exceptions=True)
        for err in errors:
            assert isinstance(err, p2pcoll.CollectiveTimeout), repr(err)
            assert err.seq == 0 and err.waiting_on == [2], err
    finally:
        await asyncio.gather(*(g.close() for g in groups))


async def test_each_deadline_fires_in_its_order_with_its_own_timeout() -> None:
    # Bodies that wait outside the matcher (as the board does) and say for whom: nothing
    # but its own deadline ends each one, so each raises its own CollectiveTimeout.
    groups = await memory_groups(2)
    try:
        failures = groups[0]._failures
        matcher = groups[0].session.matcher
        loop = asyncio.get_running_loop()
        cancelled: list[tuple[int, float]] = []
        limits = {1000: 0.9, 1001: 0.3, 1002: 0.6, 1003: 0.45, 1004: 0.3}
        started = loop.time()

        async def one(seq: int) -> BaseException:
            try:
                async with failures.collective(OpKey(seq), "allreduce", limits[seq]):
                    matcher.note_waiting(OpKey(seq), [1])
                    try:
                        await asyncio.sleep(30)
                    except asyncio.CancelledError:
                        cancelled.append((seq, loop.time() - started))
                        raise
            except p2pcoll.P2PCollError as exc:
                return exc
            raise AssertionError("no timeout")

        errors = await asyncio.gather(*(one(seq) for seq in limits))
        assert [seq for seq, _ in cancelled] == [1001, 1004, 1003, 1002, 1000]
        for seq, when in cancelled:
            assert when >= limits[seq] - 1e-3, (seq, when)
        for seq, err in zip(limits, errors, strict=True):
            assert isinstance(err, p2pcoll.CollectiveTimeout), repr(err)
            assert err.seq == seq and f"timed out after {limits[seq]:g}s" in str(err)
            # Whom it waited for came from note_waiting; rank 1 said it had not started.
            assert err.waiting_on == [1] and "not started" in str(err), err
        assert len(failures._watchdog) == 0 and matcher.waiting_on(OpKey(1000)) == []
    finally:
        await asyncio.gather(*(g.close() for g in groups))


async def test_a_body_that_ends_as_its_deadline_passes_times_out_cleanly() -> None:
    # The body's wake-up and the deadline in the same turn of the loop: a timeout, as
    # asyncio.timeout gives, and no cancellation left over for the task's next await.
    groups = await memory_groups(1)
    try:
        failures = groups[0]._failures
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        for seq in range(1000, 1005):
            done = loop.create_future()
            with pytest.raises(p2pcoll.CollectiveTimeout):
                async with failures.collective(OpKey(seq), "allreduce", 0.05):
                    deadline = failures._watchdog._queue[-1][0]
                    loop.call_at(deadline, lambda f=done: f.done() or f.set_result(None))
                    await done
            assert task.cancelling() == 0
        await asyncio.sleep(0.01)  # nothing cancels this
    finally:
        await asyncio.gather(*(g.close() for g in groups))


async def test_a_body_that_ends_before_its_deadline_is_not_touched_by_the_timer() -> None:
    groups = await memory_groups(1)
    try:
        failures = groups[0]._failures
        for seq in range(1000, 1003):
            async with failures.collective(OpKey(seq), "allreduce", 0.1):
                await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)  # the timer armed for the first fires: nothing is due
        assert len(failures._watchdog) == 0 and failures._watchdog._timer is None
        assert groups[0].state is p2pcoll.GroupState.READY
    finally:
        await asyncio.gather(*(g.close() for g in groups))


async def test_a_cancellation_at_the_deadline_is_a_cancellation() -> None:
    groups = await memory_groups(1)
    try:
        failures = groups[0]._failures
        loop = asyncio.get_running_loop()

        async def body() -> None:
            async with failures.collective(OpKey(1000), "allreduce", 0.05):
                task = asyncio.current_task()
                assert task is not None
                loop.call_at(failures._watchdog._queue[-1][0], task.cancel)  # same turn
                await asyncio.sleep(30)

        with pytest.raises(asyncio.CancelledError):
            await asyncio.create_task(body())
        assert groups[0].state is p2pcoll.GroupState.BROKEN
        assert not isinstance(groups[0].cause, p2pcoll.CollectiveTimeout)
    finally:
        await asyncio.gather(*(g.close() for g in groups))


async def test_a_peer_lost_mid_collective_ends_it_at_once() -> None:
    groups = await memory_groups(3, collective_timeout=60)
    try:
        loop = asyncio.get_running_loop()
        calls = [asyncio.create_task(g.allreduce(np.ones(5), strategy="ring"))
                 for g in groups[:2]]
        await asyncio.sleep(0.1)
        started = loop.time()
        groups[0].session.transport.network.cut(groups[2].endpoint)
        errors = await asyncio.gather(*calls, return_exceptions=True)
        for err in errors:
            assert isinstance(err, p2pcoll.PeerLost) and err.rank == 2, repr(err)
        assert loop.time() - started < 30  # the link's loss, not the 60 s deadline
        assert all(len(g._failures._watchdog) == 0 for g in groups[:2])
    finally:
        await asyncio.gather(*(g.close() for g in groups))


async def test_collectives_behind_a_long_wait_leave_neither_entries_nor_results() -> None:
    # A receive with a long deadline runs while many collectives finish behind it in the
    # watchdog's queue: they are dropped, and their tasks (with their results) are freed.
    groups = await memory_groups(2, collective_timeout=120)
    try:
        pending = asyncio.create_task(groups[1].recv(src=0, tag=7))
        await asyncio.sleep(0.01)
        x = np.ones(2, np.int64)

        async def rank(g: p2pcoll.Group) -> None:
            for _ in range(3000):
                await g.allreduce(x, out=x)

        await asyncio.gather(*(rank(g) for g in groups))
        assert len(groups[1]._failures._watchdog) <= 40

        results: list[weakref.ref[Any]] = []
        for _ in range(50):
            tasks = [asyncio.create_task(g.allreduce(np.ones(1000))) for g in groups]
            results += [weakref.ref(t) for t in tasks]
            for t in tasks:  # not gather: its future would hold the last two
                await t
            del tasks, t
        await asyncio.sleep(0)  # the loop's handle that woke this task held the last one
        gc.collect()
        assert not [r for r in results if r() is not None]

        await groups[0].send(np.ones(1), dst=1, tag=7)
        await pending
        assert len(groups[1]._failures._watchdog) == 0
    finally:
        await asyncio.gather(*(g.close() for g in groups))


async def test_watch_tells_of_each_message_of_a_collective_until_it_finishes() -> None:
    groups = await memory_groups(2)
    try:
        matcher = groups[1].session.matcher
        seen: list[tuple[int, int, int]] = []
        matcher.watch(OpKey(0), lambda h: seen.append((h.seq, h.src, h.seg)))
        matcher.watch(OpKey(1), lambda h: seen.append((-1, -1, -1)))
        matcher.unwatch(OpKey(1))
        sent = asyncio.create_task(groups[0].allreduce(np.arange(4.0), strategy="ring"))
        for _ in range(500):
            if seen:
                break
            await asyncio.sleep(0.01)
        assert seen and seen[0][:2] == (0, 0)  # before rank 1 even started
        mine = await groups[1].allreduce(np.arange(4.0), strategy="ring")
        np.testing.assert_array_equal(mine, 2 * np.arange(4.0))
        np.testing.assert_array_equal(await sent, mine)
        told = len(seen)
        assert all(s[:2] == (0, 0) for s in seen)
        assert not matcher._watched  # finish unwatched it
        await asyncio.gather(*(g.allreduce(np.ones(4), strategy="ring") for g in groups))
        assert len(seen) == told  # seq 1 was unwatched
    finally:
        await asyncio.gather(*(g.close() for g in groups))


async def test_note_waiting_is_named_until_the_collective_finishes() -> None:
    groups = await memory_groups(3)
    try:
        matcher = groups[0].session.matcher
        matcher.note_waiting(OpKey(7), [2, 1])
        assert matcher.waiting_on(OpKey(7)) == [1, 2]
        assert matcher.waiting_on(OpKey(8)) == []
        matcher.finish(OpKey(7))
        assert matcher.waiting_on(OpKey(7)) == []
    finally:
        await asyncio.gather(*(g.close() for g in groups))
