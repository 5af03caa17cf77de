"""The transport interface: where a peer binds and how its address is written.

Every transport is a ZeroMQ endpoint family, so all of them share one mesh implementation
(:class:`p2pcoll.transport.mesh.Mesh`) and one wire format; they differ in the address a
peer binds and advertises:

- ``tcp``: ``tcp://HOST:PORT`` on the interface that routes to the rendezvous host (any host);
- ``ipc``: a Unix socket path (peers on one host);
- ``inproc``: an in-process queue (peers in one process; tests and simulations).
"""

from __future__ import annotations

import os
import tempfile
import uuid
from abc import ABC, abstractmethod


class Transport(ABC):
    """Chooses the endpoint a peer binds. One instance per peer."""

    name: str

    @abstractmethod
    def bind_address(self, host: str) -> str:
        """The address to bind; may end in ``:*`` to let the OS pick a port."""

    def cleanup(self, endpoint: str) -> None:
        """Release anything the bound endpoint left behind (files, ...)."""


class TcpTransport(Transport):
    name = "tcp"

    def bind_address(self, host: str) -> str:
        return f"tcp://{host}:*"


class IpcTransport(Transport):
    name = "ipc"

    def bind_address(self, host: str) -> str:
        # Unix socket paths are limited to ~107 bytes, so keep this short.
        path = os.path.join(tempfile.gettempdir(), f"p2pcoll-{uuid.uuid4().hex[:16]}.sock")
        return f"ipc://{path}"

    def cleanup(self, endpoint: str) -> None:
        path = endpoint.removeprefix("ipc://")
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


class InprocTransport(Transport):
    name = "inproc"

    def bind_address(self, host: str) -> str:
        return f"inproc://p2pcoll-{uuid.uuid4().hex}"


TRANSPORTS: dict[str, type[Transport]] = {
    t.name: t for t in (TcpTransport, IpcTransport, InprocTransport)
}


def get_transport(name: str | None = None) -> Transport:
    """The transport named by ``name``, else ``$P2PCOLL_TRANSPORT``, else tcp."""
    name = name or os.environ.get("P2PCOLL_TRANSPORT") or "tcp"
    if name == "auto":
        name = "tcp"
    try:
        return TRANSPORTS[name]()
    except KeyError:
        raise ValueError(
            f"unknown transport {name!r}; expected one of {', '.join(TRANSPORTS)} or 'auto'"
        ) from None
