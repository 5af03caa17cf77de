"""Rendezvous URLs, and the address a peer advertises to the others."""

from __future__ import annotations

import asyncio
import socket
from urllib.parse import urlsplit

from ..errors import RendezvousError


def parse_url(url: str) -> tuple[str, int]:
    """Split ``tcp://HOST:PORT`` (or ``torch://HOST:PORT``, torchrun's store) into host
    and port, or raise RendezvousError."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:  # a port out of range
        port = None
    if parts.scheme not in ("tcp", "torch") or not parts.hostname or port is None:
        raise RendezvousError(f"rendezvous must look like tcp://HOST:PORT, got {url!r}")
    return parts.hostname, port


async def advertised_host(rendezvous_host: str) -> str:
    """The local IP address of the interface that routes to the rendezvous host.

    A UDP socket ``connect`` picks the route without sending anything.
    """
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(rendezvous_host, None, family=socket.AF_INET)
    target = infos[0][4][0]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((target, 9))
        return str(s.getsockname()[0])
