"""Direct allreduce: a direct reduce-scatter, then a direct allgather.

The data is cut into p chunks, and rank j owns chunk j.

1. Reduce-scatter. Every rank sends chunk j to its owner, rank j, for every j but its own.
   Rank j folds the p-1 contributions of chunk j into its own copy, in rank order, so the
   result is the same whatever order the messages arrive in. Rank j now holds the finished
   chunk j.
2. Allgather. Every rank sends its finished chunk to every other rank, and receives each
   other rank's finished chunk in place of its own copy.

Two rounds; in each one a rank sends p-1 messages of n/p bytes, 2(p-1)/p·n bytes in all:
the ring's bandwidth with 2 latency terms instead of 2(p-1), paid for with p-1 concurrent
messages per round (Gloo's bcube without a factorisation, hivemind's butterfly with equal
shares). It suits mid-sized data on groups that are small or have a full-bisection network.

Written only against :mod:`p2pcoll.strategy`, the way any third-party plugin is.
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

__all__ = ["DirectAllreduce"]


class DirectAllreduce(Strategy):
    name = "direct"
    collective = "allreduce"
    description = "direct reduce-scatter then direct allgather; 2 rounds, 2(p-1)/p·n bytes"

    def chunks(self, size: int) -> int:
        return size  # chunk j is owned by rank j

    def schedule(self, ctx: Context) -> Schedule:
        me = ctx.rank
        others = [peer for peer in range(ctx.size) if peer != me]
        # Reduce-scatter: give every owner its chunk; fold theirs into mine in rank order.
        yield [Send(owner, owner) for owner in others] + [Reduce(peer, me) for peer in others]
        # Allgather: hand my finished chunk to everyone; take each owner's finished chunk.
        yield [Send(peer, me) for peer in others] + [Recv(owner, owner) for owner in others]

    # Optional: the cost model that lets "auto" choose this strategy (p2pcoll.strategy.Cost).
    def cost(self, work: Workload) -> Cost:
        # Two rounds, but a single port serialises each round's p-1 sends: 2(p-1) alpha.
        p, n = work.size, work.nbytes
        return Cost(2 * (p - 1) * work.waves, 2 * (p - 1) / p * n, (p - 1) / p * n)

    def traffic(self, work: Workload) -> Traffic:
        # Rank r sends every chunk but its own, then its own chunk to each of the p-1 others.
        p, n = work.size, work.nbytes
        return Traffic((2 * (p - 1) * work.segments,) * p,
                       tuple(n - work.part(r, p) + (p - 1) * work.part(r, p) for r in range(p)))
