"""The peer mesh: one bound ROUTER per peer for receiving, one route per peer it sends to.

:class:`ZmqMesh` composes four parts, each owning its state, and keeps what joins them: the
group's forming (hellos), control messages (posted, deferred under the budget, answered) and
leaving, the placement of ``send_many``, closing.

- **The router** (:mod:`.router`): this peer's ROUTER, read in a callback on its ZMQ_FD;
  every message arrives with the identity of the link it came on, which fixes its source
  (``impostor`` and ``stranger`` links are dropped), a rank's successive links are read in
  the order it opened them, and the census counts connections that are no member's.
- **The routes** (:mod:`.route`): rank r connects a DEALER link (identity ``b"r@<link
  secret>@<nonce>@<generation>"``, see :mod:`.links`) to another peer's ROUTER the first time
  it sends to that peer: links open on demand, so a peer's sockets, descriptors and memory
  grow with the peers its collectives talk to (a ring: two; recursive doubling: log2 p), not
  with the group; under a link budget (``P2PCOLL_MAX_LINKS``) the least recently used idle
  link is closed and opened again when needed. Each link has its own ZeroMQ queue with a
  high-water mark, which gives backpressure per destination. The first message on a peer's
  first link is this peer's hello (what the receiver needs to map its shared memory), once
  the group has formed.
- **Liveness** (:mod:`.liveness`) rests on a sparse overlay (departures.overlay): each rank
  watches its two ring successors with a probe (the departures machine says whom:
  :meth:`ZmqMesh.follow`), a connection that carries only ZMTP heartbeats, so that a peer
  that dies is seen at once by its watchers, one that freezes after the heartbeat timeout,
  and one that is merely slow (its queue full) not at all; the departures machine spreads
  the news to everyone. Probes and their monitors are a constant number per peer, whatever
  the size of the group.
- **The same-host paths** (:mod:`.same_host`): between peers of one host, large pieces go
  through the sender's shared-memory ring and whole messages through lanes, in each
  sender's order across socket and lane; small collectives of a group all on one host go
  on its board.

The hot path bypasses pyzmq's asyncio layer: the ROUTER is read in a callback (see
:mod:`.router`) and a send to a link whose queue has room is a plain non-blocking send (only
a send that meets the high-water mark waits, through the asyncio socket). Every message of a
member passes through the one validation point (:func:`p2pcoll.wire.validate`, see
:mod:`.inbound`) before it is handed to ``on_message``; a message that fails it, or whose
handling raises anything at all, is dropped, counted and logged (at most one line per source
every few seconds), and the reader goes on. Sockets come from the
:class:`~.sockets.SocketFactory`, which owns their options.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import secrets
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import zmq

from ..departures import Forget, Unwatch, Via, Watch, overlay
from ..errors import PeerLost, ProtocolError
from ..relay.names import is_relay
from ..settings import Settings
from ..types import Membership
from ..wire import Header, Limits, encode_header
from . import board as boards
from . import lane, shm, shmfile
from .base import (
    Counters, Drops, Follow, LinkEvent, LinkHandler, MessageHandler, MessageHook, Paths, PathsOf,
    Poll,
)
from .endpoints import EndpointPolicy, sweep_peer
from .inbound import Inbound
from .links import link_identity
from .liveness import Probes
from .malloc import tune_malloc
from .ordering import marker_value as _marker
from .route import ZERO_COPY_BYTES, Route, Routes, link_frames
from .router import Router
from .same_host import RING_WAIT_S as RING_WAIT_S  # (tests take it and _put from here)
from .same_host import SameHost, ring_put as _put
from .sockets import SocketFactory

if TYPE_CHECKING:  # both imported where a roster names a relay: most groups have none
    from ..relay.server import Relay
    from .relayed import RelayPaths

log = logging.getLogger("p2pcoll.transport")


def _misplaced(header: Header) -> None:
    """A farewell on a member's link to this peer: it answers a bye and comes back on the
    connection the bye went on (a link of this peer's, a watcher's probe), never here."""
    raise ProtocolError(f"rank {header.src} sent a farewell on its own link",
                        reason="unexpected")


def _discard_outcome(fut: asyncio.Future[object]) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.debug("control message not sent: %s", fut.exception())


class ZmqMesh:
    """The production transport: frames between the peers of one group over ZeroMQ; a
    :class:`~.router.Router`, :class:`~.route.Routes`, :class:`~.liveness.Probes` and
    :class:`~.same_host.SameHost` composed (see the module docstring)."""

    sent: MessageHook | None = None  # instrumentation hooks: see p2pcoll.transport.base
    delivered: MessageHook | None = None

    def __init__(self, policy: EndpointPolicy, host: str, settings: Settings,
                 sockets: SocketFactory | None = None) -> None:
        self.policy = policy
        self.name = policy.name
        self.host = host
        self.settings = settings
        self.sockets = sockets or SocketFactory()
        self.on_message: MessageHandler = lambda header, pieces: None
        self.on_link: LinkHandler = lambda peer, event: None
        self.counters = Counters()
        self.drops = Drops(self.counters, lambda: self.rank)
        self.group_id = ""
        self.rank = -1
        self._limits: Limits | None = None
        # The paths to the peers of this host: rings, lanes, the board (see .same_host).
        local = self._local = SameHost(self.drops,
                                       lambda peer: self.on_link(peer, LinkEvent.DOWN))
        self._lane_put = local.lane_put  # bound once: every send tries the lane first
        # A goodbye is answered on the connection it came on (see _answer): the farewells
        # that come back from a watcher's probe it said goodbye on are read here, and
        # nothing else; a bye over the probe of a peer this one watches likewise. What
        # comes back on this peer's links (see _heard_back): farewells, goodbyes said back
        # on them, and news that this peer was declared lost.
        self._answers = Inbound(self, kinds={"farewell", "bye"})
        self._back = Inbound(self, kinds={"farewell", "bye", "gone"},
                             watch={"farewell": self._answered_back, "bye": self._answered_back})
        self._byes = Inbound(self, kinds={"bye"})
        # This peer's ROUTER: every member's links, read in their order (see .router).
        self._router = Router(self.sockets, policy, self.counters, self.drops,
                              take_in=local.take_in, answered=self._answers.accept,
                              heard=self._heard_from)
        self.endpoints: list[str] = self._router.endpoints
        # Every message, once its link's member is known, goes through this (see .inbound):
        # lane markers come back to the ordering, hellos are looked at on the way.
        self._inbound = Inbound(self, keep={"lane": _marker, "end": self._router.on_end,
                                            "farewell": _misplaced},
                                watch={"hello": local.on_hello}, resolve=local.pieces)
        local.accept = self._inbound.accept  # what the same host's paths hand messages to
        self._leaving = False  # no link opens any more (see leaving)
        self._bye_on_link: set[int] = set()  # whose goodbye came back on this peer's link
        self._nonce = secrets.token_hex(8)  # this peer's nonce (see .links)
        self._secret = ""  # the group's link secret: never log
        self.identity = b""  # of this peer's first links; holds the secret: never log
        # The routes to the peers this one sends to (links on demand, within the budget).
        self.routes = Routes(self.sockets, self.counters, settings.max_links,
                             opened=self._opened, heard=self._heard_back,
                             on_link=self._link_event, streams=settings.streams,
                             lane_off=local.lane_off, lane_gone=local.lane_gone)
        self.paths: Paths = PathsOf(self.routes.path, self.routes.drive,  # Transport.paths
                                    self.routes.measure, self.routes.paths.buffers.window)
        # Heartbeat-only links to the watched peers (see .liveness).
        self._probes = Probes(self.sockets, lambda peer: self._link_event(
            peer, LinkEvent.PROBE_DOWN), self._bye_on_probe)
        self._gone: set[int] = set()  # peers the session has told this one are gone
        self._watched: set[int] = set()  # the peers this one watches (see follow)
        self._peer_endpoints: tuple[str, ...] = ()
        self._hello: Header | None = None  # sent first on every link opened after greet()
        # The peers whose hellos the group's forming waits for (see hello_peers).
        self.hello_peers: frozenset[int] = frozenset()
        self._greeted: frozenset[int] = frozenset()  # whom greet() says hello to at once
        self._tasks: list[asyncio.Task[None]] = []
        # Control messages that need a new link while the budget is full of draining ones,
        # in the order posted, and the task that sends them as room comes (see post).
        self._deferred: collections.deque[tuple[int, Header]] = collections.deque()
        self._deferring: asyncio.Task[None] | None = None
        self._closed = False
        self._monitored = False
        self._snapshot_all = False  # over inproc every large piece goes as a snapshot
        self._relay: RelayPaths | None = None  # the paths through relays, if any (.relayed)
        self._kept: list[Relay] = []  # relays this peer serves (see keep_relay)
        tune_malloc(settings.tune_malloc)

    async def bind(self) -> list[str]:
        """Bind this peer's ROUTER and return the endpoints the others may connect to."""
        return self._router.bind(self.host)

    def connect(self, membership: Membership, on_message: MessageHandler,
                on_link: LinkHandler) -> Poll:
        """Start reading; links open as they are first sent to (see Transport.connect)."""
        assert self._router.bound, "bind() first"
        self.on_message, self.on_link = on_message, on_link
        group_id, rank, endpoints = membership.group_id, membership.rank, membership.endpoints
        self.group_id, self.rank = group_id, rank
        self._limits = Limits(group_id, rank, membership.world_size,
                              self.settings.max_message_bytes)
        self._inbound.limits = self._answers.limits = self._byes.limits = self._limits
        self._back.limits = self._limits
        secret = self._secret = membership.secret or group_id  # in-process tests have none
        size = membership.world_size
        self._router.start(rank, size, secret)
        reach = endpoints  # peers behind a relay are reached through it (see .relayed)
        if any(is_relay(e) for e in endpoints):
            from .relayed import RelayPaths
            self._relay = RelayPaths(membership, self._router,
                                     self.settings.heartbeat_timeout, self._relay_lost,
                                     self.counters)
            reach = self._relay.endpoints
        self.routes.start(rank, secret, self._nonce, reach,
                          pinned=(), end=encode_header(Header("end", group_id, rank)),
                          hosts=membership.hosts)
        self.identity = self.routes.identity()
        # Heartbeats and monitors need a real connection; inproc has neither. Over inproc a
        # zero-copy frame is shared with the receiver until it frees it, so two peers that
        # each hold the other's frame while waiting to reuse their own would deadlock:
        # inproc sends snapshots (copies owned by libzmq, nobody waits for them) instead.
        inproc = self.policy.name == "inproc"
        self._monitored = not inproc
        self._snapshot_all = inproc
        near = {
            peer for peer, endpoint in enumerate(endpoints)
            if peer != rank and endpoint.startswith("ipc://")
        }
        if near and not inproc and self.settings.shm and shm.available():
            # Peers reached over ipc share this host (see .same_host).
            self._local.open(membership, near, self.settings.shm_bytes)
        if self.settings.tcp_lanes and not self.sockets.secure and self._relay is None:
            self._local.open_far(membership, self.endpoints)  # other hosts' (see .tcp_lane)
        self._peer_endpoints = tuple(reach)
        # A group on a board wakes every peer through its wake-up pipe, which a peer opens
        # from the other's hello: there every peer greets every other (a board group is
        # small, see board.MAX_BOARD_RANKS). Elsewhere only the overlay's neighbours.
        if self._local.on_board():
            self.hello_peers = self._greeted = frozenset(range(size)) - {rank}
        else:  # hellos go to the peers this one watches, and come from those watching it
            self.hello_peers = frozenset(overlay.watchers(rank, size))
            self._greeted = frozenset(overlay.watched(rank, size))
        self._tasks.append(asyncio.create_task(
            self._router.read(self._local.wakeup, self._local.on_wake)))
        if self._router.counts_links:
            # A member connects at most its link and, if it watches this peer, its probe:
            # what comes beyond is no member's link (counted as links_refused; LinkCensus).
            members = size - 1 + len(overlay.watchers(rank, size))
            self._tasks.append(asyncio.create_task(
                self._router.census(members, lambda: len(self._gone))))
        return self._local.poller(self._router.poll)

    @property
    def board(self) -> boards.Board | None:
        """The group's board, when every peer shares this host (see .same_host)."""
        return self._local.board

    @property
    def _lanes(self) -> lane.Lanes | None:
        """This peer's lanes (for tests: see .same_host)."""
        return self._local.lanes

    def keep_relay(self, relay: Relay) -> None:  # its rendezvous's: serve until closed
        self._kept.append(relay)

    def _relay_lost(self, why: str) -> None:  # the peers reaching this one through it: lost
        for peer in sorted(self.counters.relayed):
            self._link_event(peer, LinkEvent.DOWN)

    def _link_event(self, peer: int, event: LinkEvent) -> None:
        if not self._closed:
            self.on_link(peer, event)

    def _heard_from(self, peer: int) -> None:
        self._link_event(peer, LinkEvent.HEARD)
        if self._monitored:  # its nonce is known: so is its probe's identity
            self._link_event(peer, LinkEvent.PROBE_KNOWN)

    @property
    def links(self) -> int:
        """How many data links this peer has open (probes not counted)."""
        return len(self.routes)

    @property
    def probes(self) -> int:
        """How many heartbeat probes this peer keeps (the peers it watches)."""
        return len(self._probes)

    def _bye_on_probe(self, peer: int, frames: list[zmq.Frame]) -> None:
        """A watched peer with no link to this one said goodbye on this peer's probe."""
        self._byes.accept(peer, frames[0].buffer, frames[1:])

    def follow(self, action: Follow) -> None:
        """Carry out a departures action (see Transport.follow): open or close a probe
        (the watched peers' links stay under the budget: see .route), let go of a peer
        that has gone, or leave."""
        if self._closed or self.rank < 0:
            return
        if isinstance(action, Watch):
            self._watch(action.peer, action.late)
        elif isinstance(action, Unwatch):
            self._watched.discard(action.peer)
            self.routes.pin(self._watched)
            self._probes.close(action.peer)
        elif isinstance(action, Forget):
            self._forget(action.peer, action.graceful)
        else:
            self._leave()

    def _watch(self, peer: int, late: bool) -> None:
        self._watched.add(peer)
        self.routes.pin(self._watched)
        if self._monitored and peer not in self._probes:  # (inproc has no heartbeats)
            self._probes.open(peer, self._peer_endpoints[peer], self.identity + b"~probe",
                              late=late)

    def _forget(self, rank: int, graceful: bool) -> None:
        """``rank`` has gone: let go of what this peer kept for it and, unless it said
        goodbye (``graceful``: it removed its own; a sweep lists two folders, which for
        every goodbye made a 64-peer group's close 1-2 s slower), the files it left here."""
        if rank in self._gone or rank == self.rank:
            return
        self._gone.add(rank)
        self.routes.forget(rank)
        self._router.forget(rank)
        self._local.forget(rank)
        removed = [] if graceful else sweep_peer(self._peer_endpoints[rank], shmfile.SHM_DIR)
        if removed:
            log.debug("rank %d: removed %d files rank %d left", self.rank, len(removed), rank)

    def _opened(self, route: Route) -> None:
        """A route's link has opened: its first message is the hello once the group is
        greeted (on a link opened again, only to name a new TCP lane)."""
        if self._hello is not None:
            self._post_hello(route.peer, again=route.generation > 0)

    async def send(
        self, dst: int, header: Header, payload: Sequence[np.ndarray] = (), *, copy: bool = False
    ) -> zmq.MessageTracker | None:
        """Queue one message to ``dst``; see :meth:`send_many`."""
        return await self.send_many([dst], [header], payload, copy=copy)

    async def send_many(
        self, dsts: Sequence[int], headers: Sequence[Header], payload: Sequence[np.ndarray] = (),
        *, copy: bool = False,
    ) -> zmq.MessageTracker | None:
        """Queue one message with the same payload to each of ``dsts`` (one header each).

        Payload pieces of ZERO_COPY_BYTES and more go to peers of this host through the
        shared-memory ring, copied in once for all of them (see :mod:`.shm`); to the others
        zero-copy, and then a tracker is returned and the arrays must not be written until
        ``tracker.done``. With ``copy`` they go as snapshots instead: libzmq copies them into
        buffers it owns (one copy, and no release to track: a tracked frame's release goes
        through pyzmq's garbage-collector thread, which must take the GIL), and the arrays
        may be written as soon as this returns. Returns None when nothing needs waiting
        for. Smaller pieces are always copied.

        Raises:
            PeerLost: a destination has left, or this peer has closed.
        Cancellation: some destinations may have been sent the message and others not;
        ring space reserved for the others stays taken until the group closes (the
        caller breaks the group on cancellation anyway).
        """
        table = self.routes.routes
        if len(dsts) == 1:
            # The usual small message: one destination whose lane is open (a peer of
            # another host, or of this one without its ring): no ring to place pieces in,
            # no loop over destinations.
            dst = dsts[0]
            route = table.get(dst)
            rings = self._local.rings
            if (route is not None and route.lane is not None
                    and (rings is None or dst not in rings.peers)):
                header = headers[0]
                header.nbytes = nbytes = [a.nbytes for a in payload]
                head = encode_header(header)
                route.used = next(self.routes.clock)  # (as _link does)
                tracked: list[zmq.Frame] = []
                if not self._lane_put(route, [head, *payload]):
                    frames, size = link_frames(head, payload, copy or self._snapshot_all,
                                               tracked)
                    await self.routes.put(route, frames, size)
                elif header.kind == "data":
                    self.counters.messages_sent_lane += 1
                self._count(dst, header, sum(nbytes), 0)
                return zmq.MessageTracker(*tracked) if tracked else None
        for dst in dsts:  # a bad rank fails before anything is sent (and opens nothing)
            if dst not in table:
                self.routes.check(dst)
                if self._closed or self._leaving:
                    raise self._cannot_link(dst)
        nbytes = [a.nbytes for a in payload]
        # Which of dsts read this peer's ring (see .same_host), inline: once per message.
        rings = self._local.rings
        near = rings.readers(dsts) if rings is not None else []
        outbox = rings.outbox if near and rings is not None else None
        # Where each piece went in the ring: (offset, reader indices), or None.
        placed: list[tuple[int, list[int]] | None] = []
        for piece in payload:
            spot = None
            if outbox is not None and piece.nbytes >= ZERO_COPY_BYTES:
                spot = await _put(outbox, piece, near)  # None: the ring stayed full
            placed.append(spot)
        tracked = []
        snapshot = copy or self._snapshot_all
        in_ring, total, c = any(placed), sum(nbytes), self.counters
        for dst, header in zip(dsts, headers, strict=True):
            header.nbytes = nbytes
            inline, ringed = payload, 0  # (across hosts nothing is in a ring)
            if in_ring and outbox is not None:
                inline, header.shm, ringed = shm.split(dst, payload, placed, near, outbox.name)
            head = encode_header(header)
            if dst not in self.routes.routes:
                await self.routes.room()  # the budget full of draining links: one drains
            # No await between taking the route and queueing on it (see .route's budget).
            route = self._link(dst)
            if self._lane_put(route, [head, *inline]):
                c.messages_sent_lane += header.kind == "data"
            else:
                frames, size = link_frames(head, inline, snapshot, tracked)
                await self.routes.put(route, frames, size)
            self._count(dst, header, total, ringed)
        return zmq.MessageTracker(*tracked) if tracked else None

    def _count(self, dst: int, header: Header, total: int, ringed: int) -> None:
        """Count one message sent (a data message's, and tell the ``sent`` hook)."""
        if header.kind == "data":
            c = self.counters
            c.messages_sent += 1
            c.bytes_sent += total
            c.bytes_sent_shm += ringed
            if self.sent is not None:
                self.sent(dst, header, total)

    def _link(self, dst: int) -> Route:
        """The route to ``dst``, its link opened if need be.

        Raises:
            PeerLost: this peer has closed.
            ValueError: ``dst`` is no other member's rank.
        """
        routes = self.routes
        route = routes.routes.get(dst)
        if route is None:
            if self._closed or self._leaving:
                raise self._cannot_link(dst)
            return routes.get(dst)
        route.used = next(routes.clock)  # for the budget: the least recently used goes first
        return route

    def _cannot_link(self, dst: int) -> PeerLost:
        why = "closed" if self._closed else "left its group"
        return PeerLost(f"cannot send to rank {dst}: this peer has {why}", dst)

    def post(self, dst: int, header: Header, via: Via = "link") -> None:
        """Send a control message (no payload) without waiting; never raises (see
        Transport.post for ``via``).

        One that needs a new link while the budget is full of draining links goes once
        there is room, after those deferred before it, so that a burst of them (an
        inquiry to every peer, the news of a loss) keeps the budget as a send does: a
        link each that opens and then drains, not all at once."""
        if self._closed or self.rank < 0:
            return
        if via == "answer":
            self._answer(dst, header)
        elif via == "probe":
            self._post_to_probe(dst, header)
        elif not self._leaving and dst not in self.routes.routes and (
                self._deferred or self.routes.full()):
            self._deferred.append((dst, header))
            if self._deferring is None:
                self._deferring = asyncio.create_task(self._post_deferred())
        else:
            self._post(dst, header)

    async def _post_deferred(self) -> None:
        try:
            while self._deferred:
                await self.routes.room()
                if self._closed:
                    return
                self._post(*self._deferred.popleft())
        finally:
            self._deferring = None

    def _post(self, dst: int, header: Header) -> None:
        """Post on this peer's link to ``dst``: opened if need be, unless this peer is
        leaving. After news, the link is read: a peer that declared this one lost answers
        it there (see departures.machine)."""
        if self._leaving and dst not in self.routes.routes:
            log.debug("rank %d: leaving, with no link to rank %d for a %s", self.rank, dst,
                      header.kind)
            return
        try:
            route = self.routes.get(dst)
        except (ValueError, OSError, zmq.ZMQError) as exc:
            log.debug("control message to rank %d not sent: %s", dst, exc)
            return
        link = route.link
        if link.closed:
            return
        if header.kind == "gone":
            self.routes.listen(route)
        frame = encode_header(header)
        if self._lane_put(route, [frame]):
            return
        try:
            sent = link.send(frame, zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.debug("control message to rank %d not sent: %s", dst, exc)
            return
        # An asyncio socket reports a full queue (EAGAIN) through the returned future.
        sent.add_done_callback(_discard_outcome)

    def _answer(self, rank: int, header: Header) -> None:
        """Post back on the connection the last message from ``rank`` came on: its link to
        this peer (through this peer's ROUTER, as an ``end`` is answered), or, for a
        goodbye that came on this peer's probe of ``rank``, that probe. A peer forgotten
        is answered all the same, once (a stalled peer told it was declared lost): a
        ROUTER drops what it cannot route at once, so nothing waits on a dead peer, and
        no link to it opens. Never raises."""
        if rank in self._bye_on_link:
            return  # (a goodbye said back on this peer's own link is not answered)
        frame = encode_header(header)
        try:
            if self._probes.answer(rank, frame):
                return
            self._router.answer(rank, frame)
        except zmq.ZMQError as exc:
            log.debug("rank %d: answer to rank %d not sent: %s", self.rank, rank, exc)

    def _leave(self) -> None:
        """This peer is leaving its group: it opens no link from now on, whatever it sends
        (a goodbye, an abort of what it leaves running), so closing costs no descriptor
        and stays within the budget. A goodbye to a watcher it has no link to goes over
        that watcher's probe (``via="probe"``). The answers that come back on its links
        (farewells) are read from now on."""
        if self._leaving:
            return
        self._leaving = True
        for route in self.routes.routes.values():
            self.routes.listen(route)

    def _heard_back(self, route: Route, frames: list[zmq.Frame]) -> None:
        """A message back on this peer's link: a farewell, news that this peer was declared
        lost, or the peer's goodbye said back on it (not answered: nobody waits for it)."""
        self._back.accept(route.peer, frames[0].buffer, frames[1:])

    def _answered_back(self, header: Header) -> None:
        self._bye_on_link.add(header.src)

    def _probe_identity(self, watcher: int) -> bytes | None:
        """The identity of ``watcher``'s probe of this peer (its first link's, see
        SocketFactory.mesh_probe), if this peer can reach it: the watcher's links have
        spoken here (its hello, at forming)."""
        nonce = self._router.nonce(watcher)
        if nonce is None:
            return None
        return link_identity(watcher, self._secret, nonce.decode()) + b"~probe"

    def _post_to_probe(self, dst: int, header: Header) -> None:
        """Post a goodbye to a watcher this peer has no link to, on the watcher's probe
        (see :meth:`_leave`); its answer comes back on it. Nothing else goes there: the
        probe's reader takes only a goodbye (see liveness), and would drop anything else.
        A watcher this peer has a link to gets it there."""
        if dst in self.routes.routes:
            self._post(dst, header)
        elif header.kind == "bye" and self._monitored:
            self._router.to_probe(dst, self._probe_identity(dst), header)

    def greet(self, header: Header) -> None:
        """Post a hello to the peers this one watches now (to every peer in a board group),
        and to any other as the first message on its link when that opens; to those of this
        host it names this peer's shared-memory ring, which they map if they can (see
        :mod:`.shm`), and its lane to them."""
        self._hello = header
        for peer in sorted(self._greeted):
            if peer in self.routes.contacts():
                self._post_hello(peer)
            else:
                self._link(peer)  # opening it posts the hello

    def _post_hello(self, peer: int, again: bool = False) -> None:
        assert self._hello is not None
        meta = self._local.hello_meta(peer, again)  # again: the peer keeps the rest
        if meta or not again:
            self.post(peer, dataclasses.replace(self._hello, meta=meta or None))

    async def aclose(self) -> None:
        """Stop reading and close every socket; queued outgoing messages get LINGER_MS."""
        if self._closed:
            return
        self._closed = True
        self._router.closing()
        self._local.closing()
        watching = self._probes.close_all()
        self._deferred.clear()
        tasks = [*self._tasks, *([self._deferring] if self._deferring is not None else [])]
        for task in tasks:
            task.cancel()
        draining = self.routes.close()
        await asyncio.gather(*tasks, *watching, *draining, return_exceptions=True)
        self._router.stop_census()
        self._local.close()
        self._router.close()
        for relaying in filter(None, (self._relay, *self._kept)):
            await relaying.aclose()
