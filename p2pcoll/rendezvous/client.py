"""The rendezvous client: register this peer's endpoints and wait for the roster."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import msgpack

from ..errors import RendezvousError
from ..transport.sockets import SocketFactory
from ..types import Membership
from ..wire import WIRE_VERSION
from .url import parse_url


def _reply(raw: bytes, url: str) -> dict[str, Any]:
    """Decode a reply; anything that is not a rendezvous message says who answered."""
    try:
        msg = msgpack.unpackb(raw, raw=False, max_bin_len=0, max_ext_len=0)
    except Exception:  # noqa: BLE001 - msgpack raises several unrelated types
        msg = None
    if not isinstance(msg, dict) or msg.get("op") not in ("status", "error", "roster"):
        raise RendezvousError(
            f"something other than a p2pcoll rendezvous answered at {url} "
            f"({len(raw)} bytes that are not a rendezvous reply)"
        )
    return msg


def _roster(msg: dict[str, Any], url: str, choose: Callable[[str, list[str]], str]
            ) -> Membership:
    try:
        hosts = tuple(str(h) for h in msg["hosts"])
        endpoints = [list(map(str, e)) for e in msg["endpoints"]]
        size, rank = int(msg["world_size"]), int(msg["rank"])
        if not (len(hosts) == len(endpoints) == size and 0 <= rank < size):
            raise ValueError("sizes disagree")
        return Membership(
            group_id=str(msg["group"]), epoch=int(msg["epoch"]), rank=rank, world_size=size,
            endpoints=tuple(choose(h, e) for h, e in zip(hosts, endpoints, strict=True)),
            hosts=hosts,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise RendezvousError(f"the rendezvous at {url} sent a malformed roster: {exc}") from None


async def rendezvous(
    url: str,
    *,
    endpoints: list[str],
    world_size: int | None,
    rank: int | None,
    timeout: float,
    host_id: str,
    choose: Callable[[str, list[str]], str],
    sockets: SocketFactory | None = None,
) -> Membership:
    """Register ``endpoints`` at the rendezvous and wait for the roster.

    ``choose(host, endpoints)`` picks which of a peer's endpoints this peer will use.

    Raises:
        RendezvousError: on timeout (saying how many peers arrived and which ranks are
            missing), at once when the server rejects this peer, or when something that is
            not a rendezvous answers.
    Cancellation: leaves nothing behind (the socket is closed).
    """
    host, port = parse_url(url)
    sock = (sockets or SocketFactory()).rendezvous_client()
    sock.connect(f"tcp://{host}:{port}")
    request = {"v": WIRE_VERSION, "op": "join", "rank": rank, "world_size": world_size,
               "endpoints": endpoints, "host": host_id}
    status: dict[str, Any] | None = None
    deadline = time.monotonic() + timeout
    try:
        await sock.send(msgpack.packb(request))
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not await sock.poll(int(min(left, 1e6) * 1000) + 1):
                if status is None:
                    raise RendezvousError(
                        f"rendezvous at {url} timed out after {timeout:g}s with no answer "
                        f"from the rendezvous host (is it up and reachable?)"
                    )
                raise RendezvousError(
                    f"rendezvous at {url} timed out after {timeout:g}s: {status.get('arrived')}"
                    f" of {status.get('world_size')} peers arrived; missing ranks "
                    f"{status.get('missing')}"
                )
            msg = _reply(await sock.recv(), url)
            if msg["op"] == "status":
                status = msg
            elif msg["op"] == "error":
                raise RendezvousError(
                    f"rendezvous at {url} rejected this peer: {msg.get('reason')}")
            else:
                return _roster(msg, url, choose)
    finally:
        sock.close(linger=0)
