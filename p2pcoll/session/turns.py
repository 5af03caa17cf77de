"""Turns: the order in which a group's calls start while a coded reduction waits.

A collective is matched across ranks by the sequence number it takes when it starts, so
every rank must start its collectives in the same order; a collective that is a coroutine
takes its number before its first await, so the order in which the caller starts them is
the order. A coded reduction with scales (int8) is two collectives, and the second (the
data) can only start once the first (the scales) has finished, which happens at different
moments on different ranks. Anything started meanwhile (another bucket's reduction, the
next round's header exchange) would take its number before the data on one rank and after
it on another.

So while a coded reduction holds its *turn* (from its start until its data collective has
started), every collective started on the group after it waits for its own turn, first
come first served, and starts when every one started before it has. The order of the
sequence numbers is then the order the caller started the collectives in, on every rank,
whatever the timing. When nothing holds a turn (no coded reduction waiting for its
scales), a collective starts at once: the plain path pays one attribute test.

The session's runner keeps the turns and consults them at the start of every call
(:meth:`p2pcoll.session.calls.Runner.run`); a call made of several collectives (a coded
reduction, a robust one, an alltoall) holds one with ``async with turns.hold()``.
The holder's own collectives (its scales, its data) run inside its turn: a context
variable marks the task that holds the current turn.
"""

from __future__ import annotations

import asyncio
from contextvars import ContextVar, Token

__all__ = ["Turn", "Turns"]

_holding: ContextVar[Turns | None] = ContextVar("p2pcoll_codec_turn", default=None)


class Turns:
    """A first-come, first-served queue of the collectives one group starts.

    ``busy`` is True while some turn is taken and not finished: a collective started then
    calls :meth:`queue` first (unless its task holds the current turn).
    """

    def __init__(self) -> None:
        self._next = 0  # the turn the next taker gets
        self._current = 0  # the turn that may go now
        self._finished: set[int] = set()  # turns finished before their predecessors
        self._waiting: dict[int, asyncio.Future[None]] = {}
        # _next != _current, kept as a plain attribute: every call of the group reads it
        self.busy = False

    def take(self) -> int:
        """The next turn (at once, before any await)."""
        turn = self._next
        self._next += 1
        self.busy = True
        return turn

    async def wait(self, turn: int) -> None:
        """Return once every earlier turn has finished (at once, without awaiting anything,
        if they have)."""
        if self._current != turn:
            future = self._waiting[turn] = asyncio.get_running_loop().create_future()
            try:
                await future
            finally:
                self._waiting.pop(turn, None)

    def finish(self, turn: int) -> None:
        """``turn`` has started its collective, or never will (it failed or was cancelled).
        The next turn's waiter is woken by a callback, so a collective started right after
        this call, before the caller's next await, still goes first."""
        self._finished.add(turn)
        while self._current in self._finished:
            self._finished.discard(self._current)
            self._current += 1
        self.busy = self._next != self._current
        future = self._waiting.get(self._current)
        if future is not None and not future.done():
            future.set_result(None)

    async def queue(self) -> None:
        """Wait for a turn, if this task does not hold the current one; the caller starts
        its collective right after, before its next await.

        Cancellation: gives the turn up (the ones after it do not wait for it)."""
        if _holding.get() is self:
            return
        turn = self.take()
        try:
            await self.wait(turn)
        finally:
            self.finish(turn)

    def hold(self) -> Turn:
        """Take a turn now (call it before any await: the order the caller started in) for
        ``async with``: the body runs once every earlier turn has finished, holding this one
        (its own collectives do not queue behind it); the turn is passed on at the latest
        when the body ends, or earlier by :meth:`Turn.release`."""
        return Turn(self)


class Turn:
    """One taken turn of :class:`Turns` (see :meth:`Turns.hold`)."""

    def __init__(self, turns: Turns) -> None:
        self._turns = turns
        self._number = turns.take()
        self._held = True
        self._token: Token[Turns | None] | None = None

    def release(self) -> None:
        """Pass the turn on (its last collective is about to start, before the caller's
        next await); idempotent."""
        if self._held:
            self._held = False
            self._turns.finish(self._number)

    async def __aenter__(self) -> Turn:
        try:
            await self._turns.wait(self._number)
        except BaseException:
            self.release()
            raise
        self._token = _holding.set(self._turns)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._token is not None:
            _holding.reset(self._token)
        self.release()
