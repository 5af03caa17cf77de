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
alone; :class:`TcpLanes` holds one peer's listener, its lanes and the callbacks that tell
the mesh about them.
"""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from ..errors import ProtocolError
from .tcp_records import (
    END, LARGEST, MAX_FRAMES, TOKEN_BYTES, Record, RecordReader, Tokens, encode_record,
    encode_sized, record_size,
)

if TYPE_CHECKING:
    from typing_extensions import Buffer  # collections.abc.Buffer from Python 3.12

log = logging.getLogger("p2pcoll.transport")

__all__ = ["END", "LARGEST", "MAGIC", "Record", "RecordReader", "TcpLaneIn", "TcpLaneOut",
           "TcpLanes", "Tokens", "encode_record", "record_size"]

PENDING_BYTES = 4 << 20  # what a sender keeps for the kernel at most, per lane
INBOUND_BYTES = 4 << 20  # what a receiver holds unread at most before it stops reading
MAGIC = b"P2PL"
HANDSHAKE_S = 10.0  # a connection to the lane port presents its token within this
MAX_HANDSHAKES = 64  # connections to the lane port still presenting at once
RECV_BYTES = 1 << 18
BYE = b"E"  # what a receiver that closes in good order writes
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


class TcpLaneOut:
    """The sending end of a TCP lane: whole records, what the kernel does not take kept.

    Args:
        sock: the connection (non-blocking), which the receiver never writes to.
        peer: the receiver's rank.
        broken: called (once) with the peer if the connection fails or ends.
    """

    def __init__(self, sock: socket.socket, peer: int,
                 broken: Callable[[int, str], None]) -> None:
        self.sock, self.peer = sock, peer
        self.largest = LARGEST + 8 + 4 * MAX_FRAMES
        self.closed = False
        self.retiring = False  # its END is sent or kept (see retire)
        self._broken = broken
        self._pending: deque[memoryview] = deque()
        self.pending = 0  # bytes kept for the kernel
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(sock.fileno(), self._on_readable)

    def fits_now(self, frames: Sequence[Buffer], spare: int = 0) -> bool:
        """Whether :meth:`write` of ``frames`` with ``spare`` would take them now."""
        need = record_size(frames)
        return (not self.closed and need <= self.largest
                and self.pending + need + spare <= PENDING_BYTES)

    def write(self, frames: Sequence[Buffer], spare: int = 0) -> bool:
        """Send one record of ``frames``, keeping room for ``spare`` bytes after it; False
        (nothing sent) if it does not fit now. Never blocks. On a lane that broke meanwhile
        the record is lost with the peer (True: the peer is being named lost)."""
        pieces, need = encode_sized(frames)
        if need > self.largest or self.pending + need + spare > PENDING_BYTES:
            return False
        if self.closed:
            return True
        if self._pending:
            self._keep(pieces, 0)
            return True
        try:
            sent = self.sock.sendmsg(pieces)
        except BlockingIOError:
            sent = 0
        except OSError as exc:
            self._fail(f"cannot write: {exc}")
            return True
        if sent < need:
            self._keep(pieces, sent)
            self._loop.add_writer(self.sock.fileno(), self._on_writable)
        return True

    def _keep(self, pieces: list[memoryview], sent: int) -> None:
        for piece in pieces:
            if sent >= piece.nbytes:
                sent -= piece.nbytes
                continue
            kept = bytes(piece[sent:])  # the caller may reuse its buffers once we return
            self._pending.append(memoryview(kept))
            self.pending += len(kept)
            sent = 0

    def _on_writable(self) -> None:
        pending = self._pending
        try:
            sent = self.sock.sendmsg(list(pending)[:64])
        except BlockingIOError:
            return
        except OSError as exc:
            self._fail(f"cannot write: {exc}")
            return
        self.pending -= sent
        while sent:
            first = pending[0]
            if sent >= first.nbytes:
                sent -= first.nbytes
                pending.popleft()
            else:
                pending[0] = first[sent:]
                sent = 0
        if not pending:
            self._loop.remove_writer(self.sock.fileno())
            if self.retiring:
                self._shut()

    def _on_readable(self) -> None:
        if self.retiring and not self._pending:  # all sent: the receiver closes its end
            self.close(graceful=False)
            return
        try:
            data = self.sock.recv(1)
        except BlockingIOError:
            return
        except OSError as exc:
            self._fail(f"failed: {exc}")
            return
        if data == BYE:  # the receiver closes in good order: what comes after is not read
            self.close(graceful=False)
            return
        self._fail("closed by the receiver" if not data else "the receiver wrote to it")

    def retire(self) -> None:
        """No more records on this lane (its route's link closes for the budget): the
        :data:`END` goes after what is kept, then this end shuts for writing, and the lane
        closes once the receiver, having read everything, closes its end. Never waits;
        nothing fits any more. Records lost on the way still name the peer lost."""
        if self.closed or self.retiring:
            return
        self.retiring = True
        self.largest = -1
        if self._pending:
            self._pending.append(memoryview(END))
            self.pending += len(END)
            return
        try:
            sent = self.sock.send(END)
        except BlockingIOError:
            sent = 0
        except OSError as exc:
            self._fail(f"cannot write: {exc}")
            return
        if sent < len(END):
            self._keep([memoryview(END)], sent)
            self._loop.add_writer(self.sock.fileno(), self._on_writable)
        else:
            self._shut()

    def _shut(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:  # the receiver has gone already: nothing of it is kept
            self.close(graceful=False)

    def _fail(self, why: str) -> None:
        if not self.closed:
            self.close(graceful=False)
            self._broken(self.peer, why)

    def close(self, graceful: bool = True) -> None:
        """Close the lane; ``graceful``: after what the kernel takes now of the records
        kept and the :data:`END` record (never waiting)."""
        if self.closed:
            return
        self.closed = True
        if graceful:
            try:
                self.sock.sendmsg([*self._pending, *([] if self.retiring else [END])])
            except OSError:
                pass
        self._loop.remove_reader(self.sock.fileno())
        self._loop.remove_writer(self.sock.fileno())
        self._pending.clear()
        self.pending = 0
        self.sock.close()


class TcpLaneIn:
    """The receiving end of a TCP lane: reads and checks the records of one peer.

    Args:
        sock: the connection (non-blocking, its token sent).
        peer: the sender's rank.
        arrived: called with the peer when records have come (read them with :meth:`read`).
        broken: called (once) with the peer and what broke when the lane fails, ends or
            carries garbage; records that came whole before stay readable.
    """

    #: Whether its sender runs in this process (then no receive polls it); None: not
    #: looked at yet (see :meth:`TcpLanes.polled`).
    near: bool | None = None

    def __init__(self, sock: socket.socket, peer: int, arrived: Callable[[int], None],
                 broken: Callable[[int, ProtocolError], None]) -> None:
        self.sock, self.peer = sock, peer
        self.closed = False
        self.reader = RecordReader()
        self._arrived, self._broken = arrived, broken
        self._loop = asyncio.get_running_loop()
        self._paused = False
        self._scratch = bytearray(RECV_BYTES)  # received into, then fed to the reader
        self._loop.add_reader(sock.fileno(), self._on_readable)

    def poll(self) -> None:
        """Read what the kernel holds now, without waiting (a receive's poll before it
        parks, see :class:`~.lane_poll.LanePoll`): the same read as the loop's callback,
        so records are handed on in the same order. Never raises."""
        if not self._paused and not self.closed:
            self._on_readable()

    def read(self) -> Record | None:
        """The next whole record, or None (see :class:`~.ordering.LaneReader`)."""
        record = self.reader.take()
        if self._paused and self.reader.held < INBOUND_BYTES // 2 and not self.closed:
            self._paused = False
            self._loop.add_reader(self.sock.fileno(), self._on_readable)
        return record

    def _on_readable(self) -> None:
        try:
            got = self.sock.recv_into(self._scratch)
        except BlockingIOError:
            return
        except OSError as exc:
            self._fail(ProtocolError(f"TCP lane from rank {self.peer} failed: {exc}",
                                     reason="unexpected"))
            return
        if not got:
            if self.reader.ended:  # the sender closed in good order
                self.close(graceful=False)
                return
            if self.reader.partial:  # what came of the record is dropped (counted)
                self._fail(ProtocolError(f"TCP lane from rank {self.peer} ended mid-record",
                                         reason="malformed"))
            else:
                self._fail(ProtocolError(f"TCP lane from rank {self.peer} ended",
                                         reason="unexpected"))
            return
        try:
            with memoryview(self._scratch) as data:
                self.reader.feed(data[:got])
        except ProtocolError as exc:
            self._fail(exc)
            return
        if self.reader.held >= INBOUND_BYTES:  # not read: stop until it is (backpressure)
            self._paused = True
            self._loop.remove_reader(self.sock.fileno())
        if self.reader.records:
            self._arrived(self.peer)

    def _fail(self, exc: ProtocolError) -> None:
        if not self.closed:
            self.close(graceful=False)
            self._broken(self.peer, exc)

    def retire(self) -> None:
        """This lane is no longer read: its sender has named a newer one, after the end of
        the link this one served, so nothing on it is wanted any more. It closes when the
        sender's end comes (or at once if it has); nothing of it is told."""
        self._arrived = _ignore
        self._broken = _ignore

    def close(self, graceful: bool = True) -> None:
        """Close the lane; ``graceful``: with a :data:`BYE` first (never waiting)."""
        if self.closed:
            return
        self.closed = True
        if graceful:
            try:
                self.sock.send(BYE)
            except OSError:
                pass
        self._loop.remove_reader(self.sock.fileno())
        self.sock.close()


def _ignore(*_: object) -> None:
    pass


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
