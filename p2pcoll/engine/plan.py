"""A strategy's schedule turned into a checked, cached plan, and what the executor derives
from it once per plan: which sends go as copies, and which sends share a chunk.

This is the one place where what a strategy gives back is checked (its class is checked
where it loads, :mod:`p2pcoll.plugin_table`): its chunk count and cuts
(:func:`chunking`) and its schedule (:func:`plan`), each failure a
:class:`~p2pcoll.PluginValidationError` naming the strategy.
"""

from __future__ import annotations

import itertools
from functools import lru_cache
from collections.abc import Sequence
from typing import Any

from ..errors import PluginValidationError
from ..strategy import Chunk, Context, Op, Recv, Reduce, Send, Strategy, _All, chunk_indices

Steps = tuple[tuple[Op, ...], ...]

# Plans are cached per (strategy, rank's context, chunk count), and what is derived from
# them per plan. A compiled program keeps none of it (see engine.program), so the caches
# only spare re-planning a new shape: a few dozen entries serve a process's ranks and
# strategies, and 1024 ranks of a ring in one process (a test's, a benchmark's) do not
# keep 1024 plans of 2(p-1) steps each alive.
PLANS = 64


@lru_cache(maxsize=PLANS)
def plan(strategy: Strategy, ctx: Context, nchunks: int) -> tuple[tuple[Op, ...], ...]:
    """Materialise and validate one rank's schedule (cached: it depends on nothing else)."""
    steps: list[tuple[Op, ...]] = []
    where = f"strategy {strategy.name!r} ({strategy.collective}) on rank {ctx.rank} of {ctx.size}"
    for step in strategy.schedule(ctx):
        ops = (step,) if isinstance(step, (Send, Recv, Reduce)) else tuple(step)
        peers_out: set[int] = set()
        peers_in: set[int] = set()
        for op in ops:
            if not isinstance(op, (Send, Recv, Reduce)):
                raise PluginValidationError(f"{where} yielded {op!r}, not Send/Recv/Reduce")
            peer = op.to if isinstance(op, Send) else op.frm
            if not (0 <= peer < ctx.size) or peer == ctx.rank:
                raise PluginValidationError(f"{where} yielded {op!r}: no such peer")
            seen = peers_out if isinstance(op, Send) else peers_in
            if peer in seen:
                raise PluginValidationError(f"{where} yielded two ops with rank {peer} in one step")
            seen.add(peer)
            _check_chunk(op, nchunks, where)
        steps.append(ops)
    return tuple(steps)


@lru_cache(maxsize=PLANS)
def snapshots(steps: tuple[tuple[Op, ...], ...], nchunks: int) -> frozenset[tuple[int, int]]:
    """The sends (step, op index) whose chunk is written again later in the schedule.

    Those are sent as copies; every other send goes zero-copy from the data. So no receive
    ever waits for libzmq to let go of memory it is about to overwrite (which over a busy
    link can take as long as the transfer itself).
    """
    def ids(chunk: Chunk) -> Sequence[int]:
        return chunk_indices(chunk, nchunks)

    # The last step that writes each chunk (a receive or a reduction into it): one pass, so
    # that a schedule of p steps (a ring's) costs O(p), not O(p^2), per rank.
    last_write = [-1] * nchunks
    for i, ops in enumerate(steps):
        for op in ops:
            if not isinstance(op, Send):
                for c in ids(op.chunk):
                    last_write[c] = i
    out = set()
    for i, ops in enumerate(steps):
        for j, op in enumerate(ops):
            if isinstance(op, Send) and any(last_write[c] >= i for c in ids(op.chunk)):
                out.add((i, j))
    return frozenset(out)


@lru_cache(maxsize=PLANS)
def copies(
    steps: tuple[tuple[Op, ...], ...], nchunks: int
) -> tuple[frozenset[tuple[int, int]], frozenset[tuple[int, int]]]:
    """The sends that go as copies: in every segment, and in the last ``depth`` segments.

    Every segment copies its :func:`snapshots`. The last segments also copy the sends of
    the last step that sends anything: the collective returns only once libzmq has let go
    of every zero-copy send, and the last ones are still on the wire when the last receive
    completes. Copying them (at most ``depth`` segments' worth) costs less than waiting for
    their release, which pyzmq reports through a thread that needs the GIL.
    """
    early = snapshots(steps, nchunks)
    for i in range(len(steps) - 1, -1, -1):
        final = frozenset((i, j) for j, op in enumerate(steps[i]) if isinstance(op, Send))
        if final:
            return early, early | final
    return early, early


@lru_cache(maxsize=PLANS)
def send_groups(
    steps: tuple[tuple[Op, ...], ...],
) -> tuple[tuple[tuple[Any, tuple[tuple[int, int], ...]], ...], ...]:
    """Per step, its sends grouped by chunk: ((chunk, ((op index, peer), ...)), ...).

    A chunk sent to several peers in one step (a root's broadcast) is handed to the mesh
    once, which then copies it into shared memory once for all of them.
    """
    out = []
    for ops in steps:
        groups: dict[Any, list[tuple[int, int]]] = {}
        for j, op in enumerate(ops):
            if isinstance(op, Send):
                groups.setdefault(op.chunk, []).append((j, op.to))
        out.append(tuple((chunk, tuple(g)) for chunk, g in groups.items()))
    return tuple(out)


def chunking(strategy: Strategy, size: int, count: int, itemsize: int
             ) -> tuple[int, tuple[int, ...] | None]:
    """How ``strategy`` cuts ``count`` elements of ``itemsize`` bytes on ``size`` ranks:
    (its chunk count, its cuts or None), checked: a count of at least 1 (``size`` for a
    reduce_scatter), and for a reduce or an allreduce cuts that are ``count + 1`` offsets
    running non-decreasing from 0 to ``count`` (see :meth:`Strategy.cuts`).

    Raises:
        PluginValidationError: naming the strategy and what it gave.
    """
    where = f"{strategy.collective} strategy {strategy.name!r}"
    nchunks = strategy.chunks(size)
    if not isinstance(nchunks, int) or isinstance(nchunks, bool) or nchunks < 1:
        raise PluginValidationError(f"{where} gave {nchunks!r} chunks for {size} ranks "
                                    f"(a whole number of at least 1 is needed)")
    if strategy.collective == "reduce_scatter" and nchunks != size:
        raise PluginValidationError(f"{where} must cut the data into {size} chunks, "
                                    f"not {nchunks}")
    if strategy.collective == "alltoall" and nchunks != size * size:
        raise PluginValidationError(f"{where} must have {size * size} chunks (one per "
                                    f"pair of ranks), not {nchunks}")
    if strategy.collective not in ("allreduce", "reduce"):
        return nchunks, None
    given = strategy.cuts(size, count, itemsize)
    if given is None:
        return nchunks, None
    cuts = tuple(int(c) for c in given)
    if len(cuts) != nchunks + 1:
        raise PluginValidationError(f"{where} gave {len(cuts)} cuts for {nchunks} chunks "
                                    f"(chunks + 1 offsets are needed)")
    if cuts[0] != 0 or cuts[-1] != count or any(b < a for a, b in itertools.pairwise(cuts)):
        shown = f"{list(cuts[:4])}{'...' if len(cuts) > 4 else ''}"
        raise PluginValidationError(f"{where} gave cuts {shown} ({len(cuts)} offsets); they "
                                    f"must run non-decreasing from 0 to {count}")
    return nchunks, cuts


def _check_chunk(op: Op, nchunks: int, where: str) -> None:
    c = op.chunk
    ok = (
        isinstance(c, _All)
        or (isinstance(c, int) and 0 <= c < nchunks)
        or (isinstance(c, range) and c.step == 1 and 0 <= c.start <= c.stop <= nchunks)
        or (isinstance(c, tuple) and len(set(c)) == len(c)
            and all(isinstance(i, int) and 0 <= i < nchunks for i in c))
    )
    if not ok:
        raise PluginValidationError(f"{where} yielded {op!r}: chunk outside 0..{nchunks - 1}")
