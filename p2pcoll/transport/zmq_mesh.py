"""The peer mesh: one bound ROUTER per peer for receiving, one DEALER link per peer for sending.

Rank r binds one ROUTER and connects one DEALER (identity ``b"r"``) to every other peer's
ROUTER. So every message arrives with the identity of the link it came on, which must agree
with the source rank in its header; each link has its own ZeroMQ queue with a high-water
mark, which gives backpressure per destination; and a dead link is seen on exactly one
socket, which carries ZMTP heartbeats and a monitor.

One reader task drains the ROUTER, validates every message against the wire format and hands
good ones to ``on_message``; bad ones are dropped, counted and logged, and the peer goes on.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from ..errors import PeerLost, ProtocolError
from ..wire import Header, decode_header, encode_header
from .base import Transport
from . import shm
from .memory import tune_malloc

log = logging.getLogger("p2pcoll.transport")

# Payload pieces at least this large are sent zero-copy and tracked until libzmq lets go.
ZERO_COPY_BYTES = zmq.COPY_THRESHOLD
HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 5000
LINGER_MS = 2000
HWM = 1000

# A received payload piece: a ZeroMQ frame, or a piece in a peer's shared-memory ring.
# Both expose ``.buffer`` and ``len()``.
Piece = zmq.Frame | shm.ShmFrame
MessageHandler = Callable[[Header, list[Piece]], None]
LinkDownHandler = Callable[[int], None]


@dataclass
class Counters:
    """Traffic of one peer since it joined. Bytes are tensor payload, not headers."""

    bytes_sent: int = 0
    bytes_sent_shm: int = 0  # of bytes_sent, those that went through shared memory
    bytes_received: int = 0
    messages_sent: int = 0
    messages_received: int = 0
    messages_dropped: int = 0


def _discard_outcome(fut: asyncio.Future[object]) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.debug("control message not sent: %s", fut.exception())


# How long a send waits for room in a shared-memory ring before it goes over the socket
# instead. The receiver frees room as it consumes, so a short wait usually suffices; the
# bound keeps two peers whose rings are both full from waiting on each other. After a wait
# that ran out, later sends do not wait until one finds room again, so a stalled reader
# costs one wait, not one per piece.
RING_WAIT_S = 0.005


async def _put(
    outbox: shm.Outbox, piece: np.ndarray, readers: Sequence[int]
) -> tuple[int, list[int]] | None:
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


class Mesh:
    """Frames between the peers of one group over ZeroMQ sockets."""

    def __init__(
        self,
        transport: Transport,
        host: str,
        *,
        max_message_bytes: int,
        on_message: MessageHandler,
        on_link_down: LinkDownHandler,
    ) -> None:
        self.transport = transport
        self.host = host
        self.max_message_bytes = max_message_bytes
        self.on_message = on_message
        self.on_link_down = on_link_down
        self.counters = Counters()
        self.endpoint = ""  # the first of self.endpoints
        self.endpoints: list[str] = []
        self.group_id = ""
        self.rank = -1
        self._ctx = zmq.asyncio.Context.instance()
        self._router: zmq.asyncio.Socket | None = None
        self._links: dict[int, zmq.asyncio.Socket] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._closed = False
        self._monitored = False
        self._gone: dict[int, PeerLost] = {}
        # Over inproc every large piece goes as a snapshot (see connect).
        self._snapshot_all = False
        self._rings: shm.SharedRings | None = None
        tune_malloc()

    async def bind(self) -> list[str]:
        """Bind this peer's ROUTER and return the endpoints the others may connect to."""
        router = self._ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.RCVHWM, HWM)
        router.setsockopt(zmq.LINGER, 0)
        # A hard per-frame cap; a peer that exceeds it is disconnected by libzmq.
        router.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        self._router = router
        for address in self.transport.bind_addresses(self.host):
            router.bind(address)
            self.endpoints.append(router.getsockopt_string(zmq.LAST_ENDPOINT))
        self.endpoint = self.endpoints[0]
        return self.endpoints

    def connect(self, group_id: str, rank: int, endpoints: Sequence[str]) -> None:
        """Open a link to every other peer and start reading."""
        assert self._router is not None, "bind() first"
        self.group_id, self.rank = group_id, rank
        # Heartbeats and monitors need a real connection; inproc has neither. Over inproc a
        # zero-copy frame is shared with the receiver until it frees it, so two peers that
        # each hold the other's frame while waiting to reuse their own would deadlock:
        # inproc sends snapshots (copies owned by libzmq, nobody waits for them) instead.
        inproc = self.transport.name == "inproc"
        monitored = self._monitored = not inproc
        self._snapshot_all = inproc
        near = {
            peer for peer, endpoint in enumerate(endpoints)
            if peer != rank and endpoint.startswith("ipc://")
        }
        if near and not inproc and shm.enabled():
            # Peers reached over ipc share this host: large pieces may go through shared
            # memory, to those of them that map the ring announced in the hello.
            self._rings = shm.SharedRings(rank, len(endpoints), near, group_id)
        for peer, endpoint in enumerate(endpoints):
            if peer == rank:
                continue
            link = self._ctx.socket(zmq.DEALER)
            link.setsockopt(zmq.IDENTITY, b"%d" % rank)
            link.setsockopt(zmq.SNDHWM, HWM)
            link.setsockopt(zmq.LINGER, LINGER_MS)
            if monitored:
                link.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
                link.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
                link.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TIMEOUT_MS)
                monitor = link.get_monitor_socket(zmq.EVENT_DISCONNECTED)
                self._tasks.append(asyncio.create_task(self._watch(peer, monitor)))
            link.connect(endpoint)
            self._links[peer] = link
        self._tasks.append(asyncio.create_task(self._read()))

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
        links = [self._link(dst) for dst in dsts]
        nbytes = [a.nbytes for a in payload]
        rings = self._rings
        near = rings.readers(dsts) if rings is not None else []
        outbox = rings.outbox if near and rings is not None else None
        # Where each piece went in the ring: (offset, reader indices), or None.
        placed: list[tuple[int, list[int]] | None] = []
        for piece in payload:
            spot = None
            if outbox is not None and piece.nbytes >= ZERO_COPY_BYTES:
                spot = await _put(outbox, piece, near)  # None: the ring stayed full
            placed.append(spot)
        tracked: list[zmq.Frame] = []
        snapshot = copy or self._snapshot_all
        for dst, link, header in zip(dsts, links, headers, strict=True):
            header.nbytes = nbytes
            frames: list[object] = []
            reader = near.index(dst) if dst in near else -1
            offsets, indices = [], []
            for piece, spot in zip(payload, placed, strict=True):
                if spot is not None and reader >= 0:
                    offsets.append(spot[0])
                    indices.append(spot[1][reader])
                    continue
                offsets.append(-1)
                indices.append(-1)
                if piece.nbytes < ZERO_COPY_BYTES:
                    frames.append(piece.tobytes() if piece.nbytes else b"")
                elif snapshot:
                    frames.append(zmq.Frame(piece, copy=True))
                else:
                    frame = zmq.Frame(piece, copy=False, track=True)
                    tracked.append(frame)
                    frames.append(frame)
            if outbox is not None and any(at >= 0 for at in offsets):
                header.shm = [outbox.name, offsets, indices]
            frames.insert(0, encode_header(header))
            await link.send_multipart(frames, copy=False)
            if header.kind == "data":
                c = self.counters
                c.messages_sent += 1
                c.bytes_sent += sum(nbytes)
                c.bytes_sent_shm += sum(n for n, at in zip(nbytes, offsets) if at >= 0)
        return zmq.MessageTracker(*tracked) if tracked else None

    def _link(self, dst: int) -> zmq.asyncio.Socket:
        gone = self._gone.get(dst)
        if gone is not None:
            raise gone
        link = self._links.get(dst)
        if link is None:
            if self._closed:
                raise PeerLost(f"cannot send to rank {dst}: this peer has closed", dst)
            raise ValueError(f"no link to rank {dst} (rank {self.rank}, {len(self._links)} links)")
        return link

    def mark_gone(self, peer: int, exc: PeerLost) -> None:
        """Peer ``peer`` has left or died: sending to it raises ``exc`` from now on."""
        self._gone.setdefault(peer, exc)

    def post(self, dst: int, header: Header) -> None:
        """Send a control message (no payload) without waiting; never raises."""
        link = self._links.get(dst)
        if link is None or link.closed:
            return
        try:
            sent = link.send(encode_header(header), zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.debug("control message to rank %d not sent: %s", dst, exc)
            return
        # An asyncio socket reports a full queue (EAGAIN) through the returned future.
        sent.add_done_callback(_discard_outcome)

    def greet(self, header: Header) -> None:
        """Post a hello to every other peer; to those of this host it names this peer's
        shared-memory ring, which they map if they can (see :mod:`.shm`)."""
        outbox = self._rings.outbox if self._rings is not None else None
        for peer in self._links:
            meta = {"ring": outbox.name} if outbox and peer in self._rings.peers else None
            self.post(peer, dataclasses.replace(header, meta=meta))

    def broadcast_control(self, header: Header) -> None:
        """Post a control message to every other peer."""
        for peer in self._links:
            self.post(peer, header)

    async def _read(self) -> None:
        assert self._router is not None
        router = self._router
        while True:
            try:
                frames = await router.recv_multipart(copy=False)
            except (asyncio.CancelledError, zmq.ContextTerminated):
                return
            except zmq.ZMQError as exc:
                if self._closed:
                    return
                log.error("rank %d: receive failed: %s", self.rank, exc)
                continue
            try:
                header, payload = self._validate(frames)
            except ProtocolError as exc:
                self.counters.messages_dropped += 1
                log.warning("rank %d: dropped a malformed message: %s", self.rank, exc)
                continue
            if header.kind == "data":
                self.counters.messages_received += 1
                self.counters.bytes_received += sum(header.nbytes)
            elif header.kind == "hello" and header.meta and "ring" in header.meta:
                self._accept_ring(header.src, header.meta["ring"])
            try:
                self.on_message(header, payload)
            except ProtocolError as exc:
                self.counters.messages_dropped += 1
                log.warning("rank %d: dropped a message: %s", self.rank, exc)
            # Let go of the frames before waiting: over inproc a zero-copy send is complete
            # only when the receiver frees its frame, and the sender may be waiting for that.
            del frames, payload

    def _accept_ring(self, peer: int, name: object) -> None:
        """Map the shared-memory ring a peer of this host announced; if that fails, the
        peer keeps sending to this one over the socket."""
        if self._rings is None or peer not in self._rings.peers:
            return
        try:
            if not isinstance(name, str):
                raise ProtocolError(f"ring name {name!r} is not a string")
            self._rings.accept(peer, name)
        except ProtocolError as exc:
            log.info("rank %d: no shared memory from rank %d: %s", self.rank, peer, exc)

    def _validate(self, frames: list[zmq.Frame]) -> tuple[Header, list[Piece]]:
        if len(frames) < 2:
            raise ProtocolError("message has no header frame")
        identity = frames[0].bytes
        size = sum(len(f) for f in frames[1:])
        if size > self.max_message_bytes:
            raise ProtocolError(f"message of {size} bytes exceeds the {self.max_message_bytes} cap")
        header = decode_header(frames[1].bytes)
        if header.group != self.group_id:
            raise ProtocolError(f"message for group {header.group!r}, this is {self.group_id!r}")
        if identity != b"%d" % header.src:
            raise ProtocolError(f"header claims rank {header.src} but came on link {identity!r}")
        payload: list[Piece] = list(frames[2:])
        offsets = header.shm[1] if header.shm is not None else [-1] * len(header.nbytes)
        inline = offsets.count(-1)
        if len(payload) != inline:
            raise ProtocolError(
                f"header lists {inline} payload frames, message has {len(payload)}"
            )
        for i, (frame, n) in enumerate(zip(payload, (n for n, at in zip(header.nbytes, offsets)
                                                      if at == -1), strict=True)):
            if len(frame) != n:
                raise ProtocolError(f"payload frame {i} has {len(frame)} bytes, header says {n}")
        if header.shm is None:
            return header, payload
        if self._rings is None:
            raise ProtocolError("message names a shared-memory ring, this peer maps none")
        inbox = self._rings.inbox(header.src, header.shm[0])
        inline_frames = iter(payload)
        pieces = [next(inline_frames) if at == -1 else inbox.take(at, n, k)
                  for n, at, k in zip(header.nbytes, offsets, header.shm[2], strict=True)]
        return header, pieces

    async def _watch(self, peer: int, monitor: zmq.asyncio.Socket) -> None:
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())
                if event["event"] == zmq.EVENT_DISCONNECTED and not self._closed:
                    self.on_link_down(peer)
        except (asyncio.CancelledError, zmq.ZMQError):
            pass
        finally:
            monitor.close(linger=0)

    async def aclose(self) -> None:
        """Stop reading and close every socket; queued outgoing messages get LINGER_MS."""
        if self._closed:
            return
        self._closed = True
        # Stop the monitors while their PAIR sockets are still open: libzmq sends a final
        # event on stop, and a send to a PAIR whose peer has closed blocks forever.
        for link in self._links.values():
            if self._monitored:
                link.disable_monitor()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for link in self._links.values():
            link.close()
        self._links.clear()
        if self._rings is not None:
            self._rings.close()
        if self._router is not None:
            self._router.close(linger=0)
            for endpoint in self.endpoints:
                self.transport.cleanup(endpoint)
