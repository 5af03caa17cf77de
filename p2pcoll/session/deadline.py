"""One deadline per operation: the :class:`Watchdog` that keeps them and the
:class:`Collective` that runs an operation's body under one.

``async with Collective(rules, watchdog, key, name, limit):`` wraps every collective and
every point-to-point transfer (the session's runner makes it through
:meth:`~p2pcoll.session.failure.FailureModel.collective`). When the deadline passes, or a
peer the operation needs is gone, the task running the body is cancelled, as
``asyncio.timeout`` does, and leaving tells that cancellation from one that came from
outside. What the end of an operation *means* (whom a timeout blames, which error a lost
peer raises, whether the group breaks) is not decided here but by its :class:`Rules`: the
failure model.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from typing import Protocol

from ..errors import CollectiveTimeout, P2PCollError
from ..types import OpKey


class Rules(Protocol):
    """What the start and the end of an operation mean (the session's failure model,
    :class:`~p2pcoll.session.failure.FailureModel`)."""

    def started(self, c: Collective) -> None:
        """``c`` has started (its task and deadline are set): it may be interrupted at
        once (:meth:`Collective.interrupt`), if a peer it needs is gone already."""
        ...

    def outcome(self, c: Collective, err: BaseException | None) -> BaseException | None:
        """What ``c`` raises, its body having ended with ``err`` (None: it returned)."""
        ...

    async def expired(self, c: Collective) -> BaseException:
        """What ``c`` raises, its deadline having passed or a peer it needs having gone
        (``c.lost``)."""
        ...

    def ended(self, c: Collective) -> None:
        """``c`` has ended, whatever it raises: forget it."""
        ...


class Watchdog:
    """The deadlines of a group's running operations, on one timer of the event loop.

    A collective's deadline is registered when it starts and ends it when it passes (see
    :meth:`Collective.expire`). Deadlines of successive calls with the same limit come in
    order, so they queue in a deque; the rare one that is earlier than the last (a call
    with a shorter timeout) is inserted in place. One timer is armed, for the earliest
    deadline, and re-armed only for an earlier one: when the operation it was armed for
    finishes first (as nearly all do), it fires anyway, finds nothing due and arms for the
    earliest deadline still running. So a collective costs an append and a pop, not a
    timer of its own.

    A finished entry leaves at once from the front, where it usually is; one that finishes
    behind a longer-running operation (a receive that waits for minutes while collectives
    run) is counted, and the queue drops such entries once they are half of it, so it
    never holds more than about twice the operations that run.
    """

    __slots__ = ("_armed", "_queue", "_stale", "_timer")

    def __init__(self) -> None:
        self._queue: deque[tuple[float, Collective]] = deque()
        self._stale = 0  # finished entries still in the queue
        self._timer: asyncio.TimerHandle | None = None
        self._armed = math.inf  # when the timer fires

    def add(self, c: Collective, deadline: float) -> None:
        """End ``c`` at ``deadline`` (the event loop's time) unless it has finished."""
        queue = self._queue
        if not queue or deadline >= queue[-1][0]:
            queue.append((deadline, c))
        else:
            i = len(queue) - 1
            while i > 0 and queue[i - 1][0] > deadline:
                i -= 1
            queue.insert(i, (deadline, c))
        c.queued = True
        if deadline < self._armed:
            self._arm(deadline)

    def done(self, c: Collective) -> None:
        """``c`` (which :meth:`add` queued) has finished: forget its deadline."""
        if not c.queued:
            return  # expired: the timer took it out
        queue = self._queue
        if queue[0][1] is c:
            queue.popleft()
            c.queued = False
            while self._stale and queue[0][1].finished:
                queue.popleft()[1].queued = False
                self._stale -= 1
            return
        self._stale += 1
        if self._stale > 16 and 2 * self._stale > len(queue):
            self._compact()

    def _compact(self) -> None:
        """Drop every finished entry (in time proportional to those dropped)."""
        live: deque[tuple[float, Collective]] = deque()
        for entry in self._queue:
            if entry[1].finished:
                entry[1].queued = False
            else:
                live.append(entry)
        self._queue, self._stale = live, 0

    def _arm(self, deadline: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._armed = deadline
        self._timer = asyncio.get_running_loop().call_at(deadline, self._fire)

    def _fire(self) -> None:
        # The loop runs a timer up to its clock's resolution early: what the timer was
        # armed for is due even if the clock reads a hair before it.
        due_by = max(asyncio.get_running_loop().time(), self._armed)
        self._timer, self._armed = None, math.inf
        queue = self._queue
        due = []
        while queue and (queue[0][1].finished or queue[0][0] <= due_by):
            _, c = queue.popleft()
            c.queued = False
            if c.finished:
                self._stale -= 1
            else:
                due.append(c)
        if queue:  # the front is running and not due: the queue is in deadline order
            self._arm(queue[0][0])
        for c in due:
            c.expire()

    def __len__(self) -> int:
        return len(self._queue)


class Collective:
    """One operation under its deadline, and what its end means.

    A class rather than a generator-based context manager because it wraps every
    collective: entering and leaving it is on the fast path. The deadline is the group's
    :class:`Watchdog`'s: when it passes, or a peer the collective needs is gone
    (:meth:`interrupt`), the task running the body is cancelled, as ``asyncio.timeout``
    does, and leaving tells that cancellation from one that came from outside.

    Raises (on leaving), as its :class:`Rules` decide:
        PeerLost: a peer it needs has gone: on entering if it had gone before, else as
            soon as the session learns of it.
        CollectiveTimeout: the deadline passed (naming the ranks to blame).
        P2PCollError: whatever failed, a peer's reported cause preferred to its symptoms.
    An error that replaces the cancellation this class made shows no chain to it: the
    cancellation is this class's own business, not the caller's.

    Cancellation: the rules see it as the body's error (they break the group) and it
    propagates.
    """

    __slots__ = ("_cancelling", "_expired", "_task", "entry", "finished", "key", "limit",
                 "lost", "name", "queued", "rules", "started", "watchdog")

    def __init__(self, rules: Rules, watchdog: Watchdog, key: OpKey, name: str,
                 limit: float, entry: object = None, started: float = 0.0) -> None:
        self.rules, self.watchdog, self.key, self.name, self.limit = (
            rules, watchdog, key, name, limit)
        # What the caller says the operation is and when it started, kept while it runs
        # for whoever lists what runs (the flight record: see FailureModel.calls).
        self.entry, self.started = entry, started
        self.lost: P2PCollError | None = None  # a peer it needs has gone (see interrupt)
        self.finished = False
        self.queued = False  # its deadline is in the watchdog's queue
        self._expired = False
        self._task: asyncio.Task[object] | None = None
        self._cancelling = 0

    async def __aenter__(self) -> None:
        self.enter()

    def enter(self) -> None:
        """What ``async with`` does as it enters, without an await: the session's runner
        enters every call with this and leaves with :meth:`leave` (or :meth:`exit`), two
        coroutines fewer per call."""
        loop = asyncio.get_running_loop()
        task = self._task = asyncio.current_task(loop)
        if task is None:
            raise RuntimeError("a collective runs in an asyncio task")
        self._cancelling = task.cancelling()
        if self.limit != math.inf:
            self.watchdog.add(self, loop.time() + self.limit)
        self.rules.started(self)

    def expire(self) -> None:
        """The deadline passed (or a peer is gone): end the body now, wherever it waits."""
        if self._expired or self.finished or self._task is None:
            return
        if self._task is asyncio.current_task():
            # From the body itself (a peer gone as it starts): at its first await, as a
            # deadline would; a body that needs no await has finished by then.
            asyncio.get_running_loop().call_soon(self.expire)
            return
        self._expired = True
        self._task.cancel()

    def interrupt(self, lost: P2PCollError) -> None:
        """End the body now, wherever it waits, and raise ``lost`` on leaving (the body
        is cancelled the one way this class already handles, and :meth:`Rules.expired`
        sees why)."""
        if self.lost is not None:
            return
        self.lost = lost
        self.expire()

    async def __aexit__(self, et: type[BaseException] | None, exc: BaseException | None,
                        tb: object) -> None:
        await self.exit(exc)

    def leave(self, exc: BaseException | None) -> bool:
        """Leave, the body having ended with ``exc`` (None: it returned), unless the deadline
        fired or a peer was lost meanwhile: then nothing is done and it returns False (leave
        with ``await exit(exc)``, which asks the rules what the expiry means). Raises what
        the rules say in place of ``exc``, as :meth:`exit`; returns True otherwise."""
        if self._expired:
            return False
        self.finished = True
        if self.queued:
            self.watchdog.done(self)
        outcome: BaseException | None
        try:
            outcome = self.rules.outcome(self, exc)
        finally:
            self.rules.ended(self)
            self._task = None  # a finished task's result is not kept alive by this
        if outcome is not None and outcome is not exc:
            self._replace(outcome, False)
        return True

    async def exit(self, exc: BaseException | None) -> None:
        """What ``async with`` does as it leaves (never suppresses: the body's error goes
        on, or what the rules say in its place is raised)."""
        if self.leave(exc):
            return
        self.finished = True
        if self.queued:
            self.watchdog.done(self)
        expired = False
        outcome: BaseException | None
        try:
            if self._task is not None:
                # Ours if no cancellation from outside is left once ours is taken back.
                expired = (self._task.uncancel() <= self._cancelling
                           and type(exc) is asyncio.CancelledError)
            if expired:
                outcome = await self.rules.expired(self)
            else:
                outcome = self.rules.outcome(self, exc)
        finally:
            self.rules.ended(self)
            self._task = None
        if outcome is not None and outcome is not exc:
            self._replace(outcome, expired)

    @staticmethod
    def _replace(outcome: BaseException, expired: bool) -> None:
        if outcome.__cause__ is None and (expired or isinstance(outcome, CollectiveTimeout)):
            # In place of the cancellation this class made, or of the symptom a timeout
            # sums up: the caller sees the one error, with no chain of internals.
            raise outcome from None
        raise outcome


__all__ = ["Collective", "Rules", "Watchdog"]
