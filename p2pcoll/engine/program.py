"""A rank's part of one collective, compiled once per prepared call into a compact program.

A strategy's schedule is a sequence of steps over chunks (:mod:`p2pcoll.strategy`). For a
given layout (the chunks' pieces, the number of segments) everything the executor derives
from it is the same on every call: which element ranges make up each message, which sends
go as copies, the index of each message on its link, the byte sizes each receive must see.
:func:`compile_program` works that out once; the executor then walks the program, slicing
the call's arrays by precomputed ranges, with no schedule, chunk or counter logic per call.

The program is the rank's messages in the order it handles them (a step's sends, then its
receives, then the next step's), one entry per message in four parallel arrays of ints::

    kind    SEND (| LAST: the last destination of a send group) | EARLY / LATE (sent as a
            copy in the early / the last ``depth`` segments: see plan.copies); or a receive,
            REDUCE if it is folded in, else copied
    peer    the rank it goes to or comes from
    index   its index on that link within the segment (the k-th message to a peer is the
            k-th it receives from us: the message key's last field)
    where   which pieces of the data it carries: ``cuts.where[seg][where]``

A send group (one chunk to several peers in one step, a root's broadcast) is its run of SEND
entries up to the LAST one, handed to the transport at once. Nothing in the arrays depends on
the segment; the pieces do, and those live in :class:`Cuts`, which every program over the
same layout shares (every rank of a group in one process, every call of the same shape). So
a rank's compiled state is a few bytes per message of its schedule (a ring's 2(p-1) steps:
about 26 bytes a step), no Python object per step, and nothing the garbage collector walks::

    for kind, peer, index, w in zip(program.kind, program.peer, program.index, program.where):
        if kind & SEND: collect (peer, index); on LAST send views(where[w].ranges) to them
        else: receive message (seg, peer, index), check where[w].nbytes, fold or copy it
              into views(where[w].ranges)

Prepared calls (:mod:`p2pcoll.session.calls`) keep their program; the cache that bounds
those bounds these.
"""

from __future__ import annotations

import threading
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from ..strategy import Chunk, Op, Recv, Reduce, Send, chunk_indices
from .layout import Piece, _split_point
from .plan import Steps, copies, send_groups

Range = tuple[int, int, int]  # (array index, start, stop) in elements, of one segment

# The bits of a message's kind.
SEND = 1  # a send (else a receive)
LAST = 2  # the last destination of its send group: the group goes out here
EARLY = 4  # a send that goes as a copy in the segments before the last ``depth``
LATE = 8  # a send that goes as a copy in the last ``depth`` segments
REDUCE = 16  # a receive folded in with the op (else copied over the data)


@dataclass(frozen=True, slots=True)
class Where:
    """The pieces of one chunk (an index, a range or ALL) within one segment."""

    ranges: tuple[Range, ...]
    nbytes: list[int]  # what a message of these pieces must measure
    chunk: Chunk  # for error messages


class Cuts:
    """The chunks of one layout cut into segments: ``where[seg][w]`` is the :class:`Where`
    of the chunk numbered ``w`` (by :meth:`number`) in segment ``seg``.

    One instance serves every program compiled over the same layout (see :func:`cuts`), so
    the pieces of a chunk exist once in the process, not once per rank and step. Numbers
    are only ever added, so a number handed out stays valid.
    """

    def __init__(self, chunks: tuple[tuple[Piece, ...], ...], itemsizes: tuple[int, ...],
                 nseg: int) -> None:
        self.chunks, self.itemsizes, self.nseg = chunks, itemsizes, nseg
        self.where: tuple[list[Where], ...] = tuple([] for _ in range(nseg))
        self._numbers: dict[object, int] = {}
        self._lock = threading.Lock()  # programs may be compiled on several threads' loops

    def number(self, chunk: Chunk) -> int:
        """The number of ``chunk`` (its pieces in every segment made on first use)."""
        w = self._numbers.get(chunk)  # ranges compare (and hash) by value
        if w is None:
            with self._lock:
                w = self._numbers.get(chunk)
                if w is None:
                    w = len(self._numbers)
                    for seg, wheres in enumerate(self.where):
                        ranges = self._ranges(chunk, seg)
                        wheres.append(Where(ranges, [(b - a) * self.itemsizes[i]
                                                     for i, a, b in ranges], chunk))
                    self._numbers[chunk] = w
        return w

    def _ranges(self, chunk: Chunk, seg: int) -> tuple[Range, ...]:
        nchunks, nseg = len(self.chunks), self.nseg
        ids = chunk_indices(chunk, nchunks)
        out: list[Range] = []
        for c in ids:
            for i, lo, hi in self.chunks[c]:
                n = hi - lo
                a, b = lo + _split_point(n, nseg, seg), lo + _split_point(n, nseg, seg + 1)
                if out and out[-1][0] == i and out[-1][2] == a:
                    # Adjacent in the same array: one piece, so a message of many chunks
                    # (half the data, in Rabenseifner's first step) is not O(p) pieces.
                    out[-1] = (i, out[-1][1], b)
                else:
                    out.append((i, a, b))
        return tuple(out)


@lru_cache(maxsize=64)
def cuts(chunks: tuple[tuple[Piece, ...], ...], itemsizes: tuple[int, ...],
         nseg: int) -> Cuts:
    """The process's one :class:`Cuts` of this layout (kept for the 64 most recent)."""
    return Cuts(chunks, itemsizes, nseg)


@dataclass(frozen=True, slots=True)
class Program:
    """One rank's compiled part of a collective (see the module docstring)."""

    kind: array[int]  # per message, in the order handled: SEND | LAST | EARLY | LATE | REDUCE
    peer: array[int]
    index: array[int]
    where: array[int]
    step_ends: array[int]  # the number of messages up to the end of each step (for steps)
    cuts: Cuts
    first_late: int  # the first segment whose sends copy LATE ones (the last ``depth``)
    sources: frozenset[int]  # the ranks it receives from
    destinations: frozenset[int]  # the ranks it sends to (what it drives: Paths.drive)

    @property
    def nseg(self) -> int:
        return self.cuts.nseg

    @property
    def steps(self) -> Steps:
        """The schedule this program runs, step by step (each step's sends first, grouped
        by chunk; then its receives): what the timeline labels messages with."""
        chunk = [where.chunk for where in self.cuts.where[0]]
        out: list[tuple[Op, ...]] = []
        start = 0
        for end in self.step_ends:
            ops: list[Op] = []
            for m in range(start, end):
                kind, peer, c = self.kind[m], self.peer[m], chunk[self.where[m]]
                ops.append(Send(peer, c) if kind & SEND else
                           Reduce(peer, c) if kind & REDUCE else Recv(peer, c))
            out.append(tuple(ops))
            start = end
        return tuple(out)


def compile_program(steps: Steps, chunks: Sequence[Sequence[Piece]], itemsizes: list[int],
                    nseg: int, depth: int) -> Program:
    """Compile ``steps`` over ``chunks`` (of arrays with ``itemsizes``) cut into ``nseg``
    segments, of which up to ``depth`` run at once.

    Raises:
        ValueError: ``nseg`` is below 1.
    """
    if nseg < 1:
        raise ValueError(f"a program needs at least 1 segment, got nseg={nseg}")
    early, late = copies(steps, len(chunks))
    layout = cuts(tuple(tuple(c) for c in chunks), tuple(itemsizes), nseg)
    kinds: list[int] = []
    peers: list[int] = []
    indices: list[int] = []
    wheres: list[int] = []
    step_ends: list[int] = []
    sent: dict[int, int] = {}
    received: dict[int, int] = {}
    for i, (ops, groups) in enumerate(zip(steps, send_groups(steps), strict=True)):
        for chunk, group in groups:
            w = layout.number(chunk)
            copy = ((EARLY if any((i, j) in early for j, _ in group) else 0)
                    | (LATE if any((i, j) in late for j, _ in group) else 0))
            for k, (_, to) in enumerate(group):
                n = sent.get(to, 0)
                sent[to] = n + 1
                kinds.append(SEND | copy | (LAST if k == len(group) - 1 else 0))
                peers.append(to)
                indices.append(n)
                wheres.append(w)
        for op in ops:
            if isinstance(op, Send):
                continue
            n = received.get(op.frm, 0)
            received[op.frm] = n + 1
            kinds.append(REDUCE if isinstance(op, Reduce) else 0)
            peers.append(op.frm)
            indices.append(n)
            wheres.append(layout.number(op.chunk))
        step_ends.append(len(kinds))
    sources = frozenset(op.frm for ops in steps for op in ops if not isinstance(op, Send))
    return Program(array("B", kinds), _ints(peers), _ints(indices), _ints(wheres),
                   _ints(step_ends), layout, max(nseg - depth, 0), sources, frozenset(sent))


def _ints(values: list[int]) -> array[int]:
    """``values`` (none negative) in the narrowest array that holds them."""
    top = max(values, default=0)
    return array("B" if top < 1 << 8 else "H" if top < 1 << 16 else "i", values)


__all__ = ["EARLY", "LAST", "LATE", "REDUCE", "SEND", "Cuts", "Program", "Where",
           "compile_program", "cuts"]
