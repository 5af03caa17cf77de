"""The compact compiled program (p2pcoll.engine.program): the same messages as the schedule
says, and a rank's compiled state a few bytes per message of its schedule, whatever p.

The program used to hold one Python object per step and segment (an Out and an In, with
tuples of ranges): a 1024-rank ring's programs held ~3 GiB in one process. Now a rank keeps
four arrays of small ints, one entry per message, and the pieces of each chunk live once per
layout in a shared :class:`~p2pcoll.engine.program.Cuts`. Checked here:

- against a reference compiler written straight from the definition (the old per-step form,
  re-derived here): for every built-in allreduce/reduce/broadcast/allgather strategy, world
  sizes to 9, every rank and root, 1 and 3 segments, depth 1 and 2, one array or three: the
  same messages in the same order, each with the same peer, link index, element ranges,
  byte sizes, copy flag and fold-or-copy;
- ``Program.steps`` gives back the schedule the timeline labels messages with;
- every rank's program over one layout shares one ``Cuts``;
- memory: a ring rank's compiled state at p = 1024 is at most 12 bytes per message plus a
  constant (measured with tracemalloc, the plan caches emptied), no more per message than at
  p = 16, and holds no object the garbage collector tracks beyond a constant few.
"""

from __future__ import annotations

import gc
import tracemalloc
from typing import Any

import numpy as np
import pytest

from p2pcoll.engine import plan as plans
from p2pcoll.engine.layout import Layout, _split_point
from p2pcoll.engine.plan import copies, plan, send_groups
from p2pcoll.engine.program import LAST, LATE, REDUCE, SEND, EARLY, Program, compile_program
from p2pcoll.errors import PluginValidationError
from p2pcoll.registry import Registry
from p2pcoll.strategy import Context, Recv, Send, _All

COLLECTIVES = ("allreduce", "reduce", "broadcast", "allgather", "reduce_scatter")


def reference(steps: Any, chunks: list[list[tuple[int, int, int]]], itemsizes: list[int],
              nseg: int, depth: int) -> list[list[tuple[Any, ...]]]:
    """Per segment, the messages in the order the executor handles them, from the
    definition: each step's sends (grouped by chunk, one message per destination), then its
    receives; the k-th message on a link in a segment has index k."""
    nchunks = len(chunks)
    early, late = copies(steps, nchunks)
    first_late = max(nseg - depth, 0)

    def ranges(chunk: Any, seg: int) -> list[tuple[int, int, int]]:
        ids = (range(nchunks) if isinstance(chunk, _All) else
               chunk if isinstance(chunk, range) else [chunk])
        out: list[tuple[int, int, int]] = []
        for c in ids:
            for i, lo, hi in chunks[c]:
                a, b = (lo + _split_point(hi - lo, nseg, seg),
                        lo + _split_point(hi - lo, nseg, seg + 1))
                if out and out[-1][0] == i and out[-1][2] == a:
                    out[-1] = (i, out[-1][1], b)
                else:
                    out.append((i, a, b))
        return out

    segments = []
    for seg in range(nseg):
        copied = late if seg >= first_late else early
        sent: dict[int, int] = {}
        received: dict[int, int] = {}
        messages: list[tuple[Any, ...]] = []
        for i, ops in enumerate(steps):
            for chunk, group in send_groups(steps)[i]:
                copy = any((i, j) in copied for j, _ in group)
                for k, (_, to) in enumerate(group):
                    n = sent.get(to, 0)
                    sent[to] = n + 1
                    where = ranges(chunk, seg)
                    messages.append(("send", to, n, where, k == len(group) - 1, copy))
            for op in ops:
                if not isinstance(op, Send):
                    n = received.get(op.frm, 0)
                    received[op.frm] = n + 1
                    where = ranges(op.chunk, seg)
                    messages.append(("recv", op.frm, n, where,
                                     [(b - a) * itemsizes[k] for k, a, b in where],
                                     not isinstance(op, Recv)))
        segments.append(messages)
    return segments


def walked(program: Program) -> list[list[tuple[Any, ...]]]:
    """Per segment, the messages as the executor reads them from ``program``."""
    segments = []
    for seg in range(program.nseg):
        where = program.cuts.where[seg]
        copy_bit = LATE if seg >= program.first_late else EARLY
        messages: list[tuple[Any, ...]] = []
        for kind, peer, n, w in zip(program.kind, program.peer, program.index,
                                    program.where, strict=True):
            if kind & SEND:
                messages.append(("send", peer, n, list(where[w].ranges), bool(kind & LAST),
                                 bool(kind & copy_bit)))
            else:
                messages.append(("recv", peer, n, list(where[w].ranges), where[w].nbytes,
                                 bool(kind & REDUCE)))
        segments.append(messages)
    return segments


def layouts(nchunks: int) -> list[tuple[list[list[tuple[int, int, int]]], list[int]]]:
    """One float32 array of 37 elements, and three arrays (float64, an empty int32, int8)."""
    one = Layout.split([np.zeros(37, np.float32)], nchunks)
    three = Layout.split([np.zeros(11), np.zeros(0, np.int32), np.zeros(5, np.int8)], nchunks)
    return [(one.chunks, [4]), (three.chunks, [8, 4, 1])]


@pytest.mark.parametrize("sizes", [
    pytest.param(range(2, 7), id="p2-6"),
    pytest.param(range(7, 10), id="p7-9", marks=pytest.mark.slow),
])
def test_the_program_sends_and_receives_what_the_schedule_says(sizes: range) -> None:
    registry = Registry()
    registry.load()
    checked = 0
    for collective in COLLECTIVES:
        for name in registry.available().get(collective, []):
            strategy = registry.get(collective, name)
            for p in sizes:
                for root in range(p) if collective in ("reduce", "broadcast") else [0]:
                    for rank in range(p):
                        nchunks = strategy.chunks(p) if collective != "allgather" else p
                        try:
                            steps = plan(strategy, Context(rank, p, root), nchunks)
                        except PluginValidationError:
                            continue
                        for chunks, itemsizes in layouts(nchunks):
                            for nseg, depth in ((1, 2), (3, 1), (3, 2)):
                                program = compile_program(steps, chunks, itemsizes, nseg,
                                                          depth)
                                assert walked(program) == reference(
                                    steps, chunks, itemsizes, nseg, depth), (name, p, rank)
                                checked += 1
    assert checked > 1000, checked


def test_steps_give_back_the_schedule() -> None:
    """What the timeline labels messages with: per step, the same sends (by chunk and
    peer, in order) and the same receives as the plan."""
    registry = Registry()
    registry.load()
    for name in registry.available()["allreduce"]:
        strategy = registry.get("allreduce", name)
        for p in (2, 5, 8):
            for rank in range(p):
                nchunks = strategy.chunks(p)
                steps = plan(strategy, Context(rank, p, 0), nchunks)
                chunks = Layout.split([np.zeros(100, np.float32)], nchunks).chunks
                got = compile_program(steps, chunks, [4], 2, 2).steps
                def sends(steps: Any) -> list[list[tuple[Any, list[int]]]]:
                    return [[(c, [to for _, to in g]) for c, g in groups]
                            for groups in send_groups(steps)]

                assert sends(got) == sends(steps)
                assert [[op for op in ops if not isinstance(op, Send)] for ops in got] == [
                    [op for op in ops if not isinstance(op, Send)] for ops in steps]


def test_every_rank_shares_the_pieces_of_one_layout() -> None:
    registry = Registry()
    registry.load()
    ring = registry.get("allreduce", "ring")
    chunks = Layout.split([np.zeros(1000, np.float32)], 8).chunks
    programs = [compile_program(plan(ring, Context(r, 8, 0), 8), chunks, [4], 2, 2)
                for r in range(8)]
    assert all(p.cuts is programs[0].cuts for p in programs)
    assert len(programs[0].cuts.where[0]) == 8  # one entry per chunk, not per rank or step
    other = Layout.split([np.zeros(999, np.float32)], 8).chunks
    assert compile_program(plan(ring, Context(0, 8, 0), 8), other, [4], 2, 2).cuts \
        is not programs[0].cuts


def compiled_state(p: int, ranks: int) -> tuple[float, float, int]:
    """(bytes per rank, bytes per message, GC-tracked objects per rank) that ``ranks`` of a
    ring at world size ``p`` keep compiled for a 4 KiB allreduce, beyond what every rank
    shares (the pieces of the layout's chunks, made by a first rank compiled beforehand);
    the plan caches emptied, so only what the programs hold counts."""
    registry = Registry()
    registry.load()
    ring = registry.get("allreduce", "ring")
    chunks = Layout.split([np.zeros(1024, np.float32)], p).chunks
    shared = compile_program(plan(ring, Context(0, p, 0), p), chunks, [4], 1, 2)
    tracemalloc.start()
    try:
        programs = [compile_program(plan(ring, Context(r, p, 0), p), chunks, [4], 1, 2)
                    for r in range(1, ranks + 1)]
        assert all(program.cuts is shared.cuts for program in programs)
        messages = sum(len(program.kind) for program in programs)
        for cache in (plans.plan, plans.copies, plans.snapshots, plans.send_groups):
            cache.cache_clear()
        gc.collect()
        with_programs, objects = tracemalloc.get_traced_memory()[0], len(gc.get_objects())
        del programs  # what that frees is what they held
        gc.collect()
        kept = with_programs - tracemalloc.get_traced_memory()[0]
        tracked = objects - len(gc.get_objects())
    finally:
        tracemalloc.stop()
    return kept / ranks, kept / messages, tracked // ranks


@pytest.mark.slow  # compiles a ring of 1024 ranks under tracemalloc
def test_a_rings_compiled_state_is_a_few_bytes_per_message() -> None:
    small_rank, small_message, small_objects = compiled_state(16, 8)
    large_rank, large_message, large_objects = compiled_state(1024, 8)
    # Measured: 1.0 KiB a rank (60 messages) at p = 16; 29 KiB (4092 messages, ~7 bytes
    # each) at p = 1024. The old per-step form kept 23 KiB and 1.7 MiB (2.7 MiB with the
    # cached plans).
    assert large_message <= 12, large_message
    assert large_message <= small_message, (small_message, large_message)
    assert large_rank <= 2048 + 12 * 4092, large_rank
    # A few objects per rank (the program, its set of sources), none per step.
    assert large_objects <= max(small_objects, 16), (small_objects, large_objects)


@pytest.mark.parametrize("bad", [0, -1])
def test_a_layout_is_cut_into_at_least_one_segment(bad: int) -> None:
    registry = Registry()
    registry.load()
    ring = registry.get("allreduce", "ring")
    chunks = Layout.split([np.zeros(10, np.float32)], 2).chunks
    with pytest.raises(ValueError, match="at least 1 segment"):
        compile_program(plan(ring, Context(0, 2, 0), 2), chunks, [4], bad, 2)
