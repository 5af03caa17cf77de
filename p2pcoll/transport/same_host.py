"""The mesh's paths between the peers of one host: shared-memory rings, lanes, the board.

Between peers of one host, large pieces go through the sender's shared-memory ring
(:mod:`.shm`) and whole messages through lanes (:mod:`.lane`), read in a callback on this
peer's wake-up pipe; the order of each sender's messages across its socket and its lane is
kept by :mod:`.ordering` (a :class:`~.ordering.LaneSender` on the route of each peer sent
to, a :class:`~.ordering.LaneReceiver` per peer of this host), which :class:`SameHost` hands
the mesh's sockets and its lanes as small adapters. When every peer shares this host, small
collectives go on the group's board (:mod:`.board`): rank 0 creates it, the others map it
from rank 0's hello. What a peer maps of another's (its ring, its lane and wake-up pipe, the
board) is named in the other's hello (:meth:`SameHost.hello_meta`, :meth:`SameHost.on_hello`).

Peers of other hosts, in groups without a job key, get the same lanes over plain TCP
(:mod:`.tcp_lane`, :meth:`SameHost.open_far`): one more kind of lane behind the same
:class:`~.ordering.LaneSender` and :class:`~.ordering.LaneReceiver`, named in the hello too.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Protocol

import numpy as np
import zmq

from ..errors import ProtocolError
from ..types import Membership
from ..wire import Header, encode_header
from . import board as boards
from . import lane, shm, tcp_lane
from .base import BytesPiece, Drops, Piece
from .lane_poll import LanePoll
from .ordering import LaneReceiver, LaneSender
from .route import Route
from .router import YIELD_EVERY

if TYPE_CHECKING:
    from typing_extensions import Buffer  # collections.abc.Buffer from Python 3.12

log = logging.getLogger("p2pcoll.transport")

__all__ = ["RING_WAIT_S", "SameHost", "ring_put"]

# How long a send waits for room in a shared-memory ring before it goes over the socket
# instead. The receiver frees room as it consumes, so a short wait usually suffices; the
# bound keeps two peers whose rings are both full from waiting on each other. After a wait
# that ran out, later sends do not wait until one finds room again, so a stalled reader
# costs one wait, not one per piece.
RING_WAIT_S = 0.005


def _unset(*_: object) -> None:  # SameHost.accept until the mesh sets it (at once)
    return None


class Accept(Protocol):
    """The inbound path of the mesh (see .inbound): validates one message of a member and
    hands it on, or drops it; a lane marker's value (True: "lane on") if it was one.
    ``sizes``: the frames' byte lengths where the caller knows them."""

    def __call__(self, source: int, head: bytes | memoryview, frames: Sequence[Piece],
                 sizes: list[int] | None = None, /) -> bool | None: ...


async def ring_put(
    outbox: shm.Outbox, piece: np.ndarray, readers: Sequence[int]
) -> tuple[int, list[int]] | None:
    """Put ``piece`` in the ring for ``readers``, waiting at most RING_WAIT_S for room
    (see above): where it went (offset, reader indices), or None (the socket takes it)."""
    at = outbox.put(piece, readers)
    if at is not None or outbox.stalled or piece.nbytes > outbox.ring:
        outbox.stalled = outbox.stalled and at is None
        return at
    loop = asyncio.get_running_loop()
    deadline = loop.time() + RING_WAIT_S
    delay = 0.0
    while at is None and loop.time() < deadline:
        await asyncio.sleep(delay)
        delay = min(delay * 2 or 2e-5, 5e-4)
        at = outbox.put(piece, readers)
    outbox.stalled = at is None
    return at


class SameHost:
    """This peer's paths to the peers of its host (see the module docstring): none until
    :meth:`open`, and none at all where no peer shares the host or shared memory is off.

    Args:
        drops: the mesh's drop counter.
        link_down: called with a peer whose lane is corrupt (what it sent is lost).

    The mesh sets :attr:`accept`, its inbound path (see :class:`Accept`), as it makes it.
    """

    def __init__(self, drops: Drops, link_down: Callable[[int], None]) -> None:
        self._drops = drops
        self.accept: Accept = _unset
        self._link_down = link_down
        self.rank = -1
        self._world_size = 0
        self._group_id = ""
        self._closed = False
        self.rings: shm.SharedRings | None = None
        # Lanes to and from the peers of this host (see .lane), and the order of each
        # peer's messages across socket and lane (see .ordering): a sender on the route of
        # each peer whose lane is ready, a receiver per peer of this host.
        self.lanes: lane.Lanes | None = None
        self._receivers: dict[int, LaneReceiver[list[zmq.Frame], lane.Record]] = {}
        self._marker_on = self._marker_off = b""
        # TCP lanes to and from the peers of other hosts (see .tcp_lane), if open.
        self.far: tcp_lane.TcpLanes | None = None
        # The group's board (see .board), when every peer shares this host: rank 0's, or
        # mapped from rank 0's hello (then _board_from_hello until it comes).
        self.board: boards.Board | None = None
        self._board_from_hello = False

    def open(self, membership: Membership, near: set[int], ring_bytes: int) -> None:
        """Make this peer's ring and lanes to ``near`` (the peers reached over ipc: they
        share this host), and the board where every peer does."""
        rank, group_id = membership.rank, membership.group_id
        self.rank, self._world_size, self._group_id = rank, membership.world_size, group_id
        # Large pieces may go through shared memory, to those of them that map the ring
        # announced in the hello, and messages through lanes (see .lane), made for a peer
        # when a link to it opens.
        self.rings = shm.SharedRings(rank, len(membership.endpoints), near, group_id,
                                     ring_bytes)
        try:
            self.lanes = lane.Lanes(rank, near, shm.group_tag(group_id))
        except OSError as exc:
            log.warning("rank %d: no shared-memory lanes (%s); messages go over the "
                        "sockets", rank, exc)
        else:
            self._receivers = {
                peer: LaneReceiver(partial(self._take, peer), partial(self._drops.drop, peer))
                for peer in near}
            self._markers(group_id, rank)
            self.lanes.marker_room = lane.record_size([self._marker_off])
            self._open_board(membership, near)

    def _markers(self, group_id: str, rank: int) -> None:
        self._marker_on, self._marker_off = (
            encode_header(Header("lane", group_id, rank, meta={"on": on}))
            for on in (True, False))

    def open_far(self, membership: Membership, bound: Sequence[str]) -> None:
        """Open this peer's lane port for TCP lanes with the peers it reaches over tcp (of
        other hosts, or of this one with shared memory off), on the host of its own
        ``tcp://`` endpoint among ``bound``. If the port cannot listen, messages go over
        the ZeroMQ links (a warning says why)."""
        far = {peer: e for peer, e in enumerate(membership.endpoints)
               if peer != membership.rank and e.startswith("tcp://")}
        bind = next((e for e in bound if e.startswith("tcp://")), None)
        if not far or bind is None:
            return
        self.rank, self._world_size = membership.rank, membership.world_size
        self._group_id = membership.group_id
        try:
            self.far = tcp_lane.TcpLanes(
                self.rank, far, bind, arrived=self._far_arrived, broken=self._far_broken,
                inbound=self._far_inbound, refused=self._far_refused)
        except OSError as exc:
            log.warning("rank %d: no TCP lanes (%s); messages go over the ZeroMQ links",
                        self.rank, exc)
            return
        self._markers(membership.group_id, self.rank)
        for peer in far:
            self._receivers[peer] = LaneReceiver(partial(self._take, peer),
                                                 partial(self._drops.drop, peer))

    def _far_inbound(self, peer: int, inbound: tcp_lane.TcpLaneIn) -> None:
        receiver = self._receivers.get(peer)
        if receiver is not None:  # (not gone meanwhile)
            receiver.lane = inbound

    def _far_arrived(self, peer: int) -> None:
        """Records came on ``peer``'s TCP lane: handed on if the lane is current (as
        :meth:`_pump`, inline: once a message)."""
        receiver = self._receivers.get(peer)
        if receiver is None or not receiver.lane_current or self._closed:
            return
        try:
            more = receiver.pump(YIELD_EVERY)
        except ProtocolError as exc:
            self._corrupt(peer, exc)
            return
        if more:
            asyncio.get_running_loop().call_soon(self._pump, peer)

    def _far_broken(self, peer: int, exc: ProtocolError) -> None:
        """A TCP lane with ``peer`` failed, ended or carried garbage: what came whole is
        handed on, the rest is lost, and so the peer's link is down."""
        if self._closed:
            return
        self._far_arrived(peer)
        if exc.reason == "malformed":  # garbage, or a record cut short: dropped
            self._drops.drop(peer, exc)
        log.warning("rank %d: %s: the link to rank %d is down", self.rank, exc, peer)
        self._link_down(peer)

    def _far_refused(self) -> None:
        self._drops.counters.links_refused += 1

    def poller(self, router: Callable[[], None]) -> Callable[[], None]:
        """What a receive calls before it parks: the ROUTER's poll, and this peer's TCP
        lanes' if they are open (see .lane_poll)."""
        if self.far is None:
            return router
        return LanePoll(router, self)

    def forget(self, peer: int) -> None:
        """``peer`` has gone: its TCP lanes close, and nothing is told of it. What comes
        on its link identity from now on is read as a stranger's would be (decoded and
        dropped with its reason), not held for a lane's turn that never comes."""
        if self.far is not None and peer in self.far.far:
            self.far.forget(peer)
            self._receivers.pop(peer, None)

    def on_board(self) -> bool:
        """Whether this peer is on the group's board, or will be once rank 0's hello comes."""
        return self.board is not None or self._board_from_hello

    def wakeup(self) -> int | None:
        """The descriptor of this peer's wake-up pipe (read with :meth:`on_wake`), if any."""
        return self.lanes.wakeup.fd if self.lanes is not None else None

    def hello_meta(self, peer: int, again: bool = False) -> dict[str, str]:
        """What this peer's hello to ``peer`` names: its ring, its lane, the board; on a
        link opened ``again`` (after one closed for the budget), only its new TCP lane."""
        if again:
            return self.far.announce(peer) if self.far is not None else {}
        outbox = self.rings.outbox if self.rings is not None else None
        lanes = self.lanes
        meta: dict[str, str] = {}
        if outbox and self.rings is not None and peer in self.rings.peers:
            meta["ring"] = outbox.name
        if lanes is not None and peer in lanes.peers:
            try:
                meta.update(lanes.announce(peer))
            except OSError as exc:
                log.info("rank %d: no lane to rank %d (%s)", self.rank, peer, exc)
        if self.board is not None and self.board.owner:
            meta["board"] = self.board.name
        if self.far is not None:
            meta.update(self.far.announce(peer))
        return meta

    def _open_board(self, membership: Membership, near: set[int]) -> None:
        """Rank 0 creates the group's board when every peer shares this host (and lanes,
        whose wake-up pipes it uses, are open); the others map it from its hello."""
        size = membership.world_size
        if len(near) != size - 1 or size > boards.MAX_BOARD_RANKS or not boards.supported():
            return
        if self.rank != 0:
            self._board_from_hello = True
            return
        try:
            self.board = boards.Board.create(0, size, shm.group_tag(membership.group_id))
        except OSError as exc:
            log.warning("rank 0: no shared-memory board (%s); small collectives go as "
                        "messages", exc)
            return
        self.board.wake = self._wake

    def _wake(self, peer: int) -> None:
        """Write into ``peer``'s wake-up pipe, if this peer can (the peer's hello opened it)."""
        lanes = self.lanes
        if lanes is not None:
            try:
                lanes.wake(peer)
            except KeyError:
                pass  # its pipe is not open yet: its hello has not come

    def lane_put(self, route: Route, frames: Sequence[object]) -> bool:
        """Put one message (bytes-like frames) on the lane of a route if it may go there;
        False: the socket. Never waits. Which, and the markers that keep the order, is the
        :class:`~.ordering.LaneSender`'s to say; it is made when the lane is ready (and
        keeps the route's link open from then on, see .route)."""
        sender = route.lane
        if sender is None:
            sender = self._lane_sender(route)
            if sender is None:
                return False
        return sender.put(frames)  # type: ignore[arg-type]  # (arrays are Buffers from 3.12)

    def lane_off(self, route: Route) -> bool:
        """The route's link is about to close for the budget: a TCP lane's messages move
        off it (``lane off``, read before the link's end); False for a shared-memory
        lane, which keeps its link (see .route)."""
        sender = route.lane
        if sender is None:
            return True
        if not isinstance(sender.lane, tcp_lane.TcpLaneOut):
            return False
        sender.leave()
        return True

    def lane_gone(self, route: Route) -> None:
        """The route's link has closed for the budget: its TCP lane goes too, and the
        next link's hello names a new one (see :meth:`.tcp_lane.TcpLanes.retire`)."""
        route.lane = None
        if self.far is not None and route.peer in self.far.far:
            self.far.retire(route.peer)

    def _lane_sender(self, route: Route) -> LaneSender[Sequence[Buffer]] | None:
        """A sender for the route's lane, shared-memory or TCP, if one is ready."""
        lanes, far, peer = self.lanes, self.far, route.peer
        out: tcp_lane.TcpLaneOut | lane.LaneOut | None = None
        wake: Callable[[], None] | None
        if lanes is not None and (out := lanes.ready(peer)) is not None:
            room, wake = lanes.marker_room, partial(lanes.wake, peer)
        elif far is not None and (out := far.ready(peer)) is not None:
            room, wake = tcp_lane.record_size([self._marker_off]), None  # the kernel wakes
        else:
            return None
        route.lane = LaneSender(
            out, marker_on=self._marker_on, marker_off=[self._marker_off],
            marker_room=room, send_marker=route.send_now,
            socket_waiting=lambda: route.waiting > 0, wake=wake)
        return route.lane

    def take_in(self, source: int, frames: list[zmq.Frame]) -> None:
        """A message on member ``source``'s current link, handed on in its order."""
        if source in self._receivers:  # a peer of this host: in its order (see .ordering)
            self._pump(source, frames)
        else:
            marker = self.accept(source, frames[1].buffer, frames[2:])
            if marker is not None:  # it has no lane to this peer
                self._drops.drop(source, ProtocolError(
                    f"rank {source} moved {'to' if marker else 'off'} a lane out of turn"))

    def _pump(self, src: int, frames: list[zmq.Frame] | None = None) -> None:
        """Hand on ``src``'s messages in the order it sent them: ``frames`` from its socket
        (now, or held until its turn), then whatever waits on its lane or was held; at most
        YIELD_EVERY of them, the rest after the other callbacks (a flood must not hold the
        loop)."""
        receiver = self._receivers.get(src)
        if receiver is None:  # closed meanwhile
            return
        try:
            if frames is None:
                more = receiver.pump(YIELD_EVERY)
            else:
                more = receiver.from_socket(frames, YIELD_EVERY)
        except ProtocolError as exc:
            self._corrupt(src, exc)
            return
        if more:
            asyncio.get_running_loop().call_soon(self._pump, src)

    def _corrupt(self, src: int, exc: ProtocolError) -> None:
        """``src``'s lane is corrupt: what it sent is lost, and so is its link."""
        self._drops.drop(src, exc)
        log.error("rank %d: %s", self.rank, exc)
        self._link_down(src)

    def _take(self, src: int, message: list[zmq.Frame] | lane.Record, on_lane: bool
              ) -> bool | None:
        """One message of ``src`` whose turn it is (see :class:`~.ordering.LaneReceiver`):
        validated and handed on, or dropped; a marker's value if it was one."""
        if not on_lane:
            assert isinstance(message, list)
            return self.accept(src, message[1].buffer, message[2:])
        assert isinstance(message, tuple)
        first, rest = message
        try:
            return self.accept(src, first, list(map(BytesPiece, rest)), list(map(len, rest)))
        finally:
            first.release()
            if self.lanes is not None and src in self.lanes.into:
                self.lanes.into[src].release()

    def on_wake(self) -> None:
        """A lane sender wrote into this peer's wake-up pipe: read the lanes now current."""
        lanes = self.lanes
        if lanes is None or self._closed:
            return
        lanes.wakeup.clear()  # before reading, so that a later record wakes the loop again
        board = self.board
        if board is not None and board.on_wake is not None:
            board.on_wake()
        for src in [src for src in lanes.into if self._receivers[src].lane_current]:
            self._pump(src)

    def on_hello(self, header: Header) -> None:
        """What a hello of a peer of this host names: its ring, its lane, the board."""
        meta = header.meta
        if not meta:
            return
        if "ring" in meta:
            self._accept_ring(header.src, meta["ring"])
        if "lane" in meta:
            self._accept_lane(header.src, meta["lane"], meta.get("wake"))
        if "board" in meta:
            self._accept_board(header.src, meta["board"])
        if "tcp_lane" in meta and self.far is not None:
            try:
                self.far.accept(header.src, meta["tcp_lane"])
            except ProtocolError as exc:
                log.info("rank %d: no TCP lane from rank %d: %s", self.rank, header.src, exc)

    def _accept_lane(self, peer: int, name: object, wake: object) -> None:
        """Open the lane a peer of this host announced (and its wake-up pipe); if that
        fails, the peer keeps sending to this one over the socket."""
        if self.lanes is None or peer not in self.lanes.peers:
            return
        try:
            self.lanes.accept(peer, name, wake)
        except ProtocolError as exc:
            log.info("rank %d: no lane from rank %d: %s", self.rank, peer, exc)
            return
        self._receivers[peer].lane = self.lanes.into[peer]

    def _accept_board(self, peer: int, name: object) -> None:
        """Map the board rank 0 announced. If that fails this peer runs small collectives
        as messages while the others use the board: they fail with a CollectiveMismatch
        that says so, at the first one, rather than hang; the error log says why."""
        if peer != 0 or not self._board_from_hello or self.board is not None:
            raise ProtocolError(f"rank {peer} may not announce a board here")
        self._board_from_hello = False
        try:
            self.board = boards.Board.attach(name, self.rank, self._world_size,
                                             shm.group_tag(self._group_id))
        except ProtocolError as exc:
            log.error("rank %d: cannot use the group's shared-memory board: %s", self.rank,
                      exc)
            return
        self.board.wake = self._wake

    def _accept_ring(self, peer: int, name: object) -> None:
        """Map the shared-memory ring a peer of this host announced; if that fails, the
        peer keeps sending to this one over the socket."""
        if self.rings is None or peer not in self.rings.peers:
            return
        try:
            if not isinstance(name, str):
                raise ProtocolError(f"ring name {name!r} is not a string")
            self.rings.accept(peer, name)
        except ProtocolError as exc:
            log.info("rank %d: no shared memory from rank %d: %s", self.rank, peer, exc)

    def pieces(self, header: Header, frames: Sequence[Piece]) -> list[Piece]:
        """The payload pieces: the frames, and pieces in the sender's shared-memory ring."""
        if header.shm is None:
            return list(frames)
        if self.rings is None:
            raise ProtocolError("message names a shared-memory ring, this peer maps none")
        inbox = self.rings.inbox(header.src, header.shm[0])
        inline_frames = iter(frames)
        return [next(inline_frames) if at == -1 else inbox.take(at, n, k)
                for n, at, k in zip(header.nbytes, header.shm[1], header.shm[2], strict=True)]

    def closing(self) -> None:
        """The mesh is closing: wake-ups are no longer read."""
        self._closed = True

    def close(self) -> None:
        """Let go of the ring, the board and the lanes."""
        self._closed = True
        if self.rings is not None:
            self.rings.close()
        if self.board is not None:
            self.board.close()
            self.board = None
        self._receivers.clear()
        if self.lanes is not None:
            self.lanes.close()
            self.lanes = None
        if self.far is not None:
            self.far.close()
            self.far = None
