"""Endpoint policies: where a ZeroMQ peer binds, and which address reaches a given peer.

The ZeroMQ mesh (:mod:`.zmq_mesh`) takes one of these; the policies differ in the addresses
a peer binds and advertises:

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


class EndpointPolicy(ABC):
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


class TcpEndpoints(EndpointPolicy):
    name = "tcp"

    def bind_addresses(self, host: str) -> list[str]:
        return [f"tcp://{host}:*"]


class IpcEndpoints(EndpointPolicy):
    name = "ipc"

    def bind_addresses(self, host: str) -> list[str]:
        return [_ipc_address()]


class InprocEndpoints(EndpointPolicy):
    name = "inproc"

    def bind_addresses(self, host: str) -> list[str]:
        return [f"inproc://p2pcoll-{uuid.uuid4().hex}"]


class AutoEndpoints(EndpointPolicy):
    name = "auto"

    def bind_addresses(self, host: str) -> list[str]:
        return [f"tcp://{host}:*", _ipc_address()]

    def choose(self, my_host: str, their_host: str, their_endpoints: list[str]) -> str:
        if their_host == my_host:
            for endpoint in their_endpoints:
                if endpoint.startswith("ipc://"):
                    return endpoint
        return their_endpoints[0]


POLICIES: dict[str, type[EndpointPolicy]] = {
    t.name: t for t in (AutoEndpoints, TcpEndpoints, IpcEndpoints, InprocEndpoints)
}


def host_identity() -> str:
    """Names this machine: peers with equal identities can reach each other over ipc."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def endpoint_policy(name: str) -> EndpointPolicy:
    """The policy named ``name`` (one of :data:`POLICIES`); names are checked by Settings."""
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(
            f"unknown transport {name!r}; expected one of {', '.join(POLICIES)}"
        ) from None
