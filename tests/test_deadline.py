"""p2pcoll.session.deadline on its own: a Collective under stub Rules, no group, no peers."""

from __future__ import annotations

import asyncio
import math
import traceback

import pytest

from p2pcoll.errors import CollectiveTimeout, PeerLost
from p2pcoll.session.deadline import Collective, Watchdog
from p2pcoll.types import OpKey


class Stub:
    """Rules that record what the Collective asks and answer as told."""

    def __init__(self, expired: BaseException | None = None) -> None:
        self.calls: list[str] = []
        self.answer = expired or CollectiveTimeout("allreduce #0 timed out", seq=0)
        self.lost_at_start: PeerLost | None = None

    def started(self, c: Collective) -> None:
        self.calls.append("started")
        if self.lost_at_start is not None:
            c.interrupt(self.lost_at_start)

    def outcome(self, c: Collective, err: BaseException | None) -> BaseException | None:
        self.calls.append(f"outcome {type(err).__name__ if err else None}")
        return err

    async def expired(self, c: Collective) -> BaseException:
        self.calls.append("expired" if c.lost is None else "lost")
        return c.lost or self.answer

    def ended(self, c: Collective) -> None:
        self.calls.append("ended")


async def test_a_body_that_returns_asks_the_rules_for_its_outcome() -> None:
    rules, watchdog = Stub(), Watchdog()
    async with Collective(rules, watchdog, OpKey(0), "allreduce", 5.0):
        await asyncio.sleep(0)
    assert rules.calls == ["started", "outcome None", "ended"]
    assert len(watchdog) == 0


async def test_the_deadline_ends_the_body_with_the_rules_error_and_no_chain() -> None:
    rules = Stub()
    with pytest.raises(CollectiveTimeout) as caught:
        async with Collective(rules, Watchdog(), OpKey(0), "allreduce", 0.01):
            await asyncio.Event().wait()  # nothing but the deadline ends this
    assert rules.calls == ["started", "expired", "ended"]
    assert caught.value.__cause__ is None and caught.value.__suppress_context__
    assert "CancelledError" not in "".join(traceback.format_exception(caught.value))


async def test_an_interrupt_raises_the_lost_peers_error_without_the_cancellation() -> None:
    rules = Stub()
    lost = PeerLost("rank 1 left the group: it closed it normally", 1, how="closed")
    rules.lost_at_start = lost  # gone before it started: ends at the first await
    with pytest.raises(PeerLost) as caught:
        async with Collective(rules, Watchdog(), OpKey.transfer(0, 1, 3, 0), "send", math.inf):
            await asyncio.Event().wait()
    assert caught.value is lost and rules.calls == ["started", "lost", "ended"]
    assert "CancelledError" not in "".join(traceback.format_exception(caught.value))


async def test_a_cancellation_from_outside_is_the_bodys_own() -> None:
    rules = Stub()

    async def body() -> None:
        async with Collective(rules, Watchdog(), OpKey(0), "allreduce", 5.0):
            await asyncio.Event().wait()

    task = asyncio.create_task(body())
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert rules.calls == ["started", "outcome CancelledError", "ended"]


async def test_deadlines_fire_in_their_order_on_one_timer() -> None:
    rules, watchdog = Stub(), Watchdog()
    order: list[int] = []

    async def one(n: int, limit: float) -> None:
        with pytest.raises(CollectiveTimeout):
            async with Collective(rules, watchdog, OpKey(n), "allreduce", limit):
                try:
                    await asyncio.Event().wait()
                finally:
                    order.append(n)

    await asyncio.gather(one(0, 0.06), one(1, 0.02), one(2, 0.04))
    assert order == [1, 2, 0] and len(watchdog) == 0
