"""training.shrinking.shrunk: the rendezvous is asked while the survivors shrink, not before
(its round trip is off the shrink's path), and a shrunk group nobody can reach newcomers
through is closed. A stand-in group: no sockets, no clock."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from p2pcoll.training.admitting import live
from p2pcoll.training.shrinking import shrunk


class Departed:
    def __init__(self, graceful: bool) -> None:
        self.graceful = graceful


class Smaller:
    rank, world_size, closed = 0, 3, False

    async def close(self) -> None:
        self.closed = True


class Group:
    """What shrunk() reads of a group: rank, size, who is gone, and shrink()."""

    def __init__(self, gone: dict[int, Any]) -> None:
        self.rank, self.world_size, self.cause = 0, 4, None
        self.session = SimpleNamespace(peers=SimpleNamespace(gone=lambda: dict(gone)))
        self.shrinking = asyncio.Event()
        self.smaller = Smaller()

    async def shrink(self, lost: list[int], timeout: float) -> Smaller:
        self.shrinking.set()
        await asyncio.sleep(0)
        return self.smaller


async def test_the_rendezvous_is_asked_while_the_group_shrinks() -> None:
    group = Group({3: Departed(False)})

    async def served() -> int | None:
        await group.shrinking.wait()  # answers only once the shrink is under way
        return 0

    # Asked first and waited for, as before, the answer would never come.
    smaller = await asyncio.wait_for(shrunk(group, 2, served), 30)  # type: ignore[arg-type]
    assert smaller is group.smaller and not group.smaller.closed


async def test_a_shrunk_group_is_closed_when_nobody_answers_at_the_rendezvous() -> None:
    group = Group({3: Departed(False)})

    async def served() -> int | None:
        return None

    assert await shrunk(group, 2, served) is None  # type: ignore[arg-type]
    assert group.smaller.closed


def test_live_members_leave_out_the_lost_not_those_that_said_goodbye() -> None:
    group = Group({1: Departed(True), 3: Departed(False)})
    assert live(group) == [0, 1, 2]  # type: ignore[arg-type]
