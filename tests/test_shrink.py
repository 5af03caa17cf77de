"""Group.shrink: the survivors form a new group from the old roster (no rendezvous), over the
memory transport on a virtual clock, and once over real sockets in one process."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any, cast

import numpy as np
import pytest

import p2pcoll
from p2pcoll import CollectiveMismatch, Group, PeerLost, RendezvousError
from p2pcoll.errors import CLOSED, KILLED
from p2pcoll.session import shrink as shrinking
from p2pcoll.session.shrink import _lost_while_forming
from p2pcoll.testing import MemoryNetwork, memory_groups, run_ranks, run_virtual

HEARTBEAT = 1.0


def data(rank: int, n: int = 1001) -> np.ndarray:
    """Rank ``rank``'s input: float32 whose sum depends on the order it is added in."""
    return np.random.default_rng(rank).standard_normal(n).astype(np.float32) * 10 ** (rank % 5)


async def results(groups: Sequence[Group], inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
    """An allreduce (the default choice and ring), a reduce_scatter and an allgather."""
    out = []
    for strategy in (None, "ring"):
        out += await asyncio.gather(*(g.allreduce(x, strategy=strategy)
                                      for g, x in zip(groups, inputs, strict=True)))
    out += await asyncio.gather(*(g.reduce_scatter(x) for g, x in zip(groups, inputs,
                                                                      strict=True)))
    gathered = await asyncio.gather(*(g.allgather(x) for g, x in zip(groups, inputs,
                                                                     strict=True)))
    return out + [np.concatenate(parts) for parts in gathered]


async def close(*groups: Sequence[Group]) -> None:
    for gs in groups:
        for g in gs:
            await g.close()


def test_survivors_shrink_around_a_crashed_rank_and_match_a_fresh_group() -> None:
    async def main() -> None:
        net = MemoryNetwork()
        old = await memory_groups(5, network=net, heartbeat_timeout=HEARTBEAT)
        net.cut(old[2].endpoint)  # rank 2 crashes
        kept = [g for g in old if g.rank != 2]
        new = await asyncio.gather(*(g.shrink([2]) for g in kept))
        assert [(g.rank, g.world_size) for g in new] == [(0, 4), (1, 4), (2, 4), (3, 4)]
        assert len({g.membership.group_id for g in new}) == 1
        assert new[0].membership.group_id != old[0].membership.group_id
        inputs = [data(g.rank) for g in kept]  # each survivor keeps its own data
        shrunk = await results(new, inputs)
        fresh = await memory_groups(4, heartbeat_timeout=HEARTBEAT)
        formed = await results(fresh, inputs)
        for a, b in zip(shrunk, formed, strict=True):
            assert a.tobytes() == b.tobytes()
        await close(new, fresh, old)

    run_virtual(main())


def test_an_alive_rank_can_be_left_out() -> None:
    async def main() -> None:
        old = await memory_groups(4, heartbeat_timeout=HEARTBEAT)
        new = await asyncio.gather(*(g.shrink([0, 3]) for g in old[1:3]))
        assert [(g.rank, g.world_size) for g in new] == [(0, 2), (1, 2)]
        got = await asyncio.gather(*(g.allreduce(np.array([g.rank + 1])) for g in new))
        assert [int(x[0]) for x in got] == [3, 3]
        # The ones left out still have their old group, where the survivors are still
        # members until they close it.
        await close(new, old)

    run_virtual(main())


@pytest.mark.parametrize("exclude, error, words", [
    ([], ValueError, "empty"),
    ([4], ValueError, "out of range"),
    ([-1], ValueError, "out of range"),
    ([1, 1], ValueError, "more than once"),
    ([0, 1, 2, 3], ValueError, "every rank"),
    ([1, 0], RuntimeError, "rank 0 is excluded"),
    (["1"], TypeError, "ints"),
    (1, TypeError, "list of ranks"),
])
def test_bad_exclude_lists_are_refused_before_anything_is_sent(
        exclude: object, error: type[Exception], words: str) -> None:
    async def main() -> None:
        old = await memory_groups(4, heartbeat_timeout=HEARTBEAT)
        sent = old[0].stats()["messages_sent"]
        with pytest.raises(error, match=words):
            await old[0].shrink(exclude)  # type: ignore[arg-type]
        assert old[0].stats()["messages_sent"] == sent
        got = await asyncio.gather(*(g.allreduce(np.ones(2)) for g in old))
        assert got[0].tolist() == [4.0, 4.0]  # the group is still usable
        await close(old)

    run_virtual(main())


def test_a_survivor_lost_during_the_shrink_is_named_on_every_survivor() -> None:
    async def main() -> None:
        net = MemoryNetwork()
        old = await memory_groups(5, network=net, heartbeat_timeout=HEARTBEAT)
        net.cut(old[4].endpoint)  # rank 4 is gone, and the survivors know it
        loop = asyncio.get_running_loop()
        started = loop.time()
        net.freeze(old[1].endpoint)  # rank 1 stops before it takes part
        outcomes = await asyncio.gather(*(old[r].shrink([4]) for r in (0, 2, 3)),
                                        return_exceptions=True)
        for e in outcomes:
            assert isinstance(e, PeerLost), e
            assert e.rank == 1 and "rank 1" in str(e)
        # Found by the heartbeat (virtual time: the clock jumps), never a hang.
        assert loop.time() - started <= 3 * HEARTBEAT
        net.thaw(old[1].endpoint)
        await close(old)

    run_virtual(main())


@pytest.mark.parametrize("seen_by", ["both groups", "the new group"])
def test_a_survivor_lost_while_the_new_group_forms_ends_the_forming_at_once(
        seen_by: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Rank 1 dies after every offer came, as the new group forms: the old group's links
    # (or, when only its new endpoint goes, the new group's) find it long before the new
    # group's hello wait (the heartbeat) would end, and that ends the forming on every
    # survivor, naming it by its old rank.
    heartbeat = 5.0  # the hello wait: far longer than finding a cut link

    async def main() -> None:
        net = MemoryNetwork()
        old = await memory_groups(4, network=net, heartbeat_timeout=heartbeat)
        net.cut(old[3].endpoint)  # rank 3 is gone, and the survivors know it
        handshake = shrinking.handshake
        died = asyncio.Event()

        async def forming(session: Any, left: float) -> None:
            if session.membership.rank == 1:  # old rank 1 (new rank 1): dies right here
                if seen_by == "both groups":
                    net.cut(old[1].endpoint)
                net.cut(session.membership.endpoints[1])
                died.set()
                await asyncio.Event().wait()  # a dead process does nothing more
            await handshake(session, left)

        monkeypatch.setattr(shrinking, "handshake", forming)
        loop = asyncio.get_running_loop()
        started = loop.time()
        victim = asyncio.create_task(old[1].shrink([3]))
        outcomes = await asyncio.gather(*(old[r].shrink([3]) for r in (0, 2)),
                                        return_exceptions=True)
        assert died.is_set()
        for e in outcomes:
            assert isinstance(e, PeerLost), e
            assert e.rank == 1 and "rank 1" in str(e)
            assert ("new group's link" in str(e)) == (seen_by == "the new group"), e
        # Virtual time: before the hello wait would have ended.
        assert loop.time() - started < heartbeat
        victim.cancel()
        await asyncio.gather(victim, return_exceptions=True)
        await close(old)

    run_virtual(main())


def test_a_survivor_that_closes_the_old_group_once_shrunk_ends_no_other_forming(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The survivors whose new group formed close the old one at once (a goodbye), while
    # rank 3 still forms: a survivor that closed normally is not lost.
    async def main() -> None:
        net = MemoryNetwork()
        old = await memory_groups(5, network=net, heartbeat_timeout=HEARTBEAT)
        net.cut(old[4].endpoint)
        handshake = shrinking.handshake

        async def forming(session: Any, left: float) -> None:
            if session.membership.rank == 3:  # late: the others close the old group first
                await asyncio.sleep(HEARTBEAT / 4)
            await handshake(session, left)

        monkeypatch.setattr(shrinking, "handshake", forming)

        async def survivor(g: Group) -> Group:
            new = await g.shrink([4])
            await g.close()
            return new

        new = await asyncio.gather(*(survivor(g) for g in old[:4]))
        got = await asyncio.gather(*(g.allreduce(np.ones(1)) for g in new))
        assert [float(x[0]) for x in got] == [4.0] * 4
        await close(new)

    run_virtual(main())


def test_survivors_that_exclude_different_ranks_get_a_mismatch() -> None:
    async def main() -> None:
        old = await memory_groups(4, heartbeat_timeout=HEARTBEAT, collective_timeout=5)
        outcomes = await asyncio.gather(old[0].shrink([3]), old[1].shrink([2, 3]),
                                        return_exceptions=True)
        for e in outcomes:
            assert isinstance(e, CollectiveMismatch), e
            assert "rank 0 excludes ranks [3], rank 1 excludes ranks [2, 3]" in str(e)
        await close(old)

    run_virtual(main())


def test_a_survivor_that_does_not_shrink_is_named_at_the_deadline() -> None:
    async def main() -> None:
        old = await memory_groups(3, heartbeat_timeout=HEARTBEAT)
        with pytest.raises(p2pcoll.CollectiveTimeout, match=r"waited 4s for ranks \[1\]") as e:
            await old[0].shrink([2], timeout=4)  # rank 1 is alive but does not shrink
        assert e.value.waiting_on == [1]
        await close(old)

    run_virtual(main())


def test_a_closed_group_cannot_shrink() -> None:
    async def main() -> None:
        old = await memory_groups(2, heartbeat_timeout=HEARTBEAT)
        await close(old)
        with pytest.raises(p2pcoll.GroupBroken, match="closed"):
            await old[0].shrink([1])

    run_virtual(main())


def test_shrink_over_sockets_gives_a_working_group() -> None:
    async def main() -> None:
        async def peer(g: Group) -> list[float]:
            if g.rank == 1:
                await g.close()  # rank 1 leaves; the others shrink without it
                return []
            new = await g.shrink([1])
            try:
                got = await new.allreduce(np.array([float(g.rank)]))
                return [float(new.rank), float(new.world_size), float(got[0])]
            finally:
                await new.close()

        got = await run_ranks(3, peer, heartbeat_timeout=2)
        assert got == [[0.0, 2.0, 2.0], [], [1.0, 2.0, 2.0]]

    asyncio.run(main())


def test_a_survivor_lost_while_the_new_group_forms_is_named_by_its_old_rank() -> None:
    # A second survivor gone after every offer came: the new group's hellos miss it. The
    # error names it by its old rank, never a survivor that closed the old group normally
    # meanwhile (one that gave up on the same shrink first), whatever the old group knows.
    gone: dict[int, PeerLost] = {
        1: PeerLost("rank 1 left the group: it closed it normally", 1, how=CLOSED)}
    old = cast(Any, SimpleNamespace(departures=SimpleNamespace(lost=gone.get)))
    timeout = RendezvousError("rank 0 could not reach ranks [1] of the group")  # new numbers
    e = _lost_while_forming(old, [0, 1, 2], [2], timeout)
    assert e.rank == 2 and "rank 2" in str(e) and "ranks [2]" in str(e)
    gone[2] = PeerLost("rank 2 ended without a word", 2, how=KILLED)  # the old group saw it
    assert _lost_while_forming(old, [0, 1, 2], [2], timeout) is gone[2]
    assert _lost_while_forming(old, [0, 1, 2], [], timeout) is gone[2]
