"""Flat strategies: the root talks to every other rank directly.

One logical step, but the root's link carries (p-1) messages of the whole data, one after
the other. Cheapest for tiny data and tiny groups; the seed's original design.
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


def _from_root(work: Workload, bytes_by_rank: list[int], per_segment: list[int]) -> Traffic:
    return Traffic(tuple(m * work.segments for m in per_segment), tuple(bytes_by_rank))


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

    def cost(self, work: Workload) -> Cost:
        # (p-1)(alpha + n beta): the root's sends go one after the other; all but the first
        # repeat it (where peers read one copy, the root pays alpha + n beta once).
        p, n = work.size, work.nbytes
        again = max(0, p - 2)
        return Cost((p - 1) * work.waves, (p - 1) * n, repeats=again * work.waves,
                    repeated=again * n)

    def traffic(self, work: Workload) -> Traffic:
        p, n = work.size, work.nbytes
        return _from_root(work, [(p - 1) * n] + [0] * (p - 1), [p - 1] + [0] * (p - 1))


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

    def cost(self, work: Workload) -> Cost:
        # The root receives and folds in p-1 messages of n, one after the other.
        p, n = work.size, work.nbytes
        return Cost((p - 1) * work.waves, (p - 1) * n, (p - 1) * n)

    def traffic(self, work: Workload) -> Traffic:
        p, n = work.size, work.nbytes
        return _from_root(work, [0] + [n] * (p - 1), [0] + [1] * (p - 1))


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

    def cost(self, work: Workload) -> Cost:
        p = work.size
        return Cost((p - 1) * work.waves, work.nbytes - work.part(0, p))

    def traffic(self, work: Workload) -> Traffic:
        p = work.size
        return _from_root(work, [0] + [work.part(r, p) for r in range(1, p)], [0] + [1] * (p - 1))


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

    def cost(self, work: Workload) -> Cost:
        p = work.size
        return Cost((p - 1) * work.waves, work.nbytes - work.part(0, p))

    def traffic(self, work: Workload) -> Traffic:
        p = work.size
        rest = work.nbytes - work.part(0, p)
        return _from_root(work, [rest] + [0] * (p - 1), [p - 1] + [0] * (p - 1))
