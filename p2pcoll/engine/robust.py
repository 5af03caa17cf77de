"""The robust reductions' two halves: the exchange of the inputs, and the per-element
median or trimmed mean of what a rank received.

A median or a trimmed mean is no pairwise fold: the value of an element depends on every
rank's value of it at once. So each rank reduces one partition of the data
(``numpy.array_split`` of the n elements into p parts, part r for rank r) from every
rank's values of that partition, and the finished parts are then allgathered:

1. **Exchange** (:class:`Exchange`, an all-to-all of slices): rank r sends its part c to
   rank c and receives every rank's part r. It runs on a *stage* of ``p * n`` elements,
   row q holding rank q's input (this rank's own row is its input): chunk ``q * p + c`` is
   row q's part c, so the exchange is plain Sends and Recvs and the executor does the rest
   (segments, zero copies, signatures).
2. **Reduce** (:func:`reduce_part`): rank r sorts each element's p values (rows in rank
   order, NaNs last) and averages the middle ones, in a fixed order.
3. **Allgather** of the finished parts, with any allgather strategy (only copies).

Every element is computed by one rank, from the same p values in the same order, so the
result has the same bits on every rank whatever allgather strategy runs; and because the
values are sorted first, the result does not depend on which rank sent which value.

Cost: the exchange sends (p - 1)/p of the data from every rank in p - 1 messages, like a
ring's reduce-scatter, but nothing can be combined on the way: a tree or a recursive
halving would carry every value unreduced, up to p times the data of a normal allreduce's
messages, so the direct exchange is the one schedule. The allgather adds what an allgather
of n bytes costs.
"""

from __future__ import annotations

import numpy as np

from ..strategy import Context, Cost, Recv, Schedule, Send, Strategy, Traffic, Workload

__all__ = ["EXCHANGE", "Exchange", "reduce_part", "stage_cuts"]


def _split(n: int, p: int, c: int) -> int:
    """Start of part c when n items are split like ``numpy.array_split`` into p parts."""
    q, r = divmod(n, p)
    return c * q + min(c, r)


def stage_cuts(size: int, count: int) -> list[int]:
    """Where the chunks of a stage of ``count = size * n`` elements begin: chunk
    ``q * size + c`` is row q's part c; ``size * size + 1`` offsets."""
    p, n = size, count // size
    return [q * n + _split(n, p, c) for q in range(p) for c in range(p)] + [count]


class Exchange(Strategy):
    """The all-to-all of slices, in the pairwise order (MPICH's
    ``MPIR_Alltoall_intra_pairwise``): in step s = 1 .. p-1, rank r sends its part to rank
    r+s and receives rank r-s's part r, so every step pairs each rank with one sender and
    one receiver and no rank is flooded. Not registered: the robust allreduce runs it."""

    name = "exchange"
    collective = "allreduce"
    description = "all-to-all of slices for the robust ops; (p-1)/p·n bytes per rank"

    def chunks(self, size: int) -> int:
        return size * size

    def cuts(self, size: int, count: int, itemsize: int) -> list[int]:
        return stage_cuts(size, count)

    def schedule(self, ctx: Context) -> Schedule:
        p, r = ctx.size, ctx.rank
        for s in range(1, p):
            to, frm = (r + s) % p, (r - s) % p
            yield [Send(to, r * p + to), Recv(frm, frm * p + r)]

    def cost(self, work: Workload) -> Cost:
        # ``work.nbytes`` is one rank's input (n), as for an allreduce; the rank then sorts
        # the p slices of n/p it holds (n bytes, counted as one reduction's worth).
        p, n = work.size, work.nbytes
        return Cost((p - 1) * work.waves, (p - 1) / p * n, n)

    def traffic(self, work: Workload) -> Traffic:
        p, n = work.size, work.nbytes  # rank r sends every part but its own
        return Traffic(((p - 1) * work.segments,) * p,
                       tuple(n - work.part(r, p) for r in range(p)))


EXCHANGE = Exchange()


def reduce_part(rows: np.ndarray, trim: int, out: np.ndarray) -> None:
    """The trimmed mean of each column of ``rows`` (p values of each element of a part,
    one row per rank) into ``out``: the ``trim`` smallest and largest dropped, the rest
    summed in ascending order and divided by their count. A median is the trimmed mean
    with ``trim = (p - 1) // 2``: the middle value, or the mean of the two middle ones.

    Sums run in the dtype, float16's in float32 (numpy's ``mean`` does the same), so the
    result equals ``numpy.median`` bit for bit. An element with a NaN among its values is
    NaN (as with ``numpy.median``); infinities are values like any other.
    """
    p = rows.shape[0]
    ordered = np.sort(rows, axis=0)  # NaNs last
    keep = ordered[trim:p - trim]
    wide = np.dtype(np.float32) if rows.dtype == np.float16 else rows.dtype
    with np.errstate(all="ignore"):
        total = keep[0].astype(wide)
        for row in keep[1:]:
            total += row
        total /= wide.type(len(keep))
        np.copyto(out, total, casting="unsafe")
        out[np.isnan(ordered[-1])] = np.nan
