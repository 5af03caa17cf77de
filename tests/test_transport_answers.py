"""What a mesh peer answers on the connection a message came on (``post(via="answer")``),
over real sockets in one process."""

from __future__ import annotations

import asyncio

import p2pcoll
from p2pcoll.testing import run_ranks
from p2pcoll.wire import Header


async def test_a_peer_declared_lost_is_told_so_on_its_own_link() -> None:
    """Rank 0 declares rank 1 lost (as it would once 1's heartbeats stopped) and forgets it.
    Rank 1, which goes on (a stopped peer that resumed), sends rank 0 news of a loss: rank 0
    does not believe it and answers, on the link it came on, that rank 1 was declared lost,
    opening no link; rank 1 reads it there and fails with a PeerLost naming itself."""
    declared = asyncio.Event()
    told = asyncio.Event()
    through = asyncio.Event()  # every rank is out of the barrier (one still in it would
    passed: list[int] = []     # fail it with the loss declared next: not this test's case)

    async def fn(g: p2pcoll.Group) -> None:
        s = g.session
        await g.barrier()
        passed.append(g.rank)
        if len(passed) == g.world_size:
            through.set()
        await through.wait()
        if g.rank == 0:
            opened = s.transport.counters.links_opened
            s.peers.reported_lost(1, by=0)
            assert s.peers.lost(1) is not None
            declared.set()
            await told.wait()
            assert s.transport.counters.links_opened == opened
        elif g.rank == 1:
            await declared.wait()
            s.transport.post(0, Header("gone", g.membership.group_id, 1, 0,
                                       meta={"rank": 2, "graceful": False}))
            while g.state is not p2pcoll.GroupState.BROKEN:
                await asyncio.sleep(0.01)
            assert isinstance(g.cause, p2pcoll.PeerLost) and g.cause.rank == 1, g.cause
            assert "rank 0 says that rank 1 was declared lost" in str(g.cause)
            told.set()
        else:
            await told.wait()
            assert g.session.peers.lost(1) is not None  # the news of it went round

    await asyncio.wait_for(run_ranks(3, fn, transport="ipc"), 60)
