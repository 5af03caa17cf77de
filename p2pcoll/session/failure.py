"""The failure model: one deadline per collective, abort on failure, a broken state.

A collective that fails part-way (timeout, mismatch, lost peer, cancellation) leaves the
peers in unknown states, so the rank that saw the failure tells the others (an abort
message, which makes them fail fast with the same error) and the group becomes *broken*:
every later call raises :class:`~p2pcoll.GroupBroken` chained to the first failure. Close
the group and join anew.

``async with failures.collective(seq, name, timeout):`` is the one place this happens.
"""

from __future__ import annotations

import asyncio
from enum import StrEnum

from ..engine.matching import Matcher
from ..errors import (
    REMOTE_ERRORS,
    CollectiveMismatch,
    CollectiveTimeout,
    GroupBroken,
    P2PCollError,
    PeerLost,
)
from ..transport.base import Transport
from ..wire import Header


class GroupState(StrEnum):
    """Where a group is in its life. ``Group.state`` reports it; ``Group.cause`` says why
    a group is broken."""

    FORMING = "forming"  # join() is still finding the peers
    READY = "ready"  # collectives may run
    BROKEN = "broken"  # a collective failed part-way; every call raises GroupBroken
    CLOSED = "closed"  # close() was called (or join() failed)


class FailureModel:
    """The state of one group and what failures do to it."""

    def __init__(self) -> None:
        self.state = GroupState.FORMING
        self.cause: P2PCollError | None = None
        self._rank = -1
        self._group = ""
        self._matcher: Matcher | None = None
        self._transport: Transport | None = None
        self._active: set[int] = set()

    def attach(self, rank: int, group_id: str, matcher: Matcher, transport: Transport) -> None:
        """The session is formed: failures from now on are reported to its peers."""
        self._rank, self._group = rank, group_id
        self._matcher, self._transport = matcher, transport
        if self.state is GroupState.FORMING:
            self.state = GroupState.READY

    def check_usable(self) -> None:
        """Raises GroupBroken unless collectives may run."""
        if self.state is GroupState.CLOSED:
            raise GroupBroken("the group is closed")
        if self.state is GroupState.FORMING:
            raise GroupBroken("the group has not formed yet")
        if self.cause is not None:
            raise GroupBroken(
                f"the group is unusable after an earlier failure: {self.cause}"
            ) from self.cause

    def close(self) -> None:
        self.state = GroupState.CLOSED

    def collective(self, seq: int, collective: str, limit: float) -> Collective:
        """``async with`` this around one collective's body: it runs under its deadline,
        and every failure turns into a broken group (see :class:`Collective`)."""
        assert self._matcher is not None, "attach() first"
        return Collective(self, self._matcher, seq, collective, limit)

    def _outcome(self, c: Collective, err: BaseException | None) -> BaseException | None:
        """What a collective that ended with ``err`` (None: its body returned) raises."""
        matcher, seq, name = c.matcher, c.seq, c.name
        if err is None:
            failure = matcher.failure(seq)
            if failure is not None:
                err = failure
            else:
                stray = matcher.leftover(seq)
                if not stray:
                    return None
                err = CollectiveMismatch(
                    f"{name} #{seq}: ranks {stray} sent messages that rank {self._rank} "
                    f"did not expect; the ranks disagree about this collective"
                )
        if isinstance(err, TimeoutError):
            waiting = matcher.waiting_on(seq)
            timeout = CollectiveTimeout(
                f"{name} #{seq} timed out after {c.limit:g}s on rank {self._rank}; "
                f"still waiting for ranks {waiting}",
                collective=name, seq=seq, waiting_on=waiting,
            )
            self.fail(seq, timeout)
            return timeout
        if isinstance(err, P2PCollError):
            if isinstance(err, CollectiveTimeout) and getattr(err, "remote", False):
                # Another rank's deadline passed first: say whom this rank was waiting for
                # too, which is closer to the rank that never came.
                mine = matcher.waiting_on(seq)
                local = CollectiveTimeout(
                    f"{err}; rank {self._rank} was still waiting for ranks {mine}",
                    collective=name, seq=seq, waiting_on=mine or err.waiting_on,
                )
                local.remote = True  # type: ignore[attr-defined]
                self.fail(seq, local)
                return local
            # A failure a peer reported for this collective is the root cause; a lost link
            # or a refused send that followed it is only a symptom.
            cause = matcher.failure(seq)
            if isinstance(err, (PeerLost, GroupBroken)) and cause is not None and cause is not err:
                self.fail(seq, cause)
                cause.__cause__ = err
                return cause
            self.fail(seq, err)
            return err
        self.fail(seq, GroupBroken(f"{name} #{seq} was interrupted: {err!r}"))
        return err

    def fail(self, seq: int, err: P2PCollError) -> None:
        """Break the group with ``err``; tell the peers unless they told us."""
        if self.cause is None:
            self.cause = err
            if self.state is GroupState.READY:
                self.state = GroupState.BROKEN
        if not getattr(err, "remote", False) and self.state is not GroupState.CLOSED:
            meta = None
            if isinstance(err, CollectiveTimeout):
                meta = {"collective": err.collective, "waiting_on": err.waiting_on}
            if self._transport is not None:
                self._transport.broadcast(Header(
                    "abort", self._group, self._rank, seq,
                    err=[type(err).__name__, str(err)], meta=meta,
                ))
        if self._matcher is not None:
            for other in self._active - {seq}:
                self._matcher.fail(other, GroupBroken(f"collective #{seq} failed: {err}"))

    def on_abort(self, header: Header) -> None:
        """A peer reports that collective ``header.seq`` failed there."""
        assert header.err is not None and self._matcher is not None
        cls = REMOTE_ERRORS.get(header.err[0], P2PCollError)
        message = f"rank {header.src} failed collective #{header.seq}: {header.err[1]}"
        meta = header.meta or {}
        if cls is CollectiveTimeout:
            exc: P2PCollError = CollectiveTimeout(
                message, collective=str(meta.get("collective", "")), seq=header.seq,
                waiting_on=meta.get("waiting_on", []),
            )
        elif cls is PeerLost:
            exc = PeerLost(message)
        else:
            exc = cls(message)
        exc.remote = True  # type: ignore[attr-defined]
        if not self._matcher.fail(header.seq, exc) and self.cause is None:
            # It had finished here: the next call must not go on.
            self.cause = exc
            if self.state is GroupState.READY:
                self.state = GroupState.BROKEN

    def on_stray(self, header: Header) -> None:
        """A message for a collective that had finished here: the ranks disagreed about it."""
        if self.cause is None:
            self.fail(header.seq, CollectiveMismatch(
                f"rank {header.src} sent a message for collective #{header.seq} "
                f"that rank {self._rank} did not expect"
            ))


class Collective:
    """One collective under the failure model: its deadline, and what its end means.

    A class rather than a generator-based context manager because it wraps every
    collective: entering and leaving it is on the fast path.

    Raises (on leaving):
        CollectiveTimeout: the deadline passed (naming the ranks still awaited).
        P2PCollError: whatever failed, a peer's reported cause preferred to its symptoms.
    Cancellation: breaks the group (the peers get an abort) and propagates.
    """

    __slots__ = ("model", "matcher", "seq", "name", "limit", "_deadline")

    def __init__(self, model: FailureModel, matcher: Matcher, seq: int, name: str,
                 limit: float) -> None:
        self.model, self.matcher, self.seq, self.name, self.limit = (
            model, matcher, seq, name, limit)
        self._deadline = asyncio.timeout(limit)

    async def __aenter__(self) -> None:
        self.model._active.add(self.seq)
        await self._deadline.__aenter__()

    async def __aexit__(self, et: type[BaseException] | None, exc: BaseException | None,
                        tb: object) -> None:  # never suppresses: the body's error goes on
        try:
            try:
                await self._deadline.__aexit__(et, exc, tb)  # type: ignore[arg-type]
            except TimeoutError as expired:
                outcome = self.model._outcome(self, expired)
            else:
                outcome = self.model._outcome(self, exc)
        finally:
            self.model._active.discard(self.seq)
            self.matcher.finish(self.seq)
        if outcome is None or outcome is exc:
            return  # the body's own error (or none) goes on as it is
        if isinstance(outcome, CollectiveTimeout) and outcome.__cause__ is None:
            raise outcome from None
        raise outcome
