"""The one place every ZeroMQ socket of p2pcoll is made, with its options.

The mesh's ROUTER and DEALER links and the rendezvous server and client all come from a
:class:`SocketFactory`, so every socket option is set in one place for every socket of a
peer: high-water marks and size caps (so excess or oversize traffic is refused by libzmq
before it is buffered), linger, heartbeats, and the job's CurveZMQ key:

- With a job key (:class:`~p2pcoll.security.JobKey`), every server socket (the mesh's
  ROUTER, the rendezvous server) is a CURVE server holding the job's secret key, in the
  job's ZAP domain, and the process's ZAP gate (:mod:`p2pcoll.security.zap`) lets in only
  clients that hold the same key; every client socket (mesh links, rendezvous client)
  proves it holds the job key. A socket without the key cannot complete a handshake with
  one that has it, in either direction, and what goes over the wire is encrypted.
- Without one, sockets are plain (ZeroMQ's NULL mechanism): anyone who can reach a port can
  connect. Keep such groups on networks only the job can reach.
"""

from __future__ import annotations

import asyncio
import errno
import itertools
import logging
import resource
import time
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from ..security import Gate, JobKey
from ..settings import Settings

log = logging.getLogger("p2pcoll.transport")

LINGER_MS = 2000  # how long queued messages may still go out after a link closes
RENDEZVOUS_MAX_BYTES = 1 << 20  # a join request or a roster; larger ones are refused
LINK_RECEIVE_BYTES = 1024  # what a sending link accepts back (nothing is ever sent back)
# What may wait in one link's queue, at either end, before a send waits (backpressure per
# destination) or libzmq stops reading that connection (while the receiver's event loop is
# busy): a bound in bytes, turned into ZeroMQ's bound in messages by the largest message
# the group sends.
QUEUE_BYTES = 64 << 20
MIN_HWM, MAX_HWM = 16, 1000


def queue_messages(message_bytes: int) -> int:
    """The high-water mark (messages) that keeps one link's queue near QUEUE_BYTES."""
    return max(MIN_HWM, min(MAX_HWM, QUEUE_BYTES // max(1, message_bytes)))


class Socket(zmq.asyncio.Socket):
    """pyzmq's asyncio socket, refusing to receive or send once it is closed.

    pyzmq's asyncio socket works through a second handle on the libzmq socket that is not
    told when the socket closes, so a receive or send started after :meth:`close` (a reader
    loop whose handler of one message closed the socket, then asked for the next) reached
    the libzmq socket after libzmq's reaper thread had freed it. Reading freed memory
    crashed processes now and then, and could take the wake-up meant for the socket made
    in its place: when that was a socket monitor, libzmq's I/O thread waited forever
    inside an event's send, holding the monitor's lock, and the next ``disable_monitor()``
    froze the process. Every asyncio socket of p2pcoll is one of these (see
    :meth:`SocketFactory._socket`, :func:`monitor`); the same rule holds for the
    synchronous handles p2pcoll takes on them (``zmq.Socket.shadow``): used only while
    their socket is open.
    """

    def _refuse_closed(self) -> None:
        if self._closed:
            raise zmq.ZMQError(zmq.ENOTSOCK)

    def recv_multipart(self, flags: int = 0, copy: bool = True,
                       track: bool = False) -> Any:
        self._refuse_closed()
        return super().recv_multipart(flags, copy, track)

    def send_multipart(self, msg_parts: Any, flags: int = 0,  # type: ignore[override]
                       copy: bool = True, track: bool = False, **kwargs: Any) -> Any:
        self._refuse_closed()
        return super().send_multipart(msg_parts, flags, copy, track, **kwargs)

    def recv(self, flags: int = 0, copy: bool = True, track: bool = False) -> Any:
        self._refuse_closed()
        return super().recv(flags, copy, track)

    def send(self, data: Any, flags: int = 0, copy: bool = True,  # type: ignore[override]
             track: bool = False, **kwargs: Any) -> Any:
        self._refuse_closed()
        return super().send(data, flags, copy, track, **kwargs)


_monitors = itertools.count()


def monitor(socket: zmq.asyncio.Socket, events: int) -> zmq.asyncio.Socket:
    """A PAIR socket that reads ``socket``'s ``events``. Each monitor gets an inproc address
    of its own: pyzmq's default names it by the socket's descriptor, which a socket made
    after this one closes may reuse while this monitor's endpoint is still being torn
    down, and then one socket's events could reach another's reader.

    The reader's queue has no bound (RCVHWM 0 makes the inproc pipe unbounded). libzmq's
    I/O thread sends each event with a blocking send while holding the socket's monitor
    lock; with pyzmq's bounded reader, 500 unread events (a late probe's connect retries,
    a busy loop) made that send wait, and then ``disable_monitor()`` waited for the lock
    in C holding the interpreter lock: the process froze."""
    address = f"inproc://p2pcoll-monitor-{next(_monitors)}"
    socket.monitor(address, events)
    reader: zmq.asyncio.Socket = socket.context.socket(zmq.PAIR, socket_class=Socket)
    reader.setsockopt(zmq.RCVHWM, 0)
    reader.connect(address)
    return reader


class SocketFactory:
    """Makes the sockets of one peer (or of one rendezvous server).

    Args:
        context: the ZeroMQ context (default the process's shared asyncio context).
        key: the job key; None for plain sockets.
        max_message_bytes: the largest payload frame a receiving socket accepts; libzmq
            drops a connection that sends a larger frame.
        message_bytes: the largest message this group sends (its segment size), which sets
            the high-water marks.
        heartbeat_s: a link that is silent this long is closed (and its peer lost).

    Call :meth:`close` when every socket it made is closed: it lets go of the ZAP gate.
    """

    def __init__(self, context: zmq.asyncio.Context | None = None, *,
                 key: JobKey | None = None, max_message_bytes: int = 256 << 20,
                 message_bytes: int = 1 << 20, heartbeat_s: float = 5.0) -> None:
        self.context = context or _shared_context()
        self.key = key
        self.max_frame_bytes = max(max_message_bytes, RENDEZVOUS_MAX_BYTES)
        self.hwm = queue_messages(message_bytes)
        self.heartbeat_ms = max(100, int(heartbeat_s * 1000))
        self._gate: Gate | None = None

    @property
    def secure(self) -> bool:
        return self.key is not None

    def _server(self, kind: int) -> zmq.asyncio.Socket:
        sock = self._socket(kind)
        if self.key is not None:
            if self._gate is None:
                self._gate = Gate.admit(self.context, self.key)
            sock.setsockopt(zmq.ZAP_DOMAIN, self.key.domain.encode())
            sock.setsockopt(zmq.CURVE_SERVER, 1)
            sock.setsockopt(zmq.CURVE_SECRETKEY, self.key.secret)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, self.key.public)
        return sock

    def _socket(self, kind: int) -> zmq.asyncio.Socket:
        """A new socket of the context; out of descriptors, an OSError that says so and
        what to do (libzmq's own says only "Too many open files")."""
        try:
            return self.context.socket(kind, socket_class=Socket)
        except zmq.ZMQError as exc:
            if exc.errno != errno.EMFILE:
                raise
            soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            raise OSError(errno.EMFILE, (
                f"cannot open another ZeroMQ socket: this process has run out of file "
                f"descriptors (soft limit {soft}, `ulimit -n`); each link a peer opens costs "
                f"its process two (one over inproc): raise the limit, or run fewer peers per "
                f"process")) from exc

    def _client(self, kind: int) -> zmq.asyncio.Socket:
        sock = self._socket(kind)
        if self.key is not None:
            sock.setsockopt(zmq.CURVE_SERVERKEY, self.key.public)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, self.key.public)
            sock.setsockopt(zmq.CURVE_SECRETKEY, self.key.secret)
        return sock

    def mesh_router(self) -> zmq.asyncio.Socket:
        """The socket a peer receives every message of its group on."""
        sock = self._server(zmq.ROUTER)
        sock.setsockopt(zmq.RCVHWM, self.hwm)
        sock.setsockopt(zmq.LINGER, 0)
        # A second connection with an identity already taken replaces the first instead
        # of being ignored: libzmq never reads an ignored connection, and never frees what
        # it sent (up to RCVHWM messages) until this socket closes, whoever opened it; and a
        # member's link that reconnects before its old connection is seen dead takes its
        # place at once. No one can take a member's link this way without its exact
        # identity, which holds a nonce only that member's process and the wire know (see
        # links.link_identity); another connection claiming the member's rank is read
        # and its messages dropped as ``impostor``; the mesh counts such connections (see
        # LinkCensus).
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        # A hard per-frame cap: libzmq drops the connection of a peer that exceeds it.
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_frame_bytes)
        # A handshake that does not complete in time (a client that connects and says
        # nothing, or speaks something else) is closed rather than held.
        sock.setsockopt(zmq.HANDSHAKE_IVL, self.heartbeat_ms)
        return sock

    def mesh_link(self, identity: bytes, send_buffer: int = 0) -> zmq.asyncio.Socket:
        """A sending link to one peer (or a stripe of one, see .stripes), with routing
        ``identity`` (the sender's rank); ``send_buffer``: its SO_SNDBUF (0: the kernel
        autotunes it; see .paths)."""
        sock = self._client(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, identity)
        sock.setsockopt(zmq.SNDHWM, self.hwm)
        if send_buffer > 0:
            sock.setsockopt(zmq.SNDBUF, send_buffer)
        # A link sends; what comes back on it is small and few (read when it is: see
        # Routes.listen): the answer to its end, a farewell, the peer's goodbye said back,
        # news that this peer was declared lost.
        sock.setsockopt(zmq.RCVHWM, 4)
        sock.setsockopt(zmq.MAXMSGSIZE, LINK_RECEIVE_BYTES)
        sock.setsockopt(zmq.LINGER, LINGER_MS)
        return sock

    def mesh_probe(self, identity: bytes) -> zmq.asyncio.Socket:
        """A link to one peer that carries no messages, only ZMTP heartbeats: the peer is
        alive while its libzmq answers them. Liveness is not measured on the data link
        because a receiver whose queue is full (its event loop busy) reads nothing of that
        connection, heartbeats included, and would look dead though it is only slow."""
        sock = self._client(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, identity)
        sock.setsockopt(zmq.SNDHWM, 1)
        sock.setsockopt(zmq.RCVHWM, 1)
        sock.setsockopt(zmq.MAXMSGSIZE, LINK_RECEIVE_BYTES)
        sock.setsockopt(zmq.LINGER, 0)
        # libzmq starts a PING's timeout when it sends the PING, up to one interval after
        # the last traffic: interval + timeout = the heartbeat, so a frozen peer is lost
        # within it, not an interval later.
        interval = max(50, self.heartbeat_ms // 5)
        sock.setsockopt(zmq.HEARTBEAT_IVL, interval)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, max(50, self.heartbeat_ms - interval))
        sock.setsockopt(zmq.HEARTBEAT_TTL, self.heartbeat_ms)
        return sock

    def rendezvous_server(self) -> zmq.asyncio.Socket:
        sock = self._server(zmq.ROUTER)
        # Nothing queued needs to go out on close: a peer whose reply is lost asks again.
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, RENDEZVOUS_MAX_BYTES)
        sock.setsockopt(zmq.RCVHWM, 1000)
        sock.setsockopt(zmq.HANDSHAKE_IVL, self.heartbeat_ms)
        return sock

    def rendezvous_client(self, identity: bytes) -> zmq.asyncio.Socket:
        """A client of the rendezvous; ``identity`` stays the same across reconnections,
        so the server knows a re-sent request for the one it already has."""
        sock = self._client(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, identity)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RECONNECT_IVL, 50)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 500)
        sock.setsockopt(zmq.MAXMSGSIZE, 64 * RENDEZVOUS_MAX_BYTES)
        sock.setsockopt(zmq.RCVHWM, 64)
        sock.setsockopt(zmq.HANDSHAKE_IVL, 2000)
        return sock

    def close(self) -> None:
        """Every socket this factory made is closed: release the ZAP gate."""
        if self._gate is not None and self.key is not None:
            self._gate.release(self.key)
            self._gate = None

    def refused(self) -> int:
        """Clients the ZAP gate has refused for this factory's job (0 when insecure)."""
        return Gate.refusals(self.context, self.key) if self.key is not None else 0

    @classmethod
    def for_settings(cls, settings: Settings) -> SocketFactory:
        """The factory of a group with these settings."""
        return cls(key=settings.key, max_message_bytes=settings.max_message_bytes,
                   message_bytes=min(settings.segment_bytes, settings.max_message_bytes),
                   heartbeat_s=settings.heartbeat_timeout)


IO_THREADS = 1
"""libzmq's I/O threads in the shared context (its default: one). Each connection is served
by one of them, so with more a link's stripes (see .stripes) would encrypt and decrypt their
CurveZMQ sessions on several cores at once. Kept at one for now: with two, peers of one
process over ipc sometimes miss hellos that have arrived while the group forms
(tests/test_lazy_links.py, consecutive ranks lost), which points at a lost wake-up of the
ROUTER's edge-triggered ZMQ_FD read (see .router) that one thread hides. 0.18.0 tried one
per core, plain sockets pinned to the first (ZMQ_AFFINITY; the branch is the second parent
of commit 593cebb): a stranger's socket on the second thread sending ten bad messages to a
plain group's ROUTER stopped being read after seven in 3 of 5 runs
(tests/test_faults.py::test_malformed_messages_are_dropped_and_counted); reverted until
that is understood."""


def _shared_context() -> zmq.asyncio.Context:
    """The process's ZeroMQ context, allowed as many sockets as the process may open files:
    libzmq's own default (1023 sockets) would stop a process that runs many peers (tasks of
    one process, as in tests) long before its descriptor limit; with IO_THREADS I/O threads.
    Takes effect when the context makes its first socket."""
    context = zmq.asyncio.Context.instance()
    if id(context) not in _SIZED:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if soft == resource.RLIM_INFINITY or soft > 1 << 20:
            soft = 1 << 20
        context.set(zmq.MAX_SOCKETS, max(context.get(zmq.MAX_SOCKETS), soft))
        context.set(zmq.IO_THREADS, max(context.get(zmq.IO_THREADS), IO_THREADS))
        _SIZED.add(id(context))
    return context


_SIZED: set[int] = set()  # the contexts _shared_context has sized


class LinkCensus:
    """Counts the connections to a peer's mesh ROUTER that are none of the members' links.

    Each other member of a group connects to this peer's ROUTER at most once with its data
    link (again each time it opens the link anew after closing it for its link budget, which
    the mesh counts as it reads them) and, if it watches this peer, once with its probe (see
    :meth:`SocketFactory.mesh_probe`): the ``expected`` count. Every ZeroMQ handshake beyond
    it is someone else's: a stranger's (what it sends is read and dropped
    as ``stranger``) or an impostor's, a second connection claiming a member's rank (read
    and dropped as ``impostor``). A member's socket that reconnects after its connection
    dropped counts as well; that member has lost this peer by then (a link that goes down
    is a lost peer). The monitor names no identities: the count says how many came, not
    who; a connection that fails its handshake (a port scanner, a wrong job key) is not
    counted here (the ZAP gate counts those).

    Make it before the ROUTER binds (no handshake is missed), :meth:`watch` once the group
    is known, and :meth:`stop` before the ROUTER closes.
    """

    WARN_EVERY_S = 10.0  # at most one WARNING per interval, however many connect

    def __init__(self, router: zmq.asyncio.Socket) -> None:
        self.router = router
        self.monitor = monitor(router, zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self.handshakes = 0
        self.refused = 0
        self._warned_at = -self.WARN_EVERY_S
        self._warned = 0  # refused when the last WARNING was written

    RECOUNT_S = 1.0  # how long after a handshake beyond the count it is counted again
    MAX_RECOUNTS = 10  # ... and again while the ROUTER has unread messages, at most so often

    def handshake(self, expected: int) -> bool:
        """One more handshake on the ROUTER; whether it is beyond the ``expected`` links."""
        self.handshakes += 1
        return self.beyond(expected)

    def beyond(self, expected: int) -> bool:
        """Whether one more of the handshakes so far is beyond ``expected`` than counted
        already (then it is counted)."""
        if self.handshakes - self.refused <= expected:
            return False
        self.refused += 1
        return True

    async def watch(self, expected: Callable[[], int], on_refused: Callable[[], None],
                    rank: int, behind: Callable[[], bool]) -> None:
        """Count the ROUTER's handshakes until cancelled or stopped; ``on_refused()`` for
        each beyond ``expected()`` members' links, logged at most once per interval.

        A member's link that opens anew is counted in ``expected()`` once its first
        message is read, which may come a while after its handshake when the reader is
        behind: a handshake beyond the count is counted again :data:`RECOUNT_S` later, and
        refused only if it still is and the reader has caught up (``behind()`` false: it
        last read the ROUTER empty); while it has not, again later, at most
        :data:`MAX_RECOUNTS` times (a stranger that floods is refused all the same, a few
        seconds late). The census never asks the ROUTER itself: reading its ZMQ_EVENTS
        would take the edge its reader waits for (see Router.read).
        """
        loop = asyncio.get_running_loop()

        def recount(left: int) -> None:
            if self.handshakes - self.refused <= expected():
                return
            if left > 0 and behind():
                loop.call_later(self.RECOUNT_S, recount, left - 1)
                return
            if self.beyond(expected()):
                on_refused()
                self._warn(rank)

        try:
            while True:
                event = parse_monitor_message(await self.monitor.recv_multipart())
                if event["event"] != zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    continue
                self.handshakes += 1
                if self.handshakes - self.refused > expected():
                    loop.call_later(self.RECOUNT_S, recount, self.MAX_RECOUNTS)
        except (asyncio.CancelledError, zmq.ZMQError):
            pass

    def _warn(self, rank: int) -> None:
        now = time.monotonic()
        if now - self._warned_at < self.WARN_EVERY_S:
            return
        log.warning("rank %d: connections to the mesh port that are no member's link (a "
                    "stranger's or an impostor's, none read as a member's): %d in all, %d "
                    "since the last report", rank, self.refused, self.refused - self._warned)
        self._warned_at, self._warned = now, self.refused

    def stop(self) -> None:
        """Stop the monitor (while its socket is open: libzmq sends a last event on stop,
        and a send to a closed PAIR blocks forever), then close it."""
        if not self.router.closed:
            self.router.disable_monitor()
        self.monitor.close(linger=0)

