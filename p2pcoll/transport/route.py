"""Routes: how this peer sends to each other peer, and the budget of its links.

A :class:`Route` is this peer's way to one other: its *link* (a ZeroMQ DEALER connected to
the peer's ROUTER), opened the first time this peer sends to that peer, and, to a peer of
this host, the *lane sender* (:class:`~.ordering.LaneSender`) that moves messages between
the link and the shared-memory lane in order. (Large pieces to a peer of this host go
through this peer's shared-memory ring, which all its readers share: see :mod:`.shm`.)

:class:`Routes` is the table of them, and keeps the link budget (``P2PCOLL_MAX_LINKS``):
when a send needs a link this peer does not have and it holds ``budget`` links already, the
least recently used link that may go is closed first. A link may go when nothing waits for
room in its queue, it leads to no peer this one watches on the overlay (departures.overlay),
and it carries no shared-memory lane (whose order rests on the link's markers). A TCP lane
(:mod:`.tcp_lane`) goes with its link: ``lane off`` on the lane, then the link's end, so the
receiver reads the lane's tail before the end; the next link's hello names a new lane
(``lane_off``, ``lane_gone``). Its last message is an
``end``, and the next link to that peer is the next *generation* (its identity says so, see
:mod:`.links`), which the receiver reads only after that ``end``: the peer's messages stay in
the order they were sent. When every link must stay, the budget is exceeded rather than
waited for. A link closed for the budget is not a lost peer.

A closed link *drains*: what it still queues (up to its high-water mark) must reach a
receiver that may not be reading just then (a long step of its own), so no linger would
do. The receiver answers the ``end`` on the same connection once it has read it, and only
then is the socket closed (or when the peer is gone, or this peer closes). Until then it
holds its descriptors and counts against the budget: a send that needs a new link waits
while the budget is full of draining links (:meth:`Routes.room`), and so does a control
message, which the mesh defers until then (in the order posted). A peer whose last link
was answered has read everything this one sent it: a goodbye need not go to it
(:meth:`Routes.contacts`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Literal

import numpy as np
import zmq
import zmq.asyncio

from ..settings import MIN_LINKS
from .base import Counters, LinkEvent, LinkHandler
from .links import link_identity
from .ordering import LaneSender
from .paths import HANDSHAKE_TRIPS, Paths
from .sockets import SocketFactory, monitor
from .stripes import STRIPE_BYTES, Stripe, stripe_identity, turn

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["ENDED", "ZERO_COPY_BYTES", "Route", "Routes", "link_frames"]

# Payload pieces at least this large are sent zero-copy and tracked until libzmq lets go.
ZERO_COPY_BYTES = zmq.COPY_THRESHOLD


def link_frames(head: bytes, pieces: Sequence[np.ndarray], snapshot: bool,
                tracked: list[zmq.Frame]) -> tuple[list[object], int]:
    """A message's frames for its link, and its payload bytes on the wire (what
    :meth:`Routes.put` takes): small pieces copied, large ones as snapshots (``snapshot``)
    or zero-copy, their frames added to ``tracked``."""
    frames: list[object] = [head]
    size = 0
    for piece in pieces:
        if piece.nbytes < ZERO_COPY_BYTES:
            frames.append(piece.tobytes() if piece.nbytes else b"")
        elif snapshot:
            frames.append(zmq.Frame(piece, copy=True))
        else:
            frame = zmq.Frame(piece, copy=False, track=True)
            tracked.append(frame)
            frames.append(frame)
        size += piece.nbytes
    return frames, size

log = logging.getLogger("p2pcoll.transport")

_NOBLOCK = int(zmq.NOBLOCK)
ENDED = b"ended"  # a receiver's answer to a link's end, on that link

class Route:
    """This peer's way to one other peer (see the module docstring)."""

    __slots__ = ("conn", "generation", "lane", "link", "peer", "reader", "send_buffer",
                 "sharing", "stripes", "turn", "used", "width")

    def __init__(self, peer: int, link: zmq.asyncio.Socket, generation: int) -> None:
        self.peer = peer
        self.link = link
        self.conn = Stripe(link)  # the link as one connection of the route's (see .stripes)
        self.generation = generation
        self.lane: LaneSender[Sequence[Buffer]] | None = None  # once the peer's lane is ready
        self.used = 0  # when it last sent (Routes.clock): the least recently used goes first
        # reads what comes back on the link, once something may (see Routes.listen)
        self.reader: asyncio.Task[None] | None = None
        # Its connections: 0 while not decided (see Routes.put), else the link and
        # width - 1 stripes beside it, taken in turn (``turn``) by large messages.
        self.width = 0
        self.sharing = 0  # the peers driven at once when its width was decided (Routes.drive)
        self.stripes: list[Stripe] = []  # opened at their first turn
        self.turn = 0
        self.send_buffer = 0  # the stripes' SO_SNDBUF (0: autotuned; see .paths)

    @property
    def waiting(self) -> int:
        """Sends that wait for room in the link's queue."""
        return self.conn.waiting

    @property
    def busy(self) -> bool:
        """Whether a send waits for room on the link or a stripe."""
        return bool(self.conn.waiting or any(s.waiting for s in self.stripes))

    async def put(self, frames: list[object]) -> None:
        """Queue one message on the link: at once when its queue has room, which is the
        rule (a plain send, without pyzmq's asyncio future); else through the asyncio
        socket, which waits for room. While one such wait is pending, later messages wait
        behind it, so they stay in order."""
        sending = self.conn.enqueue(frames)
        if sending is not None:
            await sending

    def send_now(self, frame: object) -> bool:
        """Send a one-frame message now if the link's queue has room (and nothing waits
        before it); False otherwise."""
        if self.conn.waiting or self.link.closed:
            return False
        try:
            self.conn.plain.send(frame, _NOBLOCK)
        except zmq.Again:
            return False
        return True

    def close(self, linger: int | None = None) -> list[asyncio.Task[None]]:
        """Close the link and its stripes (``linger`` None: the factory's); the tasks that
        followed their connections, cancelled."""
        tasks = [self.conn.close(linger), *(s.close(linger) for s in self.stripes)]
        return [t for t in tasks if t is not None]


def least_queued(route: Route) -> int:
    """The connection of ``route`` (0: its link, i: its stripe i) that the next large
    message goes on: the one with the fewest bytes not yet acknowledged
    (:meth:`.stripes.Stripe.queued`; a stripe not opened yet has none), the first of them
    from ``route.turn`` on, so that connections alike are taken in turn. A connection that
    its congestion control holds back (BBR's round-trip probe keeps a few packets in
    flight for 200 ms) or whose window is smaller takes fewer messages than the others
    rather than an equal share, which its peer would wait for in order."""
    width = max(1, route.width)
    stripes = route.stripes
    best, least = route.turn % width, -1
    for k in range(width):
        i = (route.turn + k) % width
        if i > len(stripes):
            return len(stripes) + 1  # the next to open: nothing queued (they open in order)
        queued = (route.conn if i == 0 else stripes[i - 1]).queued()
        if least < 0 or queued < least:
            best, least = i, queued
            if not queued:
                break
    return best


def _connections(route: Route) -> int:
    """The connections of ``route`` that count against the budget: its link, its stripes,
    and those it has decided to open."""
    return max(1, route.width, 1 + len(route.stripes))


class Routes:
    """The routes of one peer (see the module docstring).

    Args:
        sockets: makes the links.
        counters: ``links_opened`` and ``links_closed`` are counted here.
        budget: the most links kept open (0: no bound), draining ones included.
        opened: called with each route whose link has just opened (this peer's hello
            goes first on a peer's first link; on a later one, if it names a new lane).
        heard: called with a route and a message that came back on its link other than
            the answer to its end, once it is read (see :meth:`listen`).
        on_link: told when a link opens, when one is closed for the budget, and when every
            link closed to a peer has drained (see :class:`~.base.LinkEvent`); and, of a
            striped route, when one of its connections goes down (see :mod:`.stripes`).
        streams: the connections a route to a peer over tcp spreads its large messages
            over: an int, or ``"auto"`` (from the path's round trip, see :mod:`.paths`).
        lane_off: called with a route whose link is about to close for the budget: moves
            its messages off its lane, or says False (the lane keeps the link).
        lane_gone: called with a route whose link has closed for the budget (its lane
            goes too).
    """

    def __init__(self, sockets: SocketFactory, counters: Counters, budget: int,
                 opened: Callable[[Route], None],
                 heard: Callable[[Route, list[zmq.Frame]], None],
                 on_link: LinkHandler, streams: int | Literal["auto"] = 1,
                 lane_off: Callable[[Route], bool] = lambda route: route.lane is None,
                 lane_gone: Callable[[Route], None] = lambda route: None) -> None:
        if budget and budget < MIN_LINKS:
            raise ValueError(f"a link budget of {budget} is below {MIN_LINKS}")
        self.sockets = sockets
        self.counters = counters
        self.budget = budget
        self.opened = opened
        self.heard = heard
        self.on_link = on_link
        self.streams = streams
        self.lane_off, self.lane_gone = lane_off, lane_gone
        self.paths = Paths()  # round trips measured as links open; bandwidths fed in
        self.routes: dict[int, Route] = {}
        # Links closed for the budget whose end the peer has not answered yet, each with
        # the task that waits for the answer: (peer, generation) -> (route, task).
        self.draining: dict[tuple[int, int], tuple[Route, asyncio.Task[None]]] = {}
        self._generations: dict[int, int] = {}  # peer -> links opened to it so far
        self._gone: set[int] = set()  # the peers gone (see forget): they answer no end
        self.clock = itertools.count(1)  # ticks of use: Route.used
        self._secret = self._nonce = ""
        self._rank = -1
        self._endpoints: tuple[str, ...] = ()
        self._striped: dict[int, bool] = {}  # peer -> whether its route may have stripes
        self._remote: frozenset[int] = frozenset()  # the peers over tcp on other hosts
        self._pinned: frozenset[int] = frozenset()
        self._end = b""
        # The remote peers the running collective sends to at once (see drive): 0 until a
        # collective says, then each route's width follows it.
        self.sharing = 0
        self._driven: frozenset[int] = frozenset()

    def start(self, rank: int, secret: str, nonce: str, endpoints: Sequence[str],
              pinned: Collection[int], end: bytes, hosts: Sequence[str] = ()) -> None:
        """The group is known: this peer's rank, the link secret, its nonce, every peer's
        endpoint, the peers whose links always stay (those it watches), the encoded
        ``end`` message that closes a link, and every peer's host (if known: ``auto``
        stripes no link to a peer of this host)."""
        self._rank, self._secret, self._nonce = rank, secret, nonce
        self._endpoints = tuple(endpoints)
        known = len(hosts) == len(endpoints)
        # Peers over tcp on another host (or on one not known): their paths may be long.
        self._remote = frozenset(
            peer for peer, endpoint in enumerate(endpoints)
            if endpoint.startswith("tcp://") and not (known and hosts[peer] == hosts[rank]))
        self._striped = {
            peer: self.streams != 1 and endpoint.startswith("tcp://") and (
                self.streams != "auto" or peer in self._remote)
            for peer, endpoint in enumerate(endpoints)}
        self._pinned = frozenset(pinned)
        self._end = end

    def pin(self, peers: Collection[int]) -> None:
        """The peers whose links always stay are these now (the watched ones change as
        peers go)."""
        self._pinned = frozenset(peers)

    def identity(self, generation: int = 0) -> bytes:
        """The identity of this peer's links of that generation (holds the secret)."""
        return link_identity(self._rank, self._secret, self._nonce, generation)

    def get(self, dst: int) -> Route:
        """The route to ``dst``, its link opened now if it has none (closing the least
        recently used link that may go, if the budget is full).

        Raises:
            ValueError: ``dst`` is not another member's rank.
            OSError: out of file descriptors (see :meth:`SocketFactory._socket`).
        """
        route = self.routes.get(dst)
        if route is None:
            route = self._open(dst)
        route.used = next(self.clock)
        return route

    def contacts(self) -> set[int]:
        """The peers that may not have read everything this one sent them: those it has
        a link to, and those whose closed link has not drained."""
        return set(self.routes) | {peer for peer, _ in self.draining}

    def __len__(self) -> int:
        return len(self.routes)

    def held(self) -> int:
        """The connections that count against the budget: every open or draining link
        and each of its stripes."""
        return (sum(_connections(r) for r in self.routes.values())
                + sum(_connections(r) for r, _ in self.draining.values()))

    def measure(self, peer: int, rtt_s: float | None = None,
                bandwidth_Bps: float | None = None) -> None:
        """A measurement of the path to ``peer`` (a probe of the topology, say; None: not
        measured): under ``auto``, the route to it decides its width again at its next
        large message. Its stripes follow the turns, so their number may change between
        any two messages: one no longer taken stays open, idle, until the link closes."""
        self.paths.measure(peer, rtt_s, bandwidth_Bps)
        route = self.routes.get(peer)
        if route is not None and self.streams == "auto" and self._striped.get(peer):
            route.width = 0
            route.turn = 0

    def drive(self, peers: frozenset[int]) -> None:
        """The collective about to run sends to ``peers`` (:meth:`.base.Paths.drive`): the
        remote ones among them share this host's line, so under ``auto`` each route to one
        decides its width again at its next large message, for that many peers at once
        (:func:`.paths.choose_streams`: a ring's one neighbour takes the host's share of
        stripes alone, a direct exchange's p - 1 peers split it). A collective with no
        remote peer to send to changes nothing. Never raises."""
        if peers is self._driven:  # the same program again (the usual case): nothing new
            return
        self._driven = peers
        remote = len(peers & self._remote)
        if remote:
            self.sharing = remote

    def path(self, peer: int) -> tuple[float | None, float | None]:
        """``(round-trip seconds, bytes/s)`` measured of the path to ``peer``, None for
        what is not; both None for a peer of this host (see :meth:`start`)."""
        if peer not in self._remote:
            return None, None
        return self.paths.rtt(peer), self.paths.bandwidth(peer)

    async def put(self, route: Route, frames: list[object], nbytes: int) -> None:
        """Queue one message of ``nbytes`` payload bytes on ``route``: on its link, or, if
        it is large and the route striped, on the connection whose turn it is, announced
        on the link (see :mod:`.stripes`). The route's width is decided at its first large
        message (under ``auto``, once its link's handshake has measured the round trip;
        until then large messages go on the link), and each stripe opens at its first
        turn (a stripe that never carries anything would look like a stranger's
        connection to the peer's census).

        Cancellation: as :meth:`Route.put`; a message may be queued on a stripe and its
        turn not, or the reverse (the caller breaks the group on cancellation anyway).
        """
        if nbytes >= STRIPE_BYTES and (route.width == 0 or route.sharing != self.sharing):
            self._widen(route)
        if nbytes < STRIPE_BYTES or route.width <= 1:
            await route.put(frames)
            return
        stripes = route.stripes
        i = least_queued(route)
        route.turn = (i + 1) % max(1, route.width)
        if i == 0:
            sending = route.conn.enqueue(frames, nbytes)
            if sending is not None:
                await sending
            return
        if i > len(stripes):
            self._open_stripe(route)
        # The turn on the link and the message on the stripe each take their place in
        # their connection's order now, before anything is awaited (see Stripe.enqueue).
        announced = route.conn.enqueue([turn(i)])
        sending = stripes[i - 1].enqueue(frames, nbytes)
        if announced is not None:
            await announced
        if sending is not None:
            await sending

    def _widen(self, route: Route) -> None:
        """Decide how many connections ``route`` has (see :meth:`put`), again whenever the
        collective that runs drives another number of remote peers (:meth:`drive`); under
        ``auto`` with the round trip still unknown, decide later. (A route at width 1 for
        a program of many peers, the direct exchange's, widens again for a ring's one.)"""
        peer = route.peer
        route.sharing = self.sharing
        if not self._striped[peer]:
            route.width = 1
            return
        # Under auto, a pair's links share this host's line with those to the other peers
        # the collective drives at once (drive): a ring one, a direct exchange all of them,
        # so each pair takes its share of the product and of the cap (see
        # paths.choose_streams). Before any collective says, two of them. Measured at p = 4,
        # 1 Gbit/s, 100 ms: the ring at 4 per pair over 6 and 8 (paths.MAX_AUTO_STREAMS).
        sharing = self.sharing or max(1, min(2, len(self._remote)))
        width = (self.paths.streams(peer, sharing) if self.streams == "auto"
                 else self.streams)
        if width is None:
            return
        if self.budget:  # stripes count against the budget, and take only what is left
            others = self.held() - _connections(route)
            width = max(1, min(width, max(self.budget - others, 1 + len(route.stripes))))
        first = route.width == 0
        if width != route.width:
            route.width, route.turn = width, 0
        if width > 1:
            route.send_buffer, capped = self.paths.send_buffer(peer, width)
            self.counters.socket_buffers_capped += capped and first

    def _open_stripe(self, route: Route) -> None:
        """Open ``route``'s next stripe."""
        index = len(route.stripes) + 1
        identity = stripe_identity(self.identity(route.generation), index)
        stripe = Stripe(self.sockets.mesh_link(identity, send_buffer=route.send_buffer))
        self._watch(route, stripe)
        stripe.socket.connect(self._endpoints[route.peer])
        route.stripes.append(stripe)
        self.counters.stripes_opened += 1

    def _watch(self, route: Route, conn: Stripe) -> None:
        """Follow a connection of ``route``: its handshake measures the path's round trip;
        going down while the route is striped breaks the route (a lost peer)."""
        trips = HANDSHAKE_TRIPS[self.sockets.secure]
        peer = route.peer

        def measured(seconds: float) -> None:
            self.paths.handshake(peer, seconds / trips)

        def down() -> None:
            if route.stripes and (self.routes.get(peer) is route or any(
                    r is route for r, _ in self.draining.values())):
                log.warning("rank %d: a connection of the striped link to rank %d went "
                            "down: the link is broken", self._rank, peer)
                self.on_link(peer, LinkEvent.DOWN)

        conn.watch(time.monotonic(), measured, down, monitor)

    def listen(self, route: Route) -> None:
        """Read what comes back on ``route``'s link from now on (a link is read only once
        something may come back: answers to a leaving peer's goodbye, or to its news, or
        to a closed link's end): each message goes to ``heard``, and the answer to the
        link's end, if it is closed for the budget, lets it close. Idempotent."""
        if route.reader is None:
            route.reader = asyncio.create_task(self._read(route))

    def forget(self, peer: int) -> None:
        """``peer`` has gone: its draining links close now, whatever they still queue (it
        will not answer their ends). Its open link stays: what goes on it now says why
        (an abort, a goodbye) to a peer that may only seem gone (a cut connection); if the
        budget needs it, it closes at once, undrained (see :meth:`_make_room`)."""
        self._gone.add(peer)
        for key in [key for key in self.draining if key[0] == peer]:
            drained, task = self.draining.pop(key)
            task.cancel()
            drained.close(linger=0)

    def full(self) -> bool:
        """Whether a new link must wait (:meth:`room`): the budget is full and some of it
        drains."""
        return bool(self.budget and self.draining and self.held() >= self.budget)

    async def room(self) -> None:
        """Wait while the budget is full and some of it drains: until a closed link's peer
        has answered (a root that sends to every peer in turn would otherwise hold a
        draining link to each). Every new link waits here (the mesh defers a control
        message that needs one); only when every link must stay is the budget exceeded."""
        while self.full():
            await asyncio.wait([task for _, task in self.draining.values()],
                               return_when=asyncio.FIRST_COMPLETED)

    async def drained(self) -> None:
        """Wait until no link drains: each closed link's peer has answered its end (or is
        gone). Cancellation: nothing is lost; the links go on draining."""
        while self.draining:
            await asyncio.wait([task for _, task in self.draining.values()])

    def check(self, dst: int) -> None:
        """Raises ValueError unless ``dst`` is another member's rank."""
        if not 0 <= dst < len(self._endpoints) or dst == self._rank:
            raise ValueError(f"no link to rank {dst} (rank {self._rank} of "
                             f"{len(self._endpoints)})")

    def _open(self, dst: int) -> Route:
        self.check(dst)
        if self.budget and self.held() >= self.budget:
            self._make_room()
        generation = self._generations.get(dst, 0)
        link = self.sockets.mesh_link(self.identity(generation))
        route = Route(dst, link, generation)
        if self._striped[dst] or dst in self._remote:
            # The round trip (for auto, and the pipeline's window); a break, if striped.
            self._watch(route, route.conn)
        link.connect(self._endpoints[dst])
        self.routes[dst] = route
        self._generations[dst] = generation + 1
        self.counters.links_opened += 1
        self.on_link(dst, LinkEvent.OPENED)
        self.opened(route)
        return route

    def _make_room(self) -> None:
        """Close the least recently used link that may go; none may: keep them all."""
        pinned = self._pinned
        for route in sorted(self.routes.values(), key=lambda r: r.used):
            if route.peer in pinned or route.busy or not self.lane_off(route):
                continue
            if route.peer in self._gone:
                # Its peer will answer no end: the link closes now (what it queues gets
                # the linger). Drained, it would hold the budget for good, and a send that
                # waits for room (see room) would wait for ever.
                del self.routes[route.peer]
                if route.reader is not None:
                    route.reader.cancel()
                route.close()
                self.lane_gone(route)
                self.counters.links_closed += 1
                return
            if not route.send_now(self._end):  # its queue is full: it is busy
                continue
            del self.routes[route.peer]
            self.lane_gone(route)
            key = (route.peer, route.generation)
            self.listen(route)
            assert route.reader is not None
            self.draining[key] = (route, route.reader)
            self.counters.links_closed += 1
            self.on_link(route.peer, LinkEvent.CLOSED)
            return

    async def _read(self, route: Route) -> None:
        """Read a link (see :meth:`listen`); close it once its peer has answered its end
        (see the module docstring). A link closed under its reader ends it (a ZMQError, or
        an OSError for a descriptor closed under the poller)."""
        with contextlib.suppress(zmq.ZMQError, OSError):
            while True:
                frames = await route.link.recv_multipart(copy=False)
                if len(frames) == 1 and frames[0].bytes == ENDED:
                    break
                self.heard(route, frames)
            route.close(linger=0)  # its stripes were read before its end
        peer = route.peer
        if self.draining.pop((peer, route.generation), None) is not None:
            if not any(p == peer for p, _ in self.draining):
                self.on_link(peer, LinkEvent.DRAINED)

    def close(self) -> list[asyncio.Task[None]]:
        """Close every link (what they queue gets the factory's linger); the tasks that
        read links, cancelled, to be awaited."""
        tasks = []
        for route in self.routes.values():
            if route.reader is not None:
                route.reader.cancel()
                tasks.append(route.reader)
            tasks.extend(route.close())
        self.routes.clear()
        for route, task in self.draining.values():
            task.cancel()
            tasks.extend(route.close())
            tasks.append(task)
        self.draining.clear()
        return tasks
