"""Transports move messages between the peers of a group (see :mod:`.base`).

``base`` the interface, ``zmq_mesh`` the ZeroMQ mesh, ``memory`` an in-memory network for
tests, ``sockets`` the one socket factory, ``endpoints`` where a ZeroMQ peer binds and
connects, ``shm`` shared-memory rings between peers of one host, ``malloc`` the allocator's
thresholds.

The names below but the interface's are imported on first use: a module that needs only
the interface (the engine, the session) loads neither the mesh nor the in-memory network.
"""

from typing import TYPE_CHECKING

from ..lazy import lazy_names

from .base import Counters, Transport

if TYPE_CHECKING:
    from .endpoints import endpoint_policy, host_identity
    from .memory import Faults, MemoryNetwork, MemoryTransport
    from .sockets import SocketFactory
    from .zmq_mesh import ZmqMesh

__all__ = [
    "Counters", "Faults", "MemoryNetwork", "MemoryTransport", "SocketFactory", "Transport",
    "ZmqMesh", "endpoint_policy", "host_identity",
]

_HOMES = {"endpoint_policy": ".endpoints", "host_identity": ".endpoints",
          "Faults": ".memory", "MemoryNetwork": ".memory", "MemoryTransport": ".memory",
          "SocketFactory": ".sockets", "ZmqMesh": ".zmq_mesh"}


__getattr__, __dir__ = lazy_names(__name__, globals(), _HOMES)
