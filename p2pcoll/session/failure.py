"""The failure model: one deadline per collective, abort on failure, a broken state.

A collective that fails part-way (timeout, mismatch, lost peer, cancellation) leaves the
peers in unknown states, so the rank that saw the failure tells the others (an abort
message, which makes them fail fast with the same error) and the group becomes *broken*:
every later call raises :class:`~p2pcoll.GroupBroken` chained to the first failure. Close
the group and join anew.

``async with failures.collective(key, name, timeout):`` is the one place this happens. A
timeout names the ranks that really did not arrive: before it breaks the group, the rank
whose deadline passed asks its peers ``why`` and blames by the rules of
:mod:`p2pcoll.session.blame` (the deadline itself is :mod:`p2pcoll.session.deadline`'s).
None of this runs unless a deadline passes.

A point-to-point transfer (``Group.send``/``Group.recv``) runs under the same model, with
its :class:`~p2pcoll.types.OpKey` (its channel ``(src, dst, tag)`` and its count on it) in
place of a sequence number: one deadline, and a failure breaks the group (the two ranks'
counts no longer agree). Only its two ranks take part, so nobody is asked why: a receive
blames its sender. Its abort carries the tag, and the peers that get it break their groups
too, failing whatever they are running.

A peer that goes (lost, or gone with a goodbye) fails at once every running operation that
needs it (the departures machine decides which, see :meth:`FailureModel.interrupt`: it
reads what runs from :meth:`FailureModel.running`), wherever that operation waits: a
receive for its message, or a send for room in a full queue, for a zero-copy buffer libzmq
still holds, for a shared-memory ring. An operation needs a peer that has *abandoned* it: a
collective, every member that is lost or said goodbye before starting it (all of a group
take part in each of its collectives); a send, its receiver lost, or gone in any way before
the send started. A receiver's goodbye does not end a send already running: the goodbye
does not say which transfers it received, and the one thing such a send may still wait
for, once its message is out, is libzmq letting go of its zero-copy frames, which can come
after a receiver that read them has closed. (A receive needs its sender only while its
message has not come: the matcher fails it, see :mod:`p2pcoll.engine.matching`.) It raises
the peer's :class:`PeerLost`, the same error its receivers get, and breaks the group as any
failure does; one started after the peer went fails as it starts. So a sender learns of a
loss as soon as a receiver does: at once for a peer whose link closes, after the heartbeat
timeout for one that freezes.

How aborts, goodbyes and news of a loss travel (the overlay's fingers, each operation taken
once, the cause a goodbye carries) is decided by :mod:`p2pcoll.departures`; this model makes
the abort of an operation this rank failed (:meth:`FailureModel.fail`, handed to the
session's ``spread_abort``, given at construction), and applies one the departures machine took
(:meth:`FailureModel.taken`). A peer that leaves after its group broke says why in its
goodbye (:meth:`FailureModel.first_failure`); one whose program crashed carries the crash
(:meth:`FailureModel.leave`).

A peer that goes while nothing runs is noticed all the same (its goodbye, its link closing,
its heartbeats stopping are read by the transport whether or not a collective waits): the
group becomes *degraded* (:attr:`GroupState.DEGRADED`) at once, so a health check sees it
without waiting for the next collective, which then fails with the peer's PeerLost.
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable
from enum import StrEnum
from typing import Any, Protocol

from ..engine.matching import Matcher
from ..errors import (
    CLOSED,
    CRASHED,
    REMOTE_ERRORS,
    CollectiveMismatch,
    CollectiveTimeout,
    GroupBroken,
    P2PCollError,
    PeerLost,
)
from ..transport.base import Transport
from ..types import OpKey
from ..wire import FAILED, FINISHED, NOT_STARTED, OWN, WAITING, Header
from ..wire.header import MAX_CAUSE_NAME, MAX_CAUSE_TEXT
from . import blame
from .deadline import Collective, Watchdog


class GroupState(StrEnum):
    """Where a group is in its life. ``Group.state`` reports it; ``Group.cause`` says why
    a group is broken."""

    FORMING = "forming"  # join() is still finding the peers (no Group exists yet)
    READY = "ready"  # collectives may run
    # A member has gone (said goodbye, or was lost: its link closed or its heartbeats
    # stopped), noticed at once even while no collective runs. A collective it had not
    # started fails with its PeerLost (and breaks the group); transfers with the members
    # still there work. Close the group and join anew.
    DEGRADED = "degraded"
    BROKEN = "broken"  # a collective failed part-way; every call raises GroupBroken
    CLOSED = "closed"  # close() was called (or join() failed)


USABLE = (GroupState.READY, GroupState.DEGRADED)  # states that calls may run in
_READY = GroupState.READY  # an enum member read off its class is a Python call: every call's


class Operations(Protocol):
    """Where the failure model asks about what it starts and reports what it fails (the
    session, which hands it to its departures machine, see
    :class:`p2pcoll.departures.Departures`)."""

    def starting(self, op: OpKey, needs: frozenset[int] | None, seq: int | None) -> None:
        """Operation ``op`` starts, needing ``needs`` (None: every member): a collective
        numbered ``seq``, or a transfer (``seq`` None). If a peer it needs has gone, the
        session calls :meth:`FailureModel.interrupt` at once. Asked only once a member has
        gone (the group is no longer :attr:`GroupState.READY`); until then nothing can
        fail an operation as it starts, and what runs is read from
        :meth:`FailureModel.running` when a peer goes."""
        ...

    def spread_abort(self, abort: Header) -> None:
        """This rank failed ``abort``'s operation: tell the peers."""
        ...


class FailureModel:
    """The state of one group's session and what failures do to it.

    Made by the session with what it works with: this rank, the group, the matcher (whose
    ``departures`` is the session's record of peers gone), the transport its questions go
    over, and the :class:`Operations` it reports to. It is the
    :class:`~.deadline.Rules` of every operation's :class:`~.deadline.Collective`.
    """

    def __init__(self, rank: int, group_id: str, matcher: Matcher,
                 transport: Transport, ops: Operations) -> None:
        self.state = GroupState.READY
        self.cause: P2PCollError | None = None
        self._cause_at: tuple[int, int | None] | None = None  # where it happened (_break)
        self._rank, self._group = rank, group_id
        self._matcher, self._transport = matcher, transport
        self._active: dict[OpKey, Collective] = {}
        self._failed: dict[OpKey, list[int]] = {}  # op -> whom it waited for when it failed
        self._inquiries: dict[int, Inquiry] = {}  # seq -> the answers to this rank's why
        self._watchdog = Watchdog()  # every running operation's deadline, on one timer
        self._ops = ops

    def check_usable(self) -> None:
        """Raises GroupBroken unless collectives may run."""
        if self.state in USABLE and self.cause is None:
            return  # every call asks: no enum member read off its class (a Python call)
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

    def leave(self, reason: str, crash: BaseException | None = None, next_seq: int = 0
              ) -> None:
        """This rank leaves (call before :meth:`close`, which mutes aborts). What is in
        flight is aborted: the peers get a :class:`PeerLost` naming this rank and
        ``reason``, here :class:`GroupBroken`. ``crash``: the error that made this rank's
        program close (``async with join()`` left by it): the peers' PeerLost says that it
        crashed, and why, in flight or not (its goodbye's cause, see :meth:`first_failure`,
        from collective ``next_seq``, the next it would have run, on)."""
        me = self._rank
        crashed = f"crashed ({_error_text(crash)})" if crash is not None else ""
        if self._active and self.state in USABLE:
            key = min(self._active, key=lambda op: op.number)  # collectives and transfers mix
            why = f" ({reason})" if reason else ""
            self.fail(key, PeerLost(
                f"rank {me} {crashed or 'left the group'} during "
                f"{key.title(self._active[key].name)}{why}", me,
                how=CRASHED if crash is not None else CLOSED))
            self._matcher.fail(key, GroupBroken(f"the group was closed during collective "
                                                f"#{key.number}{why}"))
        elif crash is not None and self.cause is None and self.state in USABLE:
            self._break(PeerLost(f"rank {me} {crashed} and closed the group", me,
                                 how=CRASHED), (next_seq, None))

    def collective(self, key: OpKey, collective: str, limit: float, entry: object = None,
                   started: float = 0.0) -> Collective:
        """``async with`` this around one operation's body: it runs under its deadline,
        and every failure turns into a broken group (see :class:`~.deadline.Collective`).
        ``entry`` and ``started``: what the flight record says of it, and when it started,
        listed by :meth:`calls` while it runs."""
        return Collective(self, self._watchdog, key, collective, limit, entry, started)

    def degrade(self) -> None:
        """A member has gone (the first one; see :class:`~p2pcoll.departures.Degrade`): a
        ready group is degraded from now on, whether or not anything was running."""
        if self.state is GroupState.READY:
            self.state = GroupState.DEGRADED

    def interrupt(self, op: Hashable, lost: PeerLost) -> None:
        """A peer that running operation ``op`` needs has gone (the departures machine says
        so, see :class:`~p2pcoll.departures.Fail`): it ends now, wherever it waits, with
        ``lost``."""
        c = self._active.get(op) if isinstance(op, OpKey) else None
        if c is not None:
            c.interrupt(lost)  # once: a second peer's loss changes nothing

    def abort(self, err: P2PCollError) -> None:
        """End every operation running now with ``err``, wherever it waits (each breaks
        the group and tells the peers, as any failure); for :meth:`p2pcoll.Group.shrink`
        with ``abort=True``."""
        for c in list(self._active.values()):
            c.interrupt(err)

    # --- the Rules of a Collective (see .deadline) -----------------------------------

    def started(self, c: Collective) -> None:
        key = c.key
        self._active[key] = c
        # While every member is there (READY: the first departure degrades the group) no
        # operation fails as it starts: the departures machine is not asked, and reads
        # what runs (running) when a peer goes.
        if self.state is not _READY:
            self._ops.starting(key, *self._needs(key))

    def ended(self, c: Collective) -> None:
        self._active.pop(c.key, None)
        self._matcher.finish(c.key)

    def running(self) -> list[tuple[OpKey, frozenset[int] | None, int | None]]:
        """Every running operation, with what it needs and its number (see
        :data:`p2pcoll.departures.Running`): what the departures machine reads when a peer
        goes."""
        return [(key, *self._needs(key)) for key in self._active]

    def calls(self) -> list[tuple[OpKey, Any, float]]:
        """Every running operation's key, entry and start (see :meth:`collective`): what
        the flight record lists as running."""
        return [(c.key, c.entry, c.started) for c in self._active.values()]

    def _needs(self, key: OpKey) -> tuple[frozenset[int] | None, int | None]:
        """The peers an operation needs, and a collective's number: a collective, every
        member; a send, its receiver; a receive, nobody (the matcher knows whether its
        message can still come). One gone before it started fails it at its first await
        (see Collective.interrupt)."""
        if key.tag is None:
            return None, key.number
        return (frozenset((key.dst,)) if key.src == self._rank else frozenset()), None

    def outcome(self, c: Collective, err: BaseException | None) -> BaseException | None:
        """What an operation that ended with ``err`` (None: its body returned) raises."""
        matcher, key, name = self._matcher, c.key, c.name
        if err is None:
            failure = matcher.failure(key)
            if failure is not None:
                err = failure
            else:
                stray = matcher.leftover(key)
                if not stray:
                    return None
                err = CollectiveMismatch(
                    f"{key.title(name)}: ranks {stray} sent messages that rank {self._rank} "
                    f"did not expect; the ranks disagree about this collective"
                )
        if isinstance(err, TimeoutError):  # raised by the body, not by the deadline
            timeout = self._blame(c, None)
            self.fail(key, timeout)
            return timeout
        if isinstance(err, P2PCollError):
            if isinstance(err, CollectiveTimeout) and err.origin is not None:
                # Another rank's deadline passed first: name whom it names (see
                # blame.follow), and say whom this rank was still waiting for.
                mine = matcher.waiting_on(key)
                local = CollectiveTimeout(
                    f"{err}; rank {self._rank} was still waiting for ranks {mine}",
                    collective=name, seq=key.number,
                    waiting_on=blame.follow(err.blame, err.waiting_on, mine),
                    blame=err.blame,
                )
                local.origin = err.origin
                self.fail(key, local)
                return local
            # A failure a peer reported for this collective is the root cause; a lost link
            # or a refused send that followed it is only a symptom.
            cause = matcher.failure(key)
            if isinstance(err, (PeerLost, GroupBroken)) and cause is not None and cause is not err:
                self.fail(key, cause)
                cause.__cause__ = err
                return cause
            self.fail(key, err)
            return err
        self.fail(key, GroupBroken(f"{key.title(name)} was interrupted: {err!r}"))
        return err

    async def expired(self, c: Collective) -> BaseException:
        """The deadline of ``c`` passed: ask the peers why, blame, break the group.

        A peer that found whom to blame first (its abort came before or during the
        inquiry) is followed, so every rank names the same ranks.

        Cancellation: blames with the answers so far, breaks the group, propagates.
        """
        key = c.key
        if c.lost is not None:  # not the deadline: a peer it needs is gone (see interrupt)
            cause = self._matcher.failure(key)
            # A failure a peer reported for it is the root cause (as in outcome), but not
            # the group broken by another operation that lost the same peer.
            err = cause if cause is not None and not isinstance(cause, GroupBroken) else c.lost
            self.fail(key, err)
            return err
        if key.is_transfer:  # its one peer is the one to blame
            timeout = self._blame(c, None)
            self.fail(key, timeout)
            return timeout
        remote = self._remote_timeout(key)
        if remote is None:
            inquiry = self._inquire(key.number)
            try:
                async with asyncio.timeout(blame.inquiry_time(c.limit)):
                    await inquiry.complete.wait()
            except TimeoutError:
                pass  # some did not answer: those are the ones to blame
            except asyncio.CancelledError:
                self.fail(key, self._blame(c, inquiry))
                raise
            finally:
                del self._inquiries[key.number]
            remote = self._remote_timeout(key)
            if remote is None:
                timeout = self._blame(c, inquiry)
                self.fail(key, timeout)
                return timeout
        outcome = self.outcome(c, remote)
        assert outcome is not None  # a remote timeout is never the body's own
        return outcome

    def _remote_timeout(self, key: OpKey) -> CollectiveTimeout | None:
        """The timeout a peer reported for collective ``key``, if it found the ranks that
        did not come (not only whom it waited for)."""
        failure = self._matcher.failure(key)
        if (isinstance(failure, CollectiveTimeout) and failure.origin is not None
                and blame.is_found(failure.blame)):
            return failure
        return None

    def _inquire(self, seq: int) -> Inquiry:
        """Ask every peer that is still there what it waits for in collective ``seq``.

        Unlike an abort, this goes to every peer (opening the links it takes): each peer's
        own answer is what is asked for, and a rank asks only when a deadline passes."""
        departures = self._matcher.departures
        asked = {p for p in range(departures.membership.world_size)
                 if p != self._rank and departures.lost(p) is None}
        inquiry = self._inquiries[seq] = Inquiry(asked)
        why = Header("why", self._group, self._rank, seq)
        for peer in sorted(asked):
            self._transport.post(peer, why)
        return inquiry

    def _blame(self, c: Collective, inquiry: Inquiry | None) -> CollectiveTimeout:
        """The timeout of ``c``, naming the ranks to blame given the peers' answers (see
        :mod:`.blame`); without an inquiry, the ranks this rank waits for."""
        key = c.key
        mine = self._matcher.waiting_on(key)
        if inquiry is None:
            verdict = blame.judge(self._rank, mine)
        else:
            departures = self._matcher.departures
            # A peer that said goodbye meanwhile, having started this collective, had
            # done its part: it is not one that did not come.
            excused = [p for p in inquiry.asked if departures.lost(p) is not None
                       and not departures.abandoned(p, key.number)]
            verdict = blame.judge(self._rank, mine, inquiry.answers, inquiry.asked, excused)
        return CollectiveTimeout(
            f"{key.title(c.name)} timed out after {c.limit:g}s on rank {self._rank}: "
            f"{verdict.report}",
            collective=c.name, seq=key.number, waiting_on=verdict.blamed, blame=verdict.rule,
        )

    def status(self, seq: int) -> tuple[str, list[int]]:
        """This rank's state in collective ``seq`` and the ranks its receives of it wait
        for: what it answers a peer's ``why``."""
        matcher, key = self._matcher, OpKey(seq)
        if key in self._failed:
            return FAILED, self._failed[key]
        if key in self._active:
            return (WAITING if matcher.failure(key) is None else FAILED), matcher.waiting_on(key)
        if matcher.finished(key):
            return FINISHED, []
        return NOT_STARTED, []

    def answer(self, header: Header) -> None:
        """A peer whose deadline passed asks what this rank waits for in ``header.seq``."""
        state, waiting = self.status(header.seq)
        self._transport.post(header.src, Header(
            "waiting", self._group, self._rank, header.seq,
            meta={"state": state, "waiting_on": waiting},
        ))

    def on_answer(self, header: Header) -> None:
        """A peer's answer to this rank's ``why``; late or unasked-for answers are ignored."""
        inquiry = self._inquiries.get(header.seq)
        if inquiry is None or header.src not in inquiry.asked:
            return
        meta = header.meta or {}
        inquiry.answers[header.src] = (str(meta.get("state", WAITING)),
                                       list(meta.get("waiting_on", [])))
        if len(inquiry.answers) == len(inquiry.asked):
            inquiry.complete.set()

    def fail(self, key: OpKey, err: P2PCollError) -> None:
        """Break the group with ``err``; tell the peers unless they told us."""
        if key not in self._failed:
            self._failed[key] = self._matcher.waiting_on(key)
        self._break(err, (key.number, key.tag))
        if err.origin is None and self.state is not GroupState.CLOSED:
            meta: dict[str, Any] | None = None
            if isinstance(err, CollectiveTimeout):
                meta = {"collective": err.collective, "waiting_on": err.waiting_on,
                        "blame": err.blame}
            elif isinstance(err, PeerLost) and err.rank is not None:
                meta = {"lost": err.rank}  # so the peers' PeerLost names it too (and how)
                if err.how:
                    meta["how"] = err.how
            self._send_abort(Header(
                "abort", self._group, self._rank, key.number,
                err=[type(err).__name__, str(err)], meta=meta or {}, tag=key.tag,
            ))
        for other in self._active.keys() - {key}:
            self._matcher.fail(other, GroupBroken(f"collective #{key.number} failed: {err}"))

    def _send_abort(self, abort: Header) -> None:
        """Tell the peers that this rank failed ``abort``'s operation: the session's
        departures machine says whom (see :meth:`p2pcoll.departures.Departures.failed`)."""
        self._ops.spread_abort(abort)

    def _break(self, err: P2PCollError, at: tuple[int, int | None]) -> None:
        """The group is broken by ``err`` (in collective ``at[0]``, or the transfer with
        count ``at[0]`` and tag ``at[1]``), unless something broke it before."""
        if self.cause is None:
            self.cause = err
            self._cause_at = at
            if self.state in USABLE:
                self.state = GroupState.BROKEN

    def first_failure(self) -> dict[str, Any] | None:
        """What broke this group, as this peer's goodbye carries it (its ``cause``, see
        :meth:`on_cause`), or None if nothing did: ``{"q": number, "t": tag (a transfer
        only), "err": [class, message], "rank": the rank a PeerLost names, "how": how it
        went, if known}``. The message is cut to
        :data:`~p2pcoll.wire.header.MAX_CAUSE_TEXT` characters."""
        err = self.cause
        if err is None or self._cause_at is None:
            return None
        number, tag = self._cause_at
        text = str(err)
        if len(text) > MAX_CAUSE_TEXT:
            text = text[:MAX_CAUSE_TEXT - 3] + "..."
        cause: dict[str, Any] = {"q": number,
                                 "err": [type(err).__name__[:MAX_CAUSE_NAME], text]}
        if tag is not None:
            cause["t"] = tag
        if isinstance(err, PeerLost) and err.rank is not None:
            cause["rank"] = err.rank
            if err.how:
                cause["how"] = err.how
        return cause

    def declared_lost(self, err: PeerLost) -> None:
        """The others declared this rank lost (it was stopped; see
        :class:`~p2pcoll.departures.DeclaredLost`): what runs fails with ``err``, naming
        this rank, and so does every later call (the group is broken)."""
        running = sorted(self._active, key=lambda op: op.number)
        first = running[0] if running else OpKey(0)
        self._break(err, (first.number, first.tag))
        for op in running:
            self._matcher.fail(op, err)

    def taken(self, header: Header, origin: int, message: str) -> None:
        """An abort, or a goodbye's cause as one, that :class:`~p2pcoll.departures.Departures`
        took (see :class:`~p2pcoll.departures.Aborted`): apply it here."""
        self._aborted(header, origin, message)

    def _aborted(self, header: Header, origin: int, message: str) -> None:
        """The abort ``header`` of rank ``origin`` (or a goodbye's cause, as one): its
        error, saying ``message``, fails the operation it names here, or breaks the group."""
        assert header.err is not None
        cls = REMOTE_ERRORS.get(header.err[0], P2PCollError)
        meta = header.meta or {}
        rule = meta.get("blame", OWN)
        if cls is CollectiveTimeout:
            exc: P2PCollError = CollectiveTimeout(
                message, collective=str(meta.get("collective", "")), seq=header.seq,
                waiting_on=meta.get("waiting_on", []), blame=rule,
            )
        elif cls is PeerLost:
            exc = PeerLost(message, meta.get("lost"), how=meta.get("how", ""))
        else:
            exc = cls(message)
        exc.origin = origin
        if header.tag is not None:
            # The two ranks of a transfer disagree now: this rank's group is broken too.
            self._break(exc, (header.seq, header.tag))
            for op in list(self._active):
                self._matcher.fail(op, exc)
            return
        inquiry = self._inquiries.get(header.seq)
        if inquiry is not None and origin in inquiry.asked:
            # This rank is asking why the collective is stuck: the peer has failed it (it
            # is alive, or it left after that), and if it has found the ranks that did not
            # come, that is the answer (see expired).
            inquiry.answers.setdefault(origin, (FAILED, []))
            found = cls is CollectiveTimeout and blame.is_found(rule)
            if found or len(inquiry.answers) == len(inquiry.asked):
                inquiry.complete.set()
        if not self._matcher.fail(OpKey(header.seq), exc) and self.cause is None:
            # It had finished here: the next call must not go on, nor those running now
            # (the peer that failed will never take part in them).
            self._break(exc, (header.seq, None))
            for other in self._active:  # with the peer's error: PeerLost names a leaver
                self._matcher.fail(other, exc)

    def on_stray(self, header: Header) -> None:
        """A message for a collective that had finished here: the ranks disagreed about it."""
        if self.cause is None:
            what = (f"collective #{header.seq}" if header.tag is None
                    else f"transfer #{header.seq} with tag {header.tag}")
            self.fail(self._matcher.op_of(header), CollectiveMismatch(
                f"rank {header.src} sent a message for {what} "
                f"that rank {self._rank} did not expect"
            ))


class Inquiry:
    """The answers to one rank's ``why`` about one collective, by peer: (state, waits)."""

    __slots__ = ("answers", "asked", "complete")

    def __init__(self, asked: set[int]) -> None:
        self.asked = asked
        self.answers: dict[int, blame.State] = {}
        self.complete = asyncio.Event()
        if not asked:
            self.complete.set()


def _error_text(err: BaseException) -> str:
    """``ValueError: boom``: an error in one line, as a peer's message quotes it."""
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0]}" if text else type(err).__name__


__all__ = ["USABLE", "FailureModel", "GroupState", "Inquiry", "Operations"]
