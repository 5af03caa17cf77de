"""Ring algorithms (Patarasuk & Yuan; MPICH ``MPIR_Allreduce_intra_ring``; Gloo's ring).

The data is cut into p chunks. Every step each rank sends one chunk to its right neighbour
and receives one from its left, so every link is busy all the time and each rank sends
(p-1)/p of the data per phase: bandwidth-optimal, 2(p-1) latency terms for an allreduce.
The executor pipelines each chunk in segments, so the reduction of one segment overlaps the
transfer of the next.
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


class RingAllreduce(Strategy):
    name = "ring"
    collective = "allreduce"
    description = "reduce-scatter ring then allgather ring; 2(p-1)/p·n bytes per rank"

    def chunks(self, size: int) -> int:
        return size

    def schedule(self, ctx: Context) -> Schedule:
        p, r = ctx.size, ctx.rank
        right, left = (r + 1) % p, (r - 1) % p
        # Reduce-scatter: pass a chunk right, fold in the one arriving from the left.
        # After p-1 steps rank r holds the full reduction of chunk r+1.
        for s in range(p - 1):
            yield [Send(right, (r - s) % p), Reduce(left, (r - s - 1) % p)]
        # Allgather: keep the finished chunks moving round, overwriting instead of folding.
        for s in range(p - 1):
            yield [Send(right, (r - s + 1) % p), Recv(left, (r - s) % p)]

    def cost(self, work: Workload) -> Cost:
        p, n = work.size, work.nbytes
        return Cost(2 * (p - 1) * work.waves, 2 * (p - 1) / p * n, (p - 1) / p * n)

    def traffic(self, work: Workload) -> Traffic:
        # Rank r sends every chunk but r+1 in the reduce-scatter, every one but r+2 after.
        p, n = work.size, work.nbytes
        return Traffic(
            (2 * (p - 1) * work.segments,) * p,
            tuple(2 * n - work.part((r + 1) % p, p) - work.part((r + 2) % p, p)
                  for r in range(p)),
        )


class RingReduceScatter(Strategy):
    name = "ring"
    collective = "reduce_scatter"
    description = "reduce-scatter ring; (p-1)/p·n bytes per rank"

    def chunks(self, size: int) -> int:
        return size

    def schedule(self, ctx: Context) -> Schedule:
        p, r = ctx.size, ctx.rank
        right, left = (r + 1) % p, (r - 1) % p
        # As the first phase of the ring allreduce, shifted by one so that rank r ends up
        # holding the full reduction of chunk r.
        for s in range(p - 1):
            yield [Send(right, (r - s - 1) % p), Reduce(left, (r - s - 2) % p)]

    def cost(self, work: Workload) -> Cost:
        p, n = work.size, work.nbytes
        return Cost((p - 1) * work.waves, (p - 1) / p * n, (p - 1) / p * n)

    def traffic(self, work: Workload) -> Traffic:
        p, n = work.size, work.nbytes  # rank r sends every chunk but its own
        return Traffic(((p - 1) * work.segments,) * p,
                       tuple(n - work.part(r, p) for r in range(p)))


class RingAllgather(Strategy):
    name = "ring"
    collective = "allgather"
    description = "allgather ring; (p-1)/p·n bytes per rank"

    def schedule(self, ctx: Context) -> Schedule:
        p, r = ctx.size, ctx.rank
        right, left = (r + 1) % p, (r - 1) % p
        # Step s: forward the part that arrived in step s-1 (my own at s = 0).
        for s in range(p - 1):
            yield [Send(right, (r - s) % p), Recv(left, (r - s - 1) % p)]

    def cost(self, work: Workload) -> Cost:
        p, n = work.size, work.nbytes
        return Cost((p - 1) * work.waves, (p - 1) / p * n)

    def traffic(self, work: Workload) -> Traffic:
        p, n = work.size, work.nbytes  # rank r sends every part but r+1's
        return Traffic(((p - 1) * work.segments,) * p,
                       tuple(n - work.part((r + 1) % p, p) for r in range(p)))
