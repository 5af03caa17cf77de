"""Transports move messages between the peers of a group (see :mod:`.base`).

``base`` the interface, ``zmq_mesh`` the ZeroMQ mesh, ``memory`` an in-memory network for
tests, ``sockets`` the one socket factory, ``endpoints`` where a ZeroMQ peer binds and
connects, ``shm`` shared-memory rings between peers of one host, ``malloc`` the allocator's
thresholds.

The names below but the interface's are imported on first use: a module that needs only
the interface (the engine, the session) loads neither the mesh nor the in-memory network.
"""

from typing import TYPE_CHECKING

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


def __getattr__(name: str) -> object:
    import importlib

    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home, __name__), name)
    globals()[name] = value  # once: later reads find it without this hook
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
