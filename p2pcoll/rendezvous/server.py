"""Rendezvous: how peers find each other and get their ranks.

One process hosts a small ZeroMQ ROUTER at the rendezvous address ``tcp://HOST:PORT``: the
peer that wants rank 0 (or, when ranks are assigned by arrival, whichever peer binds the port
first), or a standalone ``p2pcoll rendezvous`` server. Every peer, the host included, sends it
a join request with its endpoint, requested rank and world size. When ``world_size`` peers
are there, the server assigns the missing ranks in arrival order and sends every peer the
roster (a :class:`~p2pcoll.types.Membership`). Errors that concern one peer (duplicate rank,
rank out of range, world size disagreement) are sent to the peers concerned at once.

Messages are msgpack maps over a DEALER/ROUTER pair; join requests are queued by ZeroMQ until
the server is up, so peers may start in any order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import msgpack
import zmq
import zmq.asyncio

from .errors import RendezvousError
from .types import Membership
from .wire import WIRE_VERSION

log = logging.getLogger("p2pcoll.rendezvous")


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


@dataclass
class _Entry:
    identity: bytes
    rank: int | None
    endpoints: list[str]
    host: str
    order: int


class RendezvousServer:
    """Collects ``world_size`` join requests and hands out the roster."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._ctx = zmq.asyncio.Context.instance()
        self._sock: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._entries: dict[bytes, _Entry] = {}
        self._world_size: int | None = None
        self._complete = False
        self._arrivals = 0

    def bind(self) -> str:
        """Bind the rendezvous port and return the URL (port 0: the OS picks one).

        Raises:
            zmq.ZMQError: the port is taken or the host is not a local address.
        """
        host, port = parse_url(self.url)
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 1000)
        try:
            sock.bind(f"tcp://{host}:{port or '*'}")
        except zmq.ZMQError:
            sock.close(linger=0)
            raise
        self.url = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._sock = sock
        self._task = asyncio.create_task(self._serve())
        return self.url

    async def _serve(self) -> None:
        assert self._sock is not None
        while True:
            try:
                identity, raw = await self._sock.recv_multipart()
                msg = msgpack.unpackb(raw, raw=False)
                if not isinstance(msg, dict):
                    raise ValueError("not a map")
            except (asyncio.CancelledError, zmq.ZMQError):
                return
            except Exception as exc:  # a malformed request must not stop the server
                log.warning("rendezvous: dropped a malformed request: %s", exc)
                continue
            self._handle(identity, msg)

    def _reply(self, identity: bytes, **msg: Any) -> None:
        assert self._sock is not None
        try:
            self._sock.send_multipart([identity, msgpack.packb(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("rendezvous: reply not sent: %s", exc)

    def _handle(self, identity: bytes, msg: dict[str, Any]) -> None:
        def fail(reason: str) -> None:
            self._reply(identity, op="error", reason=reason)

        if msg.get("op") != "join":
            return fail(f"unknown request {msg.get('op')!r}")
        if msg.get("v") != WIRE_VERSION:
            return fail(f"wire version {msg.get('v')!r}, the rendezvous speaks {WIRE_VERSION}")
        if self._complete:
            return fail(f"the group of {self._world_size} at {self.url} is already complete")
        rank, size = msg.get("rank"), msg.get("world_size")
        endpoints, host = msg.get("endpoints"), msg.get("host")
        if (not (rank is None or isinstance(rank, int)) or not isinstance(endpoints, list)
                or not endpoints or not all(isinstance(e, str) for e in endpoints)):
            return fail("malformed join request")
        if size is not None:
            if not isinstance(size, int) or size < 1:
                return fail(f"world_size must be a positive integer, got {size!r}")
            if self._world_size is None:
                self._world_size = size
            elif size != self._world_size:
                n = len(self._entries)
                return fail(
                    f"world_size {size} disagrees with world_size {self._world_size} "
                    f"of the {n} peer(s) already at the rendezvous"
                )
        self._entries.pop(identity, None)
        if rank is not None:
            if rank < 0 or (self._world_size is not None and rank >= self._world_size):
                return fail(f"rank {rank} is out of range for world_size {self._world_size}")
            for other in list(self._entries.values()):
                if other.rank == rank:
                    reason = f"rank {rank} was requested by two peers ({other.host} and {host})"
                    del self._entries[other.identity]
                    self._reply(other.identity, op="error", reason=reason)
                    return fail(reason)
        self._arrivals += 1
        self._entries[identity] = _Entry(identity, rank, endpoints, str(host), self._arrivals)
        self._progress()

    def _progress(self) -> None:
        size = self._world_size
        if size is None:
            return
        for e in list(self._entries.values()):  # ranks that arrived before the size was known
            if e.rank is not None and e.rank >= size:
                del self._entries[e.identity]
                self._reply(e.identity, op="error", reason=f"rank {e.rank} >= world_size {size}")
        entries = sorted(self._entries.values(), key=lambda e: e.order)
        taken = {e.rank for e in entries if e.rank is not None}
        free = [r for r in range(size) if r not in taken]
        unranked = [e for e in entries if e.rank is None]
        if len(entries) < size:
            missing = free[len(unranked):]
            for e in entries:
                self._reply(e.identity, op="status", arrived=len(entries), world_size=size,
                            missing=missing)
            return
        for e, r in zip(unranked, free, strict=False):
            e.rank = r
        by_rank = sorted(entries, key=lambda e: e.rank or 0)
        group_id = uuid.uuid4().hex[:16]
        endpoints = [e.endpoints for e in by_rank]
        hosts = [e.host for e in by_rank]
        for e in by_rank:
            self._reply(e.identity, op="roster", group=group_id, epoch=0, rank=e.rank,
                        world_size=size, endpoints=endpoints, hosts=hosts)
        self._complete = True

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._sock is not None:
            self._sock.close()


async def rendezvous(
    url: str,
    *,
    endpoints: list[str],
    world_size: int | None,
    rank: int | None,
    timeout: float,
    host_id: str,
    choose: Callable[[str, list[str]], str],
) -> Membership:
    """Register ``endpoints`` at the rendezvous and wait for the roster.

    ``choose(host, endpoints)`` picks which of a peer's endpoints this peer will use.

    Raises:
        RendezvousError: on timeout (saying how many peers arrived and which ranks are
            missing), or at once when the server rejects this peer.
    """
    host, port = parse_url(url)
    ctx = zmq.asyncio.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RECONNECT_IVL, 50)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 500)
    sock.connect(f"tcp://{host}:{port}")
    request = {"v": WIRE_VERSION, "op": "join", "rank": rank, "world_size": world_size,
               "endpoints": endpoints, "host": host_id}
    status: dict[str, Any] | None = None
    deadline = time.monotonic() + timeout
    try:
        await sock.send(msgpack.packb(request))
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not await sock.poll(int(left * 1000) + 1):
                if status is None:
                    raise RendezvousError(
                        f"rendezvous at {url} timed out after {timeout:g}s with no answer "
                        f"from the rendezvous host (is it up and reachable?)"
                    )
                raise RendezvousError(
                    f"rendezvous at {url} timed out after {timeout:g}s: {status['arrived']} of "
                    f"{status['world_size']} peers arrived; missing ranks {status['missing']}"
                )
            msg = msgpack.unpackb(await sock.recv(), raw=False)
            if msg.get("op") == "status":
                status = msg
            elif msg.get("op") == "error":
                raise RendezvousError(f"rendezvous at {url} rejected this peer: {msg['reason']}")
            elif msg.get("op") == "roster":
                hosts = tuple(msg["hosts"])
                return Membership(
                    group_id=msg["group"], epoch=msg["epoch"], rank=msg["rank"],
                    size=msg["world_size"],
                    endpoints=tuple(choose(h, e) for h, e in zip(hosts, msg["endpoints"],
                                                                  strict=True)),
                    hosts=hosts,
                )
    finally:
        sock.close(linger=0)
