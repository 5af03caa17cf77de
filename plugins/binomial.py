"""Binomial trees (MPICH ``MPIR_Bcast_intra_binomial`` / ``MPIR_Reduce_intra_binomial``).

Ranks are renumbered relative to the root, ``q = (rank - root) mod p`` (``ctx.relative``;
``ctx.real(v)`` maps back). In the broadcast,
rank q receives once, from its parent ``q - lowbit(q)`` (q with its lowest set bit cleared),
then passes the data on to ``q + 2^k`` for every ``2^k < lowbit(q)`` that exists, farthest
first. The root's lowbit is the first power of two >= p. ceil(lg p) rounds, p-1 messages of
the whole data in all; the root sends ceil(lg p) of them. The reduce is the same tree run
backwards: fold in the children nearest first, then send the partial result to the parent.
"""

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


def children(q: int, p: int) -> int:
    """How many ranks relative rank ``q`` sends to in the broadcast tree of ``p`` ranks."""
    top = q & -q if q else 1 << (p - 1).bit_length()  # lowbit(q); the root's: 2^ceil(lg p)
    return sum(1 for k in range(top.bit_length() - 1) if q + (1 << k) < p)


class BinomialBroadcast(Strategy):
    name = "binomial"
    collective = "broadcast"
    description = "binomial tree, ceil(lg p) rounds; the root sends ceil(lg p)·n bytes"

    def schedule(self, ctx: Context) -> Schedule:
        p, q, real = ctx.size, ctx.relative, ctx.real
        mask = 1
        while mask < p:  # receive from the parent: clear q's lowest set bit
            if q & mask:
                yield Recv(real(q - mask))
                break
            mask <<= 1
        mask >>= 1
        while mask > 0:  # then feed the subtrees below, farthest first
            if q + mask < p:
                yield Send(real(q + mask))
            mask >>= 1

    def cost(self, work: Workload) -> Cost:
        depth = (work.size - 1).bit_length()  # ceil(lg p): the root sends that many, in turn
        return Cost(depth * work.waves, depth * work.nbytes)

    def traffic(self, work: Workload) -> Traffic:
        p, n, s = work.size, work.nbytes, work.segments
        sends = [children(q, p) for q in range(p)]
        return Traffic(tuple(c * s for c in sends), tuple(c * n for c in sends))


class BinomialReduce(Strategy):
    name = "binomial"
    collective = "reduce"
    description = "binomial tree towards the root, ceil(lg p) rounds"

    def schedule(self, ctx: Context) -> Schedule:
        p, q, real = ctx.size, ctx.relative, ctx.real
        mask = 1
        while mask < p:
            if q & mask:  # my subtree is complete: hand it to the parent
                yield Send(real(q - mask))
                break
            if q + mask < p:  # fold in the child at this distance
                yield Reduce(real(q + mask))
            mask <<= 1

    def cost(self, work: Workload) -> Cost:
        depth = (work.size - 1).bit_length()  # the root folds in ceil(lg p) children in turn
        return Cost(depth * work.waves, depth * work.nbytes, depth * work.nbytes)

    def traffic(self, work: Workload) -> Traffic:
        p, n, s = work.size, work.nbytes, work.segments
        return Traffic((0,) + (s,) * (p - 1), (0,) + (n,) * (p - 1))
