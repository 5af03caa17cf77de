"""The mesh's receiving end: one bound ROUTER per peer, its read loop and its census.

Every message arrives with the identity of the link it came on (``b"r@<link secret>@<nonce>@
<generation>"``, see :mod:`.links`), which must agree with the source rank in its header;
the first connection of a rank that speaks fixes the rank's nonce for the group, and the
messages of any other connection claiming the rank are dropped as ``impostor``; a rank's
successive links (closed and opened again for its link budget, see :mod:`.route`) are read
one after the other, in the order it opened them (see :class:`~.links.Successions`). A
link's ``end`` is answered on it, so that its sender may close it. A link's stripes
(identity ``<link>#i``, see :mod:`.stripes`) carry its large messages, handed on at their
turns on the link (:class:`~.stripes.StripeJoin`), so in the order sent.

The ROUTER is read in a callback on its ZMQ_FD, not through pyzmq's asyncio layer (a future,
a callback and a task wake-up per message, about a third of a small collective's time): one
reader drains it and hands every message of a member's current link to the mesh, which
passes it through the one validation point (:func:`p2pcoll.wire.validate`, see
:mod:`.inbound`) in its sender's order; a message that fails, or whose handling raises
anything at all, is dropped, counted and logged, and the reader goes on.

The ROUTER also carries what goes back to a peer on a connection the peer opened: the
answer to a link's end, a farewell on the link a goodbye came on, a leaving peer's goodbye
on a watcher's probe (whose answer comes back here). The census counts the connections
that are no member's link or probe (``links_refused``, see :class:`~.sockets.LinkCensus`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

import zmq
import zmq.asyncio

from ..errors import ProtocolError
from ..wire import Header, encode_header
from .base import Counters, Drops, Piece
from .endpoints import EndpointPolicy
from .links import Successions
from .route import ENDED
from .sockets import LinkCensus, SocketFactory
from .stripes import StripeJoin, parse_stripe, turn_of

log = logging.getLogger("p2pcoll.transport")

__all__ = ["YIELD_EVERY", "Router"]

_NOBLOCK = int(zmq.NOBLOCK)
# ZMQ_EVENTS as pyzmq's own constant, not an int: given an int, getsockopt first looks it up
# in the SocketOption enum (a third of the call); it is asked once or twice per message.
_EVENTS, _POLLIN = zmq.EVENTS, int(zmq.POLLIN)
YIELD_EVERY = 64  # messages a reader takes in a row before it lets other tasks run

# A message on a member's current link, handed on in its sender's order (see .same_host).
TakeIn = Callable[[int, list[zmq.Frame]], None]
# An answer on a watcher's probe: the watcher, the header frame, the payload frames.
Answered = Callable[[int, memoryview, Sequence[Piece]], object]


class Router:
    """This peer's ROUTER (see the module docstring).

    Args:
        sockets: makes the ROUTER.
        policy: where it binds, and how its endpoints are cleaned up.
        counters, drops: the mesh's.
        take_in: takes each message of a member's current link.
        answered: takes each answer that comes back on a watcher's probe.
        heard: called with a member whose link (each in turn) is read from now on: an
            answer reaches it (see :meth:`answer`).
    """

    def __init__(self, sockets: SocketFactory, policy: EndpointPolicy, counters: Counters,
                 drops: Drops, *, take_in: TakeIn, answered: Answered,
                 heard: Callable[[int], None]) -> None:
        self._sockets = sockets
        self._policy = policy
        self._counters = counters
        self._drops = drops
        self._take_in = take_in
        self._answered = answered
        self._heard = heard
        self.endpoints: list[str] = []
        self.rank = -1
        self._socket: zmq.asyncio.Socket | None = None
        # Link identity -> rank, of the members' links being read now; the order of each
        # member's successive links (made at start).
        self._ranks: dict[bytes, int] = {}
        self._successions: Successions[list[zmq.Frame]] | None = None
        # The links that have stripes (see .stripes): link identity -> the join that puts
        # their messages back in order; stripe identity -> (link identity, stripe).
        self._joins: dict[bytes, StripeJoin[list[zmq.Frame]]] = {}
        self._stripes: dict[bytes, tuple[bytes, int]] = {}
        self.stripes_heard = 0  # stripes that have spoken here (for the census)
        # Probe identity -> rank, of the watchers this peer said goodbye to on their probes
        # (their farewells come back on them).
        self._probers: dict[bytes, int] = {}
        self._reading: tuple[zmq.Socket, asyncio.Future[None]] | None = None
        self._behind = False  # the last drain stopped with messages left (see _drain)
        self._census: LinkCensus | None = None  # counts connections that are no member's link
        self._closed = False

    @property
    def bound(self) -> bool:
        return self._socket is not None

    def bind(self, host: str) -> list[str]:
        """Bind the ROUTER and return the endpoints the others may connect to."""
        router = self._sockets.mesh_router()
        self._socket = router
        if self._policy.name != "inproc":  # inproc makes no handshakes to count
            self._census = LinkCensus(router)
        for address in self._policy.bind_addresses(host):
            router.bind(address)
            self.endpoints.append(router.getsockopt_string(zmq.LAST_ENDPOINT))
        return self.endpoints

    def start(self, rank: int, size: int, secret: str) -> None:
        """Take the links of the members of a group of ``size`` (``secret``: its link
        secret, never logged) as this peer, ``rank``."""
        self.rank = rank
        self._ranks = {}
        self._successions = Successions(
            {b"%d@%s" % (r, secret.encode()): r for r in range(size) if r != rank},
            release=self._release, drop=self._drops.drop,
            size=lambda frames: sum(len(f) for f in frames))

    def nonce(self, rank: int) -> bytes | None:
        """The nonce of ``rank``'s links, once one has spoken here (see .links)."""
        successions = self._successions
        return None if successions is None else successions.nonce(rank)

    def forget(self, rank: int) -> None:
        """``rank`` has gone: hold nothing more for its links."""
        if self._successions is not None:
            self._successions.forget(rank)
            for link in [k for k in self._joins if self._successions.rank_of(k) == rank]:
                del self._joins[link]

    async def census(self, members: int, departed: Callable[[], int]) -> None:
        """Count the connections beyond the ``members`` expected (``links_refused``), and
        the later links of members that closed one, and the probe of a new watcher after
        each of the ``departed`` (see ZmqMesh.follow); if the ROUTER counts none (inproc),
        return at once."""
        if self._census is None:
            return
        successions = self._successions
        assert successions is not None, "start() first"
        counters = self._counters

        def refused() -> None:
            counters.links_refused += 1

        def expected() -> int:
            return members + successions.later_links + departed() + self.stripes_heard

        await self._census.watch(expected, refused, self.rank, behind=lambda: self._behind)

    @property
    def counts_links(self) -> bool:
        """Whether :meth:`census` counts anything (not over inproc)."""
        return self._census is not None

    async def read(self, wakeup: Callable[[], int | None], on_wake: Callable[[], None]
                   ) -> None:
        """Drain the ROUTER for good: whatever one message does, the next is read; and
        call ``on_wake`` whenever the descriptor ``wakeup()`` names (if any) is readable.

        Not through pyzmq's asyncio layer (a future, a callback and a task wake-up per
        message, about a third of a small collective's time): the loop watches the socket's
        ZMQ_FD and :meth:`_drain` reads and delivers every waiting message right in that
        callback. ZMQ_FD is edge-triggered, so a drain reads until ZMQ_EVENTS says the queue
        is empty, or hands the rest to a drain of its own after YIELD_EVERY messages so that
        a flood cannot hold the event loop. This task only owns the registration.
        """
        assert self._socket is not None
        router = zmq.Socket.shadow(self._socket.underlying)
        fd = router.getsockopt(zmq.FD)
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._reading = (router, done)
        loop.add_reader(fd, self._drain)
        waker = wakeup()
        if waker is not None:
            loop.add_reader(waker, on_wake)
        try:
            self._drain()  # what came before the registration signalled no edge to it
            await done
        except asyncio.CancelledError:
            return
        finally:
            loop.remove_reader(fd)
            if waker is not None:
                loop.remove_reader(waker)
            self._reading = None

    def poll(self) -> None:
        """Read and hand on, now, whatever waits in the ROUTER, without waiting for more.

        What a receive does before it parks (see :meth:`~p2pcoll.engine.matching.Matcher.get`):
        a message that has come is taken at once, without a turn of the event loop (the
        descriptor's callback, a future, the task's wake-up). The same drain as the
        callback's, so messages are handed on in the same order. Never raises.
        """
        reading = self._reading
        if reading is None:
            return
        try:
            events: int = reading[0].getsockopt(_EVENTS)  # type: ignore[assignment]
            waiting = events & _POLLIN
        except zmq.ZMQError:  # closed meanwhile: the reader's drain sees to its ending
            return
        if waiting:
            self._drain()

    def _drain(self) -> None:
        reading = self._reading
        if reading is None:
            return
        router, done = reading
        try:
            for _ in range(YIELD_EVERY):
                # A receive that finds a message makes no system call; an empty one does,
                # and its zmq.Again costs four times what ZMQ_EVENTS does: so the drain
                # receives first (it was called because something came) and then asks
                # ZMQ_EVENTS whether more waits (which also re-arms the descriptor's edge).
                frame = router.recv(_NOBLOCK, copy=False)
                frames = [frame]
                while frame.more:  # the parts of a message arrive together
                    frame = router.recv(_NOBLOCK, copy=False)
                    frames.append(frame)
                self._deliver(frames)
                # Let go of the frames before the next: over inproc a zero-copy send is
                # complete only when the receiver frees its frame.
                del frames
                events: int = router.getsockopt(_EVENTS)  # type: ignore[assignment]
                if not events & _POLLIN:
                    self._behind = False
                    return
        except zmq.Again:
            self._behind = False
            return
        except zmq.ZMQError as exc:
            if self._closed or isinstance(exc, zmq.ContextTerminated):
                if not done.done():
                    done.set_result(None)
                return
            log.error("rank %d: receive failed: %s", self.rank, exc)
        # More may be waiting and no edge will say so: go on after the other callbacks.
        self._behind = True
        asyncio.get_running_loop().call_soon(self._drain)

    def _send_back(self, router: zmq.Socket, frames: list[bytes]) -> None:
        """Send ``frames`` (an identity first) through the ROUTER at once; raises
        zmq.ZMQError where they cannot go at once. A drain follows: any
        operation on a socket may take the edge its ZMQ_FD would have signalled to
        :meth:`_drain` (see :meth:`read`), and what waits would stay unread for good."""
        try:
            router.send_multipart(frames, _NOBLOCK)
        finally:
            asyncio.get_running_loop().call_soon(self._drain)

    def _deliver(self, frames: list[zmq.Frame]) -> None:
        """One message from the ROUTER: handed on in its sender's order, or dropped."""
        identity = frames[0].bytes if frames else b""
        source = self._ranks.get(identity)
        if len(frames) < 2:
            self._drops.drop(source if source is not None else self._stranger(identity),
                             ProtocolError("message has no header frame"))
            return
        if source is None:
            watcher = self._probers.get(identity)
            if watcher is not None:  # a watcher answering a goodbye on its probe
                self._answered(watcher, frames[1].buffer, frames[2:])
                return
            stripe = self._stripe(identity)
            if stripe is not None:  # handed on at its turn on its link
                link, index = stripe
                rank, join = self._join(link)
                if not join.on_stripe(index, frames):
                    self._drops.drop(rank, ProtocolError(
                        f"rank {rank} sent more on a stripe than its link announced",
                        reason="oversize"))
                return
            # A link heard for the first time, or a member's later link: the rank's link
            # now; or held for its turn, or dropped and counted as a ``stranger`` (no
            # ``rank@secret`` of this group) or an ``impostor`` (another nonce claiming a
            # rank whose link has spoken). Identities are logged cut short: a member's
            # holds the group's secret.
            successions = self._successions
            source = None if successions is None else successions.arrive(identity, frames)
            if source is None:
                return
            self._ranks[identity] = source
            self._heard(source)
        self._on_link(source, identity, frames)

    def _on_link(self, source: int, identity: bytes, frames: list[zmq.Frame]) -> None:
        """A message on member ``source``'s current link: handed on, after what its
        stripes still owe before it; or a stripe's turn (see .stripes)."""
        join = self._joins.get(identity)
        index = turn_of(frames[1]) if len(frames) == 2 else None
        if index is not None:
            self._join(identity)[1].on_turn(index)
        elif join is None:
            self._take_in(source, frames)
        else:
            join.on_link(frames)

    def _stripe(self, identity: bytes) -> tuple[bytes, int] | None:
        """``(link identity, stripe)`` of a stripe of a member's link; None for anything
        else."""
        known = self._stripes.get(identity)
        if known is not None:
            return known
        parsed = parse_stripe(identity)
        successions = self._successions
        if parsed is None or successions is None or successions.rank_of(parsed[0]) is None:
            return None
        self._stripes[identity] = parsed
        self.stripes_heard += 1
        return parsed

    def _join(self, link: bytes) -> tuple[int, StripeJoin[list[zmq.Frame]]]:
        """The rank of a member's link (by identity) and the join of its stripes."""
        assert self._successions is not None
        rank = self._successions.rank_of(link)
        assert rank is not None, "a member's link"
        join = self._joins.get(link)
        if join is None:
            join = self._joins[link] = StripeJoin(
                lambda frames: self._take_in(rank, frames),
                lambda frames: sum(len(f) for f in frames))
        return rank, join

    def on_end(self, header: Header) -> None:
        """A member's link has ended (closed for its link budget): answer on it, so that
        its sender may close it (see .route), and read its next one, whatever came on that
        one meanwhile first."""
        successions = self._successions
        if successions is None:
            return
        ended = successions.current.get(header.src)
        if ended is not None:
            del self._ranks[ended]
            if self._joins.pop(ended, None) is not None:  # its stripes have all been read
                for stripe in [i for i, (link, _) in self._stripes.items() if link == ended]:
                    del self._stripes[stripe]
            reading = self._reading
            if reading is not None:
                try:  # a ROUTER drops what it cannot route at once: this never waits
                    self._send_back(reading[0], [ended, ENDED])
                except zmq.ZMQError as exc:
                    log.debug("rank %d: end of rank %d's link not answered: %s", self.rank,
                              header.src, exc)
        successions.end(header.src)

    def _release(self, rank: int, identity: bytes, messages: list[list[zmq.Frame]]) -> None:
        """The turn of a member's next link has come: what it held, in order."""
        self._ranks[identity] = rank
        self._heard(rank)
        for frames in messages:
            if self._ranks.get(identity) != rank:  # ended among these (an end was read)
                break
            self._on_link(rank, identity, frames)

    def _stranger(self, identity: bytes) -> object:
        """How the log names a link that is not (yet) a member's: never by the secret."""
        rank = None if self._successions is None else self._successions.rank_of(identity)
        return identity[:8] if rank is None else f"a link claiming rank {rank}"

    def answer(self, rank: int, frame: bytes) -> None:
        """Send ``frame`` back on ``rank``'s link to this peer, if it is read now (else
        log that it cannot go). Never waits; raises zmq.ZMQError where it cannot go."""
        identity = None if self._successions is None else self._successions.current.get(rank)
        reading = self._reading
        if identity is None or reading is None:
            log.debug("rank %d: no connection from rank %d to answer on", self.rank, rank)
            return
        # a ROUTER drops what it cannot route at once: this never waits
        self._send_back(reading[0], [identity, frame])

    def to_probe(self, watcher: int, identity: bytes | None, header: Header) -> None:
        """Send ``header`` on ``watcher``'s probe of this peer (``identity``: the probe's,
        None if this peer cannot reach it), and read the answer that comes back on it as
        ``watcher``'s. Never raises."""
        reading = self._reading
        if identity is None or reading is None:
            log.debug("rank %d: no connection to rank %d left to post a %s on", self.rank,
                      watcher, header.kind)
            return
        self._probers[identity] = watcher
        try:
            self._send_back(reading[0], [identity, encode_header(header)])
        except zmq.ZMQError as exc:
            log.debug("rank %d: %s to rank %d's probe not sent: %s", self.rank, header.kind,
                      watcher, exc)

    def unbind(self, endpoint: str) -> None:
        """Stop listening at ``endpoint`` (a peer found unreachable there: see .relayed)."""
        assert self._socket is not None
        self._socket.unbind(endpoint)
        self.endpoints.remove(endpoint)

    def closing(self) -> None:
        """The mesh is closing: a receive that fails from now on ends the reading."""
        self._closed = True

    def stop_census(self) -> None:
        if self._census is not None:
            self._census.stop()

    def close(self) -> None:
        """Close the ROUTER and clean up its endpoints."""
        self._closed = True
        if self._socket is not None:
            self._socket.close(linger=0)
            for endpoint in self.endpoints:
                self._policy.cleanup(endpoint)
