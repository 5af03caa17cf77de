"""Ring algorithms (Patarasuk & Yuan; MPICH ``MPIR_Allreduce_intra_ring``; Gloo's ring).

The data is cut into p chunks. Every step each rank sends one chunk to its right neighbour
and receives one from its left, so every link is busy all the time and each rank sends
(p-1)/p of the data per phase: bandwidth-optimal, 2(p-1) latency terms for an allreduce.
The executor pipelines each chunk in segments, so the reduction of one segment overlaps the
transfer of the next.
"""

from p2pcoll.strategy import Context, Recv, Reduce, Schedule, Send, Strategy


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
