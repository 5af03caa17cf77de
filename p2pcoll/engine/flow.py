"""Eager credits over a session: the thin I/O around :mod:`.credit`'s ledgers.

The matcher tells a :class:`Flow` what arrives and what finishes (the receiver's side: it
reports credit to senders through ``post``, a ``credit`` control message); the executor
asks it before each data message whether the message may go, and waits in :meth:`admit`
when it may not (the sender's side). A wait ends when credit comes, and fails when the
peer is lost (its :class:`~p2pcoll.errors.PeerLost`), when the operation fails (a peer's
abort) or when the session closes; the caller's deadline cancels it like any await.
Nothing here holds the event loop: a wait is a future.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from ..errors import P2PCollError
from ..types import OpKey
from .credit import Receipts, SendLedger

__all__ = ["Flow", "Report"]

Report = Callable[[int, int, int], None]
"""``report(peer, watermark, credited)``: post a credit report to ``peer``."""
Ask = Callable[[int, int], None]
"""``ask(peer, window)``: post a credit request to ``peer`` (this rank waits)."""


class Flow:
    """Credits of one session: this rank's sends (a ledger, when its window is > 0) and
    what its peers' messages hold here (always: a peer may bound its sends to it)."""

    def __init__(self, window: int, report: Report, ask: Ask,
                 lost: Callable[[int], P2PCollError | None],
                 failure: Callable[[OpKey], P2PCollError | None]) -> None:
        self.ledger = SendLedger(window) if window else None
        self.receipts = Receipts(window)
        self._report, self._ask, self._lost, self._failure = report, ask, lost, failure
        self._waiting: dict[int, set[asyncio.Future[None]]] = {}  # peer -> waits
        self._closed: P2PCollError | None = None
        self.waits = 0  # sends that waited for credit (stats)
        self.reports = 0  # credit reports sent (stats)

    # -- the sender's side

    async def admit(self, op: OpKey, peer: int) -> None:
        """Wait until a message of ``op`` may go to ``peer`` (the ledger's rule).

        Raises:
            PeerLost: ``peer`` is gone.
            P2PCollError: ``op`` failed (a peer's abort), or the session closed.
        Cancellation: leaves nothing behind.
        """
        ledger = self.ledger
        if ledger is None:
            return
        self.waits += 1
        loop = asyncio.get_running_loop()
        asked = False
        while True:
            # First: a lost peer's account is forgotten, which would let the send go.
            for error in (self._closed, self._lost(peer), self._failure(op)):
                if error is not None:
                    raise error
            if ledger.may_send(op, peer):
                return
            if not asked:  # once per wait: the peer reports by our half window from now
                self._ask(peer, ledger.window)
                asked = True
            fut: asyncio.Future[None] = loop.create_future()
            waits = self._waiting.setdefault(peer, set())
            waits.add(fut)
            try:
                await fut
            finally:
                waits.discard(fut)

    def on_credit(self, src: int, meta: dict[str, Any], watermark: int) -> None:
        """A ``credit`` message from ``src``: a report (meta ``b``) or a request (``ask``)."""
        if "ask" in meta:
            if self.receipts.ask(src, meta["ask"]):
                self._send_report(src)
            return
        if self.ledger is not None:
            self.ledger.credit(src, watermark, meta["b"])
            self._wake(src)

    def _wake(self, peer: int) -> None:
        for fut in self._waiting.get(peer, ()):
            if not fut.done():
                fut.set_result(None)

    def departed(self, rank: int) -> None:
        """``rank`` has gone: forget its accounts; its waits look again (and fail)."""
        if self.ledger is not None:
            self.ledger.forget(rank)
        self.receipts.forget(rank)
        self._wake(rank)

    def failed(self) -> None:
        """An operation failed: every wait looks again (that operation's fail)."""
        for peer in list(self._waiting):
            self._wake(peer)

    def close(self, exc: P2PCollError) -> None:
        """The session closes: every wait fails with ``exc``."""
        self._closed = exc
        self.failed()

    # -- the receiver's side

    def finished(self, op: OpKey, watermark: int) -> None:
        """Operation ``op`` finished here; ``watermark``: the collectives' (all below it
        finished)."""
        receipts = self.receipts
        if op.tag is None:
            due = receipts.collective_finished(watermark)
        else:
            due = receipts.transfer_finished(op)
        for src in due:
            self._send_report(src)

    def dropped(self, op: OpKey, src: int, nbytes: int) -> None:
        """A message of finished ``op`` was dropped."""
        for peer in self.receipts.dropped(op, src, nbytes):
            self._send_report(peer)

    def _send_report(self, src: int) -> None:
        if self._closed is None:
            self.reports += 1
            self._report(src, *self.receipts.report(src))

    def stats(self) -> dict[str, int]:
        """``eager_held_peak``: the most bytes one sender's messages held here at once
        (payload and :data:`~.credit.MESSAGE_COST` each); ``eager_outstanding``: the most
        this rank's sends to one peer are not credited now; ``eager_waits``: sends that
        waited for credit; ``eager_reports``: credit reports sent."""
        return {"eager_held_peak": self.receipts.peak,
                "eager_outstanding": self.ledger.most_outstanding() if self.ledger else 0,
                "eager_waits": self.waits, "eager_reports": self.reports}
