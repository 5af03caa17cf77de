"""Striped links: a link's large messages spread over several TCP connections, in order.

On a long path one TCP connection moves at most its window per round trip (see
:mod:`.paths`). A route to such a peer (see :mod:`.route`) therefore opens ``k - 1``
*stripes* beside its link, each a DEALER connection of its own to the peer's ROUTER (its
own CurveZMQ session, too, with a job key: libzmq's I/O threads encrypt them side by side),
and sends its messages of at least :data:`STRIPE_BYTES` in turn over the link and the
stripes. The link stays the one order of the sender's messages: a message that goes on
stripe ``i`` is announced there by a *turn*, a 3-byte frame :func:`turn` (no header: it is
the transport's own framing, never handed on), queued on the link at the same moment as
the message on the stripe. Each connection keeps its own order, so the receiver
(:class:`StripeJoin`) reads the link and, at each turn, takes the next message of that
stripe, waiting for it if need be, and holds the link's later messages meanwhile: every
message is handed on once, in the order sent.

A stripe's identity is its link's with ``#i`` after it (:func:`stripe_identity`); the
receiver takes a stripe's messages only through its link's turns, so a stripe whose link is
no member's current link hands nothing on. A stripe that breaks (its connection goes down)
breaks the link: what was on it cannot be replaced in order, so the peer is reported down
(a lost peer, named), never reordered or partly delivered. Its link's ``end`` (closing it
for the link budget) comes after every turn, so once the peer has answered it, every stripe
has been read too and all of them close.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

__all__ = [
    "STRIPE_BYTES", "Stripe", "StripeJoin", "parse_stripe", "stripe_identity", "turn",
    "turn_of",
]

M = TypeVar("M")  # a message as the receiver holds it (opaque here)

STRIPE_BYTES = 64 << 10
"""Messages with at least this many payload bytes are spread over a route's stripes; smaller
ones go on its link (a stripe's turn costs a frame on the link)."""
_TURN = b"\x00s"  # no header begins so (see p2pcoll.wire.header): a turn, never a message
_NOBLOCK, _SNDMORE = int(zmq.NOBLOCK), int(zmq.SNDMORE)
MAX_HELD_BYTES = 256 << 20  # what a join holds of stripes ahead of their turns, at most
FRAMING_BYTES = 64  # what a message costs on the wire beyond its payload, about (ZMTP, CURVE)
_TCP_INFO = getattr(socket, "TCP_INFO", 11)
# struct tcp_info (linux/tcp.h): tcpi_unacked, tcpi_bytes_acked, tcpi_notsent_bytes
_UNACKED, _ACKED, _NOTSENT, _INFO_BYTES = 24, 120, 144, 148


def acknowledged(fd: int) -> tuple[int, bool] | None:
    """``(bytes the peer has acknowledged, whether nothing is left to send or acknowledge)``
    of the TCP connection ``fd``, from the kernel (TCP_INFO); None where it cannot say
    (no such socket, another kernel)."""
    if fd < 0:
        return None
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return None
    try:
        raw = sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, _INFO_BYTES)
    except OSError:
        return None
    finally:
        sock.detach()  # the descriptor stays libzmq's
    if len(raw) < _INFO_BYTES:
        return None
    unacked, = struct.unpack_from("I", raw, _UNACKED)
    acked, = struct.unpack_from("Q", raw, _ACKED)
    notsent, = struct.unpack_from("I", raw, _NOTSENT)
    return acked, unacked == 0 and notsent == 0


def turn(stripe: int) -> bytes:
    """The frame on a link that says its next large message comes on ``stripe``."""
    return _TURN + bytes((stripe,))


def turn_of(frame: zmq.Frame | bytes) -> int | None:
    """The stripe a link's one-frame message announces; None if it is no turn."""
    if len(frame) != 3:
        return None
    data = frame.bytes if isinstance(frame, zmq.Frame) else frame
    return data[2] if data[:2] == _TURN else None


def stripe_identity(link: bytes, stripe: int) -> bytes:
    """The identity of stripe ``stripe`` (1, 2, ...) of the link whose identity is ``link``."""
    return b"%s#%d" % (link, stripe)


def parse_stripe(identity: bytes) -> tuple[bytes, int] | None:
    """``(link identity, stripe)`` of a stripe's identity; None for any other identity.

    >>> parse_stripe(b"3@s@n@0#2"), parse_stripe(b"3@s@n@0"), parse_stripe(b"x#0")
    ((b'3@s@n@0', 2), None, None)
    """
    link, sep, index = identity.rpartition(b"#")
    if not sep or not index.isdigit() or len(index) > 2 or int(index) < 1:
        return None
    return link, int(index)


class Stripe:
    """One connection of a route: its link or one of its stripes.

    Args:
        socket: the DEALER.
        on_down: called once if its connection goes down while watched (see :meth:`watch`).
    """

    __slots__ = ("base", "events", "fd", "given", "handshake_s", "plain", "seen", "socket",
                 "task", "waiting")

    def __init__(self, socket: zmq.asyncio.Socket) -> None:
        self.socket = socket
        # A send that need not wait for room skips pyzmq's asyncio future.
        self.plain: zmq.Socket[Any] = zmq.Socket.shadow(socket.underlying)
        self.waiting = 0  # sends that wait for room in its queue
        self.events: zmq.asyncio.Socket | None = None  # its monitor, while watched
        self.task: asyncio.Task[None] | None = None
        self.fd = -1  # its connection's descriptor, once connected (for diagnostics)
        self.handshake_s: float | None = None
        # What it was given to send (large messages, see queued()), and what of that the
        # kernel's count of acknowledged bytes does not cover (the small messages between)
        self.given = 0
        self.base = 0
        self.seen = -1  # ``given`` when last found drained

    def queued(self) -> int:
        """Bytes given to this connection that its peer has not acknowledged yet, about:
        what waits in libzmq's queue, in the kernel's and on the wire. The large messages
        given count (:meth:`enqueue`'s ``nbytes``), the small ones do not: each time the
        connection is found drained with nothing given since the last look, the count starts
        again from what the kernel says. 0 when the kernel cannot say."""
        progress = acknowledged(self.fd)
        if progress is None:
            return 0
        acked, drained = progress
        if drained and self.seen == self.given:
            self.base = self.given - acked
        self.seen = self.given
        return max(0, self.given - acked - self.base)

    def enqueue(self, frames: list[Any], nbytes: int = 0) -> asyncio.Future[object] | None:
        """Queue one message: sent now when the queue has room (None), else through the
        asyncio socket (the future, done once it is queued). Later messages queue behind
        a waiting one, so they stay in order; the place in the order is taken here, before
        anything is awaited.

        ``nbytes``: its payload, counted in :meth:`queued` (0: a small message, not counted).

        Raises:
            zmq.ZMQError: the connection is closed (ENOTSOCK), or the send failed.
        """
        if nbytes:
            self.given += nbytes + FRAMING_BYTES
        if not self.waiting:
            if self.socket._closed:  # the plain handle must not outlive it (see sockets.Socket)
                raise zmq.ZMQError(zmq.ENOTSOCK)
            plain = self.plain
            try:
                # Part by part as send_multipart does, with plain int flags; only the
                # first part can meet the high-water mark, the others join it.
                plain.send(frames[0], _NOBLOCK | _SNDMORE if len(frames) > 1 else _NOBLOCK)
            except zmq.Again:
                pass  # wait for room
            else:
                last = len(frames) - 1
                for i in range(1, last + 1):
                    plain.send(frames[i], _NOBLOCK if i == last else _NOBLOCK | _SNDMORE)
                return None
        self.waiting += 1
        future: asyncio.Future[object] = self.socket.send_multipart(  # type: ignore[assignment]
            frames, copy=False)
        future.add_done_callback(self._sent)
        return future

    def _sent(self, _: object) -> None:
        self.waiting -= 1

    def watch(self, started: float, on_handshake: Callable[[float], None],
              on_down: Callable[[], None], events_of: Callable[[zmq.asyncio.Socket, int],
                                                               zmq.asyncio.Socket]) -> None:
        """Follow the connection: ``on_handshake(seconds since started)`` when its
        handshake completes, ``on_down()`` when it goes down after that. (One that drops
        before its handshake has carried nothing: libzmq keeps its queue and connects
        again, as for any link.)"""
        self.events = events_of(self.socket, zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED
                                | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self.task = asyncio.create_task(self._follow(self.events, started, on_handshake,
                                                     on_down))

    async def _follow(self, events: zmq.asyncio.Socket, started: float,
                      on_handshake: Callable[[float], None],
                      on_down: Callable[[], None]) -> None:
        try:
            while True:
                event = parse_monitor_message(await events.recv_multipart())
                kind = event["event"]
                if kind == zmq.EVENT_CONNECTED:
                    self.fd = int(event["value"])
                elif kind == zmq.EVENT_HANDSHAKE_SUCCEEDED and self.handshake_s is None:
                    self.handshake_s = time.monotonic() - started
                    on_handshake(self.handshake_s)
                elif kind == zmq.EVENT_DISCONNECTED and self.handshake_s is not None:
                    on_down()
        except (asyncio.CancelledError, zmq.ZMQError, OSError):
            pass  # closed (an OSError: its descriptor was closed under the poller)

    def close(self, linger: int | None = None) -> asyncio.Task[None] | None:
        """Close the connection and its monitor (stopped while its PAIR socket is still
        open: libzmq sends a final event on stop); returns the task that followed it."""
        if self.events is not None:
            self.socket.disable_monitor()
            self.events.close(linger=0)
            self.events = None
        if self.task is not None:
            self.task.cancel()
        if linger is None:
            self.socket.close()
        else:
            self.socket.close(linger=linger)
        return self.task


class StripeJoin(Generic[M]):
    """Hands on one link's messages and those of its stripes in the order sent (see the
    module docstring). No sockets: the router feeds it.

    Args:
        deliver: hands on one message.
        size: a message's bytes (for the bound on what is held).
    """

    __slots__ = ("deliver", "held_bytes", "inbox", "queue", "size")

    def __init__(self, deliver: Callable[[M], None], size: Callable[[M], int]) -> None:
        self.deliver = deliver
        self.size = size
        # The link's messages and turns not handed on yet, in order: a turn is a stripe's
        # index, a message is never an int.
        self.queue: deque[M | int] = deque()
        self.inbox: dict[int, deque[M]] = {}  # each stripe's messages ahead of their turns
        self.held_bytes = 0

    def on_link(self, message: M) -> None:
        """A message on the link: handed on now, unless a turn before it still waits."""
        if self.queue:
            self.queue.append(message)
        else:
            self.deliver(message)

    def on_turn(self, stripe: int) -> None:
        """A turn on the link: the next message of ``stripe`` comes now."""
        self.queue.append(stripe)
        self._pump()

    def on_stripe(self, stripe: int, message: M) -> bool:
        """A message on ``stripe``: handed on if its turn has come, else held; False if
        holding it would pass :data:`MAX_HELD_BYTES` (it is not taken: the sender is
        broken or hostile)."""
        nbytes = self.size(message)
        if self.held_bytes + nbytes > MAX_HELD_BYTES:
            return False
        self.inbox.setdefault(stripe, deque()).append(message)
        self.held_bytes += nbytes
        self._pump()
        return True

    def _pump(self) -> None:
        queue, inbox = self.queue, self.inbox
        while queue:
            head = queue[0]
            if isinstance(head, int):
                box = inbox.get(head)
                if not box:
                    return  # its message has not come yet
                message = box.popleft()
                self.held_bytes -= self.size(message)
            else:
                message = head
            queue.popleft()
            self.deliver(message)
