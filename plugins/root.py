"""Flat strategies: the root talks to every other rank directly.

One logical step, but the root's link carries (p-1) messages of the whole data, one after
the other. Cheapest for tiny data and tiny groups; the seed's original design.
"""

from p2pcoll.strategy import Context, Recv, Reduce, Schedule, Send, Strategy


class RootBroadcast(Strategy):
    """The root sends the whole data to every other rank: (p-1)·n bytes from the root."""

    name = "root"
    collective = "broadcast"
    description = "root sends to every peer directly; (p-1)n bytes from the root"

    def schedule(self, ctx: Context) -> Schedule:
        if ctx.rank == ctx.root:
            yield [Send(peer) for peer in range(ctx.size) if peer != ctx.root]
        else:
            yield Recv(ctx.root)


class RootReduce(Strategy):
    """Every rank sends its data to the root, which folds them in in rank order."""

    name = "root"
    collective = "reduce"
    description = "every peer sends to the root, which reduces in rank order"

    def schedule(self, ctx: Context) -> Schedule:
        if ctx.rank == ctx.root:
            yield [Reduce(peer) for peer in range(ctx.size) if peer != ctx.root]
        else:
            yield Send(ctx.root)


class RootGather(Strategy):
    """Every rank sends its part (chunk = its rank) to the root."""

    name = "root"
    collective = "gather"
    description = "every peer sends its part to the root"

    def schedule(self, ctx: Context) -> Schedule:
        if ctx.rank == ctx.root:
            yield [Recv(peer, peer) for peer in range(ctx.size) if peer != ctx.root]
        else:
            yield Send(ctx.root, ctx.rank)


class RootScatter(Strategy):
    """The root sends part r to rank r."""

    name = "root"
    collective = "scatter"
    description = "the root sends part r to rank r"

    def schedule(self, ctx: Context) -> Schedule:
        if ctx.rank == ctx.root:
            yield [Send(peer, peer) for peer in range(ctx.size) if peer != ctx.root]
        else:
            yield Recv(ctx.root, ctx.rank)
