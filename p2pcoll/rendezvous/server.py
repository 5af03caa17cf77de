"""The rendezvous server: collects ``world_size`` join requests and hands out the roster.

One process hosts it at the rendezvous address ``tcp://HOST:PORT``: the peer that wants
rank 0 (or, when ranks are assigned by arrival, whichever peer binds the port first), or a
standalone ``p2pcoll rendezvous`` server. Every peer, the host included, sends it a join
request with its endpoints, requested rank and world size. When ``world_size`` peers are
there, it assigns the missing ranks in arrival order and sends every peer the roster.
Errors that concern one peer (duplicate rank, rank out of range, world size disagreement)
are sent to the peers concerned at once. A malformed request is logged and dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from ..transport.sockets import SocketFactory
from ..wire import WIRE_VERSION
from .url import parse_url

log = logging.getLogger("p2pcoll.rendezvous")


@dataclass
class _Entry:
    identity: bytes
    rank: int | None
    endpoints: list[str]
    host: str
    order: int


class RendezvousServer:
    """Collects ``world_size`` join requests and hands out the roster."""

    def __init__(self, url: str, sockets: SocketFactory | None = None) -> None:
        self.url = url
        self._sockets = sockets or SocketFactory()
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
        sock = self._sockets.rendezvous_server()
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
                frames = await self._sock.recv_multipart()
            except (asyncio.CancelledError, zmq.ZMQError):
                return
            try:
                if len(frames) != 2:
                    raise ValueError(f"{len(frames) - 1} frames, expected 1")
                identity, raw = frames
                msg = msgpack.unpackb(raw, raw=False, max_bin_len=0, max_ext_len=0)
                if not isinstance(msg, dict):
                    raise ValueError("not a map")
                self._handle(identity, msg)
            except Exception as exc:  # noqa: BLE001 - a malformed request must not stop it
                log.warning("rendezvous: dropped a malformed request: %s", exc)

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
        if (not (rank is None or isinstance(rank, int) and not isinstance(rank, bool))
                or not isinstance(endpoints, list) or not 0 < len(endpoints) <= 8
                or not all(isinstance(e, str) and len(e) <= 256 for e in endpoints)
                or not isinstance(host, str) or len(host) > 256):
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
