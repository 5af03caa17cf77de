"""The one place every ZeroMQ socket of p2pcoll is made, with its options.

The mesh's ROUTER and DEALER links and the rendezvous server and client all come from a
:class:`SocketFactory`, so a socket option (high-water marks, size caps, linger, heartbeats,
and the job's CURVE keys once they exist) is set in one place for every socket of a peer.
"""

from __future__ import annotations

import zmq
import zmq.asyncio

HWM = 1000  # messages queued per link before a send waits (backpressure per destination)
LINGER_MS = 2000  # how long queued messages may still go out after a link closes
HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 5000
RENDEZVOUS_MAX_BYTES = 1 << 20  # a join request or a roster; larger ones are refused


class SocketFactory:
    """Makes the sockets of one peer (or of one rendezvous server)."""

    def __init__(self, context: zmq.asyncio.Context | None = None) -> None:
        self.context = context or zmq.asyncio.Context.instance()

    def _socket(self, kind: int) -> zmq.asyncio.Socket:
        return self.context.socket(kind)

    def mesh_router(self, *, max_message_bytes: int) -> zmq.asyncio.Socket:
        """The socket a peer receives every message of its group on."""
        sock = self._socket(zmq.ROUTER)
        sock.setsockopt(zmq.RCVHWM, HWM)
        sock.setsockopt(zmq.LINGER, 0)
        # A hard per-frame cap: libzmq drops the connection of a peer that exceeds it.
        sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        return sock

    def mesh_link(self, rank: int, *, heartbeats: bool) -> zmq.asyncio.Socket:
        """A sending link to one peer; its identity is this peer's rank (``b"3"``)."""
        sock = self._socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, b"%d" % rank)
        sock.setsockopt(zmq.SNDHWM, HWM)
        sock.setsockopt(zmq.LINGER, LINGER_MS)
        if heartbeats:
            sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
            sock.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TIMEOUT_MS)
        return sock

    def rendezvous_server(self) -> zmq.asyncio.Socket:
        sock = self._socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.setsockopt(zmq.MAXMSGSIZE, RENDEZVOUS_MAX_BYTES)
        return sock

    def rendezvous_client(self) -> zmq.asyncio.Socket:
        sock = self._socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RECONNECT_IVL, 50)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 500)
        sock.setsockopt(zmq.MAXMSGSIZE, 64 * RENDEZVOUS_MAX_BYTES)
        return sock
