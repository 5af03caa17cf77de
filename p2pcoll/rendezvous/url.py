"""Rendezvous URLs, and the address a peer advertises to the others."""

from __future__ import annotations

import asyncio
import socket
from urllib.parse import urlsplit

from ..errors import RendezvousError


def parse_url(url: str) -> tuple[str, int]:
    """Split ``tcp://HOST:PORT`` into host and port, or raise RendezvousError."""
    parts = urlsplit(url)
    if parts.scheme != "tcp" or not parts.hostname or parts.port is None:
        raise RendezvousError(f"rendezvous must look like tcp://HOST:PORT, got {url!r}")
    return parts.hostname, parts.port


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
