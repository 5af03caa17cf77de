"""The seed's allreduce cycle: reduce through one process, then broadcast from it.

Rank 0 receives everyone's data and folds it in rank order, then sends the result to every
rank. Simple and deterministic, but rank 0 moves 2(p-1)·n bytes: a baseline, not a default.
"""

from p2pcoll.strategy import Context, Recv, Reduce, Schedule, Send, Strategy


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
