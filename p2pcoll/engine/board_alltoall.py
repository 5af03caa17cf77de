"""All-to-all among the peers of one host: one board round, the lengths agreed as it runs.

Over messages an all-to-all is two collectives, an agreement on every length and then the
exchange (:mod:`p2pcoll.api.alltoall`). On the board (:mod:`.board_path`) it is one round
of any size: every rank writes, at the start of its slot, a header with its row of the
lengths table (:mod:`.alltoall_table`) and where its parts lie, then its parts (except its
own) one after the other, and publishes; once every peer has published, every rank reads
every header, so every rank has the whole table and checks it alike (a disagreement is the
same :class:`~p2pcoll.CollectiveMismatch`, naming the pair, on every rank, before any data
is read), then copies its part of each peer's parts straight out. Each byte is copied
twice, once into shared memory by its sender and once out by its receiver (a socket
copies it into the kernel and out again, and wakes I/O threads to do so), and a small
call costs one wake-up per rank instead of two rounds' worth.

Parts that fit the slot after the header go in the slot. Larger ones go in the rank's
window of the board count's side (its parity, count % 2): a file in ``/dev/shm`` that only
its rank writes, grown (replaced by a larger one) when a call needs more, named in the
header. Two windows are enough: a round first waits until every peer has published
c - 1, so has finished reading c - 2, the last reader of the window of its side (the
board's own buffers, :data:`~p2pcoll.transport.board.DEPTH` of them, let a writer run
further ahead, which a window of every buffer would pay for in memory). A peer maps a
window when it first sees its name (whether or not it has a part in it this time) and
marks its line in the window's header page; the window's rank unlinks the name once
every peer has marked it, and closes it with the board. Names, like every other header
field, are checked before use; a window that does not add up is a
:class:`~p2pcoll.errors.ProtocolError`.

One copy. Where the kernel lets peers read each other's memory
(:mod:`p2pcoll.transport.cross_memory`), a rank whose parts for others come to
:data:`DIRECT_BYTES` or more writes nothing: its header gives the address of each part and
every peer copies its part straight out of the rank's own arrays, once. The rank's arrays
must then stay as they are until every peer has read them, so such a round ends with a
second, empty one on the board (every rank sees the same headers, so every rank runs it or
none). A rank uses it only once every peer has said, in its header, that it could read a
word that this rank published (each rank tries once, on the first round it sees).

Header (int64 words at the start of the slot): the table row (``alltoall_table.width(p)``
words); where the parts are (:data:`IN_SLOT`: after the header in the slot;
:data:`DIRECT`: in the rank's own memory; else the bytes of its window); the window's name
(:data:`NAME_WORDS` words of ASCII, zero-padded); whether the rank can read every peer
directly (0 or 1); the address of a word the rank publishes for that test; the address of
each of its parts.
"""

from __future__ import annotations

import errno
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from ..errors import KILLED, CollectiveMismatch, PeerLost, ProtocolError
from ..transport import cross_memory
from ..transport.board import ATTACHED, DEPTH
from ..transport.shmfile import MAX_NAME, PAGE, ShmFile
from ..wire import Signature
from . import alltoall_table as table
from .board_path import BoardPath, codes

NAME_WORDS = (MAX_NAME + 7) // 8
IN_SLOT, DIRECT = 0, -1  # where a rank's parts are, if not in its window
# The header's words after the table row: where, the name, reads directly, probe address,
# then one address per rank.
WHERE, NAME, READS, PROBE = 0, 1, 1 + NAME_WORDS, 2 + NAME_WORDS
ADDRESSES = 3 + NAME_WORDS
# A rank's parts for others from this many bytes on are read from its memory where peers
# can: below, the second round costs more than the copy it saves.
DIRECT_BYTES = 16 << 20
MIN_WINDOW = 1 << 20  # a window's data bytes: the parts' bytes rounded up to a power of two
MAX_WINDOW = 1 << 40
# A window's header page: int64 words MAGIC, its rank, the group's size, its data bytes,
# then one word per rank: 1 once that rank has mapped it.
MAGIC, RANK, SIZE, BYTES, MAPPED = 0x70327061_32610001, 0, 1, 2, 4
_CODE = codes("alltoall", "", -1)
MAX_SHAPES = 64  # the shapes of calls whose header is kept


class _Shape(NamedTuple):
    """What a rank passed, worked out once per dtype and shapes."""

    row: np.ndarray  # its table row, as bytes
    dtype: np.dtype[Any]
    rest: tuple[int, ...]  # the parts' shape after the first axis
    item: int  # bytes per row
    moving: int  # bytes of its parts for other ranks
    # Per board buffer, where in my slot each of its parts for another rank goes (that rank, the
    # place in the part's shape), made on the first call that puts them there.
    places: list[list[tuple[int, np.ndarray]] | None]


class _Agreed(NamedTuple):
    """A round's agreed table, kept per board buffer: a round whose headers are the same bytes
    (same lengths, same windows) is the same round again."""

    heads: bytes  # every rank's header
    rows: tuple[int, ...]  # the rows this rank receives from each rank
    # Per peer, where my part of its parts is: (its slot or window, first byte, bytes),
    # or (None, address in its process, bytes) to read directly.
    spans: dict[int, tuple[np.ndarray | None, int, int]]
    direct: bool  # some rank's parts are read directly: a second round ends this one
    # (dtype, row shape) -> my part of each peer's parts that lie on the board, as an
    # array of their rows: made on the first call with them, copied out by every call.
    parts: dict[tuple[np.dtype[Any], tuple[int, ...]], list[tuple[int, np.ndarray]]]


def header_words(p: int) -> int:
    return table.width(p) + ADDRESSES + p


class BoardAlltoall:
    """A session's all-to-all on the board, and the windows it uses (see the module
    docstring). :meth:`close` with the board."""

    def __init__(self, path: BoardPath) -> None:
        self.path = path
        self.rank, self.size = path.rank, path.size
        self._head = header_words(self.size) * 8
        self._own: list[ShmFile | None] = [None, None]  # my window of each side
        # (rank, side) -> the mapped window: its name as header words, the file, its data.
        self._theirs: dict[tuple[int, int], tuple[tuple[int, ...], ShmFile, np.ndarray]] = {}
        self._areas: list[np.ndarray | None] = [None, None]  # my windows' data
        # My header after the table row: zeros (parts in the slot), or per side my
        # window's bytes and name.
        self._in_slot = np.zeros(1 + NAME_WORDS, np.int64)
        self._tails = [self._in_slot, self._in_slot]
        # Reading peers directly: a word they may read to find out (its value MAGIC),
        # whether I can read every peer (None: not tried yet), whether every peer has
        # said it can read me (in the last headers I read).
        self._probe = np.array([MAGIC], np.int64)
        self._probe_at = self._probe.ctypes.data  # (ctypes.data costs microseconds a read)
        self._reads: bool | None = None if cross_memory.available() else False
        self._read_by_all = False
        self._pids: list[int] = []  # the peers' processes, known at the first round
        path.closing.append(self.close)
        self._shapes: dict[tuple[Any, ...], _Shape] = {}
        # Each board buffer's last round (its spans are views of that buffer's slots).
        self._agreed: list[_Agreed | None] = [None] * DEPTH
        # Every rank's header area, per board buffer (read by every round).
        self._heads = [[path.board.data[q][b][:self._head] for q in range(self.size)]
                       for b in range(DEPTH)]

    async def run(self, seq: int, parts: Sequence[np.ndarray],
                  out: Sequence[np.ndarray] | None,
                  sig: Signature) -> list[np.ndarray] | CollectiveMismatch:
        """This rank's ``parts`` (native C-contiguous arrays, ``parts[j]`` to rank j) out,
        the parts from every rank in: into ``out`` when given (checked against the
        senders' lengths), else into new arrays. Returns them (``[i]`` from rank i), the
        rank's own part included; or, when the ranks' tables disagree, the mismatch (the
        same on every rank, nothing read) for the caller to raise once the round is over:
        the round itself went well on every rank, so the group stays usable.

        Raises:
            CollectiveMismatch: a peer runs another collective here.
            PeerLost, CollectiveTimeout: through the board's wait.
            ProtocolError: a peer's header or window does not add up.
        """
        path = self.path
        try:
            count = await path._start(seq)
            if count > 2:  # the window of this side is free (see the module docstring)
                await path._wait(count - 1, path.others, seq)
            return await self._run(count, seq, parts, out, sig)
        finally:
            path._end(seq)

    async def _run(self, count: int, seq: int, parts: Sequence[np.ndarray],
                   out: Sequence[np.ndarray] | None,
                   sig: Signature) -> list[np.ndarray] | CollectiveMismatch:
        path, p, me = self.path, self.size, self.rank
        parity, side = count % DEPTH, count & 1  # the board's buffer, the window's side
        data = path.board.data
        slot = data[me][parity]
        shape = self._shape(parts, out)
        width = len(shape.row)
        head = slot[:self._head]
        head[:width] = shape.row
        words = head[width:].view(np.int64)
        # Where my parts go: after the header in the slot if they fit, else my window, or
        # nowhere (read where they are).
        direct = shape.moving >= DIRECT_BYTES and self._read_by_all
        area, at = slot, self._head
        if direct:
            words[:] = 0
            words[WHERE] = DIRECT
            for j, a in enumerate(parts[:p]):
                words[ADDRESSES + j] = a.ctypes.data
        else:
            if self._head + shape.moving > len(slot):
                area, at = self._window(side, shape.moving), 0
            words[:READS] = self._tails[side] if area is not slot else self._in_slot
            words[ADDRESSES:] = 0
            if area is slot:
                places = shape.places[parity]
                if places is None:
                    places = shape.places[parity] = self._places(slot, parts)
                for j, place in places:
                    np.copyto(place, parts[j])
                at += shape.moving
            else:
                for j, a in enumerate(parts[:p]):
                    if j != me:
                        n = a.nbytes
                        area[at:at + n] = a.reshape(-1).view(np.uint8)
                        at += n
        words[READS] = bool(self._reads)
        words[PROBE] = self._probe_at
        digest, described = path._signed(sig, parity)
        path._fields(parity, seq, digest, at if area is slot else self._head, _CODE,
                     described)
        path._publish(count)
        await path._wait(count, path.others, seq)
        nbytes = [path._check(q, parity, seq, digest, _CODE, None)[0] if q != me else 0
                  for q in range(p)]
        # Every rank's header as read: the same as last time on this buffer (a loop of
        # one call), the same table and places; else checked and worked out anew.
        heads = b"".join([h.tobytes() for h in self._heads[parity]])
        agreed = self._agreed[parity]
        if agreed is None or agreed.heads != heads:
            # The old rounds' views of this side's windows go first (a window replaced is
            # unmapped at once): those of every round kept on this side whose headers
            # differ. One whose headers are these names the same windows, which stay (and
            # dropping it would make its buffer's next round miss in turn, and so on
            # forever: a loop of one call would never find its round kept).
            agreed = self._agreed[parity] = None
            for b in range(side, DEPTH, 2):
                kept = self._agreed[b]
                if kept is not None and kept.heads != heads:
                    self._agreed[b] = None
            found = self._agree(parity, side, heads, nbytes, shape.item)
            if isinstance(found, CollectiveMismatch):
                return found
            self._agreed[parity] = agreed = found
        rest, dtype = shape.rest, shape.dtype
        on_board = agreed.parts.get((dtype, rest))
        if on_board is None:
            on_board = agreed.parts[dtype, rest] = [
                (q, source[at:at + n].view(dtype).reshape(agreed.rows[q], *rest))
                for q, (source, at, n) in agreed.spans.items() if source is not None]
        # Each part copied once, straight into a new array (or out= buffer).
        if out is None:
            got = [parts[me].copy()] * p
            for q, part in on_board:
                got[q] = part.copy()
        else:
            got = list(out)
            for q, part in on_board:
                np.copyto(got[q], part)
            np.copyto(got[me], parts[me])
        if agreed.direct:
            for q, (source, at, n) in agreed.spans.items():
                if source is None:
                    if out is None:
                        got[q] = np.empty((agreed.rows[q], *rest), dtype)
                    if n:
                        self._read(q, at, got[q].reshape(-1).view(np.uint8))
        if agreed.direct:  # my parts stay as they are until every peer has read them
            path.board.count = count + 1
            await path._barrier(count + 1, seq, sig)
        return got

    def _read(self, q: int, address: int, into: np.ndarray) -> None:
        """My part of rank ``q``'s parts, read where it is.

        Raises:
            PeerLost: its process is gone.
            ProtocolError: the read failed otherwise (a bad address).
        """
        try:
            cross_memory.read(self._pids[q], address, into)
        except OSError as exc:
            if exc.errno == errno.ESRCH:
                raise PeerLost(f"rank {q}'s process is gone (its alltoall parts could not "
                               f"be read)", q, how=KILLED) from None
            raise ProtocolError(f"rank {q}'s alltoall parts could not be read where its "
                                f"header says they are: {exc.strerror}") from None

    def _shape(self, parts: Sequence[np.ndarray], out: Sequence[np.ndarray] | None) -> _Shape:
        """What this rank passed, worked out once per dtype and shapes."""
        first = parts[0] if parts else None
        dtype = first.dtype if first is not None else np.dtype(np.float32)
        key = (dtype, tuple(a.shape for a in parts),
               None if out is None else tuple(a.shape for a in out))
        shape = self._shapes.get(key)
        if shape is None:
            p = self.size
            rest = first.shape[1:] if first is not None else ()
            elements = math.prod(rest)
            row = np.zeros(table.width(p), np.int64)
            table.fill(row, p, [int(a.shape[0]) for a in parts], dtype, elements,
                       None if out is None else [int(a.shape[0]) for a in out])
            moving = sum(a.nbytes for j, a in enumerate(parts[:p]) if j != self.rank)
            if len(self._shapes) >= MAX_SHAPES:
                self._shapes.clear()
            shape = self._shapes[key] = _Shape(row.view(np.uint8), dtype, rest,
                                               dtype.itemsize * elements, moving, [None] * DEPTH)
        return shape

    def _places(self, slot: np.ndarray, parts: Sequence[np.ndarray]
                ) -> list[tuple[int, np.ndarray]]:
        """Where in ``slot``, after the header, each of ``parts`` for another rank goes,
        one after the other: (that rank, the place as an array in the part's shape)."""
        places, at = [], self._head
        for j, a in enumerate(parts[:self.size]):
            if j != self.rank:
                places.append((j, slot[at:at + a.nbytes].view(a.dtype).reshape(a.shape)))
                at += a.nbytes
        return places

    def _agree(self, parity: int, side: int, heads: bytes, nbytes: list[int],
               item: int) -> _Agreed | CollectiveMismatch:
        """Every rank's header checked, its window mapped, then the whole table, alike on
        every rank: where my part of each peer's parts lies, or the table's mismatch (the
        same on every rank).

        Raises:
            ProtocolError: a header or window does not add up.
        """
        p, me, data = self.size, self.rank, self.path.board.data
        words = np.frombuffer(heads, np.int64).reshape(p, -1)
        width = table.width(p)
        if self._reads is None:  # first round: can I read every peer where it is?
            # Their pids only now: a peer attaches to the board when rank 0's hello
            # reaches it, which may be after this object was made; by now every peer
            # has published a header, so it has attached.
            self._pids = [int(v) for v in self.path.board.words[:, ATTACHED]]
            self._reads = all(self._can_read(q, int(words[q, width + PROBE]))
                              for q in range(p) if q != me)
        lines = words.tolist()  # (Python ints: a few of them each, cheaper than numpy's)
        self._read_by_all = all(lines[q][width + READS] for q in range(p) if q != me)
        sources = {q: self._source(q, side, lines[q][width:], data[q][parity], nbytes[q])
                   for q in range(p) if q != me}
        try:
            rows = table.check_lines(lines, p)  # (it reads the table row of each line)
        except CollectiveMismatch as exc:
            return exc
        for q, row in enumerate(rows):
            if min(row) < 0:
                raise ProtocolError(f"rank {q}'s header on the shared-memory board has a "
                                    f"negative length: {row}")
        spans: dict[int, tuple[np.ndarray | None, int, int]] = {}
        for q, source in sources.items():
            row = rows[q]
            n = row[me] * item
            if source is None:  # read in its process, at the address of its part for me
                spans[q] = (None, lines[q][width + ADDRESSES + me], n)
                continue
            # My part starts after its parts for the ranks before me, less its own part
            # (which it does not write) if it is one of them.
            at = item * (sum(row[:me]) - (row[q] if q < me else 0))
            if at + n > len(source):
                raise ProtocolError(f"rank {q}'s parts on the shared-memory board end at "
                                    f"byte {at + n}, beyond the {len(source)} it wrote")
            spans[q] = (source, at, n)
        direct = any(line[width + WHERE] == DIRECT for line in lines)
        return _Agreed(heads, tuple(row[me] for row in rows), spans, direct, {})

    def _can_read(self, q: int, address: int) -> bool:
        """Whether I can read rank ``q``'s memory: its probe word, where it says it is."""
        word = np.zeros(1, np.int64)
        try:
            cross_memory.read(self._pids[q], address, word)
        except OSError:
            return False
        return int(word[0]) == MAGIC

    def _window(self, side: int, nbytes: int) -> np.ndarray:
        """The data of my window of ``side`` with room for ``nbytes``, grown if it has
        not; its name unlinked once every peer has mapped it.

        Raises:
            OSError: ``/dev/shm`` is full (the call fails on this rank: its peers time out
                or see it leave, as for any local failure mid-collective).
        """
        window = self._own[side]
        if window is None or window.size - PAGE < nbytes:
            if window is not None:  # every peer has read the last call of this side
                self._areas[side] = None
                window.close()
                self._own[side] = None
            size = max(MIN_WINDOW, 1 << max(nbytes - 1, 0).bit_length())
            window = ShmFile.create(PAGE + size)
            head = np.frombuffer(window.map, np.int64, count=MAPPED + self.size)
            head[:MAPPED] = MAGIC, self.rank, self.size, size
            head[MAPPED + self.rank] = 1
            self._own[side] = window
            tail = np.zeros(1 + NAME_WORDS, np.int64)
            tail[WHERE] = size
            tail[NAME:] = np.frombuffer(window.name.encode().ljust(NAME_WORDS * 8, b"\0"),
                                        np.int64)
            self._tails[side] = tail
            self._areas[side] = np.frombuffer(window.map, np.uint8, offset=PAGE)
        elif window.linked:
            mapped = np.frombuffer(window.map, np.int64, count=self.size, offset=MAPPED * 8)
            if mapped.all():
                window.unlink()
        area = self._areas[side]
        assert area is not None
        return area

    def _source(self, q: int, side: int, tail: list[int], slot: np.ndarray,
                nbytes: int) -> np.ndarray | None:
        """Where rank ``q``'s parts lie (its slot after the header, or its window, mapped
        on first sight), as bytes, or None: in its process; ``tail`` its header's words
        after the table row."""
        size = tail[WHERE]
        if size == IN_SLOT:
            return slot[self._head:nbytes]
        if size == DIRECT:
            if not self._reads:
                raise ProtocolError(f"rank {q} has its parts read directly, but rank "
                                    f"{self.rank} said it cannot")
            return None
        named = tuple(tail[NAME:READS])
        known = self._theirs.get((q, side))
        if known is None or known[0] != named:
            raw = np.array(named, np.int64).tobytes().rstrip(b"\0")
            try:
                name = raw.decode("ascii")
            except UnicodeDecodeError:
                raise ProtocolError(f"rank {q}'s window name on the shared-memory board is "
                                    f"not ASCII: {raw[:48]!r}") from None
            if known is not None:
                del self._theirs[q, side]
                known[1].close()  # (unmapped once the last view of it goes)
            window = self._map(q, name, size)
            known = self._theirs[q, side] = (named, window, np.frombuffer(
                window.map, np.uint8, offset=PAGE))
        window = known[1]
        if window.size - PAGE != size:
            raise ProtocolError(f"rank {q}'s window {window.name!r} has {window.size - PAGE} "
                                f"bytes, its header says {size}")
        return known[2]

    def _map(self, q: int, name: str, size: int) -> ShmFile:
        if not 0 < size <= MAX_WINDOW:
            raise ProtocolError(f"rank {q}'s window on the shared-memory board has {size} "
                                f"bytes")
        window = ShmFile.open(name, f"rank {q}'s alltoall window", min_size=PAGE + size,
                              max_size=PAGE + size)
        head = np.frombuffer(window.map, np.int64, count=MAPPED + self.size)
        if list(head[:MAPPED]) != [MAGIC, q, self.size, size]:
            window.close()
            raise ProtocolError(f"alltoall window {name!r} is not rank {q}'s of this group")
        head[MAPPED + self.rank] = 1
        del head
        return window

    def close(self) -> None:
        """Unlink and unmap my windows, unmap the peers'."""
        windows = [*self._own, *(known[1] for known in self._theirs.values())]
        # Their views first, so that each unmaps at once.
        self._areas = [None, None]
        self._own = [None, None]
        self._theirs.clear()
        self._agreed = [None] * DEPTH
        self._heads = []  # views of the board, which closes next
        self._shapes.clear()  # (their places too)
        for window in windows:
            if window is not None:
                window.close()


__all__ = ["BoardAlltoall"]
