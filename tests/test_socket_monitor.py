"""A socket's monitor (transport/sockets.monitor) never stalls libzmq or the process.

libzmq's I/O thread sends each monitor event with a blocking send while it holds the
socket's monitor lock. With pyzmq's reader (``get_monitor_socket``: a bounded queue), 500
unread events made that send wait, and ``disable_monitor()`` then waited for the lock in C
while holding the interpreter lock: the whole process froze, out of reach of
pytest-timeout. A real socket retrying a connection to a closed port every
millisecond makes the events here.
"""

from __future__ import annotations

import threading
import time

import zmq

from p2pcoll.testing import free_port
from p2pcoll.transport.sockets import monitor


def test_disabling_a_monitor_whose_events_were_never_read_returns() -> None:
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RECONNECT_IVL, 1)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 0)
    events = monitor(sock, zmq.EVENT_CONNECT_RETRIED)  # type: ignore[arg-type]
    try:
        sock.connect(f"tcp://127.0.0.1:{free_port()}")  # nobody listens: it retries
        time.sleep(4)  # ~700 retries a second here: beyond the 500 that stalled
        stopper = threading.Thread(target=sock.disable_monitor, daemon=True)
        stopper.start()
        stopper.join(30)
        assert not stopper.is_alive(), "disable_monitor() is stuck"
        queued = 0
        while events.poll(0):
            events.recv_multipart()
            queued += 1
        # Every event stayed queued: the case that stalled was reached, and nothing lost.
        assert queued > 500, f"only {queued} connect retries: the stall was not reached"
    finally:
        events.close(linger=0)
        sock.close(linger=0)
        context.term()
