"""Runs a strategy's schedule over the mesh: the one place that touches buffers and messages.

For each pipeline segment the executor walks the schedule: it sends chunk views zero-copy,
receives frames into ``np.frombuffer`` views and copies or reduces them straight into the
preallocated data (``ufunc(dst, src, out=dst)``), checks each message's signature against
its own, and never writes into memory that a zero-copy send still reads. Up to ``depth``
segments run at once, so transfer and reduction overlap. Deadlines are the caller's.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Callable
from functools import lru_cache
from typing import Any

import numpy as np
import zmq

from .errors import CollectiveMismatch, P2PCollError, PluginValidationError
from .layout import Layout
from .strategy import ALL, Context, Op, Recv, Reduce, Send, Strategy, _All
from .transport.mailbox import Mailbox
from .transport.mesh import Mesh
from .wire import Header

@lru_cache(maxsize=1024)
def plan(strategy: Strategy, ctx: Context, nchunks: int) -> tuple[tuple[Op, ...], ...]:
    """Materialise and validate one rank's schedule (cached: it depends on nothing else)."""
    steps: list[tuple[Op, ...]] = []
    where = f"strategy {strategy.name!r} ({strategy.collective}) on rank {ctx.rank} of {ctx.size}"
    for step in strategy.schedule(ctx):
        ops = (step,) if isinstance(step, (Send, Recv, Reduce)) else tuple(step)
        peers_out: set[int] = set()
        peers_in: set[int] = set()
        for op in ops:
            if not isinstance(op, (Send, Recv, Reduce)):
                raise PluginValidationError(f"{where} yielded {op!r}, not Send/Recv/Reduce")
            peer = op.to if isinstance(op, Send) else op.frm
            if not (0 <= peer < ctx.size) or peer == ctx.rank:
                raise PluginValidationError(f"{where} yielded {op!r}: no such peer")
            seen = peers_out if isinstance(op, Send) else peers_in
            if peer in seen:
                raise PluginValidationError(f"{where} yielded two ops with rank {peer} in one step")
            seen.add(peer)
            _check_chunk(op, nchunks, where)
        steps.append(ops)
    return tuple(steps)


@lru_cache(maxsize=1024)
def snapshots(steps: tuple[tuple[Op, ...], ...], nchunks: int) -> frozenset[tuple[int, int]]:
    """The sends (step, op index) whose chunk is written again later in the schedule.

    Those are sent as copies; every other send goes zero-copy from the data. So no receive
    ever waits for libzmq to let go of memory it is about to overwrite (which over a busy
    link can take as long as the transfer itself).
    """
    def ids(chunk: object) -> range:
        if isinstance(chunk, _All):
            return range(nchunks)
        return chunk if isinstance(chunk, range) else range(chunk, chunk + 1)  # type: ignore[operator]

    out = set()
    for i, ops in enumerate(steps):
        for j, op in enumerate(ops):
            if not isinstance(op, Send):
                continue
            sent = ids(op.chunk)
            for later in steps[i:]:
                if any(not isinstance(w, Send) and _overlap(sent, ids(w.chunk)) for w in later):
                    out.add((i, j))
                    break
    return frozenset(out)


@lru_cache(maxsize=1024)
def copies(
    steps: tuple[tuple[Op, ...], ...], nchunks: int
) -> tuple[frozenset[tuple[int, int]], frozenset[tuple[int, int]]]:
    """The sends that go as copies: in every segment, and in the last ``depth`` segments.

    Every segment copies its :func:`snapshots`. The last segments also copy the sends of
    the last step that sends anything: the collective returns only once libzmq has let go
    of every zero-copy send, and the last ones are still on the wire when the last receive
    completes. Copying them (at most ``depth`` segments' worth) costs less than waiting for
    their release, which pyzmq reports through a thread that needs the GIL.
    """
    early = snapshots(steps, nchunks)
    for i in range(len(steps) - 1, -1, -1):
        final = frozenset((i, j) for j, op in enumerate(steps[i]) if isinstance(op, Send))
        if final:
            return early, early | final
    return early, early


@lru_cache(maxsize=1024)
def send_groups(
    steps: tuple[tuple[Op, ...], ...],
) -> tuple[tuple[tuple[Any, tuple[tuple[int, int], ...]], ...], ...]:
    """Per step, its sends grouped by chunk: ((chunk, ((op index, peer), ...)), ...).

    A chunk sent to several peers in one step (a root's broadcast) is handed to the mesh
    once, which then copies it into shared memory once for all of them.
    """
    out = []
    for ops in steps:
        groups: dict[Any, list[tuple[int, int]]] = {}
        for j, op in enumerate(ops):
            if isinstance(op, Send):
                groups.setdefault(op.chunk, []).append((j, op.to))
        out.append(tuple((chunk, tuple(g)) for chunk, g in groups.items()))
    return tuple(out)


def _overlap(a: range, b: range) -> bool:
    return a.start < b.stop and b.start < a.stop and len(a) > 0 and len(b) > 0


def _check_chunk(op: Op, nchunks: int, where: str) -> None:
    c = op.chunk
    ok = (
        isinstance(c, _All)
        or (isinstance(c, int) and 0 <= c < nchunks)
        or (isinstance(c, range) and c.step == 1 and 0 <= c.start <= c.stop <= nchunks)
    )
    if not ok:
        raise PluginValidationError(f"{where} yielded {op!r}: chunk outside 0..{nchunks - 1}")


class Executor:
    """Runs schedules for one group."""

    def __init__(
        self, mesh: Mesh, mailbox: Mailbox, *, segment_bytes: int, depth: int
    ) -> None:
        self.mesh = mesh
        self.mailbox = mailbox
        self.segment_bytes = segment_bytes
        self.depth = depth

    async def run(
        self,
        *,
        seq: int,
        strategy: Strategy,
        ctx: Context,
        layout: Layout,
        ufunc: Callable[..., Any] | None,
        sig: list[Any],
        meta: dict[str, Any] | None = None,
    ) -> None:
        """Run ``strategy`` for collective ``seq`` over ``layout``, in place.

        Raises:
            CollectiveMismatch: a peer's message carried another signature or size.
            PeerLost, P2PCollError: a peer is gone or reported a failure (abort).
        Cancellation: leaves the data partly updated; the caller must break the group.
        """
        steps = plan(strategy, ctx, len(layout.chunks))
        self.mailbox.expect(seq, sig, ctx.rank)
        nseg = layout.segment(self.segment_bytes)
        early, late = copies(steps, len(layout.chunks))
        first_late = max(nseg - self.depth, 0)
        # Zero-copy sends whose segment has finished: the caller may reuse the data only
        # once libzmq has let go of them, so they are awaited once, at the very end.
        pending: list[zmq.MessageTracker] = []
        run = self._segment
        if nseg == 1:
            await run(seq, 0, steps, late, layout, ufunc, sig, meta, ctx.rank, pending)
        else:
            window = asyncio.Semaphore(self.depth)

            async def one(seg: int) -> None:
                async with window:
                    copy = late if seg >= first_late else early
                    await run(seq, seg, steps, copy, layout, ufunc, sig, meta, ctx.rank, pending)

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
        seq: int,
        seg: int,
        steps: tuple[tuple[Op, ...], ...],
        copied: frozenset[tuple[int, int]],
        layout: Layout,
        ufunc: Callable[..., Any] | None,
        sig: list[Any],
        meta: dict[str, Any] | None,
        rank: int,
        pending: list[zmq.MessageTracker],
    ) -> None:
        sent: defaultdict[int, int] = defaultdict(int)
        received: defaultdict[int, int] = defaultdict(int)
        seg_meta = meta if seg == 0 else None
        groups = send_groups(steps)
        for i, ops in enumerate(steps):
            for chunk, group in groups[i]:
                headers = []
                for _, to in group:
                    headers.append(Header(
                        "data", self.mesh.group_id, rank, seq, seg, sent[to], sig, meta=seg_meta
                    ))
                    sent[to] += 1
                tracker = await self.mesh.send_many(
                    [to for _, to in group], headers, layout.pieces(chunk, seg),
                    copy=any((i, j) in copied for j, _ in group),
                )
                if tracker is not None:
                    pending.append(tracker)
            for op in ops:
                if isinstance(op, Send):
                    continue
                key = (seq, seg, op.frm, received[op.frm])
                received[op.frm] += 1
                header, frames = await self.mailbox.get(key)  # signature checked there
                targets = layout.pieces(op.chunk, seg)
                sizes = [t.nbytes for t in targets]
                if header.nbytes != sizes:
                    raise CollectiveMismatch(
                        f"collective #{seq} {sig[0]}: rank {op.frm} sent pieces of {header.nbytes}"
                        f" bytes for chunk {op.chunk!r}, rank {rank} expected {sizes}"
                    )
                reduce = ufunc if isinstance(op, Reduce) else None
                _combine(targets, frames, reduce)
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


def _combine(
    targets: list[np.ndarray], frames: list[zmq.Frame], ufunc: Callable[..., Any] | None
) -> None:
    with np.errstate(all="ignore"):
        for dst, frame in zip(targets, frames, strict=True):
            if dst.size == 0:
                continue
            src = np.frombuffer(frame.buffer, dtype=dst.dtype)
            if ufunc is None:
                np.copyto(dst, src)
            else:
                ufunc(dst, src, out=dst)


async def _released(trackers: list[zmq.MessageTracker]) -> None:
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


__all__ = ["ALL", "Executor", "plan"]
