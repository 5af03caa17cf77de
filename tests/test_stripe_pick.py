"""Which connection of a striped link a large message goes on (issue 36): the one with the
fewest bytes its peer has not acknowledged, not the next in strict turn.

On the lab's long paths (4 hosts, 100 ms) the receiver's timeline showed runs of 40
messages handed on at once after 150 ms with nothing: one connection of six lagged (its
congestion control held it back) while the others' messages waited behind it in the link's
order. A connection that lags now takes fewer messages. Here, over real loopback TCP:

- :func:`acknowledged` reads what the kernel says of a connection (bytes acknowledged,
  nothing left to send);
- :meth:`Stripe.queued` counts the large messages given less what was acknowledged, and
  starts again from the kernel's count whenever the connection has drained (so small
  messages it never counted do not skew it);
- :func:`least_queued` takes the emptiest connection, and connections alike in turn.
"""

from __future__ import annotations

import socket
import time
from types import SimpleNamespace
from typing import Any

import pytest
import zmq
import zmq.asyncio

from p2pcoll.transport.route import least_queued
from p2pcoll.transport.stripes import FRAMING_BYTES, Stripe, acknowledged

MiB = 1 << 20


def pair(receive_buffer: int = 64 << 10) -> tuple[socket.socket, socket.socket]:
    """A connected loopback TCP pair (sender, receiver), the receiver's buffer small."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        receiver_side = socket.socket()
        receiver_side.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        receiver_side.connect(listener.getsockname())
        sender, _ = listener.accept()
    sender.setblocking(False)
    return sender, receiver_side


def push(sock: socket.socket, nbytes: int) -> int:
    """Send up to ``nbytes`` without blocking; the bytes the kernel took."""
    sent, chunk = 0, b"x" * (256 << 10)
    while sent < nbytes:
        try:
            sent += sock.send(chunk[:nbytes - sent])
        except BlockingIOError:
            break
    return sent


def drain(sock: socket.socket, nbytes: int) -> None:
    while nbytes:
        nbytes -= len(sock.recv(min(nbytes, 1 << 20)))


def settled(fd: int, acked: int, patience: float = 5.0) -> tuple[int, bool]:
    deadline = time.monotonic() + patience
    while True:
        progress = acknowledged(fd)
        assert progress is not None
        if (progress[0] >= acked and progress[1]) or time.monotonic() > deadline:
            return progress
        time.sleep(0.01)


def test_acknowledged_reads_the_kernel() -> None:
    sender, receiver = pair()
    with sender, receiver:
        start = acknowledged(sender.fileno())
        assert start is not None and start[1]  # nothing sent: drained
        sent = push(sender, 8 * MiB)  # the receiver reads nothing: some stays unacked
        progress = acknowledged(sender.fileno())
        assert progress is not None and not progress[1]
        assert progress[0] - start[0] < sent
        drain(receiver, sent)
        acked, drained = settled(sender.fileno(), start[0] + sent)
        assert drained and acked - start[0] == sent
    assert acknowledged(-1) is None
    with socket.socket(socket.AF_UNIX) as unix:  # not TCP: the kernel cannot say
        assert acknowledged(unix.fileno()) is None


@pytest.fixture
def stripe() -> Any:
    context = zmq.asyncio.Context()
    conn = Stripe(context.socket(zmq.DEALER))
    yield conn
    conn.socket.close(linger=0)
    context.term()


def test_a_connection_counts_what_its_peer_has_not_acknowledged(stripe: Stripe) -> None:
    sender, receiver = pair()
    with sender, receiver:
        stripe.fd = sender.fileno()
        assert stripe.queued() == 0
        extra = push(sender, 1000)  # a small message: never counted
        drain(receiver, extra)
        settled(sender.fileno(), 0)
        assert stripe.queued() == 0  # more acknowledged than counted: none queued
        sent = push(sender, 4 * MiB)
        stripe.given += sent + FRAMING_BYTES  # as enqueue(frames, nbytes) counts it
        queued = stripe.queued()
        assert 0 < queued <= sent + FRAMING_BYTES
        drain(receiver, sent)
        settled(sender.fileno(), sent)
        stripe.queued()  # drained, but given since the look before: not yet trusted
        assert stripe.queued() == 0  # drained twice, nothing given between: from zero
        sent = push(sender, 2 * MiB)
        stripe.given += sent + FRAMING_BYTES
        # the count starts from the kernel's: the small message no longer offsets it
        assert stripe.queued() > sent // 2
        drain(receiver, sent)
    stripe.fd = -1
    assert stripe.queued() == 0  # no connection yet (or the kernel cannot say): 0


class Conn:
    def __init__(self, queued: int) -> None:
        self.bytes = queued

    def queued(self) -> int:
        return self.bytes


def route(turn: int, link: int, *stripes: int, width: int | None = None) -> Any:
    return SimpleNamespace(conn=Conn(link), stripes=[Conn(b) for b in stripes], turn=turn,
                           width=width or 1 + len(stripes))


def test_the_emptiest_connection_takes_the_next_large_message() -> None:
    assert least_queued(route(0, 3 * MiB, 3 * MiB, 1 * MiB, 3 * MiB)) == 2
    assert least_queued(route(3, 0, 3 * MiB, 1 * MiB, 3 * MiB)) == 0  # the link is one
    # Alike: the first from the turn on, so equal connections are taken in turn.
    assert least_queued(route(1, MiB, MiB, MiB, MiB)) == 1
    assert least_queued(route(3, MiB, MiB, MiB, MiB)) == 3
    assert least_queued(route(2, 0, 0, 0, 0)) == 2
    # A stripe not opened yet has nothing queued, and stripes open in order.
    assert least_queued(route(3, MiB, MiB, width=6)) == 2
    assert least_queued(route(0, 0, width=4)) == 0
    # One lagging connection of six gets no more until it has caught up.
    lagging = route(0, MiB, MiB, 3 * MiB, MiB, MiB, MiB)
    picks = []
    for _ in range(16):
        i = least_queued(lagging)
        picks.append(i)
        conn = lagging.conn if i == 0 else lagging.stripes[i - 1]
        conn.bytes += MiB
        lagging.turn = (i + 1) % lagging.width
    assert 2 not in picks[:10] and sorted(set(picks)) == [0, 1, 2, 3, 4, 5]
