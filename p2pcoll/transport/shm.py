"""Shared-memory payloads between peers of one host.

Over a socket a payload is copied twice by the kernel (into the socket, out of it) and once
more by the receiver (into its data); on a 2-core machine those copies, and the wake-ups of
libzmq's I/O threads that make them, are most of a large collective's time. Between peers
that reach each other over ipc (same host), a sender instead copies a large piece once into
a ring buffer in shared memory that only it writes, and the message carries where the piece
lies instead of the piece; the receiver reduces or copies straight out of the ring.

One ring per sending peer, read by every peer of its host it sends large pieces to: a file
in ``/dev/shm`` created when the peer connects and named in its hello to the other peers.
A peer that can map it (same ``/dev/shm``, same user, shared memory not turned off) marks
its slot in the ring's header as mapped; only then does the sender give it pieces through
the ring, so peers that cannot share memory simply keep the socket. The header also names
the creating rank and group, so a peer can only ever read the ring of the peer that
announced it. A piece sent to several peers (the root of a broadcast) is copied in once
and read by all of them. The space is reserved with ``posix_fallocate``: a full
``/dev/shm`` fails cleanly there instead of crashing a later write with SIGBUS.

The header page holds, per reader rank, how many of the pieces addressed to it it has
released (in order of the per-reader index each message carries, though pieces may be
consumed in any order) and whether it has mapped the file. The sender reserves space in
order (``head``, a running byte count) and frees the oldest reservations once every reader
they were addressed to has released them. A piece is released when its :class:`ShmFrame`
is dropped; whoever holds a frame must not keep views of its buffer beyond that (the
executor reduces or copies out of it at once). A send that finds no room waits briefly
(see ``SameHost.ring_put``) and then goes over the socket, so a slow receiver never blocks a sender
and nothing can deadlock on the ring.

Clean-up: the file is unlinked as soon as every peer it was announced to has mapped it (by
that last peer, or by the sender), and in any case when the sender closes (a mapping
outlives the name). A file left by a crash before that (a peer killed before all its peers
mapped its ring) is named after its creator, ``p2pcoll-<pid>-<16 hex>``: the next group that
creates a ring on the host removes it as soon as that process is gone (:func:`sweep`).

Ordering: the sender writes the piece before the message naming it is sent, and a reader
publishes its release after it has read the piece; a lock round trip on each side (a full
memory barrier on common platforms) keeps those orders.

``P2PCOLL_SHM=0`` turns this off; ``P2PCOLL_SHM_BYTES`` sets the ring size (16 MiB); both
reach this module through :class:`p2pcoll.settings.Settings`.
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import threading
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from ..errors import ProtocolError
from .shmfile import NAME, PAGE, SHM_DIR, ShmFile, available, sweep
from .shmfile import barrier as _barrier

log = logging.getLogger("p2pcoll.transport")

# The header: six int64 (header bytes, ring bytes, readers, creator rank, group tag, unused),
# then per reader rank its released count, its mapped flag and whether the creator announced
# the ring to it (int64 each).
PREAMBLE = 6
ALIGN = 64  # pieces start on cache lines

# Each mapped ring holds a descriptor (Python's mmap keeps one), so a peer maps the rings of
# at most this many peers (those that greeted it first: the peers that talk to it); the
# others send it their large pieces over the socket.
MAX_INBOXES = 8


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


def group_tag(group_id: str) -> int:
    """A 56-bit tag of a group id, stored in the rings of its peers."""
    return int.from_bytes(hashlib.blake2b(group_id.encode(), digest_size=7).digest(), "big")


class _Header:
    """Views of a ring file's header (both sides map the same one)."""

    def __init__(self, buf: mmap.mmap, readers: int) -> None:
        words = np.frombuffer(buf, np.int64, count=PREAMBLE + 3 * readers)
        self.preamble = words[:PREAMBLE]
        self.released = words[PREAMBLE:PREAMBLE + readers]
        self.mapped = words[PREAMBLE + readers:PREAMBLE + 2 * readers]
        self.announced = words[PREAMBLE + 2 * readers:]

    def all_mapped(self) -> bool:
        """Every peer the ring was announced to has mapped it: the name is no longer needed."""
        _barrier()
        return bool(np.all(self.mapped[self.announced != 0]))


class Outbox:
    """A peer's sending ring: copies pieces in once, for one or several readers."""

    def __init__(self, ring: int, readers: int, creator: int, tag: int) -> None:
        """Create the ring file (see :meth:`.shmfile.ShmFile.create`).

        Raises:
            OSError: ``/dev/shm`` is full or unusable (nothing is left behind).
        """
        head = header_bytes(readers)
        self._file = ShmFile.create(head + ring)
        self.name, self.path = self._file.name, self._file.path
        self.ring = ring
        self._map = self._file.map
        self._header = _Header(self._map, readers)
        self._header.preamble[:5] = (head, ring, readers, creator, tag)
        self._data = np.frombuffer(self._map, np.uint8, offset=head)
        self.head = 0
        # Reservations not yet freed, oldest first: (start, end, ((reader, index), ...)).
        self._live: deque[tuple[int, int, tuple[tuple[int, int], ...]]] = deque()
        self._next: dict[int, int] = {}  # per reader: the index of its next piece
        self.stalled = False  # the last wait for room ran out (see SameHost.ring_put)
        self.closed = False

    @property
    def linked(self) -> bool:
        """The file's name is still there (not every peer has mapped it yet)."""
        return self._file.linked

    def ready(self, reader: int) -> bool:
        """Whether ``reader`` has mapped this ring (only then may it be sent pieces)."""
        return not self.closed and bool(self._header.mapped[reader])

    def announce(self, readers: Iterable[int]) -> None:
        """Record the peers the ring is announced to (the file goes once all have mapped it)."""
        for r in readers:
            self._header.announced[r] = 1

    def unlink_when_all_mapped(self) -> None:
        """Unlink the file once every announced peer has mapped it: nothing left on a crash."""
        if self._file.linked and self._header.all_mapped():
            self._file.unlink()

    def _tail(self) -> int:
        """Free the oldest reservations every reader has released; where the used part starts."""
        live = self._live
        released = self._header.released
        while live and all(released[r] > k for r, k in live[0][2]):
            live.popleft()
        if not live:  # all free: start again at the ring's start, so any piece <= ring fits
            self.head += -self.head % self.ring
            return self.head
        return live[0][0]

    def put(self, piece: np.ndarray, readers: Sequence[int]) -> tuple[int, list[int]] | None:
        """Copy ``piece`` (C-contiguous) in for ``readers``; its running offset and each
        reader's index, or None if the ring is full (or closed).

        The offset is where the piece's reservation starts. A piece never wraps: if it does
        not fit before the end of the ring, its reservation also covers the rest of the ring
        and its data starts at the ring's start (see :func:`placement`).
        """
        if self.closed:
            return None
        tail = self._tail()
        _barrier()  # read the released counts before overwriting what they free
        start = self.head
        pos, end = placement(start, piece.nbytes, self.ring)
        if end - tail > self.ring:
            return None
        np.copyto(self._data[pos:pos + piece.nbytes], piece.reshape(-1).view(np.uint8))
        indices = []
        for r in readers:
            k = self._next.get(r, 0)
            self._next[r] = k + 1
            indices.append(k)
        self._live.append((start, end, tuple(zip(readers, indices, strict=True))))
        self.head = end
        _barrier()  # the piece is in memory before the message naming it leaves
        return start, indices

    def close(self) -> None:
        """Unlink the file (readers keep their mappings) and drop this side's mapping."""
        if self.closed:
            return
        self.closed = True
        del self._header, self._data, self._map
        self._file.close()  # unlinks the name if it is still there


class ShmFrame:
    """A received piece in a peer's ring; the space returns to the sender when it is dropped.

    ``buffer`` must not be used, nor views of it kept, after the frame is dropped: the
    sender may then overwrite the bytes.
    """

    __slots__ = ("_inbox", "_index", "buffer")

    def __init__(self, inbox: Inbox, index: int, buffer: memoryview) -> None:
        self.buffer = buffer
        self._inbox = inbox
        self._index = index

    def __len__(self) -> int:
        return len(self.buffer)

    def __del__(self) -> None:
        try:
            self._inbox.release(self._index)
        except Exception:  # interpreter teardown: modules may be gone
            pass


class Inbox:
    """A reader's view of one peer's ring: offsets to frames, releases published in order."""

    def __init__(self, name: str, me: int, creator: int, tag: int) -> None:
        """Map the ring ``name`` that rank ``creator`` of the group tagged ``tag`` announced.

        Raises:
            ProtocolError: the name is not a p2pcoll ring, it cannot be opened or mapped, or
                its header does not match (another rank's or group's ring, no slot for ``me``).
        """
        self._file = ShmFile.open(name, "shared-memory ring", min_size=PAGE + ALIGN)
        self._map, size = self._file.map, self._file.size
        head, ring, readers, owner, owner_tag = (
            int(v) for v in np.frombuffer(self._map, np.int64, count=5)
        )
        if (readers <= me or head != header_bytes(readers) or head + ring != size
                or ring <= 0 or ring % ALIGN or owner != creator or owner_tag != tag):
            self._file.close()
            raise ProtocolError(
                f"shared-memory ring {name!r} is not rank {creator}'s ring of this group with a "
                f"slot for rank {me} (header {head}, {ring}, {readers}, {owner}; {size} bytes)"
            )
        self.name = name
        self.ring = ring
        self._header = _Header(self._map, readers)
        self._me = me
        self._data = memoryview(self._map)[head:]
        self._count = int(self._header.released[me])  # pieces released, in index order
        self._taken: set[int] = set()  # indices handed out as frames, not yet released
        self._done: set[int] = set()  # indices released out of order
        # Frames may be dropped by the garbage collector on another thread.
        self._lock = threading.Lock()
        self.closed = False
        _barrier()
        self._header.mapped[me] = 1
        if self._header.all_mapped():  # the last to map it: nobody needs the name any more
            self._file.unlink()

    def take(self, start: int, n: int, index: int) -> ShmFrame:
        """The frame for a piece of ``n`` bytes reserved at running offset ``start``,
        this reader's piece number ``index``.

        Raises:
            ProtocolError: the piece does not fit in the ring, or was taken already.
        """
        pos, _ = placement(start, n, self.ring)
        with self._lock:
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
        with self._lock:
            if self.closed or index not in self._taken:
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
        with self._lock:
            self.closed = True
        del self._header, self._map
        try:
            self._data.release()
        except BufferError:  # frames still alive; the GC unmaps it later
            pass
        self._file.close()


class SharedRings:
    """A peer's outbox and the inboxes of the peers of its host that announced theirs."""

    def __init__(self, rank: int, world_size: int, peers: set[int], group_id: str,
                 ring_bytes: int) -> None:
        sweep()  # one listdir: what peers of this host killed earlier left behind
        self.rank = rank
        self.peers = peers  # the peers of this host (reached over ipc)
        self.tag = group_tag(group_id)
        self.outbox: Outbox | None = None
        self._in: dict[int, Inbox] = {}
        try:
            self.outbox = Outbox(ring_bytes - ring_bytes % ALIGN, world_size, rank, self.tag)
            self.outbox.announce(peers)
        except OSError as exc:  # /dev/shm full or unusable: use the socket
            log.warning("rank %d: no shared-memory ring (%s); sending over the socket", rank, exc)

    def readers(self, dsts: Sequence[int]) -> list[int]:
        """Those of ``dsts`` that may be sent pieces through the ring (they have mapped it)."""
        out = self.outbox
        if out is None:
            return []
        ready = [d for d in dsts if d in self.peers and out.ready(d)]
        if ready and out.linked:
            out.unlink_when_all_mapped()
        return ready

    def accept(self, peer: int, name: str) -> None:
        """Map the ring ``peer`` announced (once); ProtocolError if it cannot be."""
        if peer not in self.peers or peer in self._in:
            raise ProtocolError(f"rank {peer} may not announce a shared-memory ring here")
        if len(self._in) >= MAX_INBOXES:
            raise ProtocolError(f"{MAX_INBOXES} peers' rings are mapped here already (the "
                                f"budget): rank {peer} sends over the socket")
        self._in[peer] = Inbox(name, self.rank, peer, self.tag)

    def inbox(self, peer: int, name: str) -> Inbox:
        """The ring ``peer`` announced under ``name``; ProtocolError for any other."""
        box = self._in.get(peer)
        if box is None or box.name != name:
            raise ProtocolError(f"rank {peer} names shared-memory ring {name!r}, not its own")
        return box

    def close(self) -> None:
        if self.outbox is not None:
            self.outbox.close()
        for inbox in self._in.values():
            inbox.close()
        self._in.clear()


def split(dst: int, payload: Sequence[np.ndarray],
          placed: Sequence[tuple[int, list[int]] | None], near: list[int], ring: str,
          ) -> tuple[Sequence[np.ndarray], list[Any] | None, int]:
    """How one message goes to ``dst``: its pieces not in the ring (``placed[i]``: where
    piece i went in the ring and at which reader index each of ``near`` finds it, or None),
    the header's ``shm`` part (None if ``dst`` reads none of them) and the ring's bytes."""
    reader = near.index(dst) if dst in near else -1
    inline: list[np.ndarray] = []
    offsets, indices, ringed = [], [], 0
    for piece, spot in zip(payload, placed, strict=True):
        if spot is not None and reader >= 0:
            offsets.append(spot[0])
            indices.append(spot[1][reader])
            ringed += piece.nbytes
            continue
        offsets.append(-1)
        indices.append(-1)
        inline.append(piece)
    return inline, [ring, offsets, indices] if ringed else None, ringed


# NAME, PAGE, SHM_DIR, available and sweep are shmfile's, named here as they were before.
__all__ = ["NAME", "PAGE", "SHM_DIR", "Inbox", "Outbox", "SharedRings", "ShmFrame", "available",
           "split", "sweep"]
