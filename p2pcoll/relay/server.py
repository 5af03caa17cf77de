"""The relay: forwards the ZeroMQ connections of peers that cannot accept connections.

One asyncio server on one TCP port (see :mod:`.protocol` for what connections say). A
target's control connection is held in :class:`~.protocol.Targets`; a member's connection
to a target makes the relay send ``OPEN`` to the target, which opens a new connection to
the relay (outbound: it needs no open port) and says ``accept``; the relay then answers
the member ``OK`` and splices the two connections (:mod:`.pipe`).
A member behind a relay too *dials* instead (version 2): the target answers from a bound
port, and the relay tells each side the other's address to try a direct connection
(:mod:`.punch`), closing both connections if they got one and forwarding between them if
not (``dials`` in :meth:`Relay.stats`).
From there on it reads no byte of what it forwards: with a job key, the CurveZMQ session
is end to end between the two peers and the relay sees ciphertext; without one, it could
read the traffic, and says so when it starts.

Who may cost what (:class:`RelayLimits`), every decision O(1) and none waiting on another
connection: connections held at once (beyond: closed at once, counted ``full``), the time
a connection has to say its preamble (``handshake_s``: closed, counted ``timeout``) and
what it says (anything but a relay preamble: ``garbage``), the targets registered,
the member connections waiting for their target's ``accept`` or registration
(``max_pending`` in all, each for ``open_s`` or ``register_s`` at most: ``timeout``,
``unknown``). A request for a target nobody registered (``unknown``),
or registered by another group (``other-job``), is answered ``REFUSED`` and counted. The
relay never opens a connection itself: it forwards only to connections its targets opened
to it.

It runs on its process's relay loop (:mod:`.thread`), not on the caller's: a peer that
hosts it forwards while its own loop is busy.

A relay that stops (its process dies) closes every connection through it: the members'
heartbeat links to the peers behind it go down, and those peers are lost as any other; a
target sees its control connection close (or hears no ``PING`` for its heartbeat).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import socket
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any

from . import thread
from .pipe import Half
from .protocol import (
    ID_BYTES, OK, OPEN, PING, PING_S, PUNCH, REFUSED, Accept, Answer, BadPreamble, Connect,
    Dial, Hole, Preamble, Refused, Register, Targets, Verdicts, punchable,
)

log = logging.getLogger("p2pcoll.relay")

__all__ = ["Relay", "RelayLimits"]

PLAIN_WARNING = ("without a job key the relay forwards the peers' traffic in plain: it reads "
                 "none of it, but could (set P2PCOLL_KEY_FILE on every peer: then the relay "
                 "sees only CurveZMQ ciphertext and needs no key)")


@dataclass(frozen=True)
class RelayLimits:
    """What a relay holds and waits for (see the module docstring)."""

    max_connections: int = 4096
    max_targets: int = 4096
    max_pending: int = 1024
    handshake_s: float = 5.0
    open_s: float = 5.0
    # A connect for a target not registered yet waits this long for it (its peer registers
    # once it has the roster, as the others start connecting), then is refused.
    register_s: float = 2.0
    # A dial's direct attempt: each side dials for this long at most (then falls back to
    # the relay), again every 5 ms (the member) and 7 ms (the target) while the other's
    # NAT refuses it (see .punch: an attempt can only meet the other's within a round
    # trip, and two sides at one interval could keep missing each other).
    punch_s: float = 5.0
    intervals_s: tuple[float, float] = (0.005, 0.007)


class Relay:
    """A relay server (see the module docstring).

    Args:
        host, port: where to listen (port 0: the OS picks one).
        limits: its bounds.
        secured: whether the jobs it serves have a key (None: it cannot know, a standalone
            relay); False or None logs :data:`PLAIN_WARNING` at start.
    """

    def __init__(self, host: str = "0.0.0.0", port: int = 0,
                 limits: RelayLimits | None = None, secured: bool | None = None) -> None:
        self.host, self.port = host, port
        self.limits = limits or RelayLimits()
        self.secured = secured
        self.targets = Targets(self.limits.max_targets)
        self.refused: Counter[str] = Counter()  # reason -> connections refused
        self.forwards = 0  # forwards made
        self.bytes_relayed = 0  # bytes forwarded, both ways
        self.dials: Counter[str] = Counter()  # dials by outcome (see stats)
        self._connections: set[_Connection] = set()
        self._pending: dict[bytes, _Connection] = {}  # forward id -> member connection
        self._early: dict[str, list[_Connection]] = {}  # target -> connects before it registered
        self._sock: socket.socket | None = None
        self._server: asyncio.Server | None = None
        self._serving: concurrent.futures.Future[None] | None = None
        self._counting = threading.Lock()  # refused is read from the caller's thread

    def bind(self) -> int:
        """Listen now (it serves from the relay loop, see :mod:`.thread`); returns the
        port.

        Raises:
            OSError: the address cannot be bound.
        """
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("" if self.host in ("*", "0.0.0.0") else self.host, self.port))
            sock.listen(1024)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        self._sock = sock
        self.port = sock.getsockname()[1]
        self._serving = asyncio.run_coroutine_threadsafe(self._serve(sock), thread.loop())
        if not self.secured:
            log.warning("relay on port %d: %s", self.port, PLAIN_WARNING)
        return self.port

    async def _serve(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), sock=sock)

    def stats(self) -> dict[str, Any]:
        """``targets`` registered, ``connections`` open, ``forwards`` made, ``bytes_relayed``
        (both ways), ``refused`` by reason (``garbage``, ``unknown``,
        ``other-job``, ``full``, ``timeout``) and ``dials`` by outcome: ``direct``
        (the two sides connected directly), ``relayed`` (they tried, failed and were
        forwarded), ``mixed`` (one side connected, the other not: both closed),
        ``not punchable`` (forwarded without a try: see :func:`.protocol.punchable`),
        ``plain`` (a target of version 1: forwarded)."""
        with self._counting:
            refused = dict(self.refused)
        return {"targets": len(self.targets), "connections": len(self._connections),
                "forwards": self.forwards, "bytes_relayed": self.bytes_relayed,
                "refused": refused, "dials": dict(self.dials)}

    def refuse(self, conn: _Connection, reason: str, answer: bytes = b"") -> None:
        with self._counting:
            self.refused[reason] += 1
            total = sum(self.refused.values())
        if total in (1, 10, 100, 1000) or total % 10000 == 0:
            log.warning("relay on port %d: refused %d connection(s) in all (%s)", self.port,
                        total, ", ".join(f"{n} {r}" for r, n in self.refused.items()))
        if answer:
            conn.write(answer)
            conn.close()
        else:
            conn.abort()

    async def aclose(self) -> None:
        """Stop listening and close every connection through it. Idempotent."""
        await thread.run(self._aclose())

    async def _aclose(self) -> None:
        if self._serving is not None:
            await asyncio.gather(asyncio.wrap_future(self._serving), return_exceptions=True)
        if self._server is not None:
            self._server.close()
        elif self._sock is not None:
            self._sock.close()
        for conn in list(self._connections):
            conn.abort()
        if self._server is not None:
            await self._server.wait_closed()
        self._server = self._sock = self._serving = None

    # --- what connections ask -------------------------------------------------------

    def _register(self, conn: _Connection, request: Register) -> None:
        try:
            old = self.targets.register(request.target, request.tag, conn)
        except Refused:
            self.refuse(conn, "full")
            return
        if isinstance(old, _Connection):
            old.abort()
        conn.target = request.target
        conn.dials = request.version >= 2
        conn.write(OK)
        conn.ping()
        for early in self._early.pop(request.target, []):
            if not early.closed and early.early is not None:
                asked, early.early = early.early, None
                self._connect(early, asked)

    def _connect(self, conn: _Connection, request: Connect | Dial) -> None:
        waiting = len(self._pending) + sum(map(len, self._early.values()))
        try:
            control = self.targets.route(request.target, request.tag)
        except Refused as exc:
            if (exc.reason == "unknown" and conn.early is None
                    and waiting < self.limits.max_pending):
                conn.early = request  # its target may register in a moment
                self._early.setdefault(request.target, []).append(conn)
                conn.arm(self.limits.register_s)
                return
            self.refuse(conn, exc.reason, REFUSED)
            return
        if len(self._pending) >= self.limits.max_pending:
            self.refuse(conn, "full", REFUSED)
            return
        assert isinstance(control, _Connection)
        conn_id = os.urandom(ID_BYTES)
        self._pending[conn_id] = conn
        conn.pending = conn_id
        control.opens.add(conn_id)
        if isinstance(request, Dial) and control.dials:
            conn.dial = request
            control.write(PUNCH + conn_id + request.sender.encode())
        else:
            if isinstance(request, Dial):
                self.dials["plain"] += 1
            control.write(OPEN + conn_id)
        conn.arm(self.limits.open_s)

    def _accept(self, conn: _Connection, request: Accept | Answer) -> None:
        member = self._pending.pop(request.conn, None)
        if member is None or member.closed or isinstance(request, Answer) != bool(member.dial):
            self.refuse(conn, "unknown")
            return
        member.disarm()
        member.pending = None
        if isinstance(request, Answer) and member.dial is not None:
            why = punchable(member.dial.port, member.peer, request.port, conn.peer)
            if why is None:
                self._hole(member, conn)
                return
            log.debug("relay on port %d: no direct attempt: %s", self.port, why)
            self.dials["not punchable"] += 1
            conn.write(OK)
        self._forward(member, conn)

    def _forward(self, member: _Connection, target: _Connection) -> None:
        self.forwards += 1
        member.write(OK)
        member.join(target)

    def _hole(self, member: _Connection, target: _Connection) -> None:
        """Tell both sides of a dial to try a direct connection (see .protocol)."""
        nonces = os.urandom(ID_BYTES), os.urandom(ID_BYTES)
        limits = self.limits
        attempt = _Attempt(member, target)
        for side, (conn, other) in enumerate(((member, target), (target, member))):
            conn.attempt = attempt
            conn.write(Hole(other.peer[0], other.peer[1], nonces[side], nonces[1 - side],
                            limits.intervals_s[side], limits.punch_s).pack())
            conn.arm(limits.punch_s + limits.handshake_s)

    def _verdict(self, conn: _Connection, data: bytes) -> None:
        attempt = conn.attempt
        assert attempt is not None
        try:
            if len(data) != 1:
                raise BadPreamble(f"{len(data)} bytes of verdict")
            outcome = attempt.verdicts.say(attempt.sides.index(conn), data)
        except BadPreamble:
            self._end(attempt, "garbage")
            return
        if outcome is None:
            return
        self.dials[outcome] += 1
        member, target = attempt.sides
        for side in attempt.sides:
            side.disarm()
            side.attempt = None
        if outcome == "relayed":
            target.write(OK)
            self._forward(member, target)
        elif outcome == "direct":
            member.close()
            target.close()
        else:
            member.abort()
            target.abort()

    def _end(self, attempt: _Attempt, reason: str) -> None:
        """A direct attempt that went wrong: both sides closed, counted as ``reason``."""
        member, target = attempt.sides
        for side in attempt.sides:
            side.attempt = None
            side.disarm()
        target.abort()
        self.refuse(member, reason)

    def _gone(self, conn: _Connection) -> None:
        self._connections.discard(conn)
        if conn.early is not None:
            early = self._early.get(conn.early.target, [])
            if conn in early:
                early.remove(conn)
            if not early:
                self._early.pop(conn.early.target, None)
        if conn.pending is not None:
            self._pending.pop(conn.pending, None)
        attempt = conn.attempt
        if attempt is not None:  # a side gone before its verdict: the attempt ends
            side = attempt.sides.index(conn)
            if attempt.verdicts.said[side] is None:
                self._end(attempt, "timeout")
        if conn.target is not None:
            self.targets.unregister(conn.target, conn)
            for conn_id in conn.opens:  # those waiting for this target: no accept will come
                member = self._pending.pop(conn_id, None)
                if member is not None:
                    self.refuse(member, "unknown", REFUSED)


class _Attempt:
    """A direct attempt between a dial's two connections (member, target)."""

    def __init__(self, member: _Connection, target: _Connection) -> None:
        self.sides = (member, target)
        self.verdicts = Verdicts()


class _Connection(Half):
    """One connection to the relay: its preamble, then its role (a target's control
    connection, or one half of a forward)."""

    def __init__(self, relay: Relay) -> None:
        super().__init__(count=self._count, lost=lambda: relay._gone(self))
        self.relay = relay
        self.preamble: Preamble | None = Preamble()
        self.target: str | None = None  # a control connection: its target
        self.opens: set[bytes] = set()  # ... and the forwards it was asked to open
        self.pending: bytes | None = None  # a member waiting for its target's accept
        self.early: Connect | Dial | None = None  # ... or for its target to register
        self.dial: Dial | None = None  # a member's dial (waiting, or in its attempt)
        self.dials = False  # a control connection: its target can be asked to dial
        self.attempt: _Attempt | None = None  # in a direct attempt: its verdict is awaited
        self.peer: tuple[str, int] = ("", 0)  # the address this connection came from
        self._timer: asyncio.TimerHandle | None = None

    def _count(self, n: int) -> None:
        self.relay.bytes_relayed += n

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple) and len(peer) >= 2:
            self.peer = (str(peer[0]), int(peer[1]))
        relay = self.relay
        if len(relay._connections) >= relay.limits.max_connections:
            relay.refuse(self, "full")
            return
        relay._connections.add(self)
        self.arm(relay.limits.handshake_s)

    def arm(self, seconds: float) -> None:
        self.disarm()
        self._timer = asyncio.get_running_loop().call_later(seconds, self._expired)

    def disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self) -> None:
        self._timer = None
        if self.attempt is not None:
            self.relay._end(self.attempt, "timeout")
            return
        if not self.closed:
            reason = "unknown" if self.early is not None else "timeout"
            waiting = self.pending is not None or self.early is not None
            self.relay.refuse(self, reason, REFUSED if waiting else b"")

    def ping(self) -> None:
        if not self.closed:
            self.write(PING)
            self._timer = asyncio.get_running_loop().call_later(PING_S, self.ping)

    def data_received(self, data: bytes) -> None:
        preamble = self.preamble
        if self.attempt is not None:
            self.relay._verdict(self, data)
            return
        if preamble is None:
            if self.target is None and self.pending is None and self.early is None:
                super().data_received(data)  # a forward: spliced
            # (a control connection or a waiting member has nothing to say: ignored)
            return
        try:
            request = preamble.feed(data)
        except BadPreamble:
            self.preamble = None
            self.relay.refuse(self, "garbage")
            return
        if request is None:
            return
        self.preamble = None
        self.disarm()
        if preamble.rest:
            self._held += preamble.rest
        if isinstance(request, Register):
            self.relay._register(self, request)
        elif isinstance(request, Connect | Dial):
            self.relay._connect(self, request)
        else:
            self.relay._accept(self, request)

    def connection_lost(self, exc: Exception | None) -> None:
        self.disarm()
        super().connection_lost(exc)
