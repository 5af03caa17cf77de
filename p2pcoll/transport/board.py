"""The board: a group's control block in shared memory, for small collectives on one host.

The fast CPU collectives (Open MPI's xhc, UCC's shared-memory layer, Gloo's and
DeepSpeed's shared-memory allreduce) do not send small collectives as messages at all:
every rank has a slot in one shared block, publishes by writing its slot, and reads its
peers' slots. That is what this is, for groups whose peers all share this host.

Layout (one file in ``/dev/shm``, ``p2pcoll-<pid>-<16 hex>``, mode 0600, created by rank
0 when the group forms and named in its hello over the authenticated socket; every other
peer maps it and marks its line attached; rank 0 unlinks the name once all have)::

    page 0        int64 words: page size, world size, slot bytes, meta bytes, group tag,
                  version
    page 1...     one line per rank, LINE bytes (four cache lines) apart, int64 words:
                    COUNT      board collectives this rank has published (c = 1, 2, ...)
                    SLEEPING   the count this rank sleeps waiting for (0: awake)
                    ATTACHED   the pid of this rank once it mapped the board
                    STAMP      when it last published (the host's monotonic clock, ns):
                               how late it was, for its partners' hybrid waiting
                    then per buffer b (0 .. DEPTH - 1), at PARITY + b * FIELDS:
                    SEQ        the session's sequence number of collective c
                    DIGEST     its signature digest (what the rank thinks it is)
                    NBYTES     payload bytes in the data area
                    CODES      collective code | op code << 8 | (root + 1) << 16
                    META       bytes of the layout in the meta area (broadcast's root)
                    FLAGS      VIA_MESSAGES: the data goes as messages this time
                    then, for waking this rank when it sleeps:
                    WANTS      whom it sleeps waiting for: a rank, -1 every other, -2 some
                    NAP        its sleeps so far (a new number each time it goes to sleep)
                    WOKEN      written by its peers: the NAP some peer has woken it from
    data          per rank, per buffer: slot bytes of payload then meta bytes of layout

Collective c uses buffer ``c % DEPTH`` of every line (its "parity"; DEPTH buffers: no
trailing barrier). Before a rank writes buffer b for c it waits until every peer has
published c - DEPTH + 1, so every peer has finished c - DEPTH, the last reader of buffer
b; then it writes data and fields and publishes ``COUNT = c``. With DEPTH 4 a rank that
only writes (a broadcast's root, a reduce's non-roots) runs up to three collectives ahead
of its readers, as a sender over a socket runs ahead into the socket's buffer: with two
buffers the root of a loop of broadcasts waited for its reader at every other call, and
the two slept in turn (a wake-up each, and a hop between threads for a caller that drives
the loop). Readers check ``COUNT >= c`` first, then read. A rank that sleeps is woken
once per nap, by the peer whose publication completes what it waits for (its WANTS, up to
SLEEPING), not by every peer that publishes meanwhile. On x86-64 stores are seen in
program order (TSO), so a published count means its data is there; the board is only
used there (:func:`supported`).

Everything a peer reads from the board is checked before use (sizes within the slot;
sequence, digest and codes equal to this rank's own; a WANTS or NAP that does not add up
only wakes its rank),
as a lane's records are: a board whose contents do not add up is a
:class:`~p2pcoll.errors.ProtocolError`.
"""

from __future__ import annotations

import logging
import os
import platform
from collections.abc import Callable

import numpy as np

from ..errors import ProtocolError
from .shmfile import PAGE, ShmFile
from .shmfile import barrier as _barrier

log = logging.getLogger("p2pcoll.transport")

VERSION = 3  # 3: WANTS, NAP and WOKEN; 2: DEPTH buffers (1 had two)
SLOT_BYTES = 64 << 10  # payload of one rank's slot: collectives up to this go on the board
META_BYTES = 4 << 10  # a broadcast root's layout (dtypes, shapes, tree) beside its payload
DEPTH = 4  # buffers per rank: a writer runs up to DEPTH - 1 collectives ahead
LINE = 256  # bytes per rank's control line: whole cache lines, no false sharing
COUNT, SLEEPING, ATTACHED, STAMP, PARITY = 0, 1, 2, 3, 4
SEQ, DIGEST, NBYTES, CODES, META, FLAGS = range(6)
FIELDS = 6
VIA_MESSAGES = 1
WORDS = LINE // 8
WANTS, NAP, WOKEN = range(PARITY + DEPTH * FIELDS, PARITY + DEPTH * FIELDS + 3)
EVERY_OTHER, SOME = -1, -2  # WANTS of a rank that waits for all its peers, for several
assert WOKEN < WORDS
MAX_SLOT_BYTES, MAX_META_BYTES = 1 << 24, 1 << 20  # a board announced as larger is refused
# A board group greets every peer (each must be able to wake each other: a wake-up pipe
# per peer), so it stays small; beyond, small collectives go as messages over lanes.
MAX_BOARD_RANKS = 16


def supported() -> bool:
    """Whether this machine orders stores as the board's protocol needs (x86-64: TSO)."""
    return platform.machine().lower() in ("x86_64", "amd64")


def _area(slot_bytes: int, meta_bytes: int) -> int:
    n = slot_bytes + meta_bytes
    return (n + PAGE - 1) // PAGE * PAGE


def _size(world_size: int, slot_bytes: int, meta_bytes: int) -> int:
    lines = (world_size * LINE + PAGE - 1) // PAGE * PAGE
    return PAGE + lines + DEPTH * world_size * _area(slot_bytes, meta_bytes)


class Board:
    """One peer's mapping of its group's board (see the module docstring)."""

    def __init__(self, file: ShmFile, rank: int, world_size: int,
                 slot_bytes: int, meta_bytes: int) -> None:
        self.name = file.name
        self.rank = rank
        self.world_size = world_size
        self.slot_bytes = slot_bytes
        self.meta_bytes = meta_bytes
        self.owner = file.owner
        self._file = file
        self._map = buf = file.map
        lines = (world_size * LINE + PAGE - 1) // PAGE * PAGE
        # Every rank's control words as one int64 array, row r = rank r's line.
        self.words = np.frombuffer(buf, np.int64, count=world_size * WORDS,
                                   offset=PAGE).reshape(world_size, WORDS)
        area = _area(slot_bytes, meta_bytes)
        base = PAGE + lines
        # data[r][b]: rank r's payload area of buffer b (uint8), meta[r][b] its layout area.
        whole = np.frombuffer(buf, np.uint8, count=DEPTH * world_size * area, offset=base)
        at = [[(DEPTH * r + b) * area for b in range(DEPTH)] for r in range(world_size)]
        self.data = [[whole[a:a + slot_bytes] for a in row] for row in at]
        self.meta = [[whole[a + slot_bytes:a + slot_bytes + meta_bytes] for a in row]
                     for row in at]
        self.count = 0  # board collectives this rank has started
        # Set by the mesh: wake(rank) writes into that peer's wake-up pipe; on_wake is
        # called when this peer's pipe is written (set by the engine's board path).
        self.wake: Callable[[int], None] = lambda rank: None
        self.on_wake: Callable[[], None] | None = None

    def control(self) -> memoryview:
        """Every rank's control words as one flat view of int64 (rank r's line starts at
        ``r * WORDS``): a memoryview's item access is the cheapest load and store Python
        has, and each is one aligned 8-byte access."""
        size = self.world_size * LINE
        return memoryview(self._map)[PAGE:PAGE + size].cast("q")

    @classmethod
    def create(cls, rank: int, world_size: int, tag: int, slot_bytes: int = SLOT_BYTES,
               meta_bytes: int = META_BYTES) -> Board:
        """Create a group's board (rank 0 does, when the group forms).

        Raises:
            OSError: ``/dev/shm`` is full or unusable (nothing is left behind).
        """
        file = ShmFile.create(_size(world_size, slot_bytes, meta_bytes))
        head = np.frombuffer(file.map, np.int64, count=6)
        head[:] = (PAGE, world_size, slot_bytes, meta_bytes, tag, VERSION)
        del head
        board = cls(file, rank, world_size, slot_bytes, meta_bytes)
        board.words[rank, ATTACHED] = os.getpid()
        return board

    @classmethod
    def attach(cls, name: object, rank: int, world_size: int, tag: int) -> Board:
        """Map the board rank 0 of the group tagged ``tag`` named in its hello.

        Raises:
            ProtocolError: not a p2pcoll name, not a board of this user, or its header is
                not that of this group's board for ``world_size`` ranks.
        """
        file = ShmFile.open(name, "board", min_size=_size(world_size, 1, 1),
                            max_size=_size(world_size, MAX_SLOT_BYTES, MAX_META_BYTES))
        head = [int(v) for v in np.frombuffer(file.map, np.int64, count=6)]
        page, size, slot, meta, owner_tag, version = head
        ok = (page == PAGE and size == world_size and owner_tag == tag and version == VERSION
              and 0 < slot <= MAX_SLOT_BYTES and 0 < meta <= MAX_META_BYTES
              and _size(size, slot, meta) == file.size)
        if not ok:
            file.close()
            raise ProtocolError(f"board {file.name!r} is not this group's board for "
                                f"{world_size} ranks")
        board = cls(file, rank, world_size, slot, meta)
        _barrier()
        board.words[rank, ATTACHED] = os.getpid()
        return board

    @property
    def unlinked(self) -> bool:
        """Nothing is left for this peer to unlink (it is no owner, or it has unlinked)."""
        return not (self.owner and self._file.linked)

    def all_attached(self) -> bool:
        return bool(self.words[:, ATTACHED].all())

    def unlink_when_all_attached(self) -> None:
        """The creator removes the name once every rank has mapped the board."""
        if not self.unlinked and self.all_attached():
            self._file.unlink()

    def close(self) -> None:
        # Views of the map may outlive this (a result a caller still holds is a copy, but
        # a numpy view in flight is not): the GC unmaps it then.
        del self.words, self.data, self.meta, self._map
        self._file.close()  # the owner unlinks the name if it is still there


__all__ = ["DEPTH", "SLOT_BYTES", "Board", "supported"]
