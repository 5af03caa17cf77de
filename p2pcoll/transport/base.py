"""The transport interface: what the session and the engine need to move frames.

A transport connects one peer to the others of its group and moves messages (a
:class:`~p2pcoll.wire.Header` and payload pieces) between them. Every received message goes
through :func:`p2pcoll.wire.validate` before it is handed to ``on_message``; a message that
fails it, or whose handler raises, is dropped and counted by reason (:class:`Drops`), and
the transport goes on reading. Two implementations: the ZeroMQ mesh (:mod:`.zmq_mesh`,
production) and the in-memory network (:mod:`.memory`, tests that inject loss, delay and
reordering).

Every transport has two hooks for instrumentation (profilers, tests), both None by default:
``sent(dst, header, nbytes)`` is called once per data message and destination after
``send_many`` has queued it, and ``delivered(src, header, nbytes)`` once per valid data
message before it is handed to ``on_message`` (``nbytes``: its payload bytes). With a hook
None nothing is called: one attribute check per data message. A hook must be quick and
must not raise (what a ``delivered`` hook raises drops the message as a handling error).
"""

from __future__ import annotations

import logging
import time
from enum import StrEnum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from ..departures.actions import Forget, Leave, Unwatch, Via, Watch
from ..errors import ProtocolError
from ..types import Membership
from ..wire import Header

log = logging.getLogger("p2pcoll.transport")


class Piece(Protocol):
    """A received payload piece: a ZeroMQ frame, a shared-memory piece, or bytes in memory."""

    @property
    def buffer(self) -> memoryview: ...

    def __len__(self) -> int: ...


class Tracker(Protocol):
    """Reports when the transport has let go of memory it sends from without copying."""

    @property
    def done(self) -> bool: ...


class BytesPiece:
    """A received piece held in memory (bytes of its own)."""

    __slots__ = ("buffer",)

    def __init__(self, data: bytes) -> None:
        self.buffer = memoryview(data)

    def __len__(self) -> int:
        return len(self.buffer)


MessageHandler = Callable[[Header, list[Piece]], None]
MessageHook = Callable[[int, Header, int], None]  # (dst or src, header, payload bytes)


class LinkEvent(StrEnum):
    """A fact about this peer's connections to another, as a transport reports it (see
    :class:`Transport`); the session keeps what follows from them (who may not have read
    all this peer sent, whom an answer reaches) and feeds ``DOWN`` and ``PROBE_DOWN`` to
    the departures machine."""

    OPENED = "opened"  # a link to the peer opened: what goes on it may not be read yet
    CLOSED = "closed"  # a link to the peer was closed for the budget: it drains
    DRAINED = "drained"  # the peer has read every link this one closed to it
    HEARD = "heard"  # the peer's link to this one is read: an answer reaches it
    # and if the peer watches this one, a goodbye reaches it over its probe (not over inproc,
    # which has no probes)
    PROBE_KNOWN = "probe known"
    DOWN = "down"  # a link to the peer went down (lost, unless it says goodbye)
    # its probe went down (its heartbeats stopped): lost, unless it says goodbye or its
    # process still answers (busy, not gone: see p2pcoll.departures.suspects)
    PROBE_DOWN = "probe down"


LinkHandler = Callable[[int, LinkEvent], None]  # (peer, what happened)
Follow = Watch | Unwatch | Forget | Leave  # the departures actions a transport carries out
Poll = Callable[[], None]  # hands on what has come (see Transport.connect)
PathFacts = tuple[float | None, float | None]  # (round-trip seconds, bytes/s); None: unknown


class Paths(Protocol):
    """What a transport has measured of the path to each peer: ``paths[peer]`` is
    ``(round-trip seconds, bytes/s)``, None for what is not measured, both None for a peer
    of this host. What the pipeline's window follows (:mod:`p2pcoll.engine.window`); never
    raises.

    And what the engine tells the paths of the collective about to run: ``drive(peers)``,
    the ranks its program sends to, at once as far as the transport can tell (a ring's one
    neighbour, a direct exchange's p - 1). A transport whose links share a host's line
    splits the line among them (the stripes per pair: :mod:`p2pcoll.transport.paths`); a
    hint, never an error, ignored where nothing is shared.

    And what a measurement of the group's links hands in (:func:`p2pcoll.api.topology.price`):
    ``measure(peer, rtt_s, bandwidth_Bps)``, None for what it did not measure; and
    ``window``, the bytes one connection keeps in flight (the socket buffers' bound; 0 where
    no window binds, as in memory), which with the round trip bounds a path's rate."""

    @property
    def window(self) -> int: ...

    def __getitem__(self, peer: int) -> PathFacts: ...

    def drive(self, peers: frozenset[int]) -> None: ...

    def measure(self, peer: int, rtt_s: float | None = None,
                bandwidth_Bps: float | None = None) -> None: ...


def _unshared(peers: frozenset[int]) -> None:
    """Nothing to split (a transport whose paths share no line)."""


def _unmeasurable(peer: int, rtt_s: float | None = None,
                  bandwidth_Bps: float | None = None) -> None:
    """Nothing to record (a transport whose paths follow no measurement)."""


@dataclass(frozen=True)
class PathsOf:
    """The :class:`Paths` that ``of(peer)`` answers, told what runs by ``driving(peers)``
    and what was measured by ``measuring(peer, rtt_s, bandwidth_Bps)``."""

    of: Callable[[int], PathFacts]
    driving: Callable[[frozenset[int]], None] = _unshared
    measuring: Callable[[int, float | None, float | None], None] = _unmeasurable
    window: int = 0

    def __getitem__(self, peer: int) -> PathFacts:
        return self.of(peer)

    def drive(self, peers: frozenset[int]) -> None:
        self.driving(peers)

    def measure(self, peer: int, rtt_s: float | None = None,
                bandwidth_Bps: float | None = None) -> None:
        self.measuring(peer, rtt_s, bandwidth_Bps)


@dataclass
class Counters:
    """Traffic of one peer since it joined. Bytes are tensor payload, not headers."""

    bytes_sent: int = 0
    bytes_sent_shm: int = 0  # of bytes_sent, those that went through shared memory
    messages_sent_lane: int = 0  # of messages_sent, those that went on a lane (see lane.py)
    bytes_received: int = 0
    messages_sent: int = 0
    messages_received: int = 0
    messages_dropped: int = 0
    # of messages_dropped, how many for each reason: a ProtocolError's reason (see
    # p2pcoll.wire.validation; "impostor": from a second connection claiming a member's
    # rank, see Router._deliver), or "error" for a failure to handle a message (a bug)
    dropped_by_reason: dict[str, int] = field(default_factory=dict)
    # connections to this peer's mesh port that are no member's link (a stranger's or an
    # impostor's, whose messages are dropped as such): see sockets.LinkCensus
    links_refused: int = 0
    # data links this peer opened (links open on demand: see ZmqMesh._link)
    links_opened: int = 0
    # links this peer closed to stay within its budget (P2PCOLL_MAX_LINKS; see .route)
    links_closed: int = 0
    # bytes (on the wire, both ways) between this peer and relays (see .relayed)
    bytes_relayed: int = 0
    # the peers this one reaches, or is reached by, through a relay (see .relayed)
    relayed: frozenset[int] = frozenset()
    # of those, the peers behind a relay too that every connection open between the two
    # reaches directly (a dial's TCP simultaneous open: see p2pcoll.relay.punch), and how
    # many connections went direct so, and how many fell back to the relay after trying
    punched: frozenset[int] = frozenset()
    direct_punched: int = 0
    punch_failed: int = 0
    # stripes this peer opened beside its links (P2PCOLL_STREAMS; see .stripes)
    stripes_opened: int = 0
    # striped links whose send buffers net.core.wmem_max held below the path's need
    # (see .paths)
    socket_buffers_capped: int = 0


class Transport(Protocol):
    """Moves messages between the peers of one group.

    It reports what happens to its connections (:class:`LinkEvent`) through the
    ``on_link`` given at :meth:`connect`, and decides nothing about departures: it carries
    out what the departures machine says (:meth:`post`'s ``via``, :meth:`follow`).
    """

    name: str
    counters: Counters
    endpoints: list[str]
    sent: MessageHook | None  # see the module docstring
    delivered: MessageHook | None
    # The peers whose hellos the group's forming waits for (those that watch this one, see
    # p2pcoll.departures.overlay; every peer in a group on a board), known once connected.
    hello_peers: frozenset[int]
    paths: Paths  # what it has measured of the path to each peer

    async def bind(self) -> list[str]:
        """Start receiving; returns the endpoints other peers may reach this one at."""
        ...

    def connect(self, membership: Membership, on_message: MessageHandler,
                on_link: LinkHandler) -> Poll:
        """Start delivering; links to the other peers of ``membership`` open as they are
        first sent to. Watches nobody until told (:meth:`follow`).

        Returns:
            A function that hands on to ``on_message``, now, what has come and waits to be
            read, without waiting for more: a receive calls it before it parks, so a
            message that is already there costs no turn of the event loop. Never raises.
        """
        ...

    async def send_many(self, dsts: Sequence[int], headers: Sequence[Header],
                        payload: Sequence[np.ndarray] = (), *,
                        copy: bool = False) -> Tracker | None:
        """Queue one message with the same payload to each of ``dsts`` (one header each).

        Without ``copy`` large pieces may be sent from the arrays themselves: then a tracker
        is returned and the arrays must not be written until it is done.

        Raises:
            PeerLost: this peer has closed (or, leaving, has no link to a destination).
        """
        ...

    def post(self, dst: int, header: Header, via: Via = "link") -> None:
        """Send a control message (no payload) without waiting; never raises. ``via``:

        - ``"link"``: this peer's link to ``dst``, opened if need be (not once leaving:
          then a message to a peer it has no link to is not sent);
        - ``"probe"``: ``dst``'s probe of this peer (a goodbye to a watcher this peer has
          no link to; its answer comes back on it);
        - ``"answer"``: back on the connection ``dst``'s last message came on, even once
          ``dst`` is forgotten (a peer told it was declared lost); opens nothing.

        A message that cannot go is not sent (and logged at DEBUG).
        """
        ...

    def greet(self, header: Header) -> None:
        """Post a hello to the peers this one watches (departures.overlay), with whatever the
        transport needs to announce, and to any other peer before the first message sent
        to it."""
        ...

    def follow(self, action: Follow) -> None:
        """Carry out a departures action: probe a peer (:class:`Watch`) or stop
        (:class:`Unwatch`), let go of what is kept for a peer that has gone
        (:class:`Forget`), or (:class:`Leave`) open no link from now on and read the
        answers that come back on the links this peer has. Idempotent; never raises."""
        ...

    async def aclose(self) -> None:
        """Stop delivering and release every resource; idempotent."""
        ...


class Drops:
    """Counts dropped messages by reason and logs them: each at DEBUG, and at most one
    WARNING line per source per interval, which names the reason and counts the drops it
    did not report (a flood of bad messages must not become a flood of logs)."""

    def __init__(self, counters: Counters, rank: Callable[[], int], interval: float = 10.0):
        self.counters = counters
        self._rank = rank
        self.interval = interval
        self._last: dict[object, float] = {}
        self._quiet: dict[object, dict[str, int]] = {}  # source -> unreported drops by reason

    def drop(self, source: object, reason: BaseException, *, bug: bool = False) -> None:
        """Count one dropped message from ``source`` (a rank or a link identity).

        ``reason`` is the ProtocolError it broke, or (``bug``) whatever else handling it
        raised, which is counted as ``"error"``.
        """
        code = reason.reason if isinstance(reason, ProtocolError) and not bug else "error"
        c = self.counters
        c.messages_dropped += 1
        c.dropped_by_reason[code] = c.dropped_by_reason.get(code, 0) + 1
        log.debug("rank %d: dropped a message from %s (%s): %s", self._rank(), source, code,
                  reason)
        now = time.monotonic()
        if now - self._last.get(source, -self.interval) < self.interval:
            quiet = self._quiet.setdefault(source, {})
            quiet[code] = quiet.get(code, 0) + 1
            return
        self._last[source] = now
        more = ""
        quiet = self._quiet.pop(source, {})
        if quiet:
            counts = ", ".join(f"{n} {why}" for why, n in sorted(quiet.items()))
            more = (f" ({sum(quiet.values())} more from there since the last report: "
                    f"{counts})")
        if code == "error":  # not a bad message but a failure handling a good one: show where
            log.error("rank %d: dropped a message from %s (error)%s", self._rank(), source,
                      more, exc_info=reason)
        else:
            log.warning("rank %d: dropped a message from %s (%s): %s%s", self._rank(), source,
                        code, reason, more)
