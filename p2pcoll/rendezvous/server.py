"""The rendezvous server: collects join requests, forms groups, hands out their rosters.

One process hosts it at the rendezvous address ``tcp://HOST:PORT``: the peer that wants
rank 0 (or, when ranks are assigned by arrival, whichever peer binds the port first), or a
standalone ``p2pcoll rendezvous`` server. It serves any number of groups over its life:
each job (a job id, ``P2PCOLL_JOB_ID``, empty by default) has at most one group forming at a
time, and once a group has formed the next requests of that job start the next group. A
peer that hosts it for a group of fixed size closes it once that group has formed (see
:mod:`p2pcoll.session.forming`); an elastic group's host keeps it, for the next round.

The rules (the protocol, how a group forms, which refusals fail whom, what anyone who can
reach the port may cost) live in :class:`~.jobs.Jobs`, without I/O (see :mod:`.jobs`).
This module does the I/O: it binds the ROUTER, hands each request read to the jobs with
the time, sends the replies they return, and gives them the clock every :data:`TICK`
seconds.

Handshakes the socket refuses (a different job key, none at a secured rendezvous, a key at
a plain one) never become requests: they are counted (:meth:`RendezvousServer.refusals`),
the first of each kind is logged at once, and a host's join that times out says how many
there were.

The rendezvous host relays by default: the first join of a peer that cannot be reached
and names no relay of its own starts a :class:`~p2pcoll.relay.Relay` on this host (a port
the OS picks, on the rendezvous's address); it serves until the server closes, unless the
peer that hosts the server takes it over for its group (:meth:`take_relay`).

A peer that does not say whether it can be reached is checked (see :mod:`.jobs`): the
server connects to the first tcp endpoint it advertises and closes the connection at once,
before any byte (:func:`~p2pcoll.transport.endpoints.listening`, at most :data:`CHECK_S`);
one check per client connection, remembered, :data:`MAX_CHECKS` at once (a join beyond
waits for its re-send), none for a loopback address (the peer is on this host, or nobody
could tell).

The server's work is kept off the path of the collectives of a peer that hosts it in its
event loop: it reads a batch of requests, then lets the loop run others for three times as
long as the batch took (:data:`SHARE`).
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from ..settings import RendezvousLimits
from ..transport.endpoints import listening
from ..transport.sockets import SocketFactory, monitor
from .jobs import Jobs, Reply
from .protocol import RESEND
from .url import parse_url

if TYPE_CHECKING:  # imported when a peer first needs the relay: most rendezvous never do
    from ..relay.server import Relay

log = logging.getLogger("p2pcoll.rendezvous")

TICK = 0.1  # how often the server looks for lost peers and settled elastic groups
BATCH = 64  # requests read in one go, at most...
BATCH_S = 0.002  # ...or for this long, before the event loop runs others
CHECK_S = 1.0  # how long a connection back to a joining peer may take
MAX_CHECKS = 64  # connections back under way at once
CHECKED_KEPT = 16384  # verdicts remembered (the least recent forgotten)
SHARE = 0.25  # the share of its event loop's time the server takes, at most, when busy


# Handshakes the rendezvous socket refused, by what the monitor reports: (event, value) ->
# what it means. A value of None matches any.
_REFUSED: dict[tuple[int, int | None], str] = {
    (zmq.EVENT_HANDSHAKE_FAILED_AUTH, None): "a key that is not the job's",
    (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH):
        "one side secured and the other not (a peer without the job key, or with a key "
        "while the rendezvous has none)",
    (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC):
        "a key that is not the job's (their hello could not be opened)",
    # The peer closed before the handshake ended: a client with another key that gave up,
    # or a joining peer's probe of what listens here (it closes after the greetings).
    (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, None): "a handshake the other side cut off (a "
        "different job key, or a client checking what listens here)",
}
_MONITORED = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
              | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
_hosted: weakref.WeakValueDictionary[int, RendezvousServer] = weakref.WeakValueDictionary()


def hosted_at(port: int) -> RendezvousServer | None:
    """The server this process hosts on ``port``, if any (a host's join that times out
    reports what its own server refused)."""
    return _hosted.get(port)


class RendezvousServer:
    """Forms the groups of the peers that join at one address; see the module docstring.

    Args:
        url: ``tcp://HOST:PORT`` to bind (port 0: the OS picks one).
        sockets: the factory of its socket (the job key); None for plain sockets.
        limits: what it accepts and holds (default: :class:`RendezvousLimits`' defaults).
    """

    def __init__(self, url: str, sockets: SocketFactory | None = None,
                 limits: RendezvousLimits | None = None) -> None:
        self.url = url
        self.jobs = Jobs(limits or RendezvousLimits(), relay=self._relay_port,
                         reach=self._reach)
        self._checked: OrderedDict[bytes, tuple[str, bool]] = OrderedDict()  # id -> verdict
        self._checking: dict[bytes, asyncio.Task[None]] = {}
        self.relay: Relay | None = None
        self._own_sockets = sockets is None
        self._sockets = sockets or SocketFactory()
        self._sock: zmq.asyncio.Socket | None = None
        self._plain: zmq.Socket[bytes] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._drained = 0.0  # see _serve
        self._body: tuple[bytes, zmq.Frame] | None = None  # the last roster body sent
        self._monitor_async: zmq.asyncio.Socket | None = None
        self._monitor: zmq.Socket[bytes] | None = None
        self._refused: dict[str, int] = {}  # what a refused handshake meant -> how many

    @property
    def limits(self) -> RendezvousLimits:
        return self.jobs.limits

    @property
    def groups_formed(self) -> int:
        return self.jobs.groups_formed

    def stats(self) -> dict[str, int]:
        """What it holds and has done: ``peers`` registered, ``jobs`` forming, ``rosters``
        kept, ``groups_formed``, ``requests`` read, ``dropped`` (over a connection's rate,
        or malformed), ``resends`` (copies of a connection's last request over its rate,
        not handled, not refused) and ``handshakes_refused``."""
        return {**self.jobs.stats(), "handshakes_refused": sum(self._refused.values())}

    def refusals(self) -> str:
        """What it refused so far, for an error message: handshakes (by kind) and member
        joins; '' if nothing."""
        parts = [f"{n} handshake(s) with {what}" for what, n in self._refused.items()]
        refused_joins = self.jobs.refused_joins
        if refused_joins:
            parts.append(f"{len(refused_joins)} join(s): " + "; ".join(refused_joins[-3:]))
        return ("the rendezvous this process hosts refused " + ", and ".join(parts)
                if parts else "")

    def _relay_port(self) -> int | None:
        """The port of this host's relay, started now if need be (None: it cannot be)."""
        if self.relay is None:
            host = parse_url(self.url)[0]
            from ..relay.server import Relay
            relay = Relay(host, 0, secured=self._sockets.secure)
            try:
                relay.bind()
            except OSError as exc:
                log.error("rendezvous at %s: cannot start its relay: %s", self.url, exc)
                return None
            self.relay = relay
            log.info("rendezvous at %s: relaying on port %d for peers that cannot be "
                     "reached", self.url, relay.port)
        return self.relay.port

    def _reach(self, identity: bytes, endpoints: list[str]) -> bool | None:
        """Whether this server could connect to the peer's first tcp endpoint (None: not
        known yet, a check is under way or waits for room)."""
        address = next((e for e in endpoints if e.startswith("tcp://")), None)
        if address is None or address.startswith(("tcp://127.", "tcp://localhost:")):
            return True
        known = self._checked.get(identity)
        if known is not None and known[0] == address:
            return known[1]
        if identity not in self._checking and len(self._checking) < MAX_CHECKS:
            self._checking[identity] = asyncio.create_task(self._check(identity, address))
        return None

    async def _check(self, identity: bytes, address: str) -> None:
        try:
            reached = await listening(address, CHECK_S) is True
        except ValueError:
            reached = False
        finally:
            self._checking.pop(identity, None)
        if not reached:
            log.info("rendezvous at %s: a joining peer cannot be reached at %s: it is named "
                     "by a relay", self.url, address)
        self._checked[identity] = (address, reached)
        while len(self._checked) > CHECKED_KEPT:
            self._checked.popitem(last=False)

    def take_relay(self) -> Relay | None:
        """The relay this server started, if any, now the caller's to close."""
        relay, self.relay = self.relay, None
        return relay

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
        self._plain = zmq.Socket.shadow(sock.underlying)
        self._monitor_async = monitor(sock, _MONITORED)
        self._monitor = zmq.Socket.shadow(self._monitor_async.underlying)  # read between polls
        _hosted[parse_url(self.url)[1]] = self
        self._tasks = [asyncio.create_task(self._serve()), asyncio.create_task(self._watch())]
        return self.url

    async def _serve(self) -> None:
        """Read requests in batches; after each, let the loop run others for a while.

        ``_drained`` is when a read last found the queue empty: every request that came
        before it has been handled. It stays that while this waits for the next request
        (the wake-up may come late, after requests arrived: see :meth:`_read_up_to`).
        """
        assert self._sock is not None and self._plain is not None
        while True:
            start = time.perf_counter()
            drained = False
            for _ in range(BATCH):
                try:
                    frames = self._plain.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    self._drained = time.monotonic()
                    drained = True
                    break
                except zmq.ZMQError:
                    return
                self._send(self.jobs.request(frames, time.monotonic()))
                if time.perf_counter() - start > BATCH_S:
                    break
            try:
                if drained:
                    await self._sock.poll(flags=zmq.POLLIN)
                else:
                    busy = time.perf_counter() - start
                    await asyncio.sleep(busy * (1 - SHARE) / SHARE)
            except (asyncio.CancelledError, zmq.ZMQError):
                return

    async def _watch(self) -> None:
        """Refused handshakes, and the clock for the jobs (lost peers, settled elastic
        groups, old rosters), every TICK seconds."""
        while True:
            await asyncio.sleep(TICK)
            now = time.monotonic()
            self._handshakes()
            self._send(self.jobs.tick(now, self._read_up_to(now)))

    def _handshakes(self) -> None:
        """Count the handshakes the socket refused; log the first of each kind at once
        (then at 10, 100, ...: someone may be knocking on the port)."""
        monitor = self._monitor
        while monitor is not None and monitor.poll(0):
            event = parse_monitor_message(monitor.recv_multipart(zmq.NOBLOCK))
            kind, value = event["event"], event["value"]
            what = _REFUSED.get((kind, value)) or _REFUSED.get((kind, None))
            if what is None:
                continue
            count = self._refused[what] = self._refused.get(what, 0) + 1
            if count in (1, 10, 100, 1000) or count % 10000 == 0:
                log.warning("rendezvous at %s: refused %d connection(s) with %s: not a "
                            "member of this job", self.url, count, what)

    def _read_up_to(self, now: float) -> float:
        """The moment up to which every request has surely been read: ``now`` if none waits
        unread, else when a read last found the queue empty (requests waiting may be the
        re-sends of the peers whose registrations are due, if the loop stalled)."""
        assert self._sock is not None
        try:  # the asyncio socket's get: it wakes _serve's poll if a request waits
            pending = self._sock.get(zmq.EVENTS) & zmq.POLLIN
        except zmq.ZMQError:
            return self._drained
        return self._drained if pending else now

    def _send(self, replies: list[Reply]) -> None:
        """Send without waiting; a reply that cannot go is dropped (its peer asks again).
        A roster's body, the same object for every member, goes as one shared frame."""
        assert self._plain is not None
        for reply in replies:
            frames: list[Any] = [reply.to, *reply.frames]
            if len(frames) == 3:
                if self._body is None or self._body[0] is not frames[2]:
                    self._body = (frames[2], zmq.Frame(frames[2]))
                frames[2] = self._body[1]
            try:
                self._plain.send_multipart(frames, zmq.NOBLOCK, copy=False)
            except zmq.ZMQError as exc:
                log.debug("rendezvous: reply not sent: %s", exc)

    async def aclose(self) -> None:
        """Stop serving and close the socket (and its factory, if it made its own).
        Idempotent; cancelled, it leaves the socket closed and a later call finishes."""
        for task in [*self._tasks, *self._checking.values()]:
            task.cancel()
        if self._sock is not None:
            self._sock.disable_monitor()
            if self._monitor_async is not None:
                self._monitor_async.close(linger=0)
                self._monitor_async = self._monitor = None
            self._sock.close()
            self._sock = self._plain = None
        if self._own_sockets:
            self._own_sockets = False
            self._sockets.close()
        await asyncio.gather(*self._tasks, *self._checking.values(), return_exceptions=True)
        if (relay := self.take_relay()) is not None:
            await relay.aclose()


__all__ = ["RESEND", "RendezvousServer", "hosted_at"]
