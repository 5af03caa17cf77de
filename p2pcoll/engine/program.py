"""A rank's part of one collective, compiled once per prepared call into a flat program.

A strategy's schedule is a sequence of steps over chunks (:mod:`p2pcoll.strategy`). For a
given layout (the chunks' pieces, the number of segments) everything the executor derives
from it is the same on every call: which element ranges make up each message, which sends
go as copies, the index of each message on its link, the byte sizes each receive must see.
:func:`compile_program` works that out once; the executor then walks the program, slicing
the call's arrays by precomputed ranges, with no schedule, chunk or counter logic per call::

    program = compile_program(plan(strategy, ctx, nchunks), chunks, itemsizes, nseg, depth)
    for outs, ins in program.segments[seg]:      # one entry per step of the schedule
        for out in outs: send views(out.ranges) to out.dsts (messages out.index)
        for into in ins: receive message (seg, into.frm, into.index), check into.nbytes,
                         fold or copy it into views(into.ranges)

Prepared calls (:mod:`p2pcoll.session.calls`) keep their program; the cache that bounds
those bounds these.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..strategy import Chunk, Recv, Send, _All
from .layout import Piece, _split_point
from .plan import Steps, copies, send_groups

Range = tuple[int, int, int]  # (array index, start, stop) in elements, of one segment


@dataclass(frozen=True, slots=True)
class Out:
    """Send the pieces ``ranges`` to each of ``dsts`` (one message each)."""

    dsts: tuple[int, ...]
    index: tuple[int, ...]  # each message's index on its link within the segment
    ranges: tuple[Range, ...]
    copy: bool  # as snapshots (see plan.copies), not zero-copy


@dataclass(frozen=True, slots=True)
class In:
    """Receive message ``index`` of the segment from ``frm`` into ``ranges``."""

    frm: int
    index: int
    ranges: tuple[Range, ...]
    nbytes: list[int]  # what the message's pieces must measure
    reduce: bool  # fold in (a Reduce), or copy (a Recv)
    chunk: Chunk  # for error messages


Step = tuple[tuple[Out, ...], tuple[In, ...]]


@dataclass(frozen=True, slots=True)
class Program:
    """One rank's compiled part of a collective: ``segments[seg]`` is its steps."""

    steps: Steps  # the schedule it was compiled from (the timeline reads it)
    segments: tuple[tuple[Step, ...], ...]
    sources: frozenset[int]  # the ranks it receives from

    @property
    def nseg(self) -> int:
        return len(self.segments)


def compile_program(steps: Steps, chunks: list[list[Piece]], itemsizes: list[int],
                    nseg: int, depth: int) -> Program:
    """Compile ``steps`` over ``chunks`` (of arrays with ``itemsizes``) cut into ``nseg``
    segments, of which up to ``depth`` run at once."""
    nchunks = len(chunks)
    early, late = copies(steps, nchunks)
    groups = send_groups(steps)
    first_late = max(nseg - depth, 0)

    def ranges(chunk: Chunk, seg: int) -> tuple[Range, ...]:
        ids = (range(nchunks) if isinstance(chunk, _All) else
               chunk if isinstance(chunk, range) else range(chunk, chunk + 1))
        out: list[Range] = []
        for c in ids:
            for i, lo, hi in chunks[c]:
                n = hi - lo
                a, b = lo + _split_point(n, nseg, seg), lo + _split_point(n, nseg, seg + 1)
                if out and out[-1][0] == i and out[-1][2] == a:
                    # Adjacent in the same array: one piece, so a message of many chunks
                    # (half the data, in Rabenseifner's first step) is not O(p) pieces.
                    out[-1] = (i, out[-1][1], b)
                else:
                    out.append((i, a, b))
        return tuple(out)

    segments = []
    for seg in range(nseg):
        copied = late if seg >= first_late else early
        sent: dict[int, int] = {}
        received: dict[int, int] = {}
        program: list[Step] = []
        for i, ops in enumerate(steps):
            outs = []
            for chunk, group in groups[i]:
                dsts = tuple(to for _, to in group)
                index = []
                for to in dsts:
                    index.append(sent.get(to, 0))
                    sent[to] = index[-1] + 1
                outs.append(Out(dsts, tuple(index), ranges(chunk, seg),
                                any((i, j) in copied for j, _ in group)))
            ins = []
            for op in ops:
                if isinstance(op, Send):
                    continue
                n = received.get(op.frm, 0)
                received[op.frm] = n + 1
                where = ranges(op.chunk, seg)
                ins.append(In(op.frm, n, where, [(b - a) * itemsizes[k] for k, a, b in where],
                              not isinstance(op, Recv), op.chunk))
            program.append((tuple(outs), tuple(ins)))
        segments.append(tuple(program))
    sources = frozenset(op.frm for ops in steps for op in ops if not isinstance(op, Send))
    return Program(steps, tuple(segments), sources)


__all__ = ["In", "Out", "Program", "compile_program"]
