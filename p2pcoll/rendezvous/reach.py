"""Peers that cannot accept connections, as the rendezvous names them (no I/O).

A peer behind NAT or a firewall advertises a relay endpoint first
(``relay://HOST:PORT/TARGET``, see docs/relay.md); ``relay://:0/TARGET`` asks for the relay
of the rendezvous host, which the server starts on the first such join (``relay()``
returns its port, or None when it has none: the join is refused, naming
``P2PCOLL_RELAY``). The roster names it ``relay://:PORT/TARGET``; each peer reads the empty
host as the rendezvous host it reached.

A peer that does not say joins with ``check`` (its ``target``, maybe its own ``relay``):
``reach(identity, endpoints)`` says whether the server could connect back to its first
tcp endpoint (None: not known yet; the join is held, and handled when it is re-sent once
the server knows). If it could not, the peer is named by its relay endpoint as if it had
said so, followed by its ipc endpoints (for the peers of its host).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

__all__ = ["DEFAULT_RELAY", "named"]

DEFAULT_RELAY = "relay://:0/"  # a join's first endpoint: behind the rendezvous host's relay
_TARGET = re.compile(r"[0-9a-f]{32}")
_RELAY = re.compile(r"tcp://([A-Za-z0-9._-]+:[0-9]{1,5})")


def named(identity: bytes, endpoints: list[str], msg: dict[str, Any],
          reach: Callable[[bytes, list[str]], bool | None], relay: Callable[[], int | None]
          ) -> list[str] | None:
    """The endpoints of a join as the roster will name them (see the module docstring);
    None while the server does not know whether it reaches the peer.

    Raises:
        ValueError: a malformed check, or a default relay asked of a rendezvous that has
            none (the message says what to do).
    """
    if msg.get("check") is True:
        target, own = msg.get("target"), msg.get("relay")
        at = _RELAY.fullmatch(own) if isinstance(own, str) else None
        if not (isinstance(target, str) and _TARGET.fullmatch(target)
                and (own is None or at is not None)):
            raise ValueError("malformed join request (check)")
        reached = reach(identity, endpoints)
        if reached is None:
            return None
        if not reached:
            where = at.group(1) if at is not None else ":0"
            endpoints = [f"relay://{where}/{target}",
                         *(e for e in endpoints if e.startswith("ipc://"))]
    if not endpoints[0].startswith(DEFAULT_RELAY):
        return endpoints
    port = relay()
    if port is None:
        raise ValueError("this rendezvous runs no relay for peers that cannot be reached: "
                         "run `p2pcoll relay --port N` and set P2PCOLL_RELAY=tcp://HOST:N")
    return [f"relay://:{port}/" + endpoints[0].removeprefix(DEFAULT_RELAY), *endpoints[1:]]
