"""The rendezvous server: collects join requests, forms groups, hands out their rosters.

One process hosts it at the rendezvous address ``tcp://HOST:PORT``: the peer that wants
rank 0 (or, when ranks are assigned by arrival, whichever peer binds the port first), or a
standalone ``p2pcoll rendezvous`` server. It serves any number of groups over its life:
each job (a job id, ``P2PCOLL_JOB_ID``, empty by default) has at most one group forming at a
time, and once a group has formed the next requests of that job start the next group.

The protocol (msgpack maps over a ROUTER; every client keeps one routing identity for the
whole join, across reconnections):

- ``join``: endpoints, host, pid, requested rank, world size (or, for an elastic group,
  ``min``/``max``) and ``order``. Clients re-send it every :data:`RESEND` seconds until
  the roster comes; that is their heartbeat, and it is how a restarted server learns the
  peers again. Each one is answered with a ``status`` (how many arrived, which ranks are
  missing), an ``error`` for the peers concerned (duplicate rank, rank out of range, world
  size disagreement, a registered peer lost: ``permanent`` false, a new attempt may form
  a group), or the ``roster`` once the group is complete
  (the roster is sent again to a peer that asks again, in case it was lost).
- ``leave``: a client gives up (its join was cancelled or timed out).
- ``waiting``: how many peers of a job are waiting for its next group (the elastic training
  layer asks this at round boundaries).

A group of fixed size forms when every rank is there. An elastic group (world size None,
``min`` given) forms when ``max`` peers are there, or at least ``min`` are and nobody new
arrived for :data:`SETTLE` seconds. Ranks go to the requested ones first, then by ``order``
(lower first), then by arrival. A registered peer that has not re-sent its request for its
heartbeat timeout is lost: the others of a fixed-size group fail at once naming it (an
elastic group just goes on without it). A malformed request is logged and dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from ..transport.sockets import SocketFactory
from ..wire import WIRE_VERSION
from .url import parse_url

log = logging.getLogger("p2pcoll.rendezvous")

RESEND = 0.5  # seconds between a client's re-sent join requests (its heartbeat)
SETTLE = 1.0  # an elastic group with enough peers forms after this long without arrivals
TICK = 0.1  # how often the server looks for lost peers and settled elastic groups
FORMED_KEPT = 4096  # rosters kept to answer peers that ask again


@dataclass
class _Entry:
    identity: bytes
    rank: int | None
    endpoints: list[str]
    host: str
    pid: int
    order: float  # None (no preference) sorts last
    arrival: int
    heartbeat: float
    seen: float

    def describe(self) -> str:
        asked = f", asking for rank {self.rank}" if self.rank is not None else ""
        return f"the peer on {self.host} (pid {self.pid}{asked})"


@dataclass
class _Forming:
    """The group of one job that is forming."""

    job: str
    world_size: int | None = None
    low: int | None = None  # elastic bounds
    high: int | None = None
    entries: dict[bytes, _Entry] = field(default_factory=dict)
    last_arrival: float = 0.0

    @property
    def elastic(self) -> bool:
        return self.world_size is None and self.low is not None


class _Rejected(Exception):
    """A request that gets an error reply."""


def _int(msg: dict[str, Any], name: str, low: int) -> int | None:
    value = msg.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise _Rejected(f"{name} must be an integer >= {low}, got {value!r}")
    return value


class RendezvousServer:
    """Forms the groups of the peers that join at one address; see the module docstring."""

    def __init__(self, url: str, sockets: SocketFactory | None = None) -> None:
        self.url = url
        self._own_sockets = sockets is None
        self._sockets = sockets or SocketFactory()
        self._sock: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._forming: dict[str, _Forming] = {}
        self._formed: dict[bytes, tuple[str, dict[str, Any]]] = {}  # identity -> roster
        self._arrivals = 0
        self.groups_formed = 0

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
        self._tasks = [asyncio.create_task(self._serve()), asyncio.create_task(self._watch())]
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
            except Exception as exc:  # noqa: BLE001 - a malformed request must not stop it
                log.warning("rendezvous: dropped a malformed request: %s", exc)
                continue
            try:
                self._handle(identity, msg)
            except _Rejected as exc:
                self._reply(identity, op="error", reason=str(exc))
            except Exception:  # noqa: BLE001 - one request must not stop the server
                log.exception("rendezvous: failed to handle a request")

    async def _watch(self) -> None:
        """Lost peers and settled elastic groups, every TICK seconds."""
        while True:
            await asyncio.sleep(TICK)
            now = time.monotonic()
            for forming in list(self._forming.values()):
                self._expire(forming, now)
                self._progress(forming, now)

    def _reply(self, identity: bytes, **msg: Any) -> None:
        assert self._sock is not None
        try:
            self._sock.send_multipart([identity, msgpack.packb(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("rendezvous: reply not sent: %s", exc)

    def _handle(self, identity: bytes, msg: dict[str, Any]) -> None:
        op = msg.get("op")
        if msg.get("v") != WIRE_VERSION:
            raise _Rejected(f"wire version {msg.get('v')!r}, the rendezvous speaks {WIRE_VERSION}")
        job = msg.get("job", "")
        if not isinstance(job, str) or len(job) > 128:
            raise _Rejected("malformed job id")
        if op == "waiting":
            forming = self._forming.get(job)
            self._reply(identity, op="waiting", count=len(forming.entries) if forming else 0)
        elif op == "leave":
            forming = self._forming.get(job)
            if forming is not None and forming.entries.pop(identity, None) is not None:
                self._status(forming)
        elif op == "join":
            self._join(identity, job, msg)
        else:
            raise _Rejected(f"unknown request {op!r}")

    def _join(self, identity: bytes, job: str, msg: dict[str, Any]) -> None:
        formed = self._formed.get(identity)
        if formed is not None and formed[0] == job:
            self._reply(identity, **formed[1])  # it asked again: its roster was lost
            return
        rank, size = _int(msg, "rank", 0), _int(msg, "world_size", 1)
        low, high = _int(msg, "min", 1), _int(msg, "max", 1)
        order, pid = _int(msg, "order", 0), _int(msg, "pid", 0) or 0
        endpoints, host, heartbeat = msg.get("endpoints"), msg.get("host"), msg.get("heartbeat")
        if (not isinstance(endpoints, list) or not 0 < len(endpoints) <= 8
                or not all(isinstance(e, str) and len(e) <= 256 for e in endpoints)
                or not isinstance(host, str) or len(host) > 256
                or not isinstance(heartbeat, (int, float)) or not 0 < heartbeat < 1e6):
            raise _Rejected("malformed join request")
        forming = self._forming.setdefault(job, _Forming(job))
        entry = forming.entries.get(identity)
        now = time.monotonic()
        if entry is not None:  # a re-sent request: it is alive
            entry.seen = now
            self._status(forming, [entry])
            return
        if size is not None:
            if forming.world_size is None and not forming.entries:
                forming.world_size = size
            elif size != forming.world_size:
                raise _Rejected(
                    f"world_size {size} disagrees with "
                    + (f"world_size {forming.world_size}" if forming.world_size else
                       "an elastic group")
                    + f" of the {len(forming.entries)} peer(s) already at the rendezvous"
                )
        elif low is not None:
            if forming.entries and (forming.world_size is not None
                                    or (low, high) != (forming.low, forming.high)):
                raise _Rejected(f"elastic bounds {low}..{high} disagree with those of the "
                                f"{len(forming.entries)} peer(s) already at the rendezvous")
            forming.low, forming.high = low, high
            if rank is not None:
                raise _Rejected("an elastic group assigns every rank: do not ask for one")
        if rank is not None:
            if forming.world_size is not None and rank >= forming.world_size:
                raise _Rejected(f"rank {rank} is out of range for world_size "
                                f"{forming.world_size}")
            for other in list(forming.entries.values()):
                if other.rank == rank:
                    reason = f"rank {rank} was requested by two peers ({other.host} and {host})"
                    del forming.entries[other.identity]
                    self._reply(other.identity, op="error", reason=reason)
                    raise _Rejected(reason)
        self._arrivals += 1
        forming.entries[identity] = _Entry(
            identity, rank, endpoints, host, pid, float("inf") if order is None else order,
            self._arrivals, float(heartbeat), now)
        forming.last_arrival = now
        if not self._progress(forming, now):
            self._status(forming)  # an arrival: tell everyone how far the group is

    def _status(self, forming: _Forming, to: list[_Entry] | None = None) -> None:
        size = forming.world_size or forming.low
        taken = {e.rank for e in forming.entries.values() if e.rank is not None}
        unranked = sum(e.rank is None for e in forming.entries.values())
        missing = ([r for r in range(size) if r not in taken][unranked:]
                   if forming.world_size else [])
        for e in to if to is not None else list(forming.entries.values()):
            self._reply(e.identity, op="status", arrived=len(forming.entries),
                        world_size=size, missing=missing)

    def _expire(self, forming: _Forming, now: float) -> None:
        """Peers that stopped re-sending their request are lost."""
        lost = [e for e in forming.entries.values() if now - e.seen > e.heartbeat]
        if not lost:
            return
        for e in lost:
            del forming.entries[e.identity]
        names = "; ".join(f"{e.describe()} registered and then stopped answering for "
                          f"{now - e.seen:.1f}s" for e in lost)
        log.warning("rendezvous: job %r: %s", forming.job, names)
        if forming.elastic:
            return
        for e in forming.entries.values():
            self._reply(e.identity, op="error", reason=f"{names}: it was lost while the "
                        f"group formed", permanent=False)
        del self._forming[forming.job]

    def _progress(self, forming: _Forming, now: float) -> bool:
        """Form the group if it is complete; returns whether it formed."""
        entries = sorted(forming.entries.values(), key=lambda e: e.arrival)
        if forming.elastic:
            assert forming.low is not None
            full = forming.high is not None and len(entries) >= forming.high
            settled = len(entries) >= forming.low and now - forming.last_arrival >= SETTLE
            if not (full or settled):
                return False
            entries = sorted(entries, key=lambda e: (e.order, e.arrival))[:forming.high]
            size = len(entries)
        else:
            size = forming.world_size
            if size is None:
                return False
            for e in entries:  # ranks that arrived before the size was known
                if e.rank is not None and e.rank >= size:
                    del forming.entries[e.identity]
                    self._reply(e.identity, op="error",
                                reason=f"rank {e.rank} is out of range for world_size {size}")
            entries = sorted(forming.entries.values(), key=lambda e: (e.order, e.arrival))
            if len(entries) < size:
                return False
        taken = {e.rank for e in entries if e.rank is not None}
        free = iter(r for r in range(size) if r not in taken)
        ranks = {e.identity: e.rank if e.rank is not None else next(free) for e in entries}
        by_rank = sorted(entries, key=lambda e: ranks[e.identity])
        group_id = uuid.uuid4().hex[:16]
        roster = {"op": "roster", "group": group_id, "secret": secrets.token_hex(16),
                  "epoch": 0, "world_size": size,
                  "endpoints": [e.endpoints for e in by_rank],
                  "hosts": [e.host for e in by_rank]}
        for e in by_rank:
            reply = {**roster, "rank": ranks[e.identity]}
            self._formed[e.identity] = (forming.job, reply)
            self._reply(e.identity, **reply)
            del forming.entries[e.identity]
        while len(self._formed) > FORMED_KEPT:
            del self._formed[next(iter(self._formed))]
        self.groups_formed += 1
        log.info("rendezvous: job %r: formed group %s of %d", forming.job, group_id, size)
        if not forming.entries:  # peers left over from an elastic group start the next
            del self._forming[forming.job]
        return True

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._own_sockets:
            self._sockets.close()
