"""The robust reductions' two halves: the exchange of the inputs, and the per-element
median or trimmed mean of what a rank received.

A median or a trimmed mean is no pairwise fold: the value of an element depends on every
rank's value of it at once. So each rank reduces one partition of the data
(``numpy.array_split`` of the n elements into p parts, part r for rank r) from every
rank's values of that partition, and the finished parts are then allgathered:

1. **Exchange** (:class:`Exchange`, an all-to-all of slices): rank r sends its part c to
   rank c and receives every rank's part r. It runs on a *stage* where chunk ``q * p + c``
   is rank q's part c (only this rank's own row and the parts it receives take room), so
   the exchange is plain Sends and Recvs and the executor does the rest (segments, zero
   copies, signatures).
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

from functools import lru_cache

import numpy as np

from ..strategy import Context, Cost, Recv, Schedule, Send, Strategy, Traffic, Workload

__all__ = ["EXCHANGE", "Exchange", "exchange", "reduce_part", "stage_size"]


def _split(n: int, p: int, c: int) -> int:
    """Start of part c when n items are split like ``numpy.array_split`` into p parts."""
    q, r = divmod(n, p)
    return c * q + min(c, r)


class Exchange(Strategy):
    """The all-to-all of slices, in the pairwise order (MPICH's
    ``MPIR_Alltoall_intra_pairwise``): in step s = 1 .. p-1, rank r sends its part to rank
    r+s and receives rank r-s's part r, so every step pairs each rank with one sender and
    one receiver and no rank is flooded. Not registered: the robust allreduce runs it.

    Rank r's stage holds n + (p-1) * ceil(n/p) elements, the same on every rank: its own
    input where row r goes, and for every other rank q a slot of ceil(n/p) for the one part
    it receives from q (chunk ``q * p + r``, the rest of the slot a chunk nobody moves).
    So the stage costs about twice the input, not p times; one instance per (rank, n).
    """

    name = "exchange"
    collective = "allreduce"
    description = "all-to-all of slices for the robust ops; (p-1)/p·n bytes per rank"

    def __init__(self, rank: int = 0, n: int = 0) -> None:
        self.rank, self.n = rank, n

    def chunks(self, size: int) -> int:
        return size * size

    def cuts(self, size: int, count: int, itemsize: int) -> list[int]:
        p, r, n = size, self.rank, self.n
        slot = -(-n // p)
        mine = _split(n, p, r + 1) - _split(n, p, r)
        spare = (r + 1) % p  # the chunk that holds the rest of a slot
        lengths = []
        for q in range(p):
            for c in range(p):
                if q == r:
                    lengths.append(_split(n, p, c + 1) - _split(n, p, c))
                elif c == r:
                    lengths.append(mine)
                else:
                    lengths.append(slot - mine if c == spare else 0)
        cuts = [0]
        for length in lengths:
            cuts.append(cuts[-1] + length)
        return cuts

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


EXCHANGE = Exchange()  # for cost models: every instance costs the same


@lru_cache(maxsize=256)
def exchange(rank: int, n: int) -> Exchange:
    """The exchange of rank ``rank`` for ``n`` elements (one instance each, so that the
    engine's plans are cached)."""
    return Exchange(rank, n)


def stage_size(n: int, size: int) -> int:
    """Elements of every rank's stage for ``n`` elements on ``size`` ranks."""
    return n + (size - 1) * -(-n // size)


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
