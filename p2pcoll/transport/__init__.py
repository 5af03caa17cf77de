"""Transports move messages between the peers of a group (see :mod:`.base`).

``base`` the interface, ``zmq_mesh`` the ZeroMQ mesh, ``memory`` an in-memory network for
tests, ``sockets`` the one socket factory, ``endpoints`` where a ZeroMQ peer binds and
connects, ``shm`` shared-memory rings between peers of one host, ``malloc`` the allocator's
thresholds.
"""

from .base import Counters, Transport
from .endpoints import endpoint_policy, host_identity
from .memory import Faults, MemoryNetwork, MemoryTransport
from .sockets import SocketFactory
from .zmq_mesh import ZmqMesh

__all__ = [
    "Counters", "Faults", "MemoryNetwork", "MemoryTransport", "SocketFactory", "Transport",
    "ZmqMesh", "endpoint_policy", "host_identity",
]
