"""Matches arriving messages to the receives waiting for them.

A message's key is ``(op, segment, src, index)``: the collective's sequence number (as an
:class:`~p2pcoll.types.OpKey`), the
pipeline segment, the sending rank, and how many messages that rank had already sent us in
this (seq, segment). Because the index is in the key, messages may even arrive out of order;
a strategy only has to post its sends and receives in a consistent order per pair of ranks,
and several collectives can be in flight at once without mixing.

Point-to-point transfers (``Group.send``/``Group.recv``) are matched here too, under the
same rules: only two ranks take part in one, so it has no collective sequence number but
its channel ``(src, dst, tag)`` and a count, how many messages the sender had sent the
receiver with that tag before (each side counts on its own: MPI's non-overtaking rule, per
tag). Either is an :class:`~p2pcoll.types.OpKey`, the first part of a message's key; the
collectives and each (src, dst, tag) are separate channels, each with its own record of
what finished.

Every message's signature digest (what its sender thinks the collective is) is compared
with this rank's own as soon as both are known, so ranks that disagree fail at the first
message. A message that arrives before its receive is buffered. A receive that is cancelled
leaves nothing behind and consumes nothing. Whether a peer has gone is not recorded here:
a receive asks the session's one record (:class:`Departures`) about the peer it needs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from ..errors import CollectiveMismatch, P2PCollError, PeerLost, ProtocolError
from ..transport.base import Piece
from ..types import Membership, OpKey
from ..wire import Header, Signature
from .polling import MessageWait

if TYPE_CHECKING:  # made by the session (see .flow)
    from .flow import Flow

Key = tuple[OpKey, int, int, int]  # (op, segment, src, index)
Slot = tuple[int, int, int]  # (segment, src, index): a message's place within its op
Message = tuple[Header, list[Piece]]
Channel = tuple[int, int, int] | None  # None: the collectives; (src, dst, tag): transfers
MAX_SIGNATURES = 8192  # readable signatures kept, by (src, digest)


class _Finished:
    """The operations of one channel that have finished: all below a watermark, and the
    few above it that finished early (operations may finish out of order)."""

    __slots__ = ("above", "watermark")

    def __init__(self) -> None:
        self.watermark = 0
        self.above: set[int] = set()

    def __contains__(self, n: int) -> bool:
        return n < self.watermark or n in self.above

    def add(self, n: int) -> None:
        if n == self.watermark and not self.above:  # in order, as nearly all finish
            self.watermark = n + 1
            return
        self.above.add(n)
        while self.watermark in self.above:
            self.above.discard(self.watermark)
            self.watermark += 1


class Departures(Protocol):
    """The session's record of peers that have gone (see p2pcoll.departures)."""

    @property
    def membership(self) -> Membership:
        """The roster whose peers it records."""
        ...

    def lost(self, rank: int) -> PeerLost | None:
        """The error for ``rank`` if it has left or been lost, else None."""
        ...

    def abandoned(self, rank: int, seq: int) -> bool:
        """Whether ``rank`` is gone without having taken part in collective ``seq``."""
        ...

    def gone(self) -> Mapping[int, object]:
        """The peers that have gone, by rank (usually none)."""
        ...


def _nothing() -> None:
    pass


class Matcher:
    """Per-session store of early messages and of receives still waiting."""

    def __init__(self, departures: Departures) -> None:
        self.departures = departures
        # Takes in what has come and waits to be read (what the transport's ``connect``
        # returns): a receive calls it before it parks, so a message already there costs
        # no event-loop turn.
        self.poll: Callable[[], None] = _nothing
        # Polls for a peer's message before a receive parks, where the transport can
        # (see .polling); None: it parks at once.
        self.waits: MessageWait | None = None
        # The eager credits (see .credit): told what arrives and finishes; None: none.
        self.flow: Flow | None = None
        # Early messages by operation, then by slot: a backlog of many operations' messages
        # (a fast sender's eager window: thousands of small transfers) costs each operation
        # only its own messages, never a scan of everyone's.
        self._buffered: dict[OpKey, dict[Slot, Message]] = {}
        self._waiting: dict[Key, asyncio.Future[Message]] = {}
        self._first_header: dict[OpKey, Header] = {}  # op -> its first segment-0 header
        self._first: dict[OpKey, asyncio.Future[Header]] = {}  # op -> a first() waiting for it
        self._failed: dict[OpKey, P2PCollError] = {}
        self._finished: dict[Channel, _Finished] = {None: _Finished()}
        self._expected: dict[OpKey, tuple[Signature, int]] = {}  # op -> (signature, my rank)
        self._stalled: dict[OpKey, set[int]] = {}  # op -> sources of cancelled receives
        self._first_origin: dict[OpKey, int] = {}  # op -> the rank a first() waits on
        self._any_waiters: set[asyncio.Future[None]] = set()  # first_of_any()s: departures
        self._noted: dict[OpKey, Sequence[int]] = {}  # op -> whom a wait outside here is on
        self._watched: dict[OpKey, Callable[[Header], None]] = {}  # op -> told of each message
        # What finish() forgets of an operation (the tables keyed by it alone).
        self._per_op: tuple[dict[OpKey, Any], ...] = (
            self._failed, self._expected, self._stalled, self._noted, self._watched,
            self._first_header)
        # (src, digest) -> the readable signature: a sender describes a digest to each peer
        # once (see the executor), on whichever message of it came first.
        self._signatures: dict[tuple[int, bytes], list[Any]] = {}

    def put(self, header: Header, frames: list[Piece]) -> bool:
        """Deliver a data message.

        Returns False, dropping it, when its collective (or transfer) has already finished
        here.

        Raises:
            ProtocolError: a second message with the same key.
        """
        if header.described is not None:
            signatures = self._signatures
            if len(signatures) >= MAX_SIGNATURES:
                signatures.clear()  # only mismatch messages lose detail, never a result
            signatures[header.src, header.sig] = header.described
        # (The checks of finished() and _check() inline: they run on every message.)
        tag = header.tag
        if tag is None:
            op = OpKey(header.seq)
            done: _Finished | None = self._finished[None]
        else:
            op = OpKey(header.seq, tag, header.src, self.departures.membership.rank)
            done = self._finished.get(op.channel)
        flow = self.flow
        if op in self._failed:
            if flow is not None:  # credited when the failed operation finishes here
                flow.receipts.arrived(op, header.src, sum(header.nbytes))
            return True  # that collective already failed here: late traffic is expected
        if done is not None and (op.number < done.watermark or op.number in done.above):
            if flow is not None:  # (finished: _Finished.__contains__ inline)
                flow.dropped(op, header.src, sum(header.nbytes))
            return False
        slot = (header.seg, header.src, header.step)
        early = self._buffered.get(op)
        if early is not None and slot in early:
            raise ProtocolError(f"duplicate message {(op, *slot)} (seq, segment, src, index)",
                                reason="duplicate")
        if flow is not None:
            flow.receipts.arrived(op, header.src, sum(header.nbytes))
        if self._watched:
            watcher = self._watched.get(op)
            if watcher is not None:
                watcher(header)
        expected = self._expected.get(op)
        if (expected is not None and header.sig != expected[0].digest
                and not self._check(header)):
            return True
        if header.seg == 0 and op not in self._first_header:
            # Kept for a first() that may come; a future only if one waits already.
            self._first_header[op] = header
            first = self._first.get(op)
            if first is not None and not first.done():
                first.set_result(header)
        waiter = self._waiting.pop((op, *slot), None) if self._waiting else None
        if waiter is not None and not waiter.done():
            waiter.set_result((header, frames))
        elif early is not None:
            early[slot] = (header, frames)
        else:
            self._buffered[op] = {slot: (header, frames)}
        return True

    def op_of(self, header: Header) -> OpKey:
        """The operation a data message for this rank belongs to."""
        if header.tag is None:
            return OpKey(header.seq)
        return OpKey(header.seq, header.tag, header.src, self.departures.membership.rank)

    def expect(self, op: OpKey, sig: Signature, rank: int) -> None:
        """Declare this rank's signature of collective ``op`` and check what already came."""
        self._expected[op] = (sig, rank)
        early = self._buffered.get(op)
        if early:
            for header, _ in list(early.values()):
                if not self._check(header):
                    return

    def _check(self, header: Header) -> bool:
        op = self.op_of(header)
        sig, rank = self._expected[op]
        if header.sig == sig.digest:
            return True
        diff = sig.describe_difference(self.described(header), rank, header.src)
        what = (f"collective #{header.seq}" if header.tag is None
                else f"message #{header.seq} with tag {header.tag}")
        self.fail(op, CollectiveMismatch(f"{what} {sig.collective}: {diff}"))
        return False

    def leftover(self, op: OpKey) -> list[int]:
        """Source ranks of messages of ``op`` that arrived but were never received."""
        early = self._buffered.get(op)
        return sorted({src for _, src, _ in early}) if early else []

    def described(self, header: Header) -> list[Any] | None:
        """The readable signature of a data message's sender for its digest, if it has
        said it (on this message or an earlier one)."""
        if header.described is not None:
            return header.described
        return self._signatures.get((header.src, header.sig))

    def stray(self, op: OpKey) -> Header | None:
        """A header of a message of ``op`` that arrived but was never received (one
        whose readable signature is known, if there is one), or None."""
        found = None
        for header, _ in self._buffered.get(op, {}).values():
            if self.described(header) is not None:
                return header
            found = found or header
        return found

    def _take(self, op: OpKey, slot: Slot) -> Message | None:
        """Remove and return the early message of ``op`` in ``slot``, if it has come."""
        early = self._buffered.get(op)
        if early is None:
            return None
        msg = early.pop(slot, None)
        if not early:
            del self._buffered[op]
        return msg

    async def get(self, key: Key) -> Message:
        """Wait for the message with this key.

        Raises:
            P2PCollError: the collective was aborted, or the source rank is gone.
        Cancellation: consumes nothing; a message that arrives later is buffered.
        """
        op, seg, src, index = key
        slot = (seg, src, index)
        if op in self._failed:
            raise self._failed[op]
        early = self._buffered.get(op)  # (_take, inline: the usual receive's one look)
        if early is not None:
            msg = early.pop(slot, None)
            if msg is not None:
                if not early:
                    del self._buffered[op]
                return msg
        self.poll()  # what has come meanwhile, now (it may be an abort or a departure)
        if op in self._failed:
            raise self._failed[op]
        msg = self._take(op, slot)
        if msg is not None:
            return msg
        began = -1
        if self.waits is not None:  # poll for it a while (the departures asked after)
            buffered, failed = self._buffered, self._failed
            began = self.waits.poll(src, lambda: op in failed or slot in buffered.get(op, ()))
            if not began:
                if op in failed:
                    raise failed[op]
                return self._take(op, slot)  # type: ignore[return-value]
        gone = self.departures.lost(src)
        if gone is not None:
            raise gone
        fut: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        self._waiting[key] = fut
        try:
            msg = await fut
            if began > 0:
                self.waits.parked_until(src, began)  # type: ignore[union-attr]
            return msg
        except BaseException:
            self._stalled.setdefault(op, set()).add(src)  # for the error's message
            raise
        finally:
            if self._waiting.get(key) is fut:
                del self._waiting[key]

    async def first(self, op: OpKey, origin: int) -> Header:
        """The header of the first segment-0 message of collective ``op`` from anyone.

        ``origin`` is the rank the data comes from (a root), named while this waits. Which
        rank actually sends the first message depends on the strategy, which this rank learns
        only from that message, so the wait fails on ``origin``'s departure only if it left
        without taking its part (it was lost, or said goodbye before starting collective
        ``op``): a root that finished its part and left may still have its data come
        through another rank, whose own loss then fails the receive that needs it.
        """
        if op in self._failed:
            raise self._failed[op]
        header = self._first_header.get(op)
        if header is not None:
            return header
        fut = self._first.get(op)
        if fut is None:
            fut = self._first[op] = asyncio.get_running_loop().create_future()
        if not fut.done() and self._abandoned(origin, op):
            raise self.departures.lost(origin)  # type: ignore[misc]
        self._first_origin[op] = origin
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            self._stalled.setdefault(op, set()).add(origin)  # for the timeout's message
            raise
        finally:
            self._first_origin.pop(op, None)

    async def first_of_any(self, candidates: Mapping[int, OpKey]) -> int:
        """The source rank among ``candidates`` (source -> the transfer it would send next)
        whose message has come; the lowest such rank if several have. Consumes nothing: the
        caller then receives that transfer as usual.

        Raises:
            PeerLost: every candidate has gone without sending (the lowest one's).
            P2PCollError: a candidate's transfer was aborted.
        Cancellation: consumes nothing.
        """
        loop = asyncio.get_running_loop()
        while True:
            live: list[asyncio.Future[Header]] = []
            for src, op in sorted(candidates.items()):
                if op in self._failed:
                    raise self._failed[op]
                if op in self._first_header:
                    return src
                fut = self._first.get(op)
                if fut is None:
                    fut = self._first[op] = loop.create_future()
                if fut.done():
                    if not fut.cancelled() and fut.exception() is not None:
                        raise fut.exception()  # type: ignore[misc]
                    return src
                if not self._abandoned(src, op):
                    live.append(fut)
            if not live:
                raise self.departures.lost(min(candidates))  # type: ignore[misc]
            departed: asyncio.Future[None] = loop.create_future()
            self._any_waiters.add(departed)
            try:
                wakes: list[asyncio.Future[Any]] = [*live, departed]
                await asyncio.wait(wakes, return_when=asyncio.FIRST_COMPLETED)
            finally:
                self._any_waiters.discard(departed)

    def _abandoned(self, rank: int, op: OpKey) -> bool:
        """Whether ``rank`` is gone without taking its part in ``op``. A sender that has
        gone in any way will not send a transfer's message that has not come: everything
        it sent before its goodbye arrived before the goodbye."""
        if op.tag is None:
            return self.departures.abandoned(rank, op.number)
        return self.departures.lost(rank) is not None

    def failure(self, op: OpKey) -> P2PCollError | None:
        """The recorded failure of collective ``op``, if a peer aborted it."""
        return self._failed.get(op)

    def finished(self, op: OpKey) -> bool:
        """Whether collective ``op`` has finished here (returned or failed)."""
        done = self._finished.get(op.channel)
        return done is not None and op.number in done

    def waiting_on(self, op: OpKey) -> list[int]:
        """Source ranks that receives of collective ``op`` are waiting for (or were, when
        they were cancelled: the deadline's cancellation leaves its answer here)."""
        now = {k[2] for k in self._waiting if k[0] == op}
        now.update(self._noted.get(op, ()))
        if op in self._first_origin:
            now.add(self._first_origin[op])
        return sorted(now | self._stalled.get(op, set()))

    def note_waiting(self, op: OpKey, ranks: Sequence[int]) -> None:
        """An engine path that waits outside the matcher (the board) waits for ``ranks``
        in ``op``: :meth:`waiting_on` says so (a timeout's inquiry asks it)."""
        self._noted[op] = ranks

    def watch(self, op: OpKey, callback: Callable[[Header], None]) -> None:
        """Call ``callback(header)`` for each data message of ``op`` that arrives from now
        on, before it is matched or buffered as usual, until :meth:`unwatch` or
        :meth:`finish`: so an engine path that waits outside the matcher (the board) can
        wake up when a peer sends instead. Replaces an earlier callback for ``op``.

        The callback runs in the transport's dispatch and must not raise; it is not called
        for a message that is dropped (its operation finished or failed here) or that
        repeats a key (a :class:`ProtocolError`).
        """
        self._watched[op] = callback

    def unwatch(self, op: OpKey) -> None:
        """Stop calling the callback :meth:`watch` set for ``op`` (if any)."""
        self._watched.pop(op, None)

    def fail(self, op: OpKey, exc: P2PCollError) -> bool:
        """Fail collective ``op`` now and later. Returns False if it had already finished."""
        if self.finished(op):
            return False
        self._failed.setdefault(op, exc)
        for key, fut in list(self._waiting.items()):
            if key[0] == op and not fut.done():
                fut.set_exception(exc)
        if self.flow is not None:  # a send of it waiting for credit
            self.flow.failed()
        first = self._first.get(op)
        if first is not None and not first.done():
            first.set_exception(exc)
            first.exception()  # mark retrieved; a waiter may have gone
        return True

    def peer_departed(self, rank: int) -> None:
        """``rank`` has gone (the record says how): wake the receives that need it."""
        exc = self.departures.lost(rank)
        if exc is None:
            return
        if self.flow is not None:
            self.flow.departed(rank)
        for waiter in self._any_waiters:  # first_of_any() looks again at who is left
            if not waiter.done():
                waiter.set_result(None)
        for key, fut in list(self._waiting.items()):
            if key[2] == rank and not fut.done():
                fut.set_exception(exc)
        for op, origin in self._first_origin.items():
            if origin == rank and self._abandoned(rank, op):
                first = self._first.get(op)
                if first is not None and not first.done():
                    first.set_exception(exc)
                    first.exception()

    def finish(self, op: OpKey) -> None:
        """Forget everything about collective ``op``; later messages for it are stale."""
        chan = None if op.tag is None else op.channel  # every collective's: no call
        done = self._finished.get(chan)
        if done is None:
            done = self._finished[chan] = _Finished()
        if op.number == done.watermark and not done.above:  # (add's usual case, inline)
            done.watermark += 1
        else:
            done.add(op.number)
        if self.flow is not None:
            self.flow.finished(op, done.watermark)
        # Each table looked at only if it holds anything (a board collective's are empty,
        # but for the board's note of whom it waited for): a pop hashes the key every time.
        for table in self._per_op:
            if table:
                table.pop(op, None)
        if self._first:
            first = self._first.pop(op, None)
            if first is not None and not first.done():
                first.cancel()
        if self._buffered:
            self._buffered.pop(op, None)

    def close(self, exc: P2PCollError) -> None:
        """Fail everything pending."""
        if self.flow is not None:
            self.flow.close(exc)
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_exception(exc)
        for first in self._first.values():
            if not first.done():
                first.cancel()
        self._waiting.clear()
        self._buffered.clear()
        self._first_header.clear()
        self._watched.clear()

    def stats(self) -> dict[str, Any]:
        return {"buffered": sum(map(len, self._buffered.values())),
                "waiting": len(self._waiting)}

    def flow_stats(self) -> dict[str, int]:
        """The eager credits' figures (see :meth:`.flow.Flow.stats`), if there are any."""
        return {} if self.flow is None else self.flow.stats()
