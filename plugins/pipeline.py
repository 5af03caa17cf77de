"""Pipelined chain broadcast (MPICH's "pipelined" / Open MPI's ``bcast_intra_pipeline``).

Ranks are renumbered relative to the root, ``q = (rank - root) mod p`` (``ctx.relative``;
``ctx.real(v)`` maps back), and form a chain
0 -> 1 -> ... -> p-1: each rank receives the data from its predecessor and passes it on to
its successor. Unsegmented that would take p-1 full transfers one after the other; the
executor cuts data above about 1 MiB into segments and runs several at once, so rank q+1
forwards segment s while rank q is already receiving segment s+1. For S segments the chain
then takes about (p - 2 + S) segment times: close to one transfer of n for large data,
whatever p. Every rank but the last sends n bytes, in one message per segment; the last
sends nothing. Small data gets no pipelining: use ``binomial`` there.
"""

from p2pcoll.strategy import (
    Context,
    Cost,
    Recv,
    Schedule,
    Send,
    Strategy,
    Traffic,
    Workload,
)


class PipelineBroadcast(Strategy):
    name = "pipeline"
    collective = "broadcast"
    description = "chain from the root, pipelined in ~1 MiB segments; n bytes from all but the last"

    def schedule(self, ctx: Context) -> Schedule:
        p, q = ctx.size, ctx.relative
        if q > 0:
            yield Recv(ctx.real(q - 1))
        if q < p - 1:
            yield Send(ctx.real(q + 1))

    def cost(self, work: Workload) -> Cost:
        # The first segment takes p-1 hops; each of the other S-1 arrives one hop later,
        # their latencies overlapping ``depth`` at a time (the bandwidth terms do not).
        p, s = work.size, work.segments
        if p == 1:
            return Cost(0, 0)
        return Cost(p - 2 + work.waves, (p - 2 + s) * work.nbytes / s)

    def traffic(self, work: Workload) -> Traffic:
        p, n, s = work.size, work.nbytes, work.segments
        return Traffic((s,) * (p - 1) + (0,), (n,) * (p - 1) + (0,))
