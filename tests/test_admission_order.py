"""The members of a group that admits a newcomer keep their places: with ``delay=1`` they
go to the rendezvous as soon as the round's reduction tells them of the admission, beside
their steps, so a second newcomer that comes after the count does not form in place of a
member whose step ends late (train_elastic, peers as tasks over a real rendezvous)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import numpy as np
import pytest

import p2pcoll
from p2pcoll import training
from conftest import newcomer_arrives
from peer_processes import port_held
from test_async_diloco import digest, replayed

# Real sockets and real seconds (about 7 s): the processes tier, not the default one.
pytestmark = pytest.mark.processes

H, ROUNDS, POLL = 3, 10, 0.2
SLOW_S = 0.5  # the slow member's inner step while the newcomer waits: its step ends late
LATE_S = 0.3  # the second newcomer comes this long after the admission was decided


class _Decided(logging.Handler):
    """Calls ``then`` once, at the first admission a member logs."""

    def __init__(self, then: Any) -> None:
        super().__init__()
        self.then = then

    def emit(self, record: logging.LogRecord) -> None:
        if "peers wait to join" in record.getMessage() and self.then is not None:
            then, self.then = self.then, None
            then()


async def test_a_newcomer_after_the_count_does_not_take_a_slow_members_place() -> None:
    url = f"tcp://127.0.0.1:{p2pcoll.testing.free_port()}"
    arrived = asyncio.Event()  # the first newcomer waits at the rendezvous
    digests: dict[int, list[str]] = {}

    async def peer(slow: bool = False, newcomer: bool = False) -> Any:
        params = {"w": np.full((2, 3), 9.0 if newcomer else 0.0), "b": np.zeros(3)}

        async def inner(group: p2pcoll.Group, r: int, i: int) -> None:
            if slow and group.world_size == 2 and arrived.is_set():
                await asyncio.sleep(SLOW_S)  # the step in flight at the admission ends late
            else:
                await asyncio.sleep(0.01)
            for p in params.values():
                p -= 1.0

        rounds = training.DiLoCoRounds(params, inner, inner_steps=H, outer_lr=0.5,
                                       outer_momentum=0.5, delay=1)

        def apply(state: Any, deltas: dict[str, Any], r: int) -> None:
            rounds.apply(state, deltas, r)
            digests.setdefault(r, []).append(digest(state))

        result = await training.train_elastic(
            rounds.step, apply, rounds.state, rounds=ROUNDS, min_world_size=2,
            max_world_size=3, rendezvous=url, timeout=20.0, poll_every=POLL,
            delay=rounds.delay, settings=rounds.settings)
        return result, rounds

    loop = asyncio.get_running_loop()
    late: list[asyncio.Task[Any]] = []
    handler = _Decided(lambda: loop.call_later(
        LATE_S, lambda: late.append(asyncio.create_task(peer(newcomer=True)))))
    logger = logging.getLogger("p2pcoll.training")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        members = [asyncio.create_task(peer())]  # hosts the rendezvous
        while not port_held(int(url.rsplit(":", 1)[1])):
            await asyncio.sleep(0.01)
        members.append(asyncio.create_task(peer(slow=True)))
        async with asyncio.timeout(60):
            while 1 not in digests:  # the two run as a group, then the first newcomer comes
                await asyncio.sleep(0.01)
            first = asyncio.create_task(peer(newcomer=True))
            await newcomer_arrives(url, arrived)
            results = await asyncio.gather(*members, first)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        for task in late:  # the second newcomer waits for a place that never comes
            task.cancel()
        await asyncio.gather(*late, return_exceptions=True)
    assert late, "no admission was decided"
    (fast, _), (slow, _), (newcomer, _) = results
    # The slow member stayed: every round applied once, in the group of three after the
    # admission (it would otherwise wait alone at the rendezvous for its join timeout).
    assert slow.applied == fast.applied == list(range(ROUNDS))
    assert [f.world_size for f in slow.formations] == [2, 3]
    assert [f.world_size for f in newcomer.formations] == [3]
    want = digest(replayed(ROUNDS, H))
    for _, rounds in results:
        assert digest(rounds.state) == want
    for r, seen in digests.items():
        assert len(set(seen)) == 1, f"round {r}: replicas differ"
