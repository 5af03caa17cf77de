"""How peers behind relays are named, without I/O: target names, group tags, the
``relay://HOST:PORT/TARGET`` endpoints a roster carries, and which of a peer's endpoints
the mesh uses.

What every peer needs of the relay to form a group, whether or not any peer is behind a
relay: it imports neither the relay (:mod:`.server`) nor the splicing (:mod:`.attach`), so
a group with no relayed peer loads neither. See docs/relay.md.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from collections.abc import Callable, Sequence

__all__ = ["HEX", "PREFIX", "advertised", "choosing", "endpoint", "is_relay", "new_target",
           "parse_endpoint", "tag_of"]

PREFIX = "relay://"
HEX = 32  # a target and a tag: 32 hex digits each (128 bits)
_ENDPOINT = re.compile(r"relay://([^/\s]*):([0-9]{1,5})/([0-9a-f]{32})(?:\.([0-9a-f]{32}))?")


def new_target() -> str:
    """A fresh target name: 128 random bits, in hex."""
    return secrets.token_hex(HEX // 2)


def tag_of(secret: str) -> str:
    """The tag of a group at a relay: a digest of its link secret (the relay learns the
    tag, never the secret)."""
    return hashlib.sha256(b"p2pcoll-relay\x00" + secret.encode()).hexdigest()[:HEX]


def is_relay(endpoint: str) -> bool:
    return endpoint.startswith(PREFIX)


def endpoint(host: str, port: int, target: str, tag: str = "") -> str:
    """``relay://HOST:PORT/TARGET`` (``.TAG`` appended when given: the form a member's
    mesh uses). An empty host means the rendezvous host, as each peer reaches it."""
    return f"relay://{host}:{port}/{target}" + (f".{tag}" if tag else "")


def parse_endpoint(text: str) -> tuple[str, int, str, str]:
    """``(host, port, target, tag)`` of a relay endpoint (tag and host may be '').

    Raises:
        ValueError: ``text`` is no relay endpoint.
    """
    m = _ENDPOINT.fullmatch(text)
    if m is None or int(m.group(2)) > 65535:
        raise ValueError(f"{text!r} is not a relay endpoint (relay://HOST:PORT/TARGET)")
    return m.group(1), int(m.group(2)), m.group(3), m.group(4) or ""


def advertised(bound: Sequence[str], relay: str | None, target: str) -> list[str]:
    """The endpoints a peer behind a relay advertises: ``relay://HOST:PORT/TARGET`` at
    ``relay`` (``tcp://HOST:PORT``), or at the rendezvous host's relay (``relay://:0/``,
    which the rendezvous fills in), then its ipc endpoints, for the peers of its host."""
    host, port = ("", 0)
    if relay is not None:
        host, _, number = relay.removeprefix("tcp://").rpartition(":")
        port = int(number)
    return [endpoint(host, port, target), *(e for e in bound if e.startswith("ipc://"))]


def choosing(choose: Callable[[str, list[str]], str], rendezvous_host: str, target: str
             ) -> Callable[[str, list[str]], str]:
    """``choose`` (which endpoint of a peer to use) for a roster with relay endpoints: one
    with no host is on the rendezvous host; this peer's own entry (it names ``target``)
    is its relay endpoint, where it registers (see
    :class:`~p2pcoll.transport.relayed.RelayPaths`)."""

    def chosen(host: str, endpoints: list[str]) -> str:
        endpoints = [f"relay://{rendezvous_host}{e.removeprefix('relay://')}"
                     if e.startswith("relay://:") else e for e in endpoints]
        if target and endpoints and endpoints[0].endswith("/" + target):
            return endpoints[0]
        return choose(host, endpoints)

    return chosen
