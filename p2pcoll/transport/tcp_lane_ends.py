"""The two ends of one TCP lane: the sender's (whole records, what the kernel does not take
kept and written when the socket has room) and the receiver's (records read and checked as
they come, reading paused while too much lies unread).

What a lane is, how it opens and closes and what a record looks like: :mod:`.tcp_lane`,
whose :class:`~.tcp_lane.TcpLanes` makes and keeps these ends.
"""

from __future__ import annotations

import asyncio
import select
import socket
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from ..errors import ProtocolError
from .tcp_records import (
    END, LARGEST, MAX_FRAMES, Record, RecordReader, encode_sized, record_size,
)

if TYPE_CHECKING:
    from typing_extensions import Buffer  # collections.abc.Buffer from Python 3.12

__all__ = ["BYE", "TcpLaneIn", "TcpLaneOut"]

PENDING_BYTES = 4 << 20  # what a sender keeps for the kernel at most, per lane
INBOUND_BYTES = 4 << 20  # what a receiver holds unread at most before it stops reading
RECV_BYTES = 1 << 18
BYE = b"E"  # what a receiver that closes in good order writes


class TcpLaneOut:
    """The sending end of a TCP lane: whole records, what the kernel does not take kept.

    Args:
        sock: the connection (non-blocking), which the receiver never writes to.
        peer: the receiver's rank.
        broken: called (once) with the peer if the connection fails or ends.
    """

    def __init__(self, sock: socket.socket, peer: int,
                 broken: Callable[[int, str], None]) -> None:
        self.sock, self.peer = sock, peer
        self.largest = LARGEST + 8 + 4 * MAX_FRAMES
        self.closed = False
        self.retiring = False  # its END is sent or kept (see retire)
        self._broken = broken
        self._pending: deque[memoryview] = deque()
        self.pending = 0  # bytes kept for the kernel
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(sock.fileno(), self._on_readable)

    def fits_now(self, frames: Sequence[Buffer], spare: int = 0) -> bool:
        """Whether :meth:`write` of ``frames`` with ``spare`` would take them now."""
        need = record_size(frames)
        return (not self.closed and need <= self.largest
                and self.pending + need + spare <= PENDING_BYTES)

    def write(self, frames: Sequence[Buffer], spare: int = 0) -> bool:
        """Send one record of ``frames``, keeping room for ``spare`` bytes after it; False
        (nothing sent) if it does not fit now. Never blocks. On a lane that broke meanwhile
        the record is lost with the peer (True: the peer is being named lost)."""
        pieces, need = encode_sized(frames)
        if need > self.largest or self.pending + need + spare > PENDING_BYTES:
            return False
        if self.closed:
            return True
        self._send(pieces, need)  # what the kernel does not take now is kept
        return True

    def _send(self, pieces: list[Buffer], need: int) -> bool:
        """Send ``pieces`` (``need`` bytes) after what is kept: what the kernel does not
        take now is kept and written when the socket has room. True if all went now."""
        if self._pending:
            self._keep(pieces, 0)
            return False
        try:
            sent = self.sock.sendmsg(pieces)
        except BlockingIOError:
            sent = 0
        except OSError as exc:
            self._fail(f"cannot write: {exc}")
            return False
        if sent < need:
            self._keep(pieces, sent)
            self._loop.add_writer(self.sock.fileno(), self._on_writable)
            return False
        return True

    def _keep(self, pieces: list[Buffer], sent: int) -> None:
        for piece in pieces:
            view = memoryview(piece).cast("B")  # (an array's items may be wider than bytes)
            if sent >= view.nbytes:
                sent -= view.nbytes
                continue
            kept = bytes(view[sent:])  # the caller may reuse its buffers once we return
            self._pending.append(memoryview(kept))
            self.pending += len(kept)
            sent = 0

    def _on_writable(self) -> None:
        pending = self._pending
        try:
            sent = self.sock.sendmsg(list(pending)[:64])
        except BlockingIOError:
            return
        except OSError as exc:
            self._fail(f"cannot write: {exc}")
            return
        self.pending -= sent
        while sent:
            first = pending[0]
            if sent >= first.nbytes:
                sent -= first.nbytes
                pending.popleft()
            else:
                pending[0] = first[sent:]
                sent = 0
        if not pending:
            self._loop.remove_writer(self.sock.fileno())
            if self.retiring:
                self._shut()

    def _on_readable(self) -> None:
        if self.retiring and not self._pending:  # all sent: the receiver closes its end
            self.close(graceful=False)
            return
        try:
            data = self.sock.recv(1)
        except BlockingIOError:
            return
        except OSError as exc:
            self._fail(f"failed: {exc}")
            return
        if data == BYE:  # the receiver closes in good order: what comes after is not read
            self.close(graceful=False)
            return
        self._fail("closed by the receiver" if not data else "the receiver wrote to it")

    def retire(self) -> None:
        """No more records on this lane (its route's link closes for the budget): the
        :data:`END` goes after what is kept, then this end shuts for writing, and the lane
        closes once the receiver, having read everything, closes its end. Never waits;
        nothing fits any more. Records lost on the way still name the peer lost."""
        if self.closed or self.retiring:
            return
        self.retiring = True
        self.largest = -1
        if self._send([memoryview(END)], len(END)):
            self._shut()  # else the writer shuts it once END has gone

    def _shut(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:  # the receiver has gone already: nothing of it is kept
            self.close(graceful=False)

    def _fail(self, why: str) -> None:
        if not self.closed:
            self.close(graceful=False)
            self._broken(self.peer, why)

    def close(self, graceful: bool = True) -> None:
        """Close the lane; ``graceful``: after what the kernel takes now of the records
        kept and the :data:`END` record (never waiting)."""
        if self.closed:
            return
        self.closed = True
        if graceful:
            try:
                self.sock.sendmsg([*self._pending, *([] if self.retiring else [END])])
            except OSError:
                pass
        self._loop.remove_reader(self.sock.fileno())
        self._loop.remove_writer(self.sock.fileno())
        self._pending.clear()
        self.pending = 0
        self.sock.close()


class TcpLaneIn:
    """The receiving end of a TCP lane: reads and checks the records of one peer.

    Args:
        sock: the connection (non-blocking, its token sent).
        peer: the sender's rank.
        arrived: called with the peer when records have come (read them with :meth:`read`).
        broken: called (once) with the peer and what broke when the lane fails, ends or
            carries garbage; records that came whole before stay readable.
    """

    #: Whether its sender runs in this process (then no receive polls it); None: not
    #: looked at yet (see :meth:`TcpLanes.polled`).
    near: bool | None = None

    def __init__(self, sock: socket.socket, peer: int, arrived: Callable[[int], None],
                 broken: Callable[[int, ProtocolError], None]) -> None:
        self.sock, self.peer = sock, peer
        self.closed = False
        self.reader = RecordReader()
        self._arrived, self._broken = arrived, broken
        self._loop = asyncio.get_running_loop()
        self._paused = False
        self._scratch = bytearray(RECV_BYTES)  # received into, then fed to the reader
        # Whether anything waits, asked before a poll reads: a read that finds nothing
        # raises (BlockingIOError), about three times what this costs, and a receive that
        # polls for its message mostly finds nothing.
        self._waiting = select.poll()
        self._waiting.register(sock.fileno(), select.POLLIN)
        self._loop.add_reader(sock.fileno(), self._on_readable)

    def poll(self) -> None:
        """Read what the kernel holds now, without waiting (a receive's poll before it
        parks, see :class:`~.lane_poll.LanePoll`): the same read as the loop's callback,
        so records are handed on in the same order. Never raises."""
        if not self._paused and not self.closed and self._waiting.poll(0):
            self._on_readable()  # (also what an error or the end is: the read says which)

    def read(self) -> Record | None:
        """The next whole record, or None (see :class:`~.ordering.LaneReader`)."""
        reader = self.reader
        if not reader.records:  # (RecordReader.take, inline: once a record)
            record = None
        else:
            reader.held -= reader.sizes.popleft()
            record = reader.records.popleft()
        if self._paused and self.reader.held < INBOUND_BYTES // 2 and not self.closed:
            self._paused = False
            self._loop.add_reader(self.sock.fileno(), self._on_readable)
        return record

    def _on_readable(self) -> None:
        try:
            got = self.sock.recv_into(self._scratch)
        except BlockingIOError:
            return
        except OSError as exc:
            self._fail(ProtocolError(f"TCP lane from rank {self.peer} failed: {exc}",
                                     reason="unexpected"))
            return
        if not got:
            if self.reader.ended:  # the sender closed in good order
                self.close(graceful=False)
                return
            if self.reader.partial:  # what came of the record is dropped (counted)
                self._fail(ProtocolError(f"TCP lane from rank {self.peer} ended mid-record",
                                         reason="malformed"))
            else:
                self._fail(ProtocolError(f"TCP lane from rank {self.peer} ended",
                                         reason="unexpected"))
            return
        try:
            with memoryview(self._scratch) as data:
                self.reader.feed(data[:got])
        except ProtocolError as exc:
            self._fail(exc)
            return
        if self.reader.held >= INBOUND_BYTES:  # not read: stop until it is (backpressure)
            self._paused = True
            self._loop.remove_reader(self.sock.fileno())
        if self.reader.records:
            self._arrived(self.peer)

    def _fail(self, exc: ProtocolError) -> None:
        if not self.closed:
            self.close(graceful=False)
            self._broken(self.peer, exc)

    def retire(self) -> None:
        """This lane is no longer read: its sender has named a newer one, after the end of
        the link this one served, so nothing on it is wanted any more. It closes when the
        sender's end comes (or at once if it has); nothing of it is told."""
        self._arrived = _ignore
        self._broken = _ignore

    def close(self, graceful: bool = True) -> None:
        """Close the lane; ``graceful``: with a :data:`BYE` first (never waiting)."""
        if self.closed:
            return
        self.closed = True
        if graceful:
            try:
                self.sock.send(BYE)
            except OSError:
                pass
        self._loop.remove_reader(self.sock.fileno())
        self.sock.close()


def _ignore(*_: object) -> None:
    pass
