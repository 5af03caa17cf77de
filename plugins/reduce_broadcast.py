"""The seed's allreduce cycle: reduce through one process, then broadcast from it.

Rank 0 receives everyone's data and folds it in rank order, then sends the result to every
rank. Simple and deterministic, but rank 0 moves 2(p-1)·n bytes: a baseline, not a default.
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


class ReduceBroadcast(Strategy):
    name = "reduce_broadcast"
    collective = "allreduce"
    description = "reduce to rank 0, then broadcast from it (the seed's cycle)"

    def schedule(self, ctx: Context) -> Schedule:
        hub = 0
        others = [peer for peer in range(ctx.size) if peer != hub]
        if ctx.rank == hub:
            yield [Reduce(peer) for peer in others]
            yield [Send(peer) for peer in others]
        else:
            yield Send(hub)
            yield Recv(hub)

    def cost(self, work: Workload) -> Cost:
        # The hub folds in p-1 messages, then sends p-1, one after the other (all but the
        # first repeat it: cheap where peers read one copy).
        p, n = work.size, work.nbytes
        again = max(0, p - 2)
        return Cost(2 * (p - 1) * work.waves, 2 * (p - 1) * n, (p - 1) * n,
                    repeats=again * work.waves, repeated=again * n)

    def traffic(self, work: Workload) -> Traffic:
        p, n, s = work.size, work.nbytes, work.segments
        return Traffic(((p - 1) * s,) + (s,) * (p - 1), ((p - 1) * n,) + (n,) * (p - 1))
