"""Runs a strategy's plan over a transport: the one place that touches buffers and messages.

For each pipeline segment the executor walks the plan: it sends chunk views zero-copy,
receives pieces into ``np.frombuffer`` views and copies or reduces them straight into the
preallocated data (``ufunc(dst, src, out=dst)``), has each message's signature checked
against its own, and never writes into memory that a zero-copy send still reads. Up to
``depth`` segments run at once, so transfer and reduction overlap. Deadlines are the
caller's.

It moves data only through the primitives it is handed (:class:`Wire`: send, receive,
fold in), by default the transport's ``send_many``, the matcher's ``get`` and
:func:`combine` themselves, unwrapped. That is the instrumentation seam: the timeline
(:mod:`.timeline`) runs a collective over traced primitives, and a profiler may install
its own in ``executor.wire``; with neither, nothing is wrapped.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import CollectiveMismatch, P2PCollError
from ..strategy import Context, Reduce, Send, Strategy
from ..transport.base import Piece, Tracker, Transport
from ..wire import Header, Signature
from .layout import Layout
from .matching import Departures, Key, Matcher
from .plan import Steps, copies, plan, send_groups
from .timeline import COLLECTIVE, Timeline, Tracer

Ufunc = Callable[..., Any]


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
        *, segment_bytes: int, depth: int, max_message_bytes: int,
        timeline: Timeline | None = None, wire: Wire | None = None,
    ) -> None:
        self.transport = transport
        self.matcher = matcher
        self.departures = departures
        self.group_id = group_id
        self.segment_bytes = segment_bytes
        self.max_message_bytes = max_message_bytes
        self.depth = depth
        self.timeline = timeline  # None: nothing recorded (one check per collective)
        self.wire = wire or Wire.direct(transport, matcher)

    async def run(
        self,
        *,
        seq: int,
        strategy: Strategy,
        ctx: Context,
        layout: Layout,
        ufunc: Ufunc | None,
        sig: Signature,
        meta: dict[str, Any] | None = None,
        tag: int | None = None,
    ) -> None:
        """Run ``strategy`` for collective ``seq`` over ``layout``, in place.

        With a ``tag`` it is a point-to-point transfer instead (see
        :mod:`p2pcoll.engine.matching`): ``seq`` is its count on the (peer, tag) channel.

        Raises:
            CollectiveMismatch: a peer's message carried another signature or size.
            PeerLost, P2PCollError: a peer is gone or reported a failure (abort).
        Cancellation: leaves the data partly updated; the caller must break the group.
        """
        if self.timeline is None:
            await self._run(seq, strategy, ctx, layout, ufunc, sig, meta, tag)
            return
        timeline, started, error = self.timeline, Timeline.now(), None
        try:
            await self._run(seq, strategy, ctx, layout, ufunc, sig, meta, tag)
        except BaseException as exc:
            error = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            args: dict[str, Any] = {
                "strategy": strategy.name, "seq": seq,
                "bytes": sum(int(a.nbytes) for a in layout.arrays), "segments": layout.nseg}
            if tag is not None:
                args.update(tag=tag, peer=ctx.root)
            if error is not None:
                args["error"] = error
            timeline.span(COLLECTIVE, f"{strategy.collective} #{seq}", started, args)

    async def _run(
        self, seq: int, strategy: Strategy, ctx: Context, layout: Layout,
        ufunc: Ufunc | None, sig: Signature, meta: dict[str, Any] | None,
        tag: int | None,
    ) -> None:
        steps = plan(strategy, ctx, len(layout.chunks))
        if tag is None:
            self.matcher.expect(seq, sig, ctx.rank)
        else:
            for frm in {op.frm for ops in steps for op in ops if not isinstance(op, Send)}:
                self.matcher.expect((frm, ctx.rank, tag, seq), sig, ctx.rank)
        wire = self.wire
        if self.timeline is not None:  # a send, receive and fold of each step on its track
            tracer = Tracer(self.timeline, wire, steps, ctx.rank)
            wire = Wire(tracer.send_many, tracer.get, tracer.combine)
        nseg = layout.segment(self.segment_bytes, self.max_message_bytes)
        early, late = copies(steps, len(layout.chunks))
        first_late = max(nseg - self.depth, 0)
        # Zero-copy sends whose segment has finished: the caller may reuse the data only
        # once libzmq has let go of them, so they are awaited once, at the very end.
        pending: list[Tracker] = []
        run = self._segment
        if nseg == 1:
            await run(wire, seq, 0, steps, late, layout, ufunc, sig, meta, ctx.rank, pending, tag)
        else:
            window = asyncio.Semaphore(self.depth)

            async def one(seg: int) -> None:
                async with window:
                    copy = late if seg >= first_late else early
                    await run(wire, seq, seg, steps, copy, layout, ufunc, sig, meta, ctx.rank,
                              pending, tag)

            try:
                async with asyncio.TaskGroup() as tg:
                    for seg in range(nseg):
                        tg.create_task(one(seg))
            except BaseExceptionGroup as group:
                # The first segment to fail cancels the others; report its error.
                raise _root_error(group) from None
        await _released(pending)

    async def _segment(
        self,
        wire: Wire,
        seq: int,
        seg: int,
        steps: Steps,
        copied: frozenset[tuple[int, int]],
        layout: Layout,
        ufunc: Ufunc | None,
        sig: Signature,
        meta: dict[str, Any] | None,
        rank: int,
        pending: list[Tracker],
        tag: int | None,
    ) -> None:
        sent: defaultdict[int, int] = defaultdict(int)
        received: defaultdict[int, int] = defaultdict(int)
        seg_meta = meta if seg == 0 else None
        groups = send_groups(steps)
        for i, ops in enumerate(steps):
            for chunk, group in groups[i]:
                headers = []
                for _, to in group:
                    gone = self.departures.lost(to)
                    if gone is not None:
                        raise gone
                    # The first message on a link also says what the signature is, so a
                    # mismatch can be described field by field.
                    first = seg == 0 and sent[to] == 0
                    headers.append(Header(
                        "data", self.group_id, rank, seq, seg, sent[to], sig.digest,
                        meta=seg_meta, described=list(sig.fields) if first else None, tag=tag,
                    ))
                    sent[to] += 1
                tracker = await wire.send_many(
                    [to for _, to in group], headers, layout.pieces(chunk, seg),
                    copy=any((i, j) in copied for j, _ in group),
                )
                if tracker is not None:
                    pending.append(tracker)
            for op in ops:
                if isinstance(op, Send):
                    continue
                key: Key = (seq if tag is None else (op.frm, rank, tag, seq), seg, op.frm,
                            received[op.frm])
                received[op.frm] += 1
                header, frames = await wire.get(key)  # signature checked there
                targets = layout.pieces(op.chunk, seg)
                sizes = [t.nbytes for t in targets]
                if header.nbytes != sizes:
                    raise CollectiveMismatch(
                        f"collective #{seq} {sig.collective}: rank {op.frm} sent pieces of "
                        f"{header.nbytes} bytes for chunk {op.chunk!r}, rank {rank} expected "
                        f"{sizes}"
                    )
                wire.combine(header, targets, frames, ufunc if isinstance(op, Reduce) else None)
                del frames  # release the sender's buffer now (inproc shares it)


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
    (``ufunc(dst, src, out=dst)``), or copy them there (``ufunc`` None)."""
    with np.errstate(all="ignore"):
        for dst, frame in zip(targets, frames, strict=True):
            if dst.size == 0:
                continue
            src = np.frombuffer(frame.buffer, dtype=dst.dtype)
            if ufunc is None:
                np.copyto(dst, src)
            else:
                ufunc(dst, src, out=dst)


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
