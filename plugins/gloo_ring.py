"""The ring allreduce and reduce in Gloo's order: the same bits as torch.distributed's Gloo.

Floating-point addition is not associative, so two correct allreduces of the same inputs may
differ in their last bits; a model trained on one drifts away from the same model trained on
the other. This strategy takes every partial sum where ``gloo::allreduce``'s ring (the one
ProcessGroupGloo runs on CPU, torch 2.x) takes it, so results equal Gloo's bit for bit at any
world size; the torch backend uses it by default.

Gloo cuts the data (one flat buffer of ``n`` elements of ``es`` bytes) into
``S = roundUp(max(ceil(n*es / 1 MiB), 2p), p)`` segments of ``seg = ceil(n / S)`` elements,
``S/p`` consecutive segments per rank; block ``b`` is elements
``[b*(S/p)*seg, (b+1)*(S/p)*seg)`` clipped to ``n`` (the last blocks may be short or empty,
so these are not ``array_split``'s cuts). Data travels down the ring (rank r sends to r-1):
block b starts at rank b-1 and each rank adds its own, so rank b ends with
``x[b] + (x[b+1] + (... + (x[b-2] + x[b-1])))``; an allgather passes the blocks on. Same
traffic and rounds as the ring; Gloo pipelines its segments and p2pcoll its own, which does
not change a single sum.

``gloo::reduce`` runs the same reduce-scatter over blocks of other segments
(``seg = min(ceil(n / 2p), 1 MiB / es)`` elements, ``S = roundUp(max(ceil(n / seg), 2p), p)``),
then every rank sends its finished block to the root.
"""

import itertools
import math
from collections.abc import Iterator, Sequence

from p2pcoll.strategy import (
    Context,
    Cost,
    Recv,
    Reduce,
    Schedule,
    Send,
    Step,
    Strategy,
    Traffic,
    Workload,
)

SEGMENT_BYTES = 1 << 20  # Gloo's largest segment


def gloo_cuts(size: int, count: int, itemsize: int) -> list[int]:
    """Block b of Gloo's ring allreduce is elements ``cuts[b] .. cuts[b+1]-1``."""
    p = size
    segments = max(math.ceil(count * itemsize / SEGMENT_BYTES), 2 * p)
    segments = math.ceil(segments / p) * p
    block = (segments // p) * math.ceil(count / segments)
    return [min(count, b * block) for b in range(p + 1)]


def gloo_reduce_cuts(size: int, count: int, itemsize: int) -> list[int]:
    """Block b of Gloo's reduce: segments of at most half a block, at most 1 MiB."""
    p = size
    if count == 0:
        return [0] * (p + 1)
    segment = min(math.ceil(count / (2 * p)), max(1, SEGMENT_BYTES // itemsize))
    segments = max(math.ceil(count / segment), 2 * p)
    segments = math.ceil(segments / p) * p
    block = (segments // p) * segment
    return [min(count, b * block) for b in range(p + 1)]


def reduce_down_the_ring(ctx: Context) -> Iterator[Step]:
    """Gloo's reduce-scatter: rank r ends with block r, summed r, r+1, ..., r-1 inwards.

    Block b leaves rank b-1 first and reaches b last. At step s rank r passes on the block
    it last folded into (its own block r+1 at s = 0) and adds its own data to the one
    arriving from above; after p-1 steps it holds block r whole.
    """
    p, r = ctx.size, ctx.rank
    down, up = (r - 1) % p, (r + 1) % p
    for s in range(p - 1):
        yield [Send(down, (r + 1 + s) % p), Reduce(up, (r + 2 + s) % p)]


def _blocks(cuts: Sequence[int], itemsize: int) -> list[int]:
    return [(b - a) * itemsize for a, b in itertools.pairwise(cuts)]


class GlooRingAllreduce(Strategy):
    name = "gloo_ring"
    collective = "allreduce"
    description = "ring in Gloo's order (down the ring, Gloo's blocks): Gloo's bits exactly"
    automatic = False  # chosen for its bits (the torch backend's default), never by auto

    def chunks(self, size: int) -> int:
        return size

    def cuts(self, size: int, count: int, itemsize: int) -> Sequence[int]:
        return gloo_cuts(size, count, itemsize)

    def schedule(self, ctx: Context) -> Schedule:
        p, r = ctx.size, ctx.rank
        yield from reduce_down_the_ring(ctx)
        # Allgather: the finished blocks travel down the ring the same way, copied.
        for s in range(p - 1):
            yield [Send((r - 1) % p, (r + s) % p), Recv((r + 1) % p, (r + 1 + s) % p)]

    def cost(self, work: Workload) -> Cost:
        # The ring's, where the largest of Gloo's blocks sets the pace of every step.
        p = work.size
        largest = max(_blocks(gloo_cuts(p, work.nbytes // work.itemsize, work.itemsize),
                              work.itemsize))
        return Cost(2 * (p - 1) * work.waves, 2 * (p - 1) * largest, (p - 1) * largest)

    def traffic(self, work: Workload) -> Traffic:
        # Rank r sends every block but its own in the reduce-scatter, all but r-1's after.
        p, n = work.size, work.nbytes
        block = _blocks(gloo_cuts(p, n // work.itemsize, work.itemsize), work.itemsize)
        return Traffic(
            (2 * (p - 1) * work.segments,) * p,
            tuple(2 * n - block[r] - block[(r - 1) % p] for r in range(p)),
        )


class GlooRingReduce(Strategy):
    name = "gloo_ring"
    collective = "reduce"
    description = "Gloo's reduce: its ring reduce-scatter, then each block to the root"
    automatic = False  # chosen for its bits (the torch backend's default), never by auto

    def chunks(self, size: int) -> int:
        return size

    def cuts(self, size: int, count: int, itemsize: int) -> Sequence[int]:
        return gloo_reduce_cuts(size, count, itemsize)

    def schedule(self, ctx: Context) -> Schedule:
        yield from reduce_down_the_ring(ctx)
        if ctx.rank != ctx.root:
            yield Send(ctx.root, ctx.rank)
        elif ctx.size > 1:
            yield [Recv(b, b) for b in range(ctx.size) if b != ctx.root]

    def cost(self, work: Workload) -> Cost:
        # p-1 ring steps paced by the largest block, then the root takes the p-1 others'
        # blocks in turn (root 0, as traffic is counted).
        p = work.size
        block = _blocks(gloo_reduce_cuts(p, work.nbytes // work.itemsize, work.itemsize),
                        work.itemsize)
        largest = max(block)
        return Cost(2 * (p - 1) * work.waves, (p - 1) * largest + work.nbytes - block[0],
                    (p - 1) * largest)

    def traffic(self, work: Workload) -> Traffic:
        # Every block but its own in the ring; a non-root then sends its own to the root
        # (root 0, as traffic is counted).
        p, n = work.size, work.nbytes
        block = _blocks(gloo_reduce_cuts(p, n // work.itemsize, work.itemsize), work.itemsize)
        return Traffic(
            tuple((p - 1 if r == 0 else p) * work.segments for r in range(p)),
            tuple(n - block[0] if r == 0 else n for r in range(p)),
        )
