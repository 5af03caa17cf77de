"""Runs a collective's compiled program over a transport: the one place that touches
buffers and messages.

A prepared call carries its :class:`~p2pcoll.engine.program.Program`: the rank's messages in
order, each with its peer, its index on the link and the pieces it carries (whose element
ranges depend on the pipeline segment). The executor walks it: it sends views of the call's
arrays zero-copy (or as snapshots where the program says so), receives pieces and copies
or reduces them straight into the data (``ufunc(dst, src, out=dst)``), has each message's
signature checked against its own, and never writes into memory that a zero-copy send still
reads. Several segments run at once, so transfer and reduction overlap: the depth set, or
as many as fill the paths to the program's peers (:mod:`.window`). Deadlines are the
caller's. The readable signature goes to each peer once per digest (the receiving
matcher keeps it for mismatch messages).

It moves data only through the primitives it is handed (:class:`Wire`: send, receive,
fold in), by default the transport's ``send_many``, the matcher's ``get`` and
:func:`combine` themselves, unwrapped. That is the instrumentation seam: the timeline
(:mod:`.timeline`) runs a collective over traced primitives, and a profiler may install
its own in ``executor.wire``; with neither, nothing is wrapped.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import CollectiveMismatch, P2PCollError
from ..settings_env import DEFAULT_PIPELINE_DEPTH
from ..strategy import Strategy
from ..transport.base import Piece, Tracker, Transport
from ..types import OpKey
from ..wire import Header, Signature
from .matching import Departures, Key, Matcher
from .program import EARLY, LAST, LATE, REDUCE, SEND, Program
from .window import pipeline_depth

if TYPE_CHECKING:  # imported with a timeline (P2PCOLL_TIMELINE): most groups have none
    from .timeline import Timeline

Ufunc = Callable[..., Any]
MAX_TOLD = 4096  # (peer, digest) pairs remembered as described
# The most a run of collectives that never suspend holds the event loop (see Executor.run).
TURN_S = 1e-3


@dataclass(frozen=True, slots=True)
class Wire:
    """The executor's primitives, each called exactly where the executor moves data.

    Attributes:
        send_many: ``await send_many(dsts, headers, pieces, copy=...)`` queues one data
            message per destination (as :meth:`~p2pcoll.transport.base.Transport.send_many`);
            called once per group of destinations of one step's chunk.
        get: ``await get(key)`` returns the ``(header, pieces)`` of the message matching
            ``key`` (as :meth:`~p2pcoll.engine.matching.Matcher.get`); once per receive.
        combine: ``combine(header, targets, pieces, ufunc)`` folds a received message's
            pieces into ``targets`` (``ufunc`` None: copies them); once per receive.
    """

    send_many: Callable[..., Awaitable[Tracker | None]]
    get: Callable[[Key], Awaitable[tuple[Header, list[Piece]]]]
    combine: Callable[[Header, Sequence[np.ndarray], Sequence[Piece], Ufunc | None], None]

    @classmethod
    def direct(cls, transport: Transport, matcher: Matcher) -> Wire:
        """The untraced primitives: the transport's and the matcher's own bound methods."""
        return cls(transport.send_many, matcher.get, combine)


class Executor:
    """Runs schedules for one group."""

    def __init__(
        self, transport: Transport, matcher: Matcher, departures: Departures, group_id: str,
        *, segment_bytes: int, depth: int | None, max_message_bytes: int,
        timeline: Timeline | None = None, wire: Wire | None = None,
    ) -> None:
        self.transport = transport
        self.matcher = matcher
        self.departures = departures
        self.group_id = group_id
        self.segment_bytes = segment_bytes
        self.max_message_bytes = max_message_bytes
        # The segments in flight: ``depth`` if set (P2PCOLL_PIPELINE_DEPTH), else at least
        # the default, more over long paths (see depth_for). Programs compile with this.
        self.depth = DEFAULT_PIPELINE_DEPTH if depth is None else depth
        self._follow = depth is None
        self.timeline = timeline  # None: nothing recorded (one check per collective)
        self.wire = wire or Wire.direct(transport, matcher)
        self._told: set[tuple[int, bytes]] = set()  # (peer, digest) described to it
        self._turned = time.perf_counter()  # when a collective last gave the loop a turn

    async def run(
        self,
        op: OpKey,
        program: Program,
        arrays: Sequence[np.ndarray],
        ufunc: Ufunc | None,
        sig: Signature,
        meta: dict[str, Any] | None,
        strategy: Strategy,
    ) -> None:
        """Run ``program`` (this rank's compiled part of operation ``op`` with
        ``strategy``) over ``arrays``, in place: a collective, or a point-to-point transfer
        (see :mod:`p2pcoll.engine.matching`) whose count on its channel takes the sequence
        number's place in the messages.

        Raises:
            CollectiveMismatch: a peer's message carried another signature or size.
            PeerLost, P2PCollError: a peer is gone or reported a failure (abort).
        Cancellation: leaves the data partly updated; the caller must break the group.
        """
        # A collective whose sends the kernel takes at once and whose messages have come
        # never suspends its task: a loop of them (a broadcast root's, a sender's over TCP
        # lanes) would hold the event loop for ever, and with it the timers and readers
        # that learn of a lost peer. So the loop gets a turn at least every TURN_S.
        now = time.perf_counter()
        if now - self._turned > TURN_S:
            self._turned = now
            await asyncio.sleep(0)
        if self.timeline is None:
            # The usual small collective: its one segment, here. (A transfer takes _run:
            # its sender's eager-credit mark is set and cleared there.)
            if program.cuts.nseg == 1 and op.tag is None:
                rank = self._begin(op, program, sig)
                pending: list[Tracker] = []
                await self._segment(self.wire, op, 0, program, arrays, ufunc, sig, meta, rank,
                                    pending)
                if pending:
                    await _released(pending)
            else:
                await self._run(op, program, arrays, ufunc, sig, meta)
            return
        from .timeline import COLLECTIVE
        timeline, started, error = self.timeline, self.timeline.now(), None
        try:
            await self._run(op, program, arrays, ufunc, sig, meta)
        except BaseException as exc:
            error = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            args: dict[str, Any] = {
                "strategy": strategy.name, "seq": op.number,
                "bytes": sum(int(a.nbytes) for a in arrays), "segments": program.nseg}
            if op.tag is not None:
                rank = self.departures.membership.rank
                args.update(tag=op.tag, peer=op.dst if op.src == rank else op.src)
            if error is not None:
                args["error"] = error
            timeline.span(COLLECTIVE, f"{strategy.collective} #{op.number}", started, args)

    def _begin(self, op: OpKey, program: Program, sig: Signature) -> int:
        """What every run does first; returns this rank."""
        rank = self.departures.membership.rank
        self.transport.paths.drive(program.destinations)  # its links share the line
        if op.tag is None or program.sources:  # a send expects nothing, a receive op.src
            self.matcher.expect(op, sig, rank)
        return rank

    async def _run(
        self, op: OpKey, program: Program, arrays: Sequence[np.ndarray],
        ufunc: Ufunc | None, sig: Signature, meta: dict[str, Any] | None,
    ) -> None:
        rank = self._begin(op, program, sig)
        wire = self.wire
        if self.timeline is not None:  # a send, receive and fold of each step on its track
            from .timeline import Tracer
            tracer = Tracer(self.timeline, wire, program.steps, rank)
            wire = Wire(tracer.send_many, tracer.get, tracer.combine)
        flow = self.matcher.flow
        ledger = flow.ledger if flow is not None else None
        # A transfer this rank sends: what its messages may wait for (see .credit).
        sends = ledger is not None and op.tag is not None and op.src == rank
        if sends:
            ledger.begin(op, op.dst)  # type: ignore[union-attr]
        nseg = program.nseg
        # Zero-copy sends whose segment has finished: the caller may reuse the data only
        # once libzmq has let go of them, so they are awaited once, at the very end.
        pending: list[Tracker] = []
        run = self._segment
        try:
            if nseg == 1:
                await run(wire, op, 0, program, arrays, ufunc, sig, meta, rank, pending)
            else:
                window = asyncio.Semaphore(self.depth_for(program))

                async def one(seg: int) -> None:
                    async with window:
                        await run(wire, op, seg, program, arrays, ufunc, sig, meta, rank,
                                  pending)

                try:
                    async with asyncio.TaskGroup() as tg:
                        for seg in range(nseg):
                            tg.create_task(one(seg))
                except BaseExceptionGroup as group:
                    # The first segment to fail cancels the others; report its error.
                    raise _root_error(group) from None
        finally:
            if sends:
                ledger.end(op, op.dst)  # type: ignore[union-attr]
        if pending:
            await _released(pending)

    def depth_for(self, program: Program) -> int:
        """The segments of ``program`` to keep in flight: the depth set, else as many as
        fill the paths to its peers as the transport knows them now
        (:func:`~.window.pipeline_depth`; a path measured later counts from then on)."""
        if not self._follow:
            return self.depth
        paths = self.transport.paths
        return pipeline_depth([paths[peer] for peer in set(program.peer)],
                              self.segment_bytes, floor=self.depth)

    async def _segment(
        self,
        wire: Wire,
        op: OpKey,
        seg: int,
        program: Program,
        arrays: Sequence[np.ndarray],
        ufunc: Ufunc | None,
        sig: Signature,
        meta: dict[str, Any] | None,
        rank: int,
        pending: list[Tracker],
    ) -> None:
        seg_meta = meta if seg == 0 else None
        digest, group_id, lost = sig.digest, self.group_id, self.departures.lost
        told = self._told
        flow = self.matcher.flow
        ledger = flow.ledger if flow is not None else None
        # What the data headers say the collective is (a transfer's is its sender's call).
        seq, tag = op.number, op.tag
        collective = sig.fields[0] if tag is None else "send"  # (Signature.collective)
        where = program.cuts.where[seg]
        copy_bit = LATE if seg >= program.first_late else EARLY
        dsts: list[int] = []  # the send group being gathered, and its headers
        headers: list[Header] = []
        describing = False  # one of them carries the readable signature
        messages = zip(program.kind, program.peer, program.index, program.where, strict=True)
        for kind, peer, n, w in messages:
            if kind & SEND:
                gone = lost(peer)
                if gone is not None:
                    raise gone
                # The signature itself, readable, goes to each peer once per digest, so
                # that a mismatch can be described field by field (the matcher keeps it).
                described = None
                if (peer, digest) not in told:
                    described, describing = list(sig.fields), True
                # Header's fields in order: kind, group, src, seq, seg, step, sig, nbytes
                # (the transport's to fill), meta, err, shm, described, tag, collective.
                headers.append(Header("data", group_id, rank, seq, seg, n, digest, [],
                                      seg_meta, None, None, described, tag, collective))
                dsts.append(peer)
                if not kind & LAST:
                    continue
                # Eager credits (see .credit for the rule): while what no peer has credited
                # is within the window, summed, every message may go.
                if ledger is not None and ledger.total > ledger.window:
                    for to in dsts:
                        if not ledger.may_send(op, to):
                            await self._admit(op, to)
                into = where[w]
                tracker = await wire.send_many(
                    dsts, headers, _views(arrays, into.ranges), copy=kind & copy_bit != 0)
                if ledger is not None:
                    ledger.sent(op, dsts, sum(into.nbytes))
                if tracker is not None:
                    pending.append(tracker)
                if describing:
                    for h, to in zip(headers, dsts, strict=True):
                        if h.described is not None:
                            self._tell(to, digest)
                    describing = False
                dsts, headers = [], []
                continue
            into = where[w]
            header, frames = await wire.get((op, seg, peer, n))  # signature checked there
            if header.nbytes != into.nbytes:
                raise CollectiveMismatch(
                    f"collective #{seq} {sig.collective}: rank {peer} sent pieces of "
                    f"{header.nbytes} bytes for chunk {into.chunk!r}, rank {rank} "
                    f"expected {into.nbytes}"
                )
            wire.combine(header, _views(arrays, into.ranges), frames,
                         ufunc if kind & REDUCE else None)
            del frames  # release the sender's buffer now (inproc shares it)

    async def _admit(self, op: OpKey, peer: int) -> None:
        """Wait for credit to send ``peer`` a message of ``op``; meanwhile the deadline's
        inquiry hears that ``op`` waits for ``peer``."""
        self.matcher.note_waiting(op, [peer])
        try:
            await self.matcher.flow.admit(op, peer)  # type: ignore[union-attr]
        finally:
            self.matcher.note_waiting(op, ())

    def _tell(self, peer: int, digest: bytes) -> None:
        """Note that ``peer`` has been sent the readable signature of ``digest``."""
        told = self._told
        if len(told) >= MAX_TOLD:
            told.clear()  # telling again costs a few bytes; forgetting never a wrong answer
        told.add((peer, digest))


def _views(arrays: Sequence[np.ndarray], ranges: Sequence[tuple[int, int, int]]
           ) -> list[np.ndarray]:
    """The pieces of a message: element ranges ``(array, start, stop)`` of the call's flat
    arrays (a whole array itself, the usual small message's one piece: no view made)."""
    if len(ranges) == 1:
        i, a, b = ranges[0]
        arr = arrays[i]
        return [arr if a == 0 and b == len(arr) else arr[a:b]]
    return [arrays[i][a:b] for i, a, b in ranges]


def _root_error(group: BaseExceptionGroup) -> BaseException:
    """The most telling error in a task group's failure: a p2pcoll error if there is one."""
    flat: list[BaseException] = []

    def walk(g: BaseExceptionGroup) -> None:
        for exc in g.exceptions:
            walk(exc) if isinstance(exc, BaseExceptionGroup) else flat.append(exc)

    walk(group)
    for kind in (P2PCollError, Exception, BaseException):
        for exc in flat:
            if isinstance(exc, kind):
                return exc
    return group


def combine(
    header: Header, targets: Sequence[np.ndarray], frames: Sequence[Piece], ufunc: Ufunc | None
) -> None:
    """Fold the pieces ``frames`` of a received message into ``targets`` with ``ufunc``
    (``ufunc(dst, src, out=dst)``), or copy them there (``ufunc`` None), with numpy's
    floating-point errors ignored (an overflow to inf is the sum, not a warning)."""
    if _ERRORS is None:  # another numpy: its public errstate
        with np.errstate(all="ignore"):
            _fold(targets, frames, ufunc)
        return
    token = _ERRORS.set(_IGNORE)  # np.errstate(all="ignore") without its object
    try:
        _fold(targets, frames, ufunc)
    finally:
        _ERRORS.reset(token)


def _fold(targets: Sequence[np.ndarray], frames: Sequence[Piece], ufunc: Ufunc | None) -> None:
    for dst, frame in zip(targets, frames, strict=True):
        if dst.size == 0:
            continue
        src = np.frombuffer(frame.buffer, dtype=dst.dtype)
        if ufunc is None:
            np.copyto(dst, src)
        else:
            ufunc(dst, src, out=dst)


# What np.errstate(all="ignore") sets, set directly: the errstate object costs 2-4 us a
# receive (built, its state made, entered and left), the context variable 0.4 us. numpy 2
# keeps ufuncs' error handling in that variable; another numpy takes the public errstate.
def _numpy_errors() -> tuple[ContextVar[Any] | None, object]:
    """numpy's context variable of ufunc error handling and its value for "ignore all",
    or None where numpy keeps them otherwise."""
    try:
        from numpy._core import _ufunc_config as config
        return vars(config)["_extobj_contextvar"], vars(config)["_make_extobj"](all="ignore")
    except (ImportError, KeyError, TypeError):  # pragma: no cover - numpy < 2
        return None, None


_ERRORS, _IGNORE = _numpy_errors()


async def _released(trackers: list[Tracker]) -> None:
    """Wait until libzmq has let go of every zero-copy send, so the caller may reuse its data.

    libzmq signals completion on no file descriptor, so poll: a few turns of the event loop
    first (usually enough), then sleeps growing to 1 ms.
    """
    for tracker in trackers:
        spins, delay = 0, 0.0
        while not tracker.done:
            await asyncio.sleep(delay)
            spins += 1
            if spins > 8:
                delay = min(delay * 2 or 2e-5, 1e-3)


__all__ = ["Executor", "Wire", "combine"]
