"""Groups over the memory transport on a virtual clock (issue 34).

``run_virtual`` runs a coroutine on a loop whose clock jumps to the next timer whenever
every task waits, so heartbeats, deadlines and blame cost no wall time; the tests assert
the virtual time that passed. The memory transport's probes are the mesh's: a frozen peer,
or a cut link between a watcher and the peer it watches, is a PeerLost after the heartbeat
(5 s by default) and the grace of a link down; a cut between peers that do not watch each
other ends only in the collectives that wait on it, as over sockets.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import numpy as np
import pytest

import p2pcoll
from conftest import groups_of
from p2pcoll.departures import LINK_LOSS_GRACE
from p2pcoll.testing import MemoryNetwork, VirtualClockLoop, memory_groups, run_virtual

T = TypeVar("T")
HEARTBEAT = 5.0  # the default heartbeat_timeout, which these tests do not change
LOST_BY = HEARTBEAT + LINK_LOSS_GRACE  # when a watcher declares a silent peer lost


def now() -> float:
    return asyncio.get_running_loop().time()


async def outcome(aw: Awaitable[T]) -> T | BaseException:
    """What ``aw`` returns or raises (a P2PCollError), and never more than that."""
    try:
        return await aw
    except p2pcoll.P2PCollError as exc:
        return exc


def each(groups: list[p2pcoll.Group], ranks: range | list[int],
         call: Callable[[p2pcoll.Group], Awaitable[T]]) -> Awaitable[list[Any]]:
    """``call`` on the groups of ``ranks`` at once; what each returned or raised."""
    return asyncio.gather(*(outcome(call(groups[r])) for r in ranks))


def allreduce(g: p2pcoll.Group, **kwargs: Any) -> Awaitable[Any]:
    return g.allreduce(np.full(8, g.rank + 1.0), **kwargs)


# --- the clock ----------------------------------------------------------------------------


def test_sleep_timeout_wait_for_and_timers_follow_the_virtual_clock() -> None:
    async def main() -> list[float]:
        loop = asyncio.get_running_loop()
        assert isinstance(loop, VirtualClockLoop)
        marks = [now()]
        await asyncio.sleep(100)
        marks.append(now())
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(50):
                await asyncio.Event().wait()
        marks.append(now())
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(asyncio.Event().wait(), 30)
        marks.append(now())
        fired: list[float] = []
        loop.call_later(7, lambda: fired.append(now()))
        await asyncio.gather(asyncio.sleep(3), asyncio.sleep(7.5))
        marks.append(now())
        assert fired == [marks[3] + 7]
        return [b - a for a, b in itertools.pairwise(marks)]

    assert run_virtual(main()) == pytest.approx([100, 50, 30, 7.5])


def test_the_clock_waits_for_a_thread_the_loop_waits_on() -> None:
    # A thread's work takes no virtual time, and no timer overtakes it: the deadline of
    # 1 s would pass at once if the clock jumped while the thread sleeps.
    async def main() -> tuple[str, float]:
        start = now()
        def work() -> str:
            time.sleep(0.05)
            return "done"

        done = await asyncio.wait_for(asyncio.to_thread(work), 1)
        return done, now() - start

    assert run_virtual(main()) == ("done", 0.0)


def test_the_clock_only_moves_forward() -> None:
    loop = VirtualClockLoop()
    try:
        loop.advance(2.5)
        assert loop.time() == 2.5
        with pytest.raises(ValueError, match="only moves forward"):
            loop.advance(-1)
    finally:
        loop.close()


# --- a frozen peer ------------------------------------------------------------------------


@pytest.mark.parametrize("frozen", range(4))
def test_a_frozen_peer_is_named_by_every_survivor(frozen: int) -> None:
    survivors = [r for r in range(4) if r != frozen]

    async def main() -> None:
        network = MemoryNetwork()
        async with groups_of(4, network=network) as groups:  # the default 5 s heartbeat
            await each(groups, range(4), allreduce)  # formed and running
            start = now()
            network.freeze(frozen)
            errors = await each(groups, survivors, allreduce)
            elapsed = now() - start
            for rank, err in zip(survivors, errors, strict=True):
                assert isinstance(err, p2pcoll.PeerLost), (rank, err)
                assert err.rank == frozen, (rank, str(err))
                assert f"rank {frozen}" in str(err)
                assert groups[rank].state == "broken"
            # found by its watchers' probes after the heartbeat, well before the 300 s
            # deadline (the news of it reaches the others in the same turn of the clock)
            assert LOST_BY <= elapsed < LOST_BY + 0.1, elapsed
            network.thaw(frozen)

    run_virtual(main())


def test_the_heartbeat_is_the_groups_setting() -> None:
    async def main() -> None:
        network = MemoryNetwork()
        async with groups_of(4, network=network, heartbeat_timeout=1.5) as groups:
            start = now()
            network.freeze(3)
            errors = await each(groups, [0, 1, 2], allreduce)
            assert [(type(e), e.rank) for e in errors] == [(p2pcoll.PeerLost, 3)] * 3, errors
            assert now() - start == pytest.approx(1.5 + LINK_LOSS_GRACE)
            network.thaw(3)

    run_virtual(main())


def test_a_killed_peer_is_named_by_every_survivor_after_the_grace_alone() -> None:
    # cut(rank) alone is a crash: every link to it goes down at once, no heartbeat waited.
    async def main() -> None:
        network = MemoryNetwork()
        async with groups_of(4, network=network) as groups:
            start = now()
            network.cut(1)
            errors = await each(groups, [0, 2, 3], allreduce)
            assert [(type(e), e.rank) for e in errors] == [(p2pcoll.PeerLost, 1)] * 3, errors
            assert now() - start == pytest.approx(LINK_LOSS_GRACE)

    run_virtual(main())


def test_a_peer_thawed_within_the_heartbeat_is_not_lost() -> None:
    async def main() -> None:
        network = MemoryNetwork()
        async with groups_of(4, network=network) as groups:
            network.freeze(1)
            running = each(groups, range(4), allreduce)
            await asyncio.sleep(HEARTBEAT - 0.5)
            network.thaw(1)
            results = await running
            assert all(np.array_equal(r, np.full(8, 10.0)) for r in results), results
            await asyncio.sleep(3 * HEARTBEAT)  # no probe left armed
            assert all(g.state == "ready" for g in groups), [g.state for g in groups]

    run_virtual(main())


def test_a_run_of_frozen_peers_is_found_one_after_another() -> None:
    # Ranks 2, 3 and 4 of 8 freeze: 4's watchers are 3 and 2, so 4 is found only once 1
    # watches it in their place (see p2pcoll.departures.overlay): a heartbeat later.
    run = {2, 3, 4}

    async def main() -> None:
        network = MemoryNetwork()
        async with groups_of(8, network=network) as groups:
            start = now()
            for rank in run:
                network.freeze(rank)
            survivors = [r for r in range(8) if r not in run]
            await asyncio.sleep(LOST_BY + 0.1)
            assert [set(groups[r].session.peers.gone()) for r in survivors] == [{2, 3}] * 5
            await asyncio.sleep(LOST_BY)
            assert [set(groups[r].session.peers.gone()) for r in survivors] == [run] * 5
            assert now() - start < 2 * LOST_BY + 0.2
            for rank in run:
                network.thaw(rank)

    run_virtual(main())


# --- deadlines ----------------------------------------------------------------------------


def test_a_collective_deadline_expires_on_the_virtual_clock() -> None:
    async def main() -> None:
        async with groups_of(3) as groups:  # rank 2 never calls
            start = now()
            errors = await each(groups, [0, 1], lambda g: allreduce(g, timeout=30))
            elapsed = now() - start
            for err in errors:
                assert isinstance(err, p2pcoll.CollectiveTimeout), err
                assert err.waiting_on == [2], str(err)
            assert 30 <= elapsed < 31, elapsed

    run_virtual(main())


def test_a_deadline_shorter_than_the_heartbeat_blames_the_frozen_peer() -> None:
    async def main() -> None:
        network = MemoryNetwork()
        async with groups_of(4, network=network) as groups:
            network.freeze(2)
            start = now()
            errors = await each(groups, [0, 1, 3], lambda g: allreduce(g, timeout=2))
            for err in errors:
                assert isinstance(err, p2pcoll.CollectiveTimeout), err
                assert err.waiting_on == [2], str(err)
                assert "rank 2 did not answer" in str(err), str(err)
            assert now() - start < HEARTBEAT  # blamed before its watchers lose it
            network.thaw(2)

    run_virtual(main())


# --- cut links ----------------------------------------------------------------------------


def test_a_cut_link_loses_the_watched_peer_everywhere() -> None:
    # Rank 1 watches ranks 2 and 3; rank 2 watches 3 and 0: with the link between 1 and 2
    # cut, 1's probe of 2 goes down and 1 names 2 lost; the news reaches 0 and 3 over the
    # overlay. (A ring, so that the collective needs the link: 2 receives from 1.) Rank 2
    # sees nothing wrong with those it watches, and what would tell it comes over the cut
    # link or not at all (the others send nothing more to a peer they know gone): as over
    # sockets, its collective ends at its deadline, blaming rank 1.
    async def main() -> None:
        network = MemoryNetwork()
        async with groups_of(4, network=network, collective_timeout=60) as groups:
            start = now()
            network.cut(1, 2)

            async def timed(g: p2pcoll.Group) -> tuple[object, float]:
                return await outcome(allreduce(g, strategy="ring")), now() - start

            ended = await asyncio.gather(*(timed(g) for g in groups))
            for rank in (0, 1, 3):
                err, elapsed = ended[rank]
                assert isinstance(err, p2pcoll.PeerLost), (rank, err)
                assert err.rank == 2, (rank, str(err))
                assert LOST_BY <= elapsed < LOST_BY + 0.1, (rank, elapsed)
            err, elapsed = ended[2]
            assert isinstance(err, p2pcoll.CollectiveTimeout), err
            assert err.waiting_on == [1], str(err)
            assert 60 <= elapsed <= 62, elapsed  # its deadline, then asking who is silent
            network.heal(1, 2)

    run_virtual(main())


def test_a_cut_between_peers_that_do_not_watch_each_other_is_held() -> None:
    # In a group of 6, rank 0 watches 1 and 2, rank 3 watches 4 and 5: no probe crosses
    # the cut between 0 and 3, so nobody is lost; what goes between them waits (as in a
    # socket's queue) and is delivered when the link heals, before the deadline.
    async def main() -> None:
        network = MemoryNetwork()
        async with groups_of(6, network=network) as groups:
            network.cut(0, 3)
            sent = asyncio.ensure_future(groups[0].send(np.arange(4.0), dst=3))
            received = asyncio.ensure_future(groups[3].recv(0))
            await asyncio.sleep(4 * HEARTBEAT)
            assert not received.done()
            assert all(g.state == "ready" for g in groups)
            network.heal(0, 3)
            await sent
            assert np.array_equal(await received, np.arange(4.0))

    run_virtual(main())


def test_a_cut_that_never_heals_ends_in_the_deadline() -> None:
    async def main() -> None:
        network = MemoryNetwork()
        async with groups_of(6, network=network) as groups:
            network.cut(0, 3)
            start = now()
            await groups[0].send(np.arange(4.0), dst=3)  # queued, as on a socket
            with pytest.raises(p2pcoll.CollectiveTimeout) as info:
                await groups[3].recv(0, timeout=60)
            assert info.value.waiting_on == [0], str(info.value)
            assert now() - start == pytest.approx(60)
            assert all(not g.session.peers.gone() for g in groups)
            network.heal(0, 3)

    run_virtual(main())


def test_a_link_healed_within_the_heartbeat_loses_no_one() -> None:
    async def main() -> None:
        network = MemoryNetwork()
        async with groups_of(4, network=network) as groups:
            network.cut(1, 2)
            running = each(groups, range(4), allreduce)
            await asyncio.sleep(HEARTBEAT - 1)
            network.heal(1, 2)
            results = await running
            assert all(np.array_equal(r, np.full(8, 10.0)) for r in results), results
            await asyncio.sleep(3 * HEARTBEAT)
            assert all(g.state == "ready" for g in groups)

    run_virtual(main())


# --- naming peers -------------------------------------------------------------------------


def test_peers_are_named_by_rank_or_endpoint() -> None:
    async def main() -> None:
        network = MemoryNetwork()
        groups = await memory_groups(3, network=network)
        try:
            assert network.endpoint(1) == groups[1].endpoint
            assert network.endpoint(groups[2].endpoint) == groups[2].endpoint
            with pytest.raises(ValueError, match="rank 3 is not a rank"):
                network.freeze(3)
            with pytest.raises(ValueError, match="two different peers"):
                network.cut(1, groups[1].endpoint)
            other = await memory_groups(2, network=network)
            try:
                with pytest.raises(ValueError, match="carries 2 groups"):
                    network.freeze(0)
            finally:
                await asyncio.gather(*(g.close() for g in other))
        finally:
            await asyncio.gather(*(g.close() for g in groups))

    run_virtual(main())
