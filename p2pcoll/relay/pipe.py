"""Splicing two TCP connections: each half writes what it reads to the other, and stops
reading while the other cannot write (so a slow side holds back the fast one instead of
filling memory). Used by the relay for every forward, and by a peer behind the relay to
join the relay's connection to its own socket.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

__all__ = ["HELD_BYTES", "Half"]

HELD_BYTES = 1 << 20  # read before the other half is there, at most (then: closed)
WRITE_HIGH = 4 << 20  # a half's write buffer above this pauses reading from the other


class Half(asyncio.Protocol):
    """One connection of a splice (see the module docstring).

    Args:
        count: called with the size of every chunk read (the relay's byte counters).
        lost: called once when this half's connection is lost (the splice ends: the other
            half is closed after writing what it holds).
    """

    def __init__(self, count: Callable[[int], None] | None = None,
                 lost: Callable[[], None] | None = None) -> None:
        self.transport: asyncio.Transport | None = None
        self.partner: Half | None = None
        self.count = count
        self.lost = lost
        self._held = bytearray()  # read before the partner came
        self._paused = False  # the partner's write buffer is full
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.set_write_buffer_limits(high=WRITE_HIGH)

    def join(self, partner: Half) -> None:
        """Splice with ``partner``: what either held so far goes to the other now."""
        self.partner, partner.partner = partner, self
        for half in (self, partner):
            if half._held and half.partner is not None:
                held, half._held = bytes(half._held), bytearray()
                half.partner.write(held)
        if self.closed or partner.closed:
            self.close()
            partner.close()

    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.closed:
            self.transport.write(data)

    def data_received(self, data: bytes) -> None:
        if self.count is not None:
            self.count(len(data))
        partner = self.partner
        if partner is not None:
            partner.write(data)
            return
        self._held += data
        if len(self._held) > HELD_BYTES:
            self.close()

    # Flow control: this half's write buffer is full: stop reading the partner.
    def pause_writing(self) -> None:
        if self.partner is not None and self.partner.transport is not None:
            self.partner.transport.pause_reading()

    def resume_writing(self) -> None:
        partner = self.partner
        if partner is not None and partner.transport is not None and not partner.closed:
            partner.transport.resume_reading()

    def eof_received(self) -> bool:
        if self.partner is not None and self.partner.transport is not None:
            if self.partner.transport.can_write_eof():
                self.partner.transport.write_eof()
                return True
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.partner is not None:
            self.partner.close()
        if self.lost is not None:
            lost, self.lost = self.lost, None
            lost()

    def close(self) -> None:
        """Close this half (what it still has to write goes first)."""
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        """Close this half at once."""
        self.closed = True
        if self.transport is not None:
            self.transport.abort()
