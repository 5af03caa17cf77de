"""An in-memory transport: peers of one event loop, no sockets, with faults on demand.

For tests of everything above the transport (matching, the executor, the failure model):
a :class:`MemoryNetwork` connects :class:`MemoryTransport` peers, and can drop, delay and
reorder data messages (seeded, so a failing run can be replayed), cut a peer off as a
crash would, or freeze one as SIGSTOP would. Messages are encoded and go through the same
validation point as the ZeroMQ mesh's, and dropped ones are counted by reason with the same
:class:`~.base.Counters` and :class:`~.base.Drops`, so what a test sees is what a real peer
would. Like a link's queue, each ordered pair of peers holds at most ``capacity`` data
messages not yet delivered: a send waits for room, so one to a frozen peer, or to one that
was cut off, waits (until the failure model ends it) as it would over a socket.
"""

from __future__ import annotations

import asyncio
import functools
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..errors import PeerLost
from ..types import Membership
from ..wire import Header, Limits, encode_header
from . import overlay
from .base import (
    BytesPiece, Counters, Drops, LinkDownHandler, MessageHandler, MessageHook,
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


@dataclass
class MemoryNetwork:
    """The peers of one in-memory group, by endpoint."""

    faults: Faults = field(default_factory=Faults)
    peers: dict[str, MemoryTransport] = field(default_factory=dict)
    capacity: int = 1000  # data messages in flight per (sender, receiver), as a link's queue

    def __post_init__(self) -> None:
        self.random = random.Random(self.faults.seed)
        self._last: dict[tuple[str, str], float] = {}
        self.frozen: set[str] = set()
        self._held: list[tuple[str, str, list[bytes], bool]] = []
        self._queued: dict[tuple[str, str], int] = {}  # data messages not yet delivered
        self._room: dict[tuple[str, str], asyncio.Event] = {}  # set when there is room

    def freeze(self, endpoint: str) -> None:
        """The peer at ``endpoint`` stops as a stopped process would: its links stay up, but
        nothing reaches it and nothing it sends goes out, until :meth:`thaw`."""
        self.frozen.add(endpoint)

    def thaw(self, endpoint: str) -> None:
        """The frozen peer goes on: what was held back to and from it is delivered."""
        self.frozen.discard(endpoint)
        held, self._held = self._held, []
        for sender, dst, frames, data in held:
            self._route(sender, dst, frames, data)

    def transport(self) -> MemoryTransport:
        return MemoryTransport(self)

    def cut(self, endpoint: str) -> None:
        """The peer at ``endpoint`` vanishes as if killed: no bye, its links go down."""
        victim = self.peers.pop(endpoint, None)
        if victim is None:
            return
        victim.closed = True
        for peer in self.peers.values():
            if peer.membership is not None and endpoint in peer.membership.endpoints:
                peer.on_link_down(peer.membership.endpoints.index(endpoint))

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
        if sender in self.frozen or dst in self.frozen:
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


class MemoryTransport:
    """One peer's end of a :class:`MemoryNetwork`."""

    name = "memory"
    sent: MessageHook | None = None  # see p2pcoll.transport.base
    delivered: MessageHook | None = None

    def __init__(self, network: MemoryNetwork, max_message_bytes: int = 256 << 20) -> None:
        self.network = network
        self.counters = Counters()
        self.endpoints: list[str] = []
        self.membership: Membership | None = None
        self.on_message: MessageHandler = lambda header, pieces: None
        self.on_link_down: LinkDownHandler = lambda peer: None
        self.max_message_bytes = max_message_bytes
        self.drops = Drops(self.counters, lambda: self.membership.rank if self.membership else -1)
        self.closed = False
        self._limits: Limits | None = None
        self._inbound = Inbound(self)  # validate, count, hand on, drop (see .inbound)
        # What came before connect(): held, as a bound socket holds it, and read at connect.
        self._early: list[tuple[str, list[bytes]]] = []
        self.hello_peers: frozenset[int] = frozenset()  # as the mesh's: the overlay's
        self._talked: set[int] = set()  # the peers sent to (see contacts)
        self._heard: set[int] = set()  # the peers received from (see senders)
        self._ranks: dict[str, int] = {}  # endpoint -> rank, of the members

    async def bind(self) -> list[str]:
        endpoint = f"mem://{len(self.network.peers)}-{id(self)}"
        self.network.peers[endpoint] = self
        self.endpoints = [endpoint]
        return self.endpoints

    def connect(self, membership: Membership, on_message: MessageHandler,
                on_link_down: LinkDownHandler) -> None:
        self.membership = membership
        self.on_message, self.on_link_down = on_message, on_link_down
        self._limits = self._inbound.limits = Limits(
            membership.group_id, membership.rank, membership.world_size,
            self.max_message_bytes)
        self.hello_peers = frozenset(overlay.watchers(membership.rank, membership.world_size))
        self._ranks = _ranks_of(membership.endpoints)
        early, self._early = self._early, []
        for sender, frames in early:
            self.receive(sender, frames)

    async def send_many(self, dsts: Sequence[int], headers: Sequence[Header],
                        payload: Sequence[np.ndarray] = (), *, copy: bool = False) -> None:
        if self.closed or self.membership is None:
            raise PeerLost("cannot send: this peer has closed", dsts[0] if dsts else None)
        pieces = [a.tobytes() for a in payload]
        self._talked.update(dsts)
        for dst, header in zip(dsts, headers, strict=True):
            header.nbytes = [len(p) for p in pieces]
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

    def post(self, dst: int, header: Header) -> None:
        if self.closed or self.membership is None:
            return
        self._talked.add(dst)
        self.network.deliver(self.endpoints[0], self.membership.endpoints[dst],
                             [encode_header(header)], False)

    def answer(self, rank: int, header: Header) -> None:
        """As :meth:`post`: the network has no links to open (see Transport.answer)."""
        if self.closed or self.membership is None:
            return
        self.network.deliver(self.endpoints[0], self.membership.endpoints[rank],
                             [encode_header(header)], False)

    def senders(self) -> set[int]:
        """The peers this one has received from."""
        return set(self._heard)

    def leaving(self) -> None:
        """Nothing to do: every peer is reachable without opening anything."""

    async def drained(self) -> None:
        """Nothing drains: no link is closed for a budget."""

    def greet(self, header: Header) -> None:
        assert self.membership is not None
        for peer in overlay.watched(self.membership.rank, self.membership.world_size):
            self.post(peer, header)

    def contacts(self) -> set[int]:
        """As the mesh's: the peers sent to, and those that watch this one (a goodbye goes
        to them; see :mod:`.overlay`)."""
        if self.membership is None:
            return set()
        m = self.membership
        return (self._talked | set(overlay.watchers(m.rank, m.world_size))) - {m.rank}

    def unread(self) -> set[int]:
        """The peers sent to: what was sent may still be on its way."""
        return set(self._talked)

    def forget(self, rank: int) -> None:
        """Nothing to let go of: the network tells every peer of a loss itself."""

    def broadcast(self, header: Header) -> None:
        assert self.membership is not None
        for peer in range(self.membership.world_size):
            if peer != self.membership.rank:
                self.post(peer, header)

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
        if link >= 0:
            self._heard.add(link)
        self._inbound.accept(link, frames[0] if frames else None,
                             [BytesPiece(f) for f in frames[1:]])

    async def aclose(self) -> None:
        self.closed = True
        for endpoint in self.endpoints:
            self.network.peers.pop(endpoint, None)
