"""TCP lanes: small messages between peers of different hosts without ZeroMQ's I/O threads.

A message through libzmq crosses an I/O thread on each side before the receiver's event
loop sees it: one 4 KiB exchange through pyzmq over tcp takes 68-83 us here, two plain
Python TCP sockets 18-19 us (``benchmarks/README.md``, "cross-host path"). A TCP lane is
the cross-host twin of the shared-memory lane (:mod:`.lane`): one plain non-blocking TCP
connection per ordered pair of peers that talk, which the sender writes whole records into
and the receiver's event loop watches (``loop.add_reader``). What the kernel does not take
at once is kept and written when the socket has room (``loop.add_writer``): a write never
blocks the loop. Only messages up to :data:`LARGEST` bytes go on a lane; larger ones go
over the ZeroMQ link (zero-copy, striped), and :mod:`.ordering` keeps each sender's order
across the two, with the same markers as the shared-memory lanes.

Connections. The *sender* listens (one listening socket per peer, on the address of its
ZeroMQ endpoint, any port) and names its lane to a peer in its hello to that peer, over the
ZeroMQ link: ``tcp_lane = "<port>:<token>"``, a one-time token of :data:`TOKEN_BYTES` random
bytes. The receiver connects to that port at the host of the sender's endpoint in the
roster and presents :data:`MAGIC` and the token; the sender takes the connection as its lane
to that peer once the token matches, and only then moves messages onto it. A connection
that presents anything else, or nothing within :data:`HANDSHAKE_S`, is closed and counted
(``links_refused``). The receiver never writes after the token.

Records. ``size: u32, count: u32, count x length: u32``, then the frames back to back;
``size`` is the whole record's. A record of no frames (:data:`END`) is the last: its sender
closes the lane as its peer closes (a goodbye), and the receiver answers by writing its one
byte, :data:`BYE`, before it closes its end likewise; a lane that ends without them was
cut (a killed peer, a failed network). The receiver checks every record as it arrives: a record
whose sizes do not add up (or larger than :data:`LARGEST` allows) breaks the lane: the
lane is closed, the message dropped and counted, and the sender's link named down (what it
sent is lost, so it is lost like any other peer). A lane that ends or fails, mid-record or
not, is the same: a partial record is never handed on.

Security: a lane is plaintext. Lanes are opened only in groups without a job key
(``--insecure``); a keyed group's messages all go over its CurveZMQ links.

Lanes are on by default (``P2PCOLL_TCP_LANES=0`` turns them off): on a quiet host they
take a 4 KiB cross-host allreduce at p = 2 from 300-460 us to 90-160 us (see
``benchmarks/README.md``, "TCP lanes"). A lane goes with its link: when the link budget
(``max_links``, see :mod:`.route`) closes the route's link, the sender moves off the lane
(``lane off``, read before the link's end) and retires it (:meth:`TcpLanes.retire`: its
:data:`END` after what it keeps, then the lane closes once the receiver has read it); the
next link's hello names a new lane with a new token, and the receiver, which reads that
hello only after the old link's end, retires the old lane and connects to the new one.

Polling. A receive whose message has not come reads the lanes before it parks (the same
read as the loop's callback, :meth:`TcpLaneIn.poll`), and then polls its peer's lane for a
budget learned per peer, capped by ``P2PCOLL_SPIN`` (:mod:`.lane_poll`,
:mod:`p2pcoll.engine.polling`): an answer that comes within tens of microseconds is read
without a turn of the event loop or a wake-up of a sleeping process. Peers of one process
(:meth:`TcpLanes.polled`) are never polled for: they share the loop that would poll.

The record codec and the tokens (:mod:`.tcp_records`) have no sockets and are tested
alone; a lane's two ends are :mod:`.tcp_lane_ends`; :class:`TcpLanes` holds one peer's
listener, its lanes and the callbacks that tell the mesh about them.
"""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import weakref
from collections.abc import Callable

from ..errors import ProtocolError
from .tcp_lane_ends import TcpLaneIn, TcpLaneOut
from .tcp_records import (
    END, LARGEST, TOKEN_BYTES, Record, RecordReader, Tokens, encode_record, record_size,
)

log = logging.getLogger("p2pcoll.transport")

__all__ = ["END", "LARGEST", "MAGIC", "Record", "RecordReader", "TcpLaneIn", "TcpLaneOut",
           "TcpLanes", "Tokens", "encode_record", "record_size"]

MAGIC = b"P2PL"
HANDSHAKE_S = 10.0  # a connection to the lane port presents its token within this
# A retired lane whose other end has not closed within this is closed here (a peer that
# keeps its ends open would otherwise hold a socket per retirement); what it still kept
# for the peer is then cut, and the peer, if it is still reading, names this one lost.
RETIRED_S = 30.0
MAX_HANDSHAKES = 64  # connections to the lane port still presenting at once
# Every peer's lanes in this process (peers of one process poll none of each other's: a
# poll there would only hold up the event loop they share).
_IN_PROCESS: weakref.WeakSet[TcpLanes] = weakref.WeakSet()
_ANNOUNCED = re.compile(r"([1-9][0-9]{0,4}):([0-9a-f]{32})")  # port:token (TOKEN_BYTES hex)


def _listening_here(sock: socket.socket) -> bool:
    """Whether ``sock`` is connected to a lane port of this process."""
    try:
        host, port = sock.getpeername()[:2]
    except OSError:
        return False
    return any(lanes.port == port and lanes.host == host and not lanes._closed
               for lanes in _IN_PROCESS)


def _host_of(endpoint: str) -> str:
    """The host of ``tcp://HOST:PORT`` (brackets of an IPv6 address removed)."""
    return endpoint.removeprefix("tcp://").rpartition(":")[0].strip("[]")


class TcpLanes:
    """A peer's TCP lanes to and from the peers of other hosts, and its lane port.

    Args:
        rank: this peer's rank.
        far: the peers of other hosts, each with its ZeroMQ endpoint (``tcp://HOST:PORT``).
        bind: this peer's own ``tcp://`` endpoint: the lane port listens on its host.
        arrived: see :class:`TcpLaneIn`.
        broken: called with a peer and what broke when a lane with it fails.
        inbound: called with a peer and its lane to this one once that is connected (before
            the token goes: the sender moves messages onto it only after).
        refused: called once for each connection to the lane port that was closed.

    Raises:
        OSError: the lane port cannot listen.
    """

    def __init__(self, rank: int, far: dict[int, str], bind: str,
                 arrived: Callable[[int], None],
                 broken: Callable[[int, ProtocolError], None],
                 inbound: Callable[[int, TcpLaneIn], None],
                 refused: Callable[[], None]) -> None:
        self.rank = rank
        self.far = {peer: _host_of(e) for peer, e in far.items()}
        self._arrived, self._broken, self._inbound = arrived, broken, inbound
        self._refused = refused
        self.tokens = Tokens()
        self.out: dict[int, TcpLaneOut] = {}
        self.into: dict[int, TcpLaneIn] = {}
        self._announced: dict[int, dict[str, str]] = {}
        self._current: dict[int, bytes] = {}  # peer -> the token its lane presents now
        self._retiring: list[TcpLaneOut | TcpLaneIn] = []  # retired, not closed yet
        self._heard: dict[int, str] = {}  # peer -> the lane it named last ("port:token")
        self._connecting: dict[int, asyncio.Task[None]] = {}
        self._handshakes: dict[socket.socket, tuple[bytearray, asyncio.TimerHandle]] = {}
        self._closed = False
        host = _host_of(bind)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._listener.setblocking(False)
            self._listener.bind((host, 0))
            self._listener.listen(64)
        except OSError:
            self._listener.close()
            raise
        self.port = self._listener.getsockname()[1]
        self.host = host
        _IN_PROCESS.add(self)
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._listener.fileno(), self._on_connection)

    # The sending side: the lane port, the tokens, the lanes once presented.

    def announce(self, peer: int) -> dict[str, str]:
        """What the hello to ``peer`` names: this peer's lane port and ``peer``'s token
        (the same each time until the lane is retired: then a new one)."""
        if peer not in self.far or self._closed:
            return {}
        meta = self._announced.get(peer)
        if meta is None:
            token = self._current[peer] = self.tokens.issue(peer)
            meta = self._announced[peer] = {"tcp_lane": f"{self.port}:{token.hex()}"}
        return meta

    def retire(self, peer: int) -> None:
        """The link to ``peer`` closes for the budget: my lane to it goes with it (see
        :meth:`TcpLaneOut.retire`; what it carries is read before the link's end), and
        the next hello names a new one. A token named before and presented later gets a
        lane that ends at once."""
        self._announced.pop(peer, None)
        self._current.pop(peer, None)
        out = self.out.pop(peer, None)
        if out is not None:
            self._retire(out)

    def _retire(self, lane: TcpLaneOut | TcpLaneIn) -> None:
        lane.retire()
        self._retiring = [kept for kept in self._retiring if not kept.closed]
        if not lane.closed:
            self._retiring.append(lane)
            self._loop.call_later(RETIRED_S, self._expire, lane)

    def _expire(self, lane: TcpLaneOut | TcpLaneIn) -> None:
        """A retired lane's other end has not closed within :data:`RETIRED_S`: close it."""
        if not lane.closed:
            log.info("rank %d: a retired TCP lane with rank %d closed after %g s",
                     self.rank, lane.peer, RETIRED_S)
            lane.close(graceful=False)
        self._retiring = [kept for kept in self._retiring if not kept.closed]

    def ready(self, peer: int) -> TcpLaneOut | None:
        """My lane to ``peer`` if it may carry messages (the peer presented its token)."""
        out = self.out.get(peer)
        return out if out is not None and not out.closed else None

    def _on_connection(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except OSError:
            return
        if len(self._handshakes) >= MAX_HANDSHAKES:
            sock.close()
            self._refused()
            return
        sock.setblocking(False)
        timer = self._loop.call_later(HANDSHAKE_S, self._refuse, sock)
        self._handshakes[sock] = (bytearray(), timer)
        self._loop.add_reader(sock.fileno(), self._on_token, sock)

    def _on_token(self, sock: socket.socket) -> None:
        got, _ = self._handshakes[sock]
        try:
            data = sock.recv(len(MAGIC) + TOKEN_BYTES - len(got))
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._refuse(sock)
            return
        got += data
        if len(got) < len(MAGIC) + TOKEN_BYTES:
            return
        token = bytes(got[len(MAGIC):])
        peer = self.tokens.redeem(token) if got.startswith(MAGIC) else None
        current = peer is not None and self._current.get(peer) == token
        if peer is None or (current and peer in self.out):
            self._refuse(sock)
            return
        self._end_handshake(sock)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        out = TcpLaneOut(sock, peer, self._out_broken)
        if current:
            self.out[peer] = out
        else:  # named in a hello before its link closed: it ends at once
            self._retire(out)

    def _refuse(self, sock: socket.socket) -> None:
        """Close a connection to the lane port that presented no valid token (counted)."""
        if sock in self._handshakes:
            self._end_handshake(sock)
            sock.close()
            self._refused()

    def _end_handshake(self, sock: socket.socket) -> None:
        _, timer = self._handshakes.pop(sock)
        timer.cancel()
        self._loop.remove_reader(sock.fileno())

    def _out_broken(self, peer: int, why: str) -> None:
        self._broken(peer, ProtocolError(f"TCP lane to rank {peer} {why}", reason="unexpected"))

    # The receiving side: connect to a peer's lane port and present its token.

    def accept(self, peer: int, announced: object) -> None:
        """Connect to the lane ``peer`` named in its hello (in the background); nothing if
        it names the lane it named before. A new one (its hello on a link opened again
        after one closed for its budget, read after that link's end) retires the lane
        from it: nothing on that one is wanted after the end. If connecting fails, the
        peer keeps sending over the ZeroMQ link.

        Raises:
            ProtocolError: ``peer`` is not of another host, or ``announced`` is not
                ``"<port>:<token>"``.
        """
        if peer not in self.far:
            raise ProtocolError(f"rank {peer} may not announce a TCP lane here")
        match = _ANNOUNCED.fullmatch(announced) if isinstance(announced, str) else None
        if match is None:
            raise ProtocolError(f"TCP lane {announced!r} is not '<port>:<token>'")
        if self._heard.get(peer) == announced or self._closed:
            return
        self._heard[peer] = match[0]
        old = self.into.pop(peer, None)
        if old is not None:
            self._retire(old)
        if peer in self._connecting:  # it connects to the newest lane named once done
            return
        task = self._loop.create_task(self._connect_newest(peer))
        self._connecting[peer] = task
        task.add_done_callback(lambda _: self._connecting.pop(peer, None))

    async def _connect_newest(self, peer: int) -> None:
        """Connect to the lane ``peer`` named last; one it named before and that connects
        after a newer one was named is retired as it connects."""
        connected = ""  # (a peer forgotten meanwhile has named none)
        while (announced := self._heard.get(peer, connected)) != connected and not self._closed:
            connected = announced
            port, token = announced.split(":")
            lane = await self._connect(peer, int(port), bytes.fromhex(token))
            if lane is not None and self._heard.get(peer) != announced:
                if self.into.get(peer) is lane:
                    del self.into[peer]
                self._retire(lane)

    async def _connect(self, peer: int, port: int, token: bytes) -> TcpLaneIn | None:
        host = self.far[peer]
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            await asyncio.wait_for(self._loop.sock_connect(sock, (host, port)), HANDSHAKE_S)
        except (OSError, TimeoutError) as exc:
            sock.close()
            log.info("rank %d: no TCP lane from rank %d (%s)", self.rank, peer, exc)
            return None
        except BaseException:
            sock.close()
            raise
        lane = self.into[peer] = TcpLaneIn(sock, peer, self._arrived, self._broken)
        self._inbound(peer, lane)  # the receiver knows it before the sender may use it
        try:
            sent = sock.send(MAGIC + token)  # a fresh connection takes 20 bytes at once
        except OSError as exc:
            sent, why = 0, str(exc)
        else:
            why = f"{sent} of {len(MAGIC) + TOKEN_BYTES} bytes of the token sent"
        if sent != len(MAGIC) + TOKEN_BYTES:
            lane.close()
            log.info("rank %d: no TCP lane from rank %d (%s)", self.rank, peer, why)
        return lane

    # Polling: a receive reads its lanes before it parks (see .lane_poll).

    def polled(self, peer: int) -> bool:
        """Whether a receive may poll for ``peer``'s records: its lane to this peer is
        open and it runs in another process."""
        lane = self.into.get(peer)
        if lane is None or lane.closed:
            return False
        if lane.near is None:
            lane.near = _listening_here(lane.sock)
        return not lane.near

    def poll(self, peer: int | None = None) -> None:
        """Read what the kernel holds now on ``peer``'s lane to this one, or on every
        lane (None); never waits, never raises."""
        if peer is not None:
            lane = self.into.get(peer)
            if lane is not None:
                lane.poll()
            return
        for lane in list(self.into.values()):
            lane.poll()

    def forget(self, peer: int) -> None:
        """``peer`` has gone: close its lanes (without telling the mesh)."""
        self.tokens.revoke(peer)
        self._heard.pop(peer, None)
        for retiring in [lane for lane in self._retiring if lane.peer == peer]:
            retiring.close()
        for lanes in (self.out, self.into):
            lane = lanes.pop(peer, None)
            if lane is not None:
                lane.close()  # in good order: it may still be reading (its farewells)
        task = self._connecting.pop(peer, None)
        if task is not None:
            task.cancel()

    def close(self) -> None:
        """Close the lane port and every lane, in good order (see the module docstring)."""
        if self._closed:
            return
        self._closed = True
        for task in self._connecting.values():
            task.cancel()
        for sock in list(self._handshakes):
            self._end_handshake(sock)
            sock.close()
        lanes: list[TcpLaneOut | TcpLaneIn] = [*self.out.values(), *self.into.values(),
                                               *self._retiring]
        for lane in lanes:
            lane.close()
        self.out.clear()
        self.into.clear()
        self._loop.remove_reader(self._listener.fileno())
        self._listener.close()
