"""The transport interface: where a peer binds, and which address reaches a given peer.

Every transport is a ZeroMQ endpoint family, so all of them share one mesh implementation
(:class:`p2pcoll.transport.mesh.Mesh`) and one wire format; they differ in the addresses a
peer binds and advertises:

- ``tcp``: ``tcp://HOST:PORT`` on the interface that routes to the rendezvous host (any host);
- ``ipc``: a Unix socket path (peers on one host);
- ``inproc``: an in-process queue (peers in one process; tests and simulations);
- ``auto`` (the default): binds both tcp and ipc, and reaches each peer over ipc when it runs
  on the same host (same hostname and kernel boot id), over tcp otherwise.
"""

from __future__ import annotations

import os
import socket
import tempfile
import uuid
from abc import ABC, abstractmethod


class Transport(ABC):
    """Chooses the endpoints a peer binds and the address it uses for each peer."""

    name: str

    @abstractmethod
    def bind_addresses(self, host: str) -> list[str]:
        """Addresses to bind; a port ``*`` lets the OS pick."""

    def choose(self, my_host: str, their_host: str, their_endpoints: list[str]) -> str:
        """The endpoint of a peer to connect to (the first one by default)."""
        return their_endpoints[0]

    def cleanup(self, endpoint: str) -> None:
        """Release anything a bound endpoint left behind (socket files, ...)."""
        if endpoint.startswith("ipc://"):
            try:
                os.unlink(endpoint.removeprefix("ipc://"))
            except FileNotFoundError:
                pass


def _ipc_address() -> str:
    # Unix socket paths are limited to ~107 bytes, so keep this short.
    return "ipc://" + os.path.join(tempfile.gettempdir(), f"p2pcoll-{uuid.uuid4().hex[:16]}.sock")


class TcpTransport(Transport):
    name = "tcp"

    def bind_addresses(self, host: str) -> list[str]:
        return [f"tcp://{host}:*"]


class IpcTransport(Transport):
    name = "ipc"

    def bind_addresses(self, host: str) -> list[str]:
        return [_ipc_address()]


class InprocTransport(Transport):
    name = "inproc"

    def bind_addresses(self, host: str) -> list[str]:
        return [f"inproc://p2pcoll-{uuid.uuid4().hex}"]


class AutoTransport(Transport):
    name = "auto"

    def bind_addresses(self, host: str) -> list[str]:
        return [f"tcp://{host}:*", _ipc_address()]

    def choose(self, my_host: str, their_host: str, their_endpoints: list[str]) -> str:
        if their_host == my_host:
            for endpoint in their_endpoints:
                if endpoint.startswith("ipc://"):
                    return endpoint
        return their_endpoints[0]


TRANSPORTS: dict[str, type[Transport]] = {
    t.name: t for t in (AutoTransport, TcpTransport, IpcTransport, InprocTransport)
}


def host_identity() -> str:
    """Names this machine: peers with equal identities can reach each other over ipc."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def get_transport(name: str | None = None) -> Transport:
    """The transport named by ``name``, else ``$P2PCOLL_TRANSPORT``, else auto."""
    name = name or os.environ.get("P2PCOLL_TRANSPORT") or "auto"
    try:
        return TRANSPORTS[name]()
    except KeyError:
        raise ValueError(
            f"unknown transport {name!r}; expected one of {', '.join(TRANSPORTS)}"
        ) from None
