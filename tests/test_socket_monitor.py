"""Sockets never stall or crash libzmq: a monitor's events (transport/sockets.monitor), and
no socket used once closed (transport/sockets.Socket).

libzmq's I/O thread sends each monitor event with a blocking send while it holds the
socket's monitor lock. With pyzmq's reader (``get_monitor_socket``: a bounded queue), 500
unread events made that send wait, and ``disable_monitor()`` then waited for the lock in C
while holding the interpreter lock: the whole process froze, out of reach of
pytest-timeout. A real socket retrying a connection to a closed port every
millisecond makes the events here. The same freeze came from a socket read after close
(see the tests at the end).
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import zmq
import zmq.asyncio

from p2pcoll.testing import free_port
from p2pcoll.transport.liveness import Probes
from p2pcoll.transport.sockets import SocketFactory, monitor


async def test_disabling_a_monitor_whose_events_were_never_read_returns() -> None:
    context = zmq.asyncio.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RECONNECT_IVL, 1)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 0)
    events = monitor(sock, zmq.EVENT_CONNECT_RETRIED)
    queue = zmq.Socket.shadow(events.underlying)  # read synchronously below
    try:
        sock.connect(f"tcp://127.0.0.1:{free_port()}")  # nobody listens: it retries
        time.sleep(4)  # ~700 retries a second here: beyond the 500 that stalled
        stopper = threading.Thread(target=sock.disable_monitor, daemon=True)
        stopper.start()
        stopper.join(30)
        assert not stopper.is_alive(), "disable_monitor() is stuck"
        queued = 0
        while queue.poll(0):
            queue.recv_multipart()
            queued += 1
        # Every event stayed queued: the case that stalled was reached, and nothing lost.
        assert queued > 500, f"only {queued} connect retries: the stall was not reached"
    finally:
        events.close(linger=0)
        sock.close(linger=0)
        context.term()


# --- a socket is never used once closed -----------------------------------------------------

class Tripwire:
    """Stands in for pyzmq's second handle on a closed socket: any use of it is recorded."""

    def __init__(self) -> None:
        self.used: list[str] = []

    def __getattr__(self, name: str) -> object:
        self.used.append(name)
        raise AssertionError(f"libzmq socket used after close ({name})")


async def test_a_closed_socket_refuses_to_receive_or_send_without_reaching_libzmq() -> None:
    """pyzmq's asyncio socket reads its libzmq socket through a handle that close() does
    not mark closed; once libzmq's reaper had freed the socket, a receive started after
    close read freed memory (crashes, and a stolen wake-up that froze a later
    disable_monitor). Each call is refused first, with the error of a closed socket."""
    sock = SocketFactory().mesh_probe(b"0@s@n~probe")
    sock.close(linger=0)
    tripwire = Tripwire()
    sock._shadow_sock = tripwire  # type: ignore[assignment]
    for call in (lambda: sock.recv_multipart(copy=False), lambda: sock.recv(),
                 lambda: sock.send_multipart([b"x"]), lambda: sock.send(b"x")):
        with pytest.raises(zmq.ZMQError) as raised:
            await call()  # type: ignore[no-untyped-call]
        assert raised.value.errno == zmq.ENOTSOCK
    assert tripwire.used == []


async def test_a_probe_closed_by_the_goodbye_it_carried_is_not_read_again() -> None:
    """The case that froze CI: a watched peer's goodbye arrives on its probe, and the
    departure it announces closes that very probe inside the handler; the probe's reader
    then must end, not ask the closed socket for the next message."""
    factory = SocketFactory()
    peer = factory.context.socket(zmq.ROUTER)
    peer.setsockopt(zmq.LINGER, 0)
    port = peer.bind_to_random_port("tcp://127.0.0.1")
    closed: list[zmq.asyncio.Socket] = []
    tripwire = Tripwire()

    def on_bye(rank: int, frames: list[zmq.Frame]) -> None:
        probe = probes._probes[rank][0]
        task = probes.close(rank)  # what a departure does to the probe of a peer gone
        assert task is not None
        probe._shadow_sock = tripwire  # type: ignore[assignment]
        closed.append(probe)
        watching.append(task)

    watching: list[asyncio.Task[None]] = []
    probes = Probes(factory, on_down=lambda rank: None, on_bye=on_bye)
    try:
        probes.open(3, f"tcp://127.0.0.1:{port}", b"0@s@n~probe")
        identity = None
        async with asyncio.timeout(30):
            while identity is None:  # the probe connects and says nothing: send to it
                await peer.send_multipart([b"0@s@n~probe", b"bye"])
                await asyncio.sleep(0.05)
                if closed:
                    identity = b"0@s@n~probe"
            await asyncio.gather(*watching, return_exceptions=True)
        assert tripwire.used == []
    finally:
        probes.close_all()
        peer.close(linger=0)
        factory.close()
