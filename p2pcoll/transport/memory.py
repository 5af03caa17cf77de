"""An in-memory transport: peers of one event loop, no sockets, with faults on demand.

For tests of everything above the transport (matching, the executor, the failure model):
a :class:`MemoryNetwork` connects :class:`MemoryTransport` peers, and can drop, delay and
reorder data messages (seeded, so a failing run can be replayed), cut a peer off as a
crash would, cut the link between two peers as a partition would, or freeze one as SIGSTOP
would. Messages are encoded and go through the same validation point as the ZeroMQ mesh's,
and dropped ones are counted by reason with the same :class:`~.base.Counters` and
:class:`~.base.Drops`, so what a test sees is what a real peer would. Like a link's queue,
each ordered pair of peers holds at most ``capacity`` data messages not yet delivered: a
send waits for room, so one to a frozen peer, or to one that was cut off, waits (until the
failure model ends it) as it would over a socket.

Liveness is the mesh's (see :mod:`.zmq_mesh` and departures.overlay): each peer probes the
ranks the departures machine says it watches (:meth:`MemoryTransport.follow`), and a probe
whose peer does not answer for the heartbeat (the peer is frozen, or the link between the
two is cut) reports it lost through :meth:`MemoryTransport.probe_lost`, the one place where
the memory transport produces the event the mesh's probe monitor produces. A probe is a
timer armed when the network changes, not a stream of heartbeats, so a frozen peer costs
nothing until it is found; under :func:`p2pcoll.testing.run_virtual` finding it costs no
wall time either.
"""

from __future__ import annotations

import asyncio
import functools
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..departures import Forget, Unwatch, Via, Watch, overlay
from ..errors import PeerLost
from ..types import Membership
from ..wire import Header, Limits, encode_header
from .base import (
    BytesPiece, Counters, Drops, Follow, LinkEvent, LinkHandler, MessageHandler, MessageHook,
    Paths, PathsOf, Poll,
)
from .inbound import Inbound


@dataclass(frozen=True)
class Faults:
    """What the network does to data messages (control messages always arrive, in order).

    Attributes:
        drop: probability that a data message is lost.
        delay: (low, high) seconds each data message is held back, uniformly.
        reorder: deliver in a random order within the delay window (needs a delay).
        seed: for the random choices, so a run can be replayed.
    """

    drop: float = 0.0
    delay: tuple[float, float] = (0.0, 0.0)
    reorder: bool = False
    seed: int = 0


Peer = int | str
"""A peer of a :class:`MemoryNetwork`: its rank in the group formed on the network, or its
endpoint (``group.endpoint``)."""


@dataclass
class MemoryNetwork:
    """The peers of one in-memory group, by endpoint, and the faults between them.

    Faults are set and lifted while the group runs: :meth:`freeze` / :meth:`thaw` a peer,
    :meth:`cut` / :meth:`heal` the link between two peers, :meth:`cut` one peer off for good
    (a crash). A peer is named by its rank (in the one group formed on this network) or its
    endpoint.
    """

    faults: Faults = field(default_factory=Faults)
    peers: dict[str, MemoryTransport] = field(default_factory=dict)
    capacity: int = 1000  # data messages in flight per (sender, receiver), as a link's queue

    def __post_init__(self) -> None:
        self.random = random.Random(self.faults.seed)
        self._last: dict[tuple[str, str], float] = {}
        self.frozen: set[str] = set()
        self.cuts: set[frozenset[str]] = set()  # the links cut (pairs of endpoints)
        # Messages that cannot go yet (to or from a frozen peer, over a cut link), in order.
        self._held: list[tuple[str, str, list[bytes], bool]] = []
        self._queued: dict[tuple[str, str], int] = {}  # data messages not yet delivered
        self._room: dict[tuple[str, str], asyncio.Event] = {}  # set when there is room

    def freeze(self, peer: Peer) -> None:
        """``peer`` stops as a stopped process would: its links stay up, but nothing reaches
        it and nothing it sends goes out, until :meth:`thaw`; its watchers' probes lose it
        after their heartbeat.

        Raises:
            ValueError: ``peer`` names no peer of this network (see :meth:`endpoint`).
        """
        self.frozen.add(self.endpoint(peer))
        self._changed()

    def thaw(self, peer: Peer) -> None:
        """The frozen ``peer`` goes on: what was held back to and from it is delivered.

        Raises:
            ValueError: ``peer`` names no peer of this network (see :meth:`endpoint`).
        """
        self.frozen.discard(self.endpoint(peer))
        self._release()

    def cut(self, a: Peer, b: Peer | None = None) -> None:
        """Cut the link between ``a`` and ``b`` as a partition would: both stay up, but
        nothing goes between them (it is held, as a socket's queue holds it) until
        :meth:`heal`; a probe between them loses its peer after the heartbeat, as over
        sockets (so a cut between two peers that do not watch each other ends only in the
        collectives that wait on it).

        With ``a`` alone: ``a`` vanishes as if killed, for good: no goodbye, every peer's
        link to it goes down at once.

        Raises:
            ValueError: a peer that this network does not know (see :meth:`endpoint`), or
                ``a`` and ``b`` are one peer.
        """
        if b is None:
            self._kill(self.endpoint(a))
            return
        pair = frozenset((self.endpoint(a), self.endpoint(b)))
        if len(pair) != 2:
            raise ValueError(f"cut({a!r}, {b!r}): a link joins two different peers")
        self.cuts.add(pair)
        self._changed()

    def heal(self, a: Peer, b: Peer) -> None:
        """The link between ``a`` and ``b`` carries again what was held on it and what
        comes next.

        Raises:
            ValueError: a peer that this network does not know (see :meth:`endpoint`).
        """
        self.cuts.discard(frozenset((self.endpoint(a), self.endpoint(b))))
        self._release()

    def answers(self, watcher: str, peer: str) -> bool:
        """Whether ``peer`` answers ``watcher``'s heartbeats: it is not frozen and the link
        between them is not cut."""
        return peer not in self.frozen and frozenset((watcher, peer)) not in self.cuts

    def endpoint(self, peer: Peer) -> str:
        """The endpoint of ``peer``: given as one, or as a rank of the group on this network.

        Raises:
            ValueError: a rank, while this network carries no group or more than one, or a
                rank out of range.
        """
        if isinstance(peer, str):
            return peer
        rosters = {t.membership.endpoints for t in self.peers.values()
                   if t.membership is not None}
        if len(rosters) != 1:
            raise ValueError(
                f"rank {peer!r} names no peer: this network carries {len(rosters)} groups, "
                f"not one; name the peer by its endpoint")
        roster = rosters.pop()
        if not 0 <= peer < len(roster):
            raise ValueError(f"rank {peer!r} is not a rank of this network's group of "
                             f"{len(roster)}")
        return roster[peer]

    def transport(self, heartbeat_s: float = 5.0) -> MemoryTransport:
        """A new peer's transport; its probes lose a peer silent for ``heartbeat_s``
        (the heartbeat_timeout setting)."""
        return MemoryTransport(self, heartbeat_s=heartbeat_s)

    def _kill(self, endpoint: str) -> None:
        victim = self.peers.pop(endpoint, None)
        if victim is None:
            return
        victim.closed = True
        victim.rearm()  # a dead peer probes nothing
        for peer in self.peers.values():
            if peer.membership is not None and endpoint in peer.membership.endpoints:
                peer.on_link(peer.membership.endpoints.index(endpoint), LinkEvent.DOWN)
        # And the victim's own links are down: should it still close (a test closes every
        # group), its goodbye reaches nobody and it waits for no farewell.
        m = victim.membership
        if m is not None:
            for rank in range(m.world_size):
                if rank != m.rank:
                    victim.on_link(rank, LinkEvent.DOWN)

    def _changed(self) -> None:
        """A fault was set or lifted: every peer's probes look again at whom they watch."""
        for peer in list(self.peers.values()):
            peer.rearm()

    def _release(self) -> None:
        """Send again what was held: what may go now goes, in order; the rest stays."""
        held, self._held = self._held, []
        for sender, dst, frames, data in held:
            self._route(sender, dst, frames, data)
        self._changed()

    async def room(self, sender: str, dst: str) -> None:
        """Wait until ``sender`` may queue another data message to ``dst``."""
        pair = (sender, dst)
        while self._queued.get(pair, 0) >= self.capacity:
            event = self._room.setdefault(pair, asyncio.Event())
            event.clear()
            await event.wait()

    def deliver(self, sender: str, dst: str, frames: list[bytes], data: bool) -> None:
        """Queue one message; a data message takes room until it is delivered (never, to
        a peer that was cut off)."""
        if data:
            self._queued[(sender, dst)] = self._queued.get((sender, dst), 0) + 1
        self._route(sender, dst, frames, data)

    def _arrived(self, sender: str, dst: str, frames: list[bytes], data: bool) -> None:
        target = self.peers.get(dst)
        if target is None:
            return  # cut off meanwhile: its queue stays full
        if data:
            self._left(sender, dst)
        target.receive(sender, frames)

    def _left(self, sender: str, dst: str) -> None:
        pair = (sender, dst)
        self._queued[pair] -= 1
        event = self._room.get(pair)
        if event is not None:
            event.set()

    def _route(self, sender: str, dst: str, frames: list[bytes], data: bool) -> None:
        target = self.peers.get(dst)
        if target is None:
            return
        if sender in self.frozen or not self.answers(sender, dst):
            self._held.append((sender, dst, frames, data))
            return
        loop = asyncio.get_running_loop()
        f = self.faults
        if data and f.drop and self.random.random() < f.drop:
            self._left(sender, dst)
            return
        if f.delay[1] <= 0:
            # Nothing is ever held back: each message goes to the back of the loop's queue,
            # which keeps the order, in O(1) (a timer would cost O(log p) to schedule: one
            # is pending per message in flight, thousands at p = 1024).
            loop.call_soon(self._arrived, sender, dst, frames, data)
            return
        if not data:
            # Control messages keep their order behind the data sent before them.
            at = self._last.get((sender, dst), 0.0)
            loop.call_at(max(at, loop.time()), self._arrived, sender, dst, frames, False)
            return
        delay = self.random.uniform(*f.delay) if f.delay[1] > 0 else 0.0
        when = loop.time() + delay
        if not f.reorder:  # no overtaking between two peers
            when = max(when, self._last.get((sender, dst), 0.0))
        self._last[(sender, dst)] = max(when, self._last.get((sender, dst), 0.0))
        loop.call_at(when, self._arrived, sender, dst, frames, True)


@functools.lru_cache(maxsize=4)
def _ranks_of(endpoints: tuple[str, ...]) -> dict[str, int]:
    """Endpoint -> rank of a roster, one dict for all the peers that hold it (read only).

    Every message received looks its sender up here: with a dict per peer, p = 1024 peers of
    one process kept a million entries (46 MiB) and each lookup missed the caches."""
    return {endpoint: r for r, endpoint in enumerate(endpoints)}


def _unmeasured(peer: int) -> tuple[None, None]:
    return None, None


def _nothing() -> None:
    pass


class MemoryTransport:
    """One peer's end of a :class:`MemoryNetwork`."""

    name = "memory"
    sent: MessageHook | None = None  # see p2pcoll.transport.base
    delivered: MessageHook | None = None

    def __init__(self, network: MemoryNetwork, max_message_bytes: int = 256 << 20,
                 heartbeat_s: float = 5.0) -> None:
        self.network = network
        self.heartbeat_s = heartbeat_s
        self.counters = Counters()
        self.endpoints: list[str] = []
        self.paths: Paths = PathsOf(_unmeasured)  # no path is long here: the floor window
        self.membership: Membership | None = None
        self.on_message: MessageHandler = lambda header, pieces: None
        self.on_link: LinkHandler = lambda peer, event: None
        self.max_message_bytes = max_message_bytes
        self.drops = Drops(self.counters, lambda: self.membership.rank if self.membership else -1)
        self.closed = False
        self._limits: Limits | None = None
        self._inbound = Inbound(self)  # validate, count, hand on, drop (see .inbound)
        # What came before connect(): held, as a bound socket holds it, and read at connect.
        self._early: list[tuple[str, list[bytes]]] = []
        self.hello_peers: frozenset[int] = frozenset()  # as the mesh's: the overlay's
        self._talked: set[int] = set()  # the peers sent to (a link "opened" to each)
        self._heard: set[int] = set()  # the peers received from (each "heard")
        self._ranks: dict[str, int] = {}  # endpoint -> rank, of the members
        # Liveness (see the module docstring): the ranks this peer watches, and the probe
        # timer of each watched peer that does not answer.
        self._watched: set[int] = set()
        self._probes: dict[int, asyncio.TimerHandle] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    async def bind(self) -> list[str]:
        endpoint = f"mem://{len(self.network.peers)}-{id(self)}"
        self.network.peers[endpoint] = self
        self.endpoints = [endpoint]
        return self.endpoints

    def connect(self, membership: Membership, on_message: MessageHandler,
                on_link: LinkHandler) -> Poll:
        self.membership = membership
        self.on_message, self.on_link = on_message, on_link
        self._limits = self._inbound.limits = Limits(
            membership.group_id, membership.rank, membership.world_size,
            self.max_message_bytes)
        self.hello_peers = frozenset(overlay.watchers(membership.rank, membership.world_size))
        self._ranks = _ranks_of(membership.endpoints)
        self._loop = asyncio.get_running_loop()
        early, self._early = self._early, []
        for sender, frames in early:
            self.receive(sender, frames)
        return _nothing  # each message is handed on as it arrives: nothing waits

    async def send_many(self, dsts: Sequence[int], headers: Sequence[Header],
                        payload: Sequence[np.ndarray] = (), *, copy: bool = False) -> None:
        if self.closed or self.membership is None:
            raise PeerLost("cannot send: this peer has closed", dsts[0] if dsts else None)
        pieces = [a.tobytes() for a in payload]
        for dst, header in zip(dsts, headers, strict=True):
            header.nbytes = [len(p) for p in pieces]
            self._talk(dst)
            if header.kind == "data":
                await self.network.room(self.endpoints[0], self.membership.endpoints[dst])
            self.network.deliver(self.endpoints[0], self.membership.endpoints[dst],
                                 [encode_header(header), *pieces], header.kind == "data")
            if header.kind == "data":
                self.counters.messages_sent += 1
                self.counters.bytes_sent += sum(header.nbytes)
                if self.sent is not None:
                    self.sent(dst, header, sum(header.nbytes))
        await asyncio.sleep(0)  # a send is a turn of the loop, as over a socket

    def post(self, dst: int, header: Header, via: Via = "link") -> None:
        """As the mesh's, but every ``via`` is the same here: the network has no links to
        open, no probes to post on (see Transport.post)."""
        if self.closed or self.membership is None:
            return
        if via == "link":
            self._talk(dst)
        self.network.deliver(self.endpoints[0], self.membership.endpoints[dst],
                             [encode_header(header)], False)

    def _talk(self, dst: int) -> None:
        """The first message to ``dst`` "opens a link" to it (what was sent may not be read
        yet, as on the mesh's)."""
        if dst not in self._talked:
            self._talked.add(dst)
            self.on_link(dst, LinkEvent.OPENED)

    def greet(self, header: Header) -> None:
        assert self.membership is not None
        for peer in overlay.watched(self.membership.rank, self.membership.world_size):
            self.post(peer, header)

    def follow(self, action: Follow) -> None:
        """Watch a peer, or stop (see :meth:`rearm`); nothing is kept for a peer that has
        gone, and every peer is reachable without a link (:class:`Leave` changes nothing)."""
        if isinstance(action, Watch):
            self._watched.add(action.peer)
            self.rearm()
        elif isinstance(action, Unwatch):
            self._watched.discard(action.peer)
            self.rearm()
        elif isinstance(action, Forget):
            pass

    def rearm(self) -> None:
        """Look again at the peers this one watches (the network changed, or whom it
        watches did): a probe runs its heartbeat's timer while its peer does not answer,
        and only while this peer runs (a frozen or closed peer notices nothing). A probe
        whose peer answers again before the timer ends is disarmed; one armed anew (a
        peer watched in a lost one's place, or after this peer thaws) waits a whole
        heartbeat, as a new probe's handshake would."""
        m, loop = self.membership, self._loop
        me = self.endpoints[0] if self.endpoints else ""
        silent: set[int] = set()
        if m is not None and loop is not None and not self.closed and \
                me not in self.network.frozen:
            silent = {p for p in self._watched if not self.network.answers(me, m.endpoints[p])}
            for peer in silent - self._probes.keys():
                self._probes[peer] = loop.call_later(self.heartbeat_s, self._timed_out, peer)
        for peer in self._probes.keys() - silent:
            self._probes.pop(peer).cancel()

    def _timed_out(self, peer: int) -> None:
        del self._probes[peer]
        self.probe_lost(peer)

    def probe_lost(self, peer: int) -> None:
        """The seam of liveness: this peer's probe of ``peer`` went down (it did not answer
        for the heartbeat), the event the mesh's probe monitor reports (see
        ``Probes._follow`` in liveness.py); handed to the session as a link down, which declares
        ``peer`` lost after a short grace unless it says goodbye meanwhile."""
        if not self.closed:
            self.on_link(peer, LinkEvent.DOWN)

    def receive(self, sender: str, frames: list[bytes]) -> None:
        """Validate and hand on one message that ``sender`` (an endpoint) sent here."""
        if self.closed:
            return
        if self._limits is None or self.membership is None:
            if len(self._early) < 1024:  # bounded: a peer that never connects holds little
                self._early.append((sender, frames))
            return
        # not a member: -1, which validate() refuses like any other stranger
        link = self._ranks.get(sender, -1)
        if link >= 0 and link not in self._heard:
            self._heard.add(link)
            self.on_link(link, LinkEvent.HEARD)
            self.on_link(link, LinkEvent.PROBE_KNOWN)  # (every peer is reachable here)
        self._inbound.accept(link, frames[0] if frames else None,
                             [BytesPiece(f) for f in frames[1:]])

    async def aclose(self) -> None:
        self.closed = True
        self.rearm()  # its probes stop
        for endpoint in self.endpoints:
            self.network.peers.pop(endpoint, None)
