"""Shared-memory payloads between peers of one host.

Over a socket a payload is copied twice by the kernel (into the socket, out of it) and once
more by the receiver (into its data); on a 2-core machine those copies, and the wake-ups of
libzmq's I/O threads that make them, are most of a large collective's time. Between peers
that reach each other over ipc (same host), a sender instead copies a large piece once into
a ring buffer in shared memory that only it writes, and the message carries where the piece
lies instead of the piece; the receiver reduces or copies straight out of the ring.

One ring per sending peer, read by every peer it sends large pieces to: a file in
``/dev/shm``, created by the sender on its first large send and mapped by each receiver
when the first message naming it arrives. A piece sent to several peers (the root of a
broadcast) is copied in once and read by all of them. The space is reserved with
``posix_fallocate``: a full ``/dev/shm`` fails cleanly there instead of crashing a later
write with SIGBUS.

The header page holds, per reader rank, how many of the pieces addressed to it it has
released (in order of the per-reader index each message carries, though pieces may be
consumed in any order), whether it has mapped the file, and whether it was ever addressed.
The sender reserves space in order (``head``, a running byte count) and frees the oldest
reservations once every reader they were addressed to has released them. A piece is
released when the last reference to its :class:`ShmFrame` goes (the executor drops frames
right after reducing them). A send that finds no room goes over the socket as usual, so a
slow receiver never blocks a sender and nothing can deadlock on the ring.

Clean-up: the file is unlinked by whichever side finds, after announcing its own part, the
sender closed and every addressed reader mapped: the sender when it closes, or the last
reader to map it. (The sender cannot simply unlink it when it closes: its last messages
may not have been read yet.) A file whose reader never came, because it died first, is
removed by the next peer on the host that starts, once its creator is gone and it is a
minute old.

Ordering: the sender writes the piece before the message naming it is sent, and a reader
publishes its release after it has read the piece; a lock round trip on each side (a full
memory barrier) keeps those orders on every architecture.

``P2PCOLL_SHM=0`` turns this off; ``P2PCOLL_SHM_BYTES`` sets the ring size (16 MiB).
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import threading
import uuid
from collections import deque
from collections.abc import Sequence

import numpy as np

from ..errors import ProtocolError

log = logging.getLogger("p2pcoll.transport")

SHM_DIR = "/dev/shm"
PAGE = 4096
# The header: four int64 (header bytes, ring bytes, readers, sender closed), then per reader
# rank its released count, its mapped flag and its addressed flag (int64 each).
PREAMBLE = 4
ALIGN = 64  # pieces start on cache lines
NAME = re.compile(r"p2pcoll-[0-9]+-[0-9a-f]{16}")
MAX_INBOXES_PER_PEER = 4

_barrier_lock = threading.Lock()


def _barrier() -> None:
    """A full memory barrier: a lock's acquire and release both fence."""
    with _barrier_lock:
        pass


def enabled() -> bool:
    """Whether same-host links may use shared memory (``P2PCOLL_SHM``, default on)."""
    return os.environ.get("P2PCOLL_SHM", "1") != "0" and os.path.isdir(SHM_DIR)


def ring_bytes() -> int:
    """The ring size of each peer's outbox (``P2PCOLL_SHM_BYTES``, default 16 MiB)."""
    raw = os.environ.get("P2PCOLL_SHM_BYTES", str(16 << 20))
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"P2PCOLL_SHM_BYTES must be a byte count, got {raw!r}") from None
    if value < 1 << 16:
        raise ValueError(f"P2PCOLL_SHM_BYTES must be at least 65536, got {value}")
    return value - value % ALIGN


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) & ~(ALIGN - 1)


def placement(start: int, n: int, ring: int) -> tuple[int, int]:
    """Where a piece of ``n`` bytes reserved at running offset ``start`` lies.

    Returns its position in the ring and the running offset where its reservation ends.
    Both sides compute it, so a message needs to carry only ``start``.
    """
    size = _aligned(n)
    pos = start % ring
    if pos + size > ring:  # skip to the ring's start; the skipped bytes are this piece's
        return 0, start + (ring - pos) + size
    return pos, start + size


def header_bytes(readers: int) -> int:
    """Bytes of the header page(s) of a ring with ``readers`` reader slots."""
    n = 8 * (PREAMBLE + 3 * readers)
    return (n + PAGE - 1) // PAGE * PAGE


class _Header:
    """Views of a ring file's header (both sides map the same one)."""

    def __init__(self, buf: mmap.mmap, readers: int) -> None:
        words = np.frombuffer(buf, np.int64, count=PREAMBLE + 3 * readers)
        self.preamble = words[:PREAMBLE]
        self.released = words[PREAMBLE:PREAMBLE + readers]
        self.mapped = words[PREAMBLE + readers:PREAMBLE + 2 * readers]
        self.addressed = words[PREAMBLE + 2 * readers:]

    def everyone_in(self) -> bool:
        """The sender has closed and every reader it addressed has mapped the file."""
        _barrier()
        return bool(self.preamble[3]) and bool(np.all(self.mapped[self.addressed != 0]))


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class Outbox:
    """A peer's sending ring: copies pieces in once, for one or several readers."""

    def __init__(self, ring: int, readers: int) -> None:
        self.name = f"p2pcoll-{os.getpid()}-{uuid.uuid4().hex[:16]}"
        self.path = os.path.join(SHM_DIR, self.name)
        self.ring = ring
        self.readers = readers
        head = header_bytes(readers)
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.posix_fallocate(fd, 0, head + ring)
            self._map = mmap.mmap(fd, head + ring)
        except BaseException:
            os.unlink(self.path)
            raise
        finally:
            os.close(fd)
        self._header = _Header(self._map, readers)
        self._header.preamble[:3] = (head, ring, readers)
        self._data = np.frombuffer(self._map, np.uint8, offset=head)
        self.head = 0
        # Reservations not yet freed, oldest first: (start, end, ((reader, index), ...)).
        self._live: deque[tuple[int, int, tuple[tuple[int, int], ...]]] = deque()
        self._next: dict[int, int] = {}  # per reader: the index of its next piece
        self.stalled = False  # the last wait for room ran out (see mesh._put)

    def _tail(self) -> int:
        """Free the oldest reservations every reader has released; where the used part starts."""
        live = self._live
        released = self._header.released
        while live and all(released[r] > k for r, k in live[0][2]):
            live.popleft()
        return live[0][0] if live else self.head

    def put(self, piece: np.ndarray, readers: Sequence[int]) -> tuple[int, list[int]] | None:
        """Copy ``piece`` (C-contiguous) in for ``readers``; its running offset and each
        reader's index, or None if the ring is full.

        The offset is where the piece's reservation starts. A piece never wraps: if it does
        not fit before the end of the ring, its reservation also covers the rest of the ring
        and its data starts at the ring's start (see :func:`placement`).
        """
        start = self.head
        pos, end = placement(start, piece.nbytes, self.ring)
        tail = self._tail()
        _barrier()  # read the released counts before overwriting what they free
        if end - tail > self.ring:
            return None
        np.copyto(self._data[pos:pos + piece.nbytes], piece.reshape(-1).view(np.uint8))
        indices = []
        for r in readers:
            k = self._next.get(r, 0)
            self._next[r] = k + 1
            indices.append(k)
            self._header.addressed[r] = 1
        self._live.append((start, end, tuple(zip(readers, indices))))
        self.head = end
        _barrier()  # the piece is in memory before the message naming it leaves
        return start, indices

    def close(self) -> None:
        """Drop this side's mapping; unlink the file if no reader still has to map it."""
        self._header.preamble[3] = 1
        if self.head == 0 or self._header.everyone_in():
            _unlink(self.path)
        del self._header, self._data
        try:
            self._map.close()
        except BufferError:  # a view is still alive somewhere; the GC unmaps it later
            pass


class ShmFrame:
    """A received piece in a peer's ring; the space returns to the sender when it goes."""

    __slots__ = ("buffer", "_inbox", "_index")

    def __init__(self, inbox: Inbox, index: int, buffer: memoryview) -> None:
        self.buffer = buffer
        self._inbox = inbox
        self._index = index

    def __len__(self) -> int:
        return len(self.buffer)

    def __del__(self) -> None:
        try:
            self.buffer.release()
        except BufferError:
            # An array still views the piece: never let the sender overwrite it. The space
            # stays taken (later sends that find no room go over the socket).
            log.warning("a view of a shared-memory piece outlived its frame; space not reused")
            return
        except Exception:  # interpreter teardown
            return
        self._inbox.release(self._index)


class Inbox:
    """A reader's view of one peer's ring: offsets to frames, releases published in order."""

    def __init__(self, name: str, me: int) -> None:
        if not NAME.fullmatch(name):
            raise ProtocolError(f"shared-memory segment name {name!r} is not one of ours")
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            raise ProtocolError(f"cannot open shared-memory segment {name!r}: {exc}") from None
        try:
            size = os.fstat(fd).st_size
            if size < PAGE:
                raise ProtocolError(f"shared-memory segment {name!r} has a bad size {size}")
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        head, ring, readers = (int(v) for v in np.frombuffer(self._map, np.int64, count=3))
        if (readers <= me or head != header_bytes(readers) or head + ring != size
                or ring <= 0 or ring % ALIGN):
            self._map.close()
            raise ProtocolError(
                f"shared-memory segment {name!r} has a bad header ({head}, {ring}, {readers}) "
                f"for {size} bytes and reader {me}"
            )
        self.name = name
        self.path = path
        self.ring = ring
        self._header = _Header(self._map, readers)
        self._me = me
        self._data = memoryview(self._map)[head:]
        self._count = int(self._header.released[me])  # pieces released, in index order
        self._taken: set[int] = set()  # indices handed out as frames, not yet released
        self._done: set[int] = set()  # indices released out of order
        self.closed = False
        self._header.mapped[me] = 1
        if self._header.everyone_in():  # the sender left first: this reader was the last
            _unlink(path)

    def take(self, start: int, n: int, index: int) -> ShmFrame:
        """The frame for a piece of ``n`` bytes reserved at running offset ``start``,
        this reader's piece number ``index``.

        Raises:
            ProtocolError: the piece does not fit in the ring, or was taken already.
        """
        pos, _ = placement(start, n, self.ring)
        if start < 0 or n > self.ring or pos + n > self.ring or index < self._count \
                or index in self._taken or index in self._done:
            raise ProtocolError(
                f"shared-memory piece {index} at {start} (+{n} bytes) is outside ring "
                f"{self.name} (size {self.ring}) or was taken already"
            )
        self._taken.add(index)
        return ShmFrame(self, index, self._data[pos:pos + n])

    def release(self, index: int) -> None:
        """Give piece ``index`` back; publish the count of pieces released in order."""
        if self.closed:
            return
        self._taken.discard(index)
        self._done.add(index)
        count = self._count
        while count in self._done:
            self._done.remove(count)
            count += 1
        if count != self._count:
            _barrier()  # every read of the freed pieces is done before the sender sees it
            self._header.released[self._me] = count
            self._count = count

    def close(self) -> None:
        self.closed = True
        del self._header
        try:
            self._data.release()
            self._map.close()
        except BufferError:  # frames still alive; the GC unmaps it later
            pass


def sweep(min_age: float = 60.0) -> int:
    """Remove ring files whose creator has exited and that are older than ``min_age`` s."""
    import time

    removed = 0
    now = time.time()
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return 0
    for name in names:
        if not NAME.fullmatch(name):
            continue
        pid = int(name.split("-")[1])
        path = os.path.join(SHM_DIR, name)
        try:
            if now - os.stat(path).st_mtime < min_age or _alive(pid):
                continue
            os.unlink(path)
            removed += 1
        except OSError:
            continue
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_swept = False


class SharedRings:
    """A peer's outbox and the inboxes of the peers that send it shared-memory pieces."""

    def __init__(self, rank: int, world_size: int, peers: set[int]) -> None:
        global _swept
        if not _swept:
            _swept = True
            sweep()
        self.ring = ring_bytes()
        self.rank = rank
        self.world_size = world_size
        self.peers = peers  # the peers that may be sent shared-memory pieces
        self._out: Outbox | None = None
        self._failed = False
        self._in: dict[tuple[int, str], Inbox] = {}

    def outbox(self) -> Outbox | None:
        """This peer's ring, created on first use; None if it cannot be."""
        if self._out is None and not self._failed:
            try:
                self._out = Outbox(self.ring, self.world_size)
            except OSError as exc:  # /dev/shm full or unusable: use the socket
                log.warning("no shared-memory ring (%s); sending over the socket", exc)
                self._failed = True
        return self._out

    def inbox(self, peer: int, name: str) -> Inbox:
        key = (peer, name)
        box = self._in.get(key)
        if box is None:
            if sum(1 for p, _ in self._in if p == peer) >= MAX_INBOXES_PER_PEER:
                raise ProtocolError(f"rank {peer} named too many shared-memory segments")
            box = self._in[key] = Inbox(name, self.rank)
        return box

    def close(self) -> None:
        if self._out is not None:
            self._out.close()
            self._out = None
        for inbox in self._in.values():
            inbox.close()
        self._in.clear()


__all__ = ["Inbox", "Outbox", "SharedRings", "ShmFrame", "enabled", "ring_bytes", "sweep"]
