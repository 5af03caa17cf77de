"""Matches arriving messages to the receives waiting for them.

A message's key is ``(seq, segment, src, index)``: the collective's sequence number, the
pipeline segment, the sending rank, and how many messages that rank had already sent us in
this (seq, segment). Messages between two ranks are delivered in order (as MPI promises), so
a strategy only has to post its sends and receives in a consistent order, and several
collectives can be in flight at once without mixing.

Every message's signature (what its sender thinks the collective is) is compared with this
rank's own as soon as both are known, so ranks that disagree fail at the first message.
A message that arrives before its receive is buffered. A receive that is cancelled leaves
nothing behind and consumes nothing. Failures are recorded so a later receive fails at once.
"""

from __future__ import annotations

import asyncio
from typing import Any

import zmq

from ..errors import CollectiveMismatch, P2PCollError, ProtocolError
from ..wire import Header, describe_mismatch

Key = tuple[int, int, int, int]
Message = tuple[Header, list[zmq.Frame]]


class Mailbox:
    """Per-group store of early messages and of receives still waiting."""

    def __init__(self) -> None:
        self._buffered: dict[Key, Message] = {}
        self._waiting: dict[Key, asyncio.Future[Message]] = {}
        self._first: dict[int, asyncio.Future[Header]] = {}
        self._failed: dict[int, P2PCollError] = {}
        self._lost: dict[int, P2PCollError] = {}
        self._finished: set[int] = set()
        self._expected: dict[int, tuple[list[Any], int]] = {}  # seq -> (signature, my rank)
        self._stalled: dict[int, set[int]] = {}  # seq -> sources of cancelled receives
        self._first_origin: dict[int, int] = {}  # seq -> the rank a first() waits on
        self._watermark = 0  # every seq below this has finished

    def put(self, header: Header, frames: list[zmq.Frame]) -> bool:
        """Deliver a data message.

        Returns False, dropping it, when collective ``seq`` has already finished here.
        """
        seq = header.seq
        if seq in self._failed:
            return True  # that collective already failed here: late traffic is expected
        if seq < self._watermark or seq in self._finished:
            return False
        key = header.key
        if seq in self._expected and not self._check(header):
            return True
        if header.seg == 0:
            first = self._first.get(seq)
            if first is None:
                first = self._first[seq] = asyncio.get_running_loop().create_future()
            if not first.done():
                first.set_result(header)
        waiter = self._waiting.pop(key, None)
        if waiter is not None and not waiter.done():
            waiter.set_result((header, frames))
        elif key in self._buffered:
            raise ProtocolError(f"duplicate message {key} (seq, segment, src, index)")
        else:
            self._buffered[key] = (header, frames)
        return True

    def expect(self, seq: int, sig: list[Any], rank: int) -> None:
        """Declare this rank's signature of collective ``seq`` and check what already came."""
        self._expected[seq] = (sig, rank)
        for key, (header, _) in list(self._buffered.items()):
            if key[0] == seq and not self._check(header):
                return

    def _check(self, header: Header) -> bool:
        sig, rank = self._expected[header.seq]
        if header.sig == sig:
            return True
        diff = describe_mismatch(sig, header.sig, rank, header.src)
        self.fail(header.seq, CollectiveMismatch(f"collective #{header.seq} {sig[0]}: {diff}"))
        return False

    def leftover(self, seq: int) -> list[int]:
        """Source ranks of messages of ``seq`` that arrived but were never received."""
        return sorted({k[2] for k in self._buffered if k[0] == seq})

    async def get(self, key: Key) -> Message:
        """Wait for the message with this key.

        Raises:
            P2PCollError: the collective was aborted, or the source rank is gone.
        """
        seq, _, src, _ = key
        if seq in self._failed:
            raise self._failed[seq]
        msg = self._buffered.pop(key, None)
        if msg is not None:
            return msg
        if src in self._lost:
            raise self._lost[src]
        fut: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        self._waiting[key] = fut
        try:
            return await fut
        except BaseException:
            self._stalled.setdefault(seq, set()).add(src)  # for the error's message
            raise
        finally:
            if self._waiting.get(key) is fut:
                del self._waiting[key]

    async def first(self, seq: int, origin: int) -> Header:
        """The header of the first segment-0 message of collective ``seq`` from anyone.

        ``origin`` is the rank the data comes from (a root): it is named while this waits,
        and its loss fails the wait.
        """
        if seq in self._failed:
            raise self._failed[seq]
        fut = self._first.get(seq)
        if fut is None:
            fut = self._first[seq] = asyncio.get_running_loop().create_future()
        if not fut.done() and origin in self._lost:
            raise self._lost[origin]
        self._first_origin[seq] = origin
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            self._stalled.setdefault(seq, set()).add(origin)  # for the timeout's message
            raise
        finally:
            self._first_origin.pop(seq, None)

    def failure(self, seq: int) -> P2PCollError | None:
        """The recorded failure of collective ``seq``, if a peer aborted it."""
        return self._failed.get(seq)

    def waiting_on(self, seq: int) -> list[int]:
        """Source ranks that receives of collective ``seq`` are waiting for."""
        now = {k[2] for k in self._waiting if k[0] == seq}
        if seq in self._first_origin:
            now.add(self._first_origin[seq])
        return sorted(now | self._stalled.get(seq, set()))

    def fail(self, seq: int, exc: P2PCollError) -> bool:
        """Fail collective ``seq`` now and later. Returns False if it had already finished."""
        if seq < self._watermark or seq in self._finished:
            return False
        self._failed.setdefault(seq, exc)
        for key, fut in list(self._waiting.items()):
            if key[0] == seq and not fut.done():
                fut.set_exception(exc)
        first = self._first.get(seq)
        if first is not None and not first.done():
            first.set_exception(exc)
            first.exception()  # mark retrieved; a waiter may have gone
        return True

    def fail_source(self, src: int, exc: P2PCollError) -> None:
        """Rank ``src`` is gone: fail every receive from it that is not already buffered."""
        self._lost.setdefault(src, exc)
        for key, fut in list(self._waiting.items()):
            if key[2] == src and not fut.done():
                fut.set_exception(exc)
        for seq, origin in self._first_origin.items():
            first = self._first.get(seq)
            if origin == src and first is not None and not first.done():
                first.set_exception(exc)

    def finish(self, seq: int) -> None:
        """Forget everything about collective ``seq``; later messages for it are stale."""
        self._finished.add(seq)
        self._failed.pop(seq, None)
        self._expected.pop(seq, None)
        self._stalled.pop(seq, None)
        first = self._first.pop(seq, None)
        if first is not None and not first.done():
            first.cancel()
        for key in [k for k in self._buffered if k[0] == seq]:
            del self._buffered[key]
        while self._watermark in self._finished:
            self._finished.discard(self._watermark)
            self._watermark += 1

    def close(self, exc: P2PCollError) -> None:
        """Fail everything pending."""
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_exception(exc)
        for fut in self._first.values():
            if not fut.done():
                fut.cancel()
        self._waiting.clear()
        self._buffered.clear()

    def stats(self) -> dict[str, Any]:
        return {"buffered": len(self._buffered), "waiting": len(self._waiting)}
