"""The rendezvous client: register this peer's endpoints and wait for the roster.

The request is re-sent every :data:`~.server.RESEND` seconds (the server's sign that this
peer is alive, and how a restarted server learns of it). The client watches its socket's
handshakes: a connection that closes before its handshake completes means that something
other than this job's rendezvous is there (a different job key, one side secured and the
other not, or a server of another protocol), which is an error at once, not a timeout. A
host that answered and then went silent for the heartbeat timeout is gone.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import msgpack
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from ..errors import RendezvousError
from ..transport.sockets import SocketFactory
from ..types import Membership
from ..wire import WIRE_VERSION
from .server import RESEND
from .url import parse_url

# Connections closed during their handshake, with no reason given, before giving up (one
# may be a server restarting); a handshake that fails with a reason is an error at once.
HANDSHAKE_FAILURES = 2

_HANDSHAKE_FAILED = {
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "it closed the handshake",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "the handshake broke the protocol",
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "it refused this peer's key",
}
_EVENTS = (zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
           | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
           | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


def _reply(raw: bytes, url: str, ops: tuple[str, ...]) -> dict[str, Any]:
    """Decode a reply; anything that is not a rendezvous message says who answered."""
    try:
        msg = msgpack.unpackb(raw, raw=False, max_bin_len=0, max_ext_len=0)
    except Exception:  # noqa: BLE001 - msgpack raises several unrelated types
        msg = None
    if not isinstance(msg, dict) or msg.get("op") not in ops:
        raise RendezvousError(
            f"something other than a p2pcoll rendezvous answered at {url} "
            f"({len(raw)} bytes that are not a rendezvous reply)", permanent=True,
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
        secret = msg["secret"]
        if not isinstance(secret, str) or not 32 <= len(secret) <= 128:
            raise ValueError("no link secret")
        return Membership(
            group_id=str(msg["group"]), epoch=int(msg["epoch"]), rank=rank, world_size=size,
            endpoints=tuple(choose(h, e) for h, e in zip(hosts, endpoints, strict=True)),
            hosts=hosts, secret=secret,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise RendezvousError(f"the rendezvous at {url} sent a malformed roster: {exc}") from None


class _Link:
    """One client socket to the rendezvous and what its handshakes said."""

    def __init__(self, url: str, sockets: SocketFactory) -> None:
        self.url = url
        host, port = parse_url(url)
        self.sock = sockets.rendezvous_client(b"j" + os.urandom(8).hex().encode())
        # Plain (not asyncio) views of the socket and its monitor: sends that must not
        # wait, and events read as they are, between polls.
        self._out = zmq.Socket.shadow(self.sock.underlying)
        self._monitor = self.sock.get_monitor_socket(_EVENTS)
        self.monitor = zmq.Socket.shadow(self._monitor.underlying)
        self.secure = sockets.secure
        self.connected = False  # a TCP connection was ever made
        self.answered: float | None = None  # when the last reply came
        self._pending = False  # connected, handshake not yet done
        self._failures: list[str] = []
        self.sock.connect(f"tcp://{host}:{port}")

    def events(self) -> None:
        """Read the monitor's events. Raises RendezvousError on failed handshakes."""
        while self.monitor.poll(0):
            event = parse_monitor_message(self.monitor.recv_multipart(zmq.NOBLOCK))
            kind = event["event"]
            if kind == zmq.EVENT_CONNECTED:
                self.connected, self._pending = True, True
            elif kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._pending = False
                self._failures.clear()
            elif kind in _HANDSHAKE_FAILED:
                self._pending = False
                self._failures.append(_HANDSHAKE_FAILED[kind])
            elif kind == zmq.EVENT_DISCONNECTED and self._pending:
                self._pending = False
                self._failures.append("it closed the connection during the handshake")
        decisive = any(f in _HANDSHAKE_FAILED.values() for f in self._failures)
        if decisive or len(self._failures) >= HANDSHAKE_FAILURES:
            why = ("this peer uses a job key (P2PCOLL_KEY_FILE / key_file=): the rendezvous "
                   "holds a different one, or none" if self.secure else
                   "this peer has no job key: the rendezvous is secured (set "
                   "P2PCOLL_KEY_FILE to the job's key file)")
            raise RendezvousError(
                f"the handshake with the rendezvous at {self.url} failed "
                f"({self._failures[-1]}): {why}; or what listens there is not a p2pcoll "
                f"rendezvous", permanent=True,
            )

    def send(self, request: dict[str, Any]) -> None:
        try:
            self._out.send(msgpack.packb(request), zmq.NOBLOCK)
        except zmq.Again:
            pass  # not connected yet: the next re-send tries again

    def close(self, goodbye: dict[str, Any] | None = None) -> None:
        if goodbye is not None and self.answered is not None:
            self.send(goodbye)
        self.sock.disable_monitor()
        self._monitor.close(linger=0)
        self.sock.close(linger=100 if goodbye is not None else 0)


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
    heartbeat: float = 5.0,
    job: str = "",
    elastic: tuple[int, int | None] | None = None,
    order: int | None = None,
) -> Membership:
    """Register ``endpoints`` at the rendezvous and wait for the roster.

    ``choose(host, endpoints)`` picks which of a peer's endpoints this peer will use;
    ``elastic`` is ``(min, max)`` world size for an elastic group (``world_size`` None);
    ``order`` ranks this peer among those without a requested rank (lower first).

    Raises:
        RendezvousError: on timeout (saying how many peers arrived and which ranks are
            missing, or that no rendezvous host answered), at once when the server rejects
            this peer or reports a registered peer lost, when the handshake fails (a
            different job key, or one side secured and the other not), when something that
            is not a rendezvous answers, and when a host that had answered is silent for
            ``heartbeat`` seconds ("no rendezvous host at URL").
    Cancellation: leaves nothing behind (the server is told, the socket closed).
    """
    link = _Link(url, sockets or SocketFactory())
    request: dict[str, Any] = {
        "v": WIRE_VERSION, "op": "join", "job": job, "rank": rank, "world_size": world_size,
        "endpoints": endpoints, "host": host_id, "pid": os.getpid(), "heartbeat": heartbeat,
        "order": order, "min": elastic[0] if elastic else None,
        "max": elastic[1] if elastic else None,
    }
    status: dict[str, Any] | None = None
    start = time.monotonic()
    deadline = start + timeout
    goodbye: dict[str, Any] | None = {"v": WIRE_VERSION, "op": "leave", "job": job}
    try:
        next_send = 0.0
        while True:
            now = time.monotonic()
            if now >= next_send:
                link.send(request)
                next_send = now + RESEND
            link.events()
            if link.answered is not None and now - link.answered > heartbeat:
                raise RendezvousError(
                    f"no rendezvous host at {url}: it answered until {now - link.answered:.1f}s"
                    f" ago and then went silent (it was stopped, or lost); "
                    + _progress(status)
                )
            if now >= deadline:
                raise _timed_out(url, timeout, status, link)
            wait = min(next_send, deadline) - now
            if not await link.sock.poll(max(1, int(wait * 1000)), zmq.POLLIN):
                continue
            msg = _reply(await link.sock.recv(), url, ("status", "error", "roster"))
            link.answered = time.monotonic()
            if msg["op"] == "status":
                status = msg
            elif msg["op"] == "error":
                goodbye = None
                raise RendezvousError(
                    f"rendezvous at {url} rejected this peer: {msg.get('reason')}",
                    permanent=msg.get("permanent", True) is not False)
            else:
                goodbye = None
                return _roster(msg, url, choose)
    finally:
        link.close(goodbye)


def _progress(status: dict[str, Any] | None) -> str:
    if status is None:
        return "no peer had been counted yet"
    missing = status.get("missing")
    return (f"{status.get('arrived')} of {status.get('world_size')} peers arrived"
            + (f"; missing ranks {missing}" if missing else ""))


def _timed_out(url: str, timeout: float, status: dict[str, Any] | None, link: _Link
               ) -> RendezvousError:
    if status is not None:
        return RendezvousError(f"rendezvous at {url} timed out after {timeout:.3g}s: "
                               + _progress(status))
    if not link.connected:
        return RendezvousError(
            f"no rendezvous host at {url}: no answer within {timeout:.3g}s, nothing accepted "
            f"a connection (is it up and reachable?)", answered=False,
        )
    return RendezvousError(
        f"rendezvous at {url} timed out after {timeout:.3g}s with no answer from the "
        f"rendezvous host (is it up and reachable?)", answered=False,
    )


async def waiting(url: str, *, job: str = "", sockets: SocketFactory | None = None,
                  timeout: float = 5.0) -> int:
    """How many peers are waiting at the rendezvous for ``job``'s next group.

    Raises:
        RendezvousError: no answer within ``timeout``, or the handshake failed.
    """
    link = _Link(url, sockets or SocketFactory())
    try:
        link.send({"v": WIRE_VERSION, "op": "waiting", "job": job})
        deadline = time.monotonic() + timeout
        while True:
            link.events()
            left = deadline - time.monotonic()
            if left <= 0:
                raise RendezvousError(f"no rendezvous host at {url}: no answer within "
                                      f"{timeout:g}s")
            if await link.sock.poll(int(min(left, 0.1) * 1000) + 1, zmq.POLLIN):
                msg = _reply(await link.sock.recv(), url, ("waiting", "error"))
                if msg["op"] == "error":
                    raise RendezvousError(f"rendezvous at {url}: {msg.get('reason')}")
                return int(msg.get("count", 0))
    finally:
        link.close()


__all__ = ["rendezvous", "waiting"]
