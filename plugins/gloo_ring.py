"""The ring allreduce in Gloo's order: the same bits as torch.distributed's Gloo backend.

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
"""

import math
from collections.abc import Sequence

from p2pcoll.strategy import (
    Context,
    Cost,
    Recv,
    Reduce,
    Schedule,
    Send,
    Strategy,
    Traffic,
    Workload,
)
import itertools

SEGMENT_BYTES = 1 << 20  # Gloo's largest segment


def gloo_cuts(size: int, count: int, itemsize: int) -> list[int]:
    """Block b of Gloo's ring allreduce is elements ``cuts[b] .. cuts[b+1]-1``."""
    p = size
    segments = max(math.ceil(count * itemsize / SEGMENT_BYTES), 2 * p)
    segments = math.ceil(segments / p) * p
    block = (segments // p) * math.ceil(count / segments)
    return [min(count, b * block) for b in range(p + 1)]


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
        down, up = (r - 1) % p, (r + 1) % p
        # Reduce-scatter: block b leaves rank b-1 first and reaches b last. At step s rank r
        # passes on the block it last folded into (its own block r+1 at s = 0) and adds its
        # own data to the one arriving from above; after p-1 steps it holds block r whole.
        for s in range(p - 1):
            yield [Send(down, (r + 1 + s) % p), Reduce(up, (r + 2 + s) % p)]
        # Allgather: the finished blocks travel down the ring the same way, copied.
        for s in range(p - 1):
            yield [Send(down, (r + s) % p), Recv(up, (r + 1 + s) % p)]

    def cost(self, work: Workload) -> Cost:
        # The ring's, where the largest of Gloo's blocks sets the pace of every step.
        p = work.size
        cuts = gloo_cuts(p, work.nbytes // work.itemsize, work.itemsize)
        largest = max(b - a for a, b in itertools.pairwise(cuts)) * work.itemsize
        return Cost(2 * (p - 1) * work.waves, 2 * (p - 1) * largest, (p - 1) * largest)

    def traffic(self, work: Workload) -> Traffic:
        # Rank r sends every block but its own in the reduce-scatter, all but r-1's after.
        p = work.size
        cuts = gloo_cuts(p, work.nbytes // work.itemsize, work.itemsize)
        block = [(cuts[b + 1] - cuts[b]) * work.itemsize for b in range(p)]
        n = work.nbytes
        return Traffic(
            (2 * (p - 1) * work.segments,) * p,
            tuple(2 * n - block[r] - block[(r - 1) % p] for r in range(p)),
        )
