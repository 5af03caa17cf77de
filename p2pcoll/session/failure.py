"""The failure model: one deadline per collective, abort on failure, a broken state.

A collective that fails part-way (timeout, mismatch, lost peer, cancellation) leaves the
peers in unknown states, so the rank that saw the failure tells the others (an abort
message, which makes them fail fast with the same error) and the group becomes *broken*:
every later call raises :class:`~p2pcoll.GroupBroken` chained to the first failure. Close
the group and join anew.

``async with failures.collective(seq, name, timeout):`` is the one place this happens.

A timeout names the ranks that really did not arrive. The rank whose deadline passed first
only knows whom *it* waits for, which in a ring is its neighbour, itself waiting further up
the chain. So before it breaks the group it asks every peer ``why`` (one control message
each) and waits a moment (:func:`inquiry_time`, less once everyone has answered) for their
``waiting`` answers: each peer's state in that collective (waiting, finished, not started,
failed) and the ranks it waits for. Every peer answers at once from its control dispatch,
whatever its own collectives are doing. Then it blames, in this order:

1. the peers that did not answer: frozen, overloaded or cut off;
2. else the peers that somebody waits for and that have not started the collective;
3. else the ranks it waits for itself.

Its abort carries the blamed ranks and which rule found them; for the first two, the peers'
errors name the same ranks (the third is only the sender's view: each peer names whom it
waits for itself). None of this runs unless a deadline passes.

A point-to-point transfer (``Group.send``/``Group.recv``) runs under the same model, with
its operation id ``(src, dst, tag, count)`` in place of a sequence number: one deadline,
and a failure breaks the group (the two ranks' counts no longer agree). Only its two ranks
take part, so nobody is asked why: a receive blames its sender. Its abort carries the tag,
and the peers that get it break their groups too, failing whatever they are running.

A peer that goes (lost, or gone with a goodbye) fails at once every running operation that
needs it, wherever that operation waits: a receive for its message, or a send for room in
a full queue, for a zero-copy buffer libzmq still holds, for a shared-memory ring. An
operation needs a peer that has *abandoned* it (see :meth:`FailureModel.gone_peer`): a
collective, every member that is lost or said goodbye before starting it (all of a group
take part in each of its collectives); a send, its receiver lost, or gone in any way before
the send started. A receiver's goodbye does not end a send already running: the goodbye
does not say which transfers it received, and the one thing such a send may still wait
for, once its message is out, is libzmq letting go of its zero-copy frames, which can come
after a receiver that read them has closed. (A receive
needs its sender only while its message has not come: the matcher fails it, see
:mod:`p2pcoll.engine.matching`.) The operation raises the peer's :class:`PeerLost`, the same
error its receivers get, and breaks the group as any failure does; one started after the
peer went fails as it starts. So a sender learns of a loss as soon as a receiver does: at
once for a peer whose link closes, after the heartbeat timeout for one that freezes.

An abort reaches every peer over the sparse overlay, as the news of a departure does (see
:mod:`p2pcoll.transport.overlay`), not over a link to each: the rank that failed sends it to
the peers that may not have read all it sent them (its ``told``: its open links and those
still draining; it comes after that data on their links) and to its fingers ``r + 1,
r + 2, r + 4, ...``; a peer that learns that an operation failed passes the abort on to its
own fingers, once per operation (and again only for a timeout that found whom to blame),
naming the rank whose failure it is (``origin``). So a failure costs each peer about
log2 p messages and links, whatever the size of the group, and reaches everyone within
about log2 p hops. A copy passed on may overtake what the origin sent a peer before its
abort, so a peer in the origin's ``told`` takes the origin's own copy, which comes after
that data; any other copy comes no earlier than a direct abort could have, on a link of
its own. A peer takes each (origin, operation) once (see :meth:`FailureModel.on_abort`);
whatever copy comes first, the error reads the same.

A peer that leaves after its group broke says why in its goodbye (see
:meth:`FailureModel.first_failure`: the operation, the error's class and message, the rank a
PeerLost names; and, from the session, a rank it knows to be lost), and so does the news of
that goodbye passed on over the overlay. A peer that reads it takes it as news of that loss
and as that peer's abort (:meth:`FailureModel.on_cause`) before the departure itself: a
survivor that heard of a loss first and closed at once cannot make a slower one, which reads
its goodbye before the news of the loss, fail with "rank X left the group" instead of the
lost rank's PeerLost. A goodbye after a healthy run carries nothing and reads as "rank X left
the group".

A peer that goes while nothing runs is noticed all the same (its goodbye, its link closing,
its heartbeats stopping are read by the transport whether or not a collective waits): the
group becomes *degraded* (:attr:`GroupState.DEGRADED`) at once, so a health check sees it
without waiting for the next collective, which then fails with the peer's PeerLost.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Callable, Collection
from enum import StrEnum
from typing import Any

from ..engine.matching import Matcher, OpId, channel
from ..errors import (
    REMOTE_ERRORS,
    CollectiveMismatch,
    CollectiveTimeout,
    GroupBroken,
    P2PCollError,
    PeerLost,
)
from ..departures import overlay
from ..transport.base import Transport
from ..wire import ABSENT, FAILED, FINISHED, NOT_STARTED, OWN, SILENT, WAITING, Header
from ..wire.header import MAX_CAUSE_NAME, MAX_CAUSE_TEXT

# The longest a rank whose deadline passed waits for its peers' answers (see inquiry_time).
INQUIRY_S = 1.0
# Aborts remembered (see FailureModel.on_abort): far more than a failing group sends.
MAX_ABORTS_KEPT = 1024


def inquiry_time(limit: float) -> float:
    """How long to wait for the peers' answers after a deadline of ``limit`` seconds passed:
    long enough for a live peer on a busy host to answer, short against the deadline."""
    return min(INQUIRY_S, max(0.1, limit / 2))


class GroupState(StrEnum):
    """Where a group is in its life. ``Group.state`` reports it; ``Group.cause`` says why
    a group is broken."""

    FORMING = "forming"  # join() is still finding the peers
    READY = "ready"  # collectives may run
    # A member has gone (said goodbye, or was lost: its link closed or its heartbeats
    # stopped), noticed at once even while no collective runs. A collective it had not
    # started fails with its PeerLost (and breaks the group); transfers with the members
    # still there work. Close the group and join anew.
    DEGRADED = "degraded"
    BROKEN = "broken"  # a collective failed part-way; every call raises GroupBroken
    CLOSED = "closed"  # close() was called (or join() failed)


USABLE = (GroupState.READY, GroupState.DEGRADED)  # states that calls may run in


class FailureModel:
    """The state of one group and what failures do to it."""

    def __init__(self) -> None:
        self.state = GroupState.FORMING
        self.cause: P2PCollError | None = None
        self._cause_at: tuple[int, int | None] | None = None  # where it happened (_break)
        self._rank = -1
        self._group = ""
        self._matcher: Matcher | None = None
        self._transport: Transport | None = None
        self._active: dict[OpId, Collective] = {}
        self._failed: dict[OpId, list[int]] = {}  # seq -> whom it waited for when it failed
        self._inquiries: dict[int, Inquiry] = {}  # seq -> the answers to this rank's why
        self._watchdog = Watchdog()  # every running operation's deadline, on one timer
        self._anyone_gone = False  # whether the session has recorded a departure
        # The aborts taken, by (origin, number, tag), and how much this rank has passed on
        # about each failed operation, by (number, tag) (see _pass_on): the latest
        # MAX_ABORTS_KEPT of each.
        self._seen: dict[tuple[int, int, int | None], int] = {}
        self._passed_on: dict[tuple[int, int | None], int] = {}
        # Set by the session: sends this rank's abort (see p2pcoll.departures.Departures.failed)
        self.spread_abort: Callable[[Header], None] | None = None

    def attach(self, rank: int, group_id: str, matcher: Matcher, transport: Transport) -> None:
        """The session is formed: failures from now on are reported to its peers."""
        self._rank, self._group = rank, group_id
        self._matcher, self._transport = matcher, transport
        self._anyone_gone = bool(matcher.departures.gone())
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

    def leave(self, reason: str) -> None:
        """This rank leaves while collectives are in flight: abort them. The peers are told
        it left (an abort carrying a :class:`PeerLost` that names this rank); here they
        end with :class:`GroupBroken`. Call before :meth:`close` (which mutes aborts)."""
        if not self._active or self._matcher is None or self.state not in USABLE:
            return
        seq = min(self._active, key=lambda op: channel(op)[1])  # ints and transfer ids mix
        why = f" ({reason})" if reason else ""
        self.fail(seq, PeerLost(f"rank {self._rank} left the group during collective "
                                f"#{seq}{why}", self._rank))
        self._matcher.fail(seq, GroupBroken(f"the group was closed during collective "
                                            f"#{seq}{why}"))

    def collective(self, seq: OpId, collective: str, limit: float) -> Collective:
        """``async with`` this around one collective's body: it runs under its deadline,
        and every failure turns into a broken group (see :class:`Collective`)."""
        assert self._matcher is not None, "attach() first"
        return Collective(self, self._matcher, seq, collective, limit)

    def gone_peer(self, seq: OpId, *, running: bool = False) -> PeerLost | None:
        """The :class:`PeerLost` of a peer that operation ``seq`` needs and that has
        abandoned it, or None (see the module docstring): for a collective, any member lost
        or gone before it started it; for a send, its receiver lost, or (unless the send is
        ``running`` already) gone with a goodbye; for a receive, nobody (the matcher knows
        whether its message can still come)."""
        assert self._matcher is not None
        if not self._anyone_gone:  # the session tells peer_departed of every departure
            return None
        departures = self._matcher.departures
        if not isinstance(seq, int):
            src, dst = seq[0], seq[1]
            if src != self._rank:
                return None
            if running and departures.said_goodbye(dst):
                return None  # it may well have received this one (see the docstring)
            return departures.lost(dst)
        for rank in departures.gone():
            if departures.abandoned(rank, seq):
                return departures.lost(rank)
        return None

    def peer_departed(self, rank: int) -> None:
        """``rank`` has gone (the session's record says how): every running operation that
        needs it ends now, with its :class:`PeerLost`, wherever it waits, and a ready
        group is degraded from now on, whether or not anything was running."""
        self._anyone_gone = True
        if self.state is GroupState.READY:
            self.state = GroupState.DEGRADED
        for c in list(self._active.values()):
            gone = self.gone_peer(c.seq, running=True)
            if gone is not None:
                c.interrupt(gone)  # once: a second peer's loss changes nothing

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
                    f"{_title(name, seq)}: ranks {stray} sent messages that rank {self._rank} "
                    f"did not expect; the ranks disagree about this collective"
                )
        if isinstance(err, TimeoutError):  # raised by the body, not by the deadline
            timeout = self._blame(c, None)
            self.fail(seq, timeout)
            return timeout
        if isinstance(err, P2PCollError):
            if isinstance(err, CollectiveTimeout) and getattr(err, "remote", False):
                # Another rank's deadline passed first. If it found the ranks that did not
                # come, name the same ones; if it only knew whom it waited for, name whom
                # this rank waits for. Say both.
                mine = matcher.waiting_on(seq)
                blame = getattr(err, "blame", OWN)
                local = CollectiveTimeout(
                    f"{err}; rank {self._rank} was still waiting for ranks {mine}",
                    collective=name, seq=seq if isinstance(seq, int) else seq[3],
                    waiting_on=(mine or err.waiting_on) if blame == OWN else err.waiting_on,
                )
                local.remote = True  # type: ignore[attr-defined]
                local.blame = blame  # type: ignore[attr-defined]
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

    async def _expired(self, c: Collective) -> BaseException:
        """The deadline of ``c`` passed: ask the peers why, blame, break the group.

        A peer that found whom to blame first (its abort came before or during the
        inquiry) is followed, so every rank names the same ranks.

        Cancellation: blames with the answers so far, breaks the group, propagates.
        """
        assert self._matcher is not None
        if c.lost is not None:  # not the deadline: a peer it needs is gone (see interrupt)
            cause = self._matcher.failure(c.seq)
            # A failure a peer reported for it is the root cause (as in _outcome), but not
            # the group broken by another operation that lost the same peer.
            err = cause if cause is not None and not isinstance(cause, GroupBroken) else c.lost
            self.fail(c.seq, err)
            return err
        if not isinstance(c.seq, int):  # a transfer: its one peer is the one to blame
            timeout = self._blame(c, None)
            self.fail(c.seq, timeout)
            return timeout
        remote = self._remote_timeout(c.seq)
        if remote is None:
            inquiry = self._inquire(c.seq)
            try:
                async with asyncio.timeout(inquiry_time(c.limit)):
                    await inquiry.complete.wait()
            except TimeoutError:
                pass  # some did not answer: those are the ones to blame
            except asyncio.CancelledError:
                self.fail(c.seq, self._blame(c, inquiry))
                raise
            finally:
                del self._inquiries[c.seq]
            remote = self._remote_timeout(c.seq)
            if remote is None:
                timeout = self._blame(c, inquiry)
                self.fail(c.seq, timeout)
                return timeout
        outcome = self._outcome(c, remote)
        assert outcome is not None
        return outcome

    def _remote_timeout(self, seq: OpId) -> CollectiveTimeout | None:
        """The timeout a peer reported for collective ``seq``, if it found the ranks that
        did not come (not only whom it waited for)."""
        assert self._matcher is not None
        failure = self._matcher.failure(seq)
        if (isinstance(failure, CollectiveTimeout) and getattr(failure, "remote", False)
                and getattr(failure, "blame", OWN) != OWN):
            return failure
        return None

    def _inquire(self, seq: int) -> Inquiry:
        """Ask every peer that is still there what it waits for in collective ``seq``.

        Unlike an abort, this goes to every peer (opening the links it takes): each peer's
        own answer is what is asked for, and a rank asks only when a deadline passes."""
        assert self._matcher is not None
        departures = self._matcher.departures
        asked = {p for p in range(departures.membership.world_size)
                 if p != self._rank and departures.lost(p) is None}
        inquiry = self._inquiries[seq] = Inquiry(asked)
        if asked and self._transport is not None:
            self._transport.broadcast(Header("why", self._group, self._rank, seq))
        return inquiry

    def _blame(self, c: Collective, inquiry: Inquiry | None) -> CollectiveTimeout:
        """The timeout of ``c``, naming the ranks to blame given the peers' answers (see
        the module docstring); without an inquiry, the ranks this rank waits for."""
        assert self._matcher is not None
        mine = self._matcher.waiting_on(c.seq)
        states = {self._rank: (WAITING, mine)}
        silent: list[int] = []
        if inquiry is not None:
            assert isinstance(c.seq, int), "only a collective's peers are asked why"
            states.update(inquiry.answers)
            departures = self._matcher.departures
            # A peer that said goodbye meanwhile, having started this collective, had
            # done its part: it is not one that did not come.
            silent = sorted(p for p in inquiry.asked - inquiry.answers.keys()
                            if departures.lost(p) is None or departures.abandoned(p, c.seq))
        waited = sorted({r for state, on in states.values() if state in (WAITING, FAILED)
                         for r in on})
        absent = [r for r in waited if states.get(r, ("",))[0] == NOT_STARTED]
        report: list[str] = []
        if silent:
            # Of several that did not answer, those somebody waits for are the likelier
            # cause (another may just be slow to answer).
            blamed, blame = [r for r in silent if r in waited] or silent, SILENT
            report.append(f"{_text(blamed)} did not answer (frozen, overloaded or cut off)")
        elif absent:
            blamed, blame = absent, ABSENT
            report.append(f"{_text(absent)} {'has' if len(absent) == 1 else 'have'} "
                          f"not started it")
        else:
            blamed, blame = mine or waited, OWN
            report.append(f"still waiting for ranks {blamed}")
        if inquiry is not None:
            waiting = [f"rank {r} for {on}" + (" (failed)" if state == FAILED else "")
                       for r, (state, on) in sorted(states.items())
                       if state in (WAITING, FAILED)]
            report.append("waiting: " + (", ".join(waiting) or "nobody"))
            rest = sorted(states.keys() - set(blamed))
            for what, ranks in (
                (FINISHED, [r for r in rest if states[r][0] == FINISHED]),
                (NOT_STARTED, [r for r in rest if states[r][0] == NOT_STARTED]),
                ("no answer", [r for r in silent if r not in blamed]),
            ):
                if ranks:
                    report.append(f"{what}: {_text(ranks)}")
        timeout = CollectiveTimeout(
            f"{_title(c.name, c.seq)} timed out after {c.limit:g}s on rank {self._rank}: "
            + "; ".join(report),
            collective=c.name, seq=c.seq if isinstance(c.seq, int) else c.seq[3],
            waiting_on=blamed,
        )
        timeout.blame = blame  # type: ignore[attr-defined]  # for the abort (see fail)
        return timeout

    def status(self, seq: int) -> tuple[str, list[int]]:
        """This rank's state in collective ``seq`` and the ranks its receives of it wait
        for: what it answers a peer's ``why``."""
        assert self._matcher is not None
        matcher = self._matcher
        if seq in self._failed:
            return FAILED, self._failed[seq]
        if seq in self._active:
            return (WAITING if matcher.failure(seq) is None else FAILED), matcher.waiting_on(seq)
        if matcher.finished(seq):
            return FINISHED, []
        return NOT_STARTED, []

    def answer(self, header: Header) -> None:
        """A peer whose deadline passed asks what this rank waits for in ``header.seq``."""
        if self._transport is None:
            return
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

    def fail(self, seq: OpId, err: P2PCollError) -> None:
        """Break the group with ``err``; tell the peers unless they told us."""
        if seq not in self._failed and self._matcher is not None:
            self._failed[seq] = self._matcher.waiting_on(seq)
        self._break(err, (seq, None) if isinstance(seq, int) else (seq[3], seq[2]))
        if not getattr(err, "remote", False) and self.state is not GroupState.CLOSED:
            meta = None
            if isinstance(err, CollectiveTimeout):
                meta = {"collective": err.collective, "waiting_on": err.waiting_on,
                        "blame": getattr(err, "blame", OWN)}
            elif isinstance(err, PeerLost) and err.rank is not None:
                meta = {"lost": err.rank}  # so the peers' PeerLost names it too
            if self._transport is not None:
                number, tag = (seq, None) if isinstance(seq, int) else (seq[3], seq[2])
                self._send_abort(Header(
                    "abort", self._group, self._rank, number,
                    err=[type(err).__name__, str(err)], meta=meta or {}, tag=tag,
                ))
        if self._matcher is not None:
            for other in self._active.keys() - {seq}:
                self._matcher.fail(other, GroupBroken(f"collective #{seq} failed: {err}"))

    def _send_abort(self, abort: Header) -> None:
        """Tell the peers that this rank failed ``abort``'s operation: directly the peers
        that may not have read all it sent them (``told``, see ``Transport.unread``: its
        abort comes after that on their links), and through its fingers everyone else
        (see :meth:`_pass_on`)."""
        if self.spread_abort is not None:  # the session's departures machine does it
            self.spread_abort(abort)
            return
        assert self._transport is not None and self._matcher is not None
        gone = self._matcher.departures.gone()
        told = sorted(p for p in self._transport.unread() if p not in gone)
        assert abort.meta is not None
        abort.meta["told"] = told
        for peer in told:
            self._transport.post(peer, abort)
        self._pass_on(abort, self._rank, skip=set(told))

    def _pass_on(self, abort: Header, origin: int, skip: Collection[int] = ()) -> None:
        """Forward the abort of ``origin`` to this rank's fingers (see
        :mod:`p2pcoll.transport.overlay`), the first time this rank learns that the
        operation failed somewhere, or when it learns whom a timeout of it blames: each
        peer does so about once per failed operation, so the news reaches every peer in
        about log2 p hops and costs a peer log2 p messages (and links), not p - 1."""
        if self.state is GroupState.CLOSED or self._transport is None or self._matcher is None:
            return
        op, level = (abort.seq, abort.tag), _news(abort)
        if self._passed_on.get(op, 0) >= level:
            return
        _remember(self._passed_on, op, level)
        meta = dict(abort.meta or ())
        meta.setdefault("told", [])
        if origin != self._rank:
            meta["origin"] = origin
        relay = Header("abort", self._group, self._rank, abort.seq, err=abort.err,
                       meta=meta, tag=abort.tag)
        departures = self._matcher.departures
        gone = departures.gone()
        for peer in overlay.fingers(self._rank, departures.membership.world_size, gone):
            if peer != origin and peer != abort.src and peer not in skip:
                self._transport.post(peer, relay)

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
        only), "err": [class, message], "rank": the rank a PeerLost names}``. The message
        is cut to :data:`~p2pcoll.wire.header.MAX_CAUSE_TEXT` characters."""
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
        return cause

    def on_cause(self, rank: int, cause: dict[str, Any]) -> None:
        """Peer ``rank`` has left after ``cause`` broke its group (see
        :meth:`first_failure`; validated): taken as its abort of that operation, so a
        peer that hears of the departure before (or instead of) the abort fails with the
        root cause, not only with "rank ``rank`` left the group"."""
        named = cause.get("rank")
        kind, text = cause["err"]
        self._aborted(Header(
            "abort", self._group, rank, cause["q"], err=[kind, text],
            meta=None if named is None else {"lost": named}, tag=cause.get("t"),
        ), rank, f"{text} (reported by rank {rank} as it left)")

    def on_abort(self, header: Header) -> None:
        """A peer reports that collective ``header.seq`` failed at ``origin`` (itself, or
        the rank whose abort it passes on): take it once, and pass it on.

        An abort the origin sent to this rank as well (``told``) comes after everything
        the origin sent here before it, on their link; a copy passed on by another peer may
        overtake that data, so it is left to the origin's own (as a goodbye's news is:
        see :meth:`~p2pcoll.session.session.Session.gone_from`). Any other copy can come
        no earlier than the origin's abort itself could have on a link of its own."""
        assert header.err is not None
        meta = header.meta or {}
        origin = meta.get("origin", header.src)
        if origin == self._rank or (origin != header.src and self._rank in meta.get("told", ())):
            return
        key = (origin, header.seq, header.tag)
        if key in self._seen:
            return
        _remember(self._seen, key, 1)
        self._pass_on(header, origin)
        what = (f"collective #{header.seq}" if header.tag is None
                else f"a point-to-point transfer (tag {header.tag})")
        self._aborted(header, origin, f"rank {origin} failed {what}: {header.err[1]}")

    def declared_lost(self, err: PeerLost) -> None:
        """The others declared this rank lost (it was stopped; see
        :class:`~p2pcoll.departures.DeclaredLost`): what runs fails with ``err``, naming
        this rank, and so does every later call (the group is broken)."""
        if self._matcher is None:
            return
        running = sorted(self._active, key=lambda op: channel(op)[1])
        first = running[0] if running else 0
        self._break(err, (first, None) if isinstance(first, int) else (first[3], first[2]))
        for op in running:
            self._matcher.fail(op, err)

    def taken(self, header: Header, origin: int, message: str) -> None:
        """An abort, or a goodbye's cause as one, that :class:`~p2pcoll.departures.Departures`
        took (see :class:`~p2pcoll.departures.Aborted`): apply it here."""
        self._aborted(header, origin, message)

    def _aborted(self, header: Header, origin: int, message: str) -> None:
        """The abort ``header`` of rank ``origin`` (or a goodbye's cause, as one): its
        error, saying ``message``, fails the operation it names here, or breaks the group."""
        assert header.err is not None and self._matcher is not None
        cls = REMOTE_ERRORS.get(header.err[0], P2PCollError)
        meta = header.meta or {}
        if cls is CollectiveTimeout:
            exc: P2PCollError = CollectiveTimeout(
                message, collective=str(meta.get("collective", "")), seq=header.seq,
                waiting_on=meta.get("waiting_on", []),
            )
        elif cls is PeerLost:
            exc = PeerLost(message, meta.get("lost"))
        else:
            exc = cls(message)
        blame = meta.get("blame", OWN)
        exc.remote = True  # type: ignore[attr-defined]
        exc.blame = blame  # type: ignore[attr-defined]
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
            # come, that is the answer (see _expired).
            inquiry.answers.setdefault(origin, (FAILED, []))
            found = cls is CollectiveTimeout and blame != OWN
            if found or len(inquiry.answers) == len(inquiry.asked):
                inquiry.complete.set()
        if not self._matcher.fail(header.seq, exc) and self.cause is None:
            # It had finished here: the next call must not go on, nor those running now
            # (the peer that failed will never take part in them).
            self._break(exc, (header.seq, None))
            for other in self._active:  # with the peer's error: PeerLost names a leaver
                self._matcher.fail(other, exc)

    def on_stray(self, header: Header) -> None:
        """A message for a collective that had finished here: the ranks disagreed about it."""
        if self.cause is None:
            assert self._matcher is not None
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
        self.answers: dict[int, tuple[str, list[int]]] = {}
        self.complete = asyncio.Event()
        if not asked:
            self.complete.set()


def _news(abort: Header) -> int:
    """How much an abort says, for passing it on (see :meth:`FailureModel._pass_on`): 2 for
    a timeout that found the ranks to blame (the peers then name the same ones), else 1."""
    meta = abort.meta or {}
    found = (abort.err is not None and abort.err[0] == CollectiveTimeout.__name__
             and meta.get("blame", OWN) != OWN)
    return 2 if found else 1


def _remember(memory: dict[Any, int], key: Any, value: int) -> None:
    """Keep ``key`` in a bounded memory of aborts, forgetting the oldest beyond
    :data:`MAX_ABORTS_KEPT` (a failed group sees a handful)."""
    memory.pop(key, None)
    memory[key] = value
    if len(memory) > MAX_ABORTS_KEPT:
        del memory[next(iter(memory))]


def _title(name: str, seq: OpId) -> str:
    """How errors name a collective or a transfer."""
    if isinstance(seq, int):
        return f"{name} #{seq}"
    src, dst, tag, n = seq
    return f"{name} #{n} from rank {src} to rank {dst} with tag {tag}"


def _text(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


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
    """One collective under the failure model: its deadline, and what its end means.

    A class rather than a generator-based context manager because it wraps every
    collective: entering and leaving it is on the fast path. The deadline is the group's
    :class:`Watchdog`'s: when it passes, or a peer the collective needs is gone
    (:meth:`interrupt`), the task running the body is cancelled, as ``asyncio.timeout``
    does, and leaving tells that cancellation from one that came from outside.

    Raises (on leaving):
        PeerLost: a peer it needs has gone (see :meth:`FailureModel.gone_peer`): on
            entering if it had gone before, else as soon as the session learns of it.
        CollectiveTimeout: the deadline passed (naming the ranks to blame, after asking
            the peers: up to :func:`inquiry_time` later).
        P2PCollError: whatever failed, a peer's reported cause preferred to its symptoms.
    Cancellation: breaks the group (the peers get an abort) and propagates.
    """

    __slots__ = ("_cancelling", "_expired", "_task", "finished", "limit", "lost", "matcher",
                 "model", "name", "queued", "seq")

    def __init__(self, model: FailureModel, matcher: Matcher, seq: OpId, name: str,
                 limit: float) -> None:
        self.model, self.matcher, self.seq, self.name, self.limit = (
            model, matcher, seq, name, limit)
        self.lost: PeerLost | None = None  # a peer it needs has gone (see interrupt)
        self.finished = False
        self.queued = False  # its deadline is in the watchdog's queue
        self._expired = False
        self._task: asyncio.Task[object] | None = None
        self._cancelling = 0

    async def __aenter__(self) -> None:
        model = self.model
        model._active[self.seq] = self
        loop = asyncio.get_running_loop()
        task = self._task = asyncio.current_task(loop)
        assert task is not None, "a collective runs in a task"
        self._cancelling = task.cancelling()
        if self.limit != math.inf:
            model._watchdog.add(self, loop.time() + self.limit)
        if model._anyone_gone:
            gone = model.gone_peer(self.seq)
            if gone is not None:  # gone before it started: fail at the first await
                self.interrupt(gone)

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

    def interrupt(self, lost: PeerLost) -> None:
        """End the body now, wherever it waits, and raise ``lost`` on leaving (the body
        is cancelled the one way this class already handles, and
        :meth:`FailureModel._expired` sees why)."""
        if self.lost is not None:
            return
        self.lost = lost
        self.expire()

    async def __aexit__(self, et: type[BaseException] | None, exc: BaseException | None,
                        tb: object) -> None:  # never suppresses: the body's error goes on
        outcome: BaseException | None
        self.finished = True
        model = self.model
        if self.queued:
            model._watchdog.done(self)
        try:
            expired = False
            if self._expired:
                assert self._task is not None
                # Ours if no cancellation from outside is left once ours is taken back.
                expired = (self._task.uncancel() <= self._cancelling
                           and et is asyncio.CancelledError)
            if expired:
                outcome = await model._expired(self)
            else:
                outcome = model._outcome(self, exc)
        finally:
            model._active.pop(self.seq, None)
            self.matcher.finish(self.seq)
            self._task = None  # a finished task's result is not kept alive by this
        if outcome is None or outcome is exc:
            return  # the body's own error (or none) goes on as it is
        if isinstance(outcome, CollectiveTimeout) and outcome.__cause__ is None:
            raise outcome from None
        raise outcome
