"""Host-aware collectives: the fast links inside each host first, the network once.

On several hosts a flat ring or tree crosses the slow network as often as the fast links
inside a host. These schedules split the group in two levels (``ctx.hosts``, from the
roster): the ranks of one host, whose messages go over shared memory, and one *leader* per
host (``ctx.leaders``: the root on the root's host, else the host's lowest rank), the only
ranks that talk across hosts. Each stage is a textbook algorithm run on a sub-group
(``ctx.within(...)``), so the schedules read as three lines.

Allreduce (NCCL's, Horovod's and MPICH's SMP-aware allreduce):

1. reduce within each host onto its leader, by a binomial tree (ceil(lg k) rounds for k
   ranks on the host);
2. allreduce among the H leaders by a ring: the data is cut into H blocks; H-1 steps of
   reduce-scatter pass one block to the right and fold in the block from the left, H-1
   steps of allgather pass the finished blocks on; each leader sends 2(H-1)/H·n bytes,
   which is all that leaves its host;
3. broadcast within each host from its leader: one send of the result, which the
   shared-memory ring copies in once for every reader.

Each block is reduced in one fixed order (the tree, then the ring) and copied from there,
so every rank ends with the same bits. For large data the executor cuts every message into
segments and keeps several in flight, each a run of the whole schedule: while one segment
crosses the network (stage 2) the next is being reduced inside the hosts (stage 1) and the
previous broadcast (stage 3), so the network stage is pipelined against the host stages.

Broadcast: a binomial tree among the leaders from the root, then each leader to its host.
Allgather: each rank hands its part to its leader, the leaders pass the hosts' parts round
a ring (a host's ranks need not be adjacent: its parts go as one message per run of
adjacent ranks), then each leader hands everything to its host.

With one host these are the reduce-then-broadcast (and gather-then-broadcast) of one host;
with one rank per host, the flat ring (and binomial tree). They declare ``needs_hosts``:
auto considers them only on several hosts of which one holds several ranks.
"""

from collections.abc import Iterator
from functools import lru_cache

from p2pcoll.strategy import (
    Chunk,
    Context,
    Cost,
    Op,
    Recv,
    Reduce,
    Schedule,
    Send,
    Step,
    Strategy,
    Traffic,
    Workload,
)

# --- the textbook algorithms the levels run, on a (sub-)group's context ------------------


def tree_reduce(ctx: Context) -> Iterator[Step]:
    """Binomial reduce of the whole data onto the root (MPICH's): fold in the children
    nearest first, then hand the partial result to the parent."""
    p, q = ctx.size, ctx.relative
    mask = 1
    while mask < p:
        if q & mask:
            yield Send(ctx.real(q - mask))
            return
        if q + mask < p:
            yield Reduce(ctx.real(q + mask))
        mask <<= 1


def tree_broadcast(ctx: Context) -> Iterator[Step]:
    """Binomial broadcast of the whole data from the root: receive from the parent, then
    feed the subtrees below, farthest first."""
    p, q = ctx.size, ctx.relative
    mask = 1
    while mask < p:
        if q & mask:
            yield Recv(ctx.real(q - mask))
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:
        if q + mask < p:
            yield Send(ctx.real(q + mask))
        mask >>= 1


def star_broadcast(ctx: Context) -> Iterator[Step]:
    """The root sends the whole data to every other rank in one step (on one host the
    shared-memory ring takes it in once for all of them); the others receive it."""
    if ctx.size == 1:
        return
    if ctx.rank == ctx.root:
        yield [Send(r) for r in range(ctx.size) if r != ctx.root]
    else:
        yield Recv(ctx.root)


def ring_allreduce(ctx: Context, blocks: list[range]) -> Iterator[Step]:
    """Ring allreduce over ``ctx.size`` blocks of chunks: reduce-scatter, then allgather."""
    p, i = ctx.size, ctx.rank
    right, left = (i + 1) % p, (i - 1) % p
    for s in range(p - 1):  # after these, rank i holds the reduction of block (i + 1) % p
        yield [Send(right, blocks[(i - s) % p]), Reduce(left, blocks[(i - s - 1) % p])]
    for s in range(p - 1):  # pass the finished blocks on, overwriting
        yield [Send(right, blocks[(i - s + 1) % p]), Recv(left, blocks[(i - s) % p])]


def runs(ranks: tuple[int, ...]) -> list[range]:
    """``ranks`` (ascending) as runs of adjacent ranks: (0, 1, 2, 5, 6) -> [0..2, 5..6]."""
    out: list[range] = []
    for r in ranks:
        if out and out[-1].stop == r:
            out[-1] = range(out[-1].start, r + 1)
        else:
            out.append(range(r, r + 1))
    return out


def hosts_shape(work: Workload) -> tuple[int, int]:
    """(H hosts, k: the most ranks on one host) of a workload."""
    ctx = work.context
    return ctx.nhosts, max(len(ctx.ranks_on(h)) for h in range(ctx.nhosts))


def lg(n: int) -> int:
    """ceil(lg n): the rounds of a binomial tree of n ranks."""
    return (n - 1).bit_length()


@lru_cache(maxsize=64)
def sends(strategy: Strategy, size: int, hosts: tuple[int, ...]) -> tuple[tuple[Chunk, ...], ...]:
    """The chunks every rank sends (rank by rank), read off the schedules; cached, as the
    cost model asks for every size of data."""
    out = []
    for rank in range(size):
        chunks: list[Chunk] = []
        for step in strategy.schedule(Context(rank, size, 0, hosts)):
            for op in (step,) if isinstance(step, (Send, Recv, Reduce)) else step:
                if isinstance(op, Send):
                    chunks.append(op.chunk)
        out.append(tuple(chunks))
    return tuple(out)


def count_traffic(strategy: Strategy, work: Workload) -> Traffic:
    """What every rank sends, read off the schedules themselves (exact)."""
    nchunks = strategy.chunks(work.size)

    def nbytes(c: Chunk) -> int:
        if isinstance(c, range):
            return work.span(c.start, c.stop, nchunks)
        if isinstance(c, int):
            return work.part(c, nchunks)
        return work.nbytes  # ALL

    sent = sends(strategy, work.size, work.hosts)
    return Traffic(tuple(len(chunks) * work.segments for chunks in sent),
                   tuple(sum(nbytes(c) for c in chunks) for chunks in sent))


# --- the strategies -----------------------------------------------------------------------


class HierarchicalAllreduce(Strategy):
    name = "hierarchical"
    needs_hosts = True
    whole_messages = True  # the stages inside a host send every chunk at once
    collective = "allreduce"
    description = ("reduce in each host, ring allreduce among one leader per host, broadcast "
                   "in each host; 2(H-1)/H·n bytes leave a host")

    def chunks(self, size: int) -> int:
        return size  # enough for the ring among any number of leaders (H <= p)

    def schedule(self, ctx: Context) -> Schedule:
        host = ctx.within(ctx.local_ranks, root=ctx.leader)
        yield from host.steps(tree_reduce(host.ctx))  # 1. my host's sum onto its leader
        if ctx.rank == ctx.leader and ctx.nhosts > 1:  # 2. the leaders, across hosts
            net = ctx.within(ctx.leaders)
            h = net.ctx.size
            blocks = [range(b * ctx.size // h, (b + 1) * ctx.size // h) for b in range(h)]
            yield from net.steps(ring_allreduce(net.ctx, blocks))
        yield from host.steps(star_broadcast(host.ctx))  # 3. the result, inside each host

    def cost(self, work: Workload) -> Cost:
        n, waves = work.nbytes, work.waves
        hosts, k = hosts_shape(work)
        tree = lg(k)
        ring = 2 * (hosts - 1)
        across = 2 * (hosts - 1) / hosts * n
        star = k - 1  # one send per reader, all but the first repeats of it
        repeats = max(star - 1, 0)
        return Cost(
            rounds=(tree + ring + star) * waves,
            sent=tree * n + across + star * n,
            reduced=tree * n + across / 2,
            repeats=repeats * waves,
            repeated=repeats * n,
            remote_rounds=ring * waves,
            remote_sent=across,
        )

    def traffic(self, work: Workload) -> Traffic:
        return count_traffic(self, work)


class HierarchicalBroadcast(Strategy):
    name = "hierarchical"
    needs_hosts = True
    whole_messages = True  # the stages inside a host send every chunk at once
    collective = "broadcast"
    description = ("binomial tree among one leader per host (the root's), then each leader "
                   "to its host")

    def schedule(self, ctx: Context) -> Schedule:
        if ctx.rank == ctx.leader:  # the root is its host's leader
            net = ctx.within(ctx.leaders, root=ctx.root)
            yield from net.steps(tree_broadcast(net.ctx))
        host = ctx.within(ctx.local_ranks, root=ctx.leader)
        yield from host.steps(star_broadcast(host.ctx))

    def cost(self, work: Workload) -> Cost:
        n, waves = work.nbytes, work.waves
        hosts, k = hosts_shape(work)
        tree, star = lg(hosts), k - 1
        repeats = max(star - 1, 0)
        return Cost(rounds=(tree + star) * waves, sent=(tree + star) * n,
                    repeats=repeats * waves, repeated=repeats * n,
                    remote_rounds=tree * waves, remote_sent=tree * n)

    def traffic(self, work: Workload) -> Traffic:
        return count_traffic(self, work)


class HierarchicalAllgather(Strategy):
    name = "hierarchical"
    needs_hosts = True
    whole_messages = True  # the stages inside a host send every chunk at once
    collective = "allgather"
    description = ("gather in each host to its leader, ring among the leaders, then each leader "
                   "to its host")

    def chunks(self, size: int) -> int:
        return size

    def schedule(self, ctx: Context) -> Schedule:
        leader = ctx.leader
        # 1. every rank hands its part to its host's leader
        if ctx.rank != leader:
            yield Send(leader, ctx.rank)
        elif len(ctx.local_ranks) > 1:
            yield [Recv(r, r) for r in ctx.local_ranks if r != leader]
        # 2. the leaders pass the hosts' parts round a ring: at step s, leader i sends the
        # parts of host i - s to the right and receives those of host i - s - 1
        if ctx.rank == leader and ctx.nhosts > 1:
            net = ctx.within(ctx.leaders)
            h, i = net.ctx.size, net.ctx.rank
            right, left = net.real((i + 1) % h), net.real((i - 1) % h)
            for s in range(h - 1):
                out = runs(ctx.ranks_on((i - s) % h))
                into = runs(ctx.ranks_on((i - s - 1) % h))
                for j in range(max(len(out), len(into))):
                    ops: list[Op] = []
                    if j < len(out):
                        ops.append(Send(right, out[j]))
                    if j < len(into):
                        ops.append(Recv(left, into[j]))
                    yield ops
        # 3. every leader hands all the parts to its host
        host = ctx.within(ctx.local_ranks, root=leader)
        yield from host.steps(star_broadcast(host.ctx))

    def cost(self, work: Workload) -> Cost:
        n, waves, p = work.nbytes, work.waves, work.size
        hosts, k = hosts_shape(work)
        ctx = work.context
        part = n / p
        pieces = max(len(runs(ctx.ranks_on(h))) for h in range(hosts))
        ring = (hosts - 1) * pieces
        gather = 1 if k > 1 else 0
        star = k - 1
        repeats = max(star - 1, 0)
        across = (hosts - 1) * k * part
        return Cost(rounds=(gather + ring + star) * waves,
                    sent=gather * part + across + star * n,
                    repeats=repeats * waves, repeated=repeats * n,
                    remote_rounds=ring * waves, remote_sent=across)

    def traffic(self, work: Workload) -> Traffic:
        return count_traffic(self, work)


__all__ = ["HierarchicalAllgather", "HierarchicalAllreduce", "HierarchicalBroadcast"]
