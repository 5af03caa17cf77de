"""Shared-memory payloads between peers of one host.

Over a socket a payload is copied twice by the kernel (into the socket, out of it) and once
more by the receiver (into its data); on a 2-core machine those copies, and the wake-ups of
libzmq's I/O threads that make them, are most of a large collective's time. Between peers
that reach each other over ipc (same host), a sender instead copies a large piece once into
a ring buffer in shared memory that only it writes, and the message carries where the piece
lies instead of the piece; the receiver reduces or copies straight out of the ring.

One ring per direction of a link (an :class:`Outbox` for the sender, an :class:`Inbox` for
the receiver), a file in ``/dev/shm`` of ``ring_bytes`` plus one page of header, created by
the sender on its first large send, opened and unlinked by the receiver when the first
message naming it arrives (so nothing is left behind once both have it mapped; the sender
unlinks it too when it closes). The space is reserved with ``posix_fallocate``: a full
``/dev/shm`` fails cleanly there instead of crashing a later write with SIGBUS.

Flow control: the sender allocates ring space in order (``head``, a running byte count);
the receiver gives it back by advancing ``tail`` (the first 8 bytes of the header page)
once every piece before it has been released, in whatever order the pieces were consumed.
A piece is released when the last reference to its :class:`ShmFrame` goes (the executor
drops frames right after reducing them). A send that finds no room goes over the socket as
usual, so a slow receiver never blocks a sender and nothing can deadlock on the ring.

Ordering: the sender writes the piece before the message naming it is sent, and the
receiver writes ``tail`` after it has read the piece; a lock round trip on each side (a
full memory barrier) keeps those orders on every architecture.

``P2PCOLL_SHM=0`` turns this off; ``P2PCOLL_SHM_BYTES`` sets the ring size (8 MiB).
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import threading
import uuid
from typing import Any

import numpy as np

from ..errors import ProtocolError

log = logging.getLogger("p2pcoll.transport")

SHM_DIR = "/dev/shm"
HEADER_BYTES = 4096  # one page: the receiver's tail counter lives at offset 0
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
    """The ring size of each outbox (``P2PCOLL_SHM_BYTES``, default 8 MiB)."""
    raw = os.environ.get("P2PCOLL_SHM_BYTES", str(8 << 20))
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


class Outbox:
    """The sending side of one link's ring: copies pieces in, hands out their offsets."""

    def __init__(self, ring: int) -> None:
        self.name = f"p2pcoll-{os.getpid()}-{uuid.uuid4().hex[:16]}"
        self.path = os.path.join(SHM_DIR, self.name)
        self.ring = ring
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.posix_fallocate(fd, 0, HEADER_BYTES + ring)
            self._map = mmap.mmap(fd, HEADER_BYTES + ring)
        except BaseException:
            os.unlink(self.path)
            raise
        finally:
            os.close(fd)
        self._tail = np.frombuffer(self._map, np.int64, count=1)
        self._data = np.frombuffer(self._map, np.uint8, offset=HEADER_BYTES)
        self.head = 0

    def put(self, piece: np.ndarray) -> int | None:
        """Copy ``piece`` (C-contiguous) into the ring; its running offset, or None if full.

        The offset is where the piece's reservation starts. A piece never wraps: if it does
        not fit before the end of the ring, its reservation also covers the rest of the ring
        and its data starts at the ring's start (see :func:`placement`).
        """
        start = self.head
        pos, end = placement(start, piece.nbytes, self.ring)
        tail = int(self._tail[0])
        _barrier()  # read tail before overwriting what it frees
        if end - tail > self.ring:
            return None
        np.copyto(self._data[pos:pos + piece.nbytes], piece.reshape(-1).view(np.uint8))
        self.head = end
        _barrier()  # the piece is in memory before the message naming it leaves
        return start

    def close(self) -> None:
        """Drop this side's mapping (the receiver unlinks the file; see the module doc)."""
        if self.head == 0:  # never named in a message: nobody else will unlink it
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        del self._tail, self._data
        try:
            self._map.close()
        except BufferError:  # a view is still alive somewhere; the GC unmaps it later
            pass


class ShmFrame:
    """A received piece in a peer's ring; the space returns to the sender when it goes."""

    __slots__ = ("buffer", "_inbox", "_start", "_end")

    def __init__(self, inbox: Inbox, start: int, end: int, buffer: memoryview) -> None:
        self.buffer = buffer
        self._inbox = inbox
        self._start = start
        self._end = end

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
        self._inbox.release(self._start, self._end)


class Inbox:
    """The receiving side of one link's ring: turns offsets into frames, frees them in order."""

    def __init__(self, name: str) -> None:
        if not NAME.fullmatch(name):
            raise ProtocolError(f"shared-memory segment name {name!r} is not one of ours")
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            raise ProtocolError(f"cannot open shared-memory segment {name!r}: {exc}") from None
        try:
            size = os.fstat(fd).st_size
            if size <= HEADER_BYTES or (size - HEADER_BYTES) % ALIGN:
                raise ProtocolError(f"shared-memory segment {name!r} has a bad size {size}")
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
            try:  # both sides have it mapped now: nothing to leave behind on a crash
                os.unlink(path)
            except OSError:
                pass
        self.name = name
        self.ring = size - HEADER_BYTES
        self._tail = np.frombuffer(self._map, np.int64, count=1)
        self._data = memoryview(self._map)[HEADER_BYTES:]
        self._taken: set[int] = set()  # reservations handed out as frames, not yet freed
        self._freed: dict[int, int] = {}  # start -> end of released reservations
        self._tail_value = int(self._tail[0])
        self.closed = False

    def take(self, start: int, n: int) -> ShmFrame:
        """The frame for a piece of ``n`` bytes reserved at running offset ``start``.

        Pieces may arrive in any order (a sender's segments interleave), but each may be
        taken once, and only from the part of the ring the sender may have written.

        Raises:
            ProtocolError: the piece is outside that part, too large, or taken twice.
        """
        pos, end = placement(start, n, self.ring)
        if start < self._tail_value or end - self._tail_value > self.ring or start in self._taken:
            raise ProtocolError(
                f"shared-memory piece at {start} (+{n} bytes) is outside the part of ring "
                f"{self.name} its sender may use (tail {self._tail_value}, size {self.ring})"
            )
        self._taken.add(start)
        return ShmFrame(self, start, end, self._data[pos:pos + n])

    def release(self, start: int, end: int) -> None:
        """Give ``[start, end)`` back; advance the shared tail over everything contiguous."""
        if self.closed:
            return
        self._taken.discard(start)
        self._freed[start] = end
        tail = self._tail_value
        while tail in self._freed:
            tail = self._freed.pop(tail)
        if tail != self._tail_value:
            _barrier()  # every read of the freed pieces is done before the sender sees it
            self._tail[0] = tail
            self._tail_value = tail

    def close(self) -> None:
        self.closed = True
        del self._tail
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
    """The outboxes and inboxes of one peer, by peer rank."""

    def __init__(self) -> None:
        global _swept
        if not _swept:
            _swept = True
            sweep()
        self.ring = ring_bytes()
        self.peers: set[int] = set()  # the peers that may be sent shared-memory pieces
        self._out: dict[int, Outbox | None] = {}
        self._in: dict[tuple[int, str], Inbox] = {}

    def outbox(self, peer: int) -> Outbox | None:
        """This peer's ring towards ``peer``, created on first use; None if it cannot be."""
        if peer not in self.peers:
            return None
        if peer not in self._out:
            try:
                self._out[peer] = Outbox(self.ring)
            except OSError as exc:  # /dev/shm full or unusable: use the socket
                log.warning(
                    "no shared memory towards rank %d (%s); sending over the socket", peer, exc
                )
                self._out[peer] = None
        return self._out[peer]

    def inbox(self, peer: int, name: str) -> Inbox:
        key = (peer, name)
        box = self._in.get(key)
        if box is None:
            if sum(1 for p, _ in self._in if p == peer) >= MAX_INBOXES_PER_PEER:
                raise ProtocolError(f"rank {peer} named too many shared-memory segments")
            box = self._in[key] = Inbox(name)
        return box

    def close(self) -> None:
        for box in self._out.values():
            if box is not None:
                box.close()
        for inbox in self._in.values():
            inbox.close()
        self._out.clear()
        self._in.clear()


__all__: list[Any] = ["Inbox", "Outbox", "SharedRings", "ShmFrame", "enabled", "ring_bytes"]
