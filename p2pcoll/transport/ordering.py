"""Order across two channels: a sender's messages to one peer, over its socket and its lane.

Between peers of one host a message may go over the socket (ZeroMQ) or over the lane (a
ring in shared memory, see :mod:`.lane`). Each channel keeps its own order, but nothing
orders one against the other, so a sender moves a peer's messages from one channel to the
other only with a *marker* on the channel it leaves, and the receiver follows the markers:

- **To the lane.** The sender sends ``lane on`` on the socket, then writes its messages on
  the lane. It does so only when no earlier send to that peer still waits for room in the
  socket's queue (else that message could arrive after the marker, and be read after the
  lane's messages, which were sent later), and only when the message fits the lane now.
- **Back to the socket.** When a message does not fit the lane, the sender writes
  ``lane off`` on the lane and sends the message on the socket. Every lane write keeps room
  for that marker, so it always fits.

The receiver reads the socket until ``lane on``, then the lane until ``lane off``, then the
socket again. Socket messages that arrive while the lane is current are *held* and handed
on after ``lane off``. A marker that comes on the wrong channel (``lane on`` on the lane,
``lane off`` on the socket, or ``lane on`` when there is no lane) is out of turn: a
:class:`~p2pcoll.errors.ProtocolError`, and the message is dropped.

This module is only that protocol, with no sockets, files or event loop: :class:`LaneSender`
decides where each message goes, :class:`LaneReceiver` the order in which messages are handed
on. The transport gives them small adapters (callables and the :class:`LaneWriter` /
:class:`LaneReader` protocols that :class:`~.lane.LaneOut` and :class:`~.lane.LaneIn`
nearly satisfy) and owns the scheduling: a receiver does at most ``budget`` messages per
call and says whether more may be waiting, so a flood cannot hold the event loop.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from ..errors import ProtocolError
from ..wire import Header

M = TypeVar("M")  # a message as a channel carries it (opaque here)
F = TypeVar("F", contravariant=True)  # the frames of one message, as the lane takes them
R = TypeVar("R", covariant=True)  # a record read from a lane (opaque here)

BUDGET = 64  # messages a receiver hands on per call before it lets other work run


class LaneWriter(Protocol[F]):
    """The sending end of a lane, as the ordering needs it."""

    def fits_now(self, frames: F, spare: int = 0) -> bool:
        """Whether ``write(frames, spare)`` would succeed now."""
        ...

    def write(self, frames: F, spare: int = 0) -> bool:
        """Append ``frames`` as one record, keeping room for ``spare`` bytes after it;
        False (nothing written) if that does not fit now."""
        ...


class LaneReader(Protocol[R]):
    """The receiving end of a lane, as the ordering needs it."""

    def read(self) -> R | None:
        """The next record, or None when the lane is empty.

        Raises:
            ProtocolError: the lane is corrupt (nothing more can be read from it).
        """
        ...


class LaneSender(Generic[F]):
    """Where one sender's messages to one peer go: its lane, or (False) its socket.

    Args:
        lane: the lane to the peer (it has mapped it and can be woken).
        marker_on: the ``lane on`` message, as :attr:`send_marker` takes it.
        marker_off: the ``lane off`` message, as the lane takes it.
        marker_room: the lane bytes a record of ``marker_off`` takes (kept free by every
            write).
        send_marker: sends ``marker_on`` on the socket now, without waiting; False if the
            socket cannot take it now (its queue is full, or it is closed).
        socket_waiting: whether an earlier send on the socket still waits for room.
        wake: tells the peer that its lane has a new record (None: the lane itself does,
            as a TCP lane's kernel wakes its reader).
    """

    def __init__(
        self,
        lane: LaneWriter[F],
        *,
        marker_on: object,
        marker_off: F,
        marker_room: int,
        send_marker: Callable[[object], bool],
        socket_waiting: Callable[[], bool],
        wake: Callable[[], None] | None,
    ) -> None:
        self.lane = lane
        self.marker_on = marker_on
        self.marker_off = marker_off
        self.marker_room = marker_room
        self.send_marker = send_marker
        self.socket_waiting = socket_waiting
        self.wake = wake
        self.on_lane = False  # my messages to the peer go on the lane now

    def put(self, frames: F) -> bool:
        """Write one message on the lane if it may go there now; False: send it on the
        socket (after everything sent on the socket so far). Never waits.

        Raises:
            RuntimeError: the room kept for ``lane off`` was taken (a bug of the lane).
        """
        spare = self.marker_room
        if not self.on_lane:
            if self.socket_waiting() or not self.lane.fits_now(frames, spare):
                return False
            if not self.send_marker(self.marker_on):
                return False
            self.on_lane = True
        if self.lane.write(frames, spare):
            if self.wake is not None:
                self.wake()
            return True
        # It does not fit: back to the socket, with the marker in the room kept for it.
        if not self.lane.write(self.marker_off):
            raise RuntimeError("the lane's room kept for the 'lane off' marker was taken")
        if self.wake is not None:
            self.wake()
        self.on_lane = False
        return False

    def leave(self) -> None:
        """Move back to the socket now (``lane off`` on the lane, if on it): what goes
        on the socket next is read after everything on the lane (the link closes, say).

        Raises:
            RuntimeError: as :meth:`put`.
        """
        if self.on_lane:
            if not self.lane.write(self.marker_off):
                raise RuntimeError("the lane's room kept for the 'lane off' marker was taken")
            if self.wake is not None:
                self.wake()
            self.on_lane = False


class LaneReceiver(Generic[M, R]):
    """Hands on one sender's messages, from its socket and its lane, in the order sent.

    Args:
        accept: validates one message and hands it on (or drops it); returns the marker's
            value if the message was a marker (True: ``lane on``, False: ``lane off``),
            else None. Its second argument says whether the message came on the lane.
            It must not raise.
        reject: told of a marker out of turn (the marker is dropped; nothing else changes).
        lane: the lane from the sender, once it is mapped (see :attr:`lane`).
    """

    def __init__(
        self,
        accept: Callable[[M | R, bool], bool | None],
        reject: Callable[[ProtocolError], None],
        lane: LaneReader[R] | None = None,
    ) -> None:
        self.accept = accept
        self.reject = reject
        self.lane = lane  # set when the sender's lane is mapped
        self.lane_current = False  # the sender's messages come on its lane now
        self.held: deque[M] = deque()  # socket messages waiting for their turn

    def from_socket(self, message: M, budget: int = BUDGET) -> bool:
        """A message from the socket: handed on now if it is its turn, else held.

        Returns True if messages may still be waiting their turn after ``budget`` of them
        were handed on: call :meth:`pump` again soon (a pump is then due).

        Raises:
            ProtocolError: from the lane, which is corrupt (see :meth:`pump`).
        """
        if self.held or self.lane_current:
            # The lane is current (this waits for "lane off"), or earlier socket messages
            # still wait for their turn (a pump is due): after them.
            self.held.append(message)
            return False
        self._take(message, on_lane=False)
        return self.pump(budget) if self.lane_current else False

    def pump(self, budget: int = BUDGET) -> bool:
        """Hand on waiting messages in the order sent: from the lane while it is current,
        else those of the socket held meanwhile; at most ``budget`` of them.

        Returns True if more may be waiting (the budget ran out): call again soon.

        Raises:
            ProtocolError: the lane is corrupt; what the sender wrote on it is lost, so
                the sender is as good as gone. Nothing more is read from the lane.
        """
        held = self.held
        for _ in range(budget):
            if not self.lane_current:
                if not held:
                    return False
                self._take(held.popleft(), on_lane=False)
                continue
            lane = self.lane
            if lane is None:
                return False
            try:
                record = lane.read()
            except ProtocolError:
                self.lane = None
                raise
            if record is None:
                return False
            marker = self.accept(record, True)  # (_take, inline: once a lane message)
            if marker is not None:
                self._marker(marker, on_lane=True)
        return bool(held) or self.lane_current

    def _take(self, message: M | R, *, on_lane: bool) -> None:
        marker = self.accept(message, on_lane)
        if marker is not None:
            self._marker(marker, on_lane=on_lane)

    def _marker(self, marker: bool, *, on_lane: bool) -> None:
        """A lane marker came (on the lane, or on the socket): follow it, if in turn."""
        if marker == on_lane or (marker and self.lane is None):
            self.reject(ProtocolError(f"moved {'to' if marker else 'off'} a lane out of turn"))
            return
        self.lane_current = marker


def marker_value(header: Header) -> bool:
    """A lane marker's value (True: "lane on"); validation checked its meta."""
    assert header.meta is not None
    return bool(header.meta["on"])


__all__ = ["BUDGET", "LaneReader", "LaneReceiver", "LaneSender", "LaneWriter", "marker_value"]
