"""Host-aware collectives: the fast links inside each host first, the network once.

On several hosts a flat ring or tree crosses the slow network as often as the fast links
inside a host. These schedules split the group in two levels (``ctx.hosts``, from the
roster): the ranks of one host, whose messages go over shared memory, and the network
between hosts. The broadcast and allgather cross it among one *leader* per host only
(``ctx.leaders``: the root on the root's host, else the host's lowest rank); the allreduce
among the ranks of equal local index on every host, each with its share of the data. Each
stage is a textbook algorithm run on a sub-group (``ctx.within(...)``), so the schedules
read as a few lines.

Allreduce (Horovod's hierarchical allreduce; NCCL's and MPICH's SMP-aware ones). With k
ranks on every host, the data is cut into k blocks, one per *lane*: local rank i (the i-th
rank of its host) carries block i.

1. reduce-scatter within each host, by a ring among its k ranks: k-1 steps, each passing
   one block on and folding in the block from the other side, after which local rank i
   holds its host's sum of block i (1/k of the data);
2. for each i, an allreduce of block i among the ranks with local index i on every host:
   k rings of H ranks run at once, each cutting its block into H pieces (H-1 steps of
   reduce-scatter, H-1 of allgather). Every rank of a host shares the work across hosts,
   and together they send 2(H-1)/H·n bytes out of the host, the least any allreduce can;
3. allgather within each host: local rank i hands its finished block to the others of its
   host in one step (the shared-memory ring copies it in once for all the readers).

Uneven hosts (hosts with different numbers of ranks, down to one) take the blocks from
the smallest host: with k its number of ranks, the ranks of every host are dealt into k
lanes by local index modulo k. The ranks of a lane on one host first reduce onto the
lane's first rank (a binomial tree), the first k ranks of each host then run the three
steps above, and each hands the result back to the rest of its lane (a star). With one
rank per host this is the flat ring; on one host, the ring reduce-scatter and the
allgather of one host.

With one lane (``lanes()`` returning 1) the same schedule is the leader form (p2pcoll
0.10's): a binomial reduce onto the host's first rank, one ring among those leaders on the
whole data, a star broadcast in the host. It sends the same bytes across hosts in k times
fewer messages but leaves the other ranks idle while the leader reduces and talks to the
network; measured against each other it was slower in every case (benchmarks/README.md).

Each piece is reduced in one fixed order (lane tree, host ring, network ring) on one rank
and copied from there, so every rank ends with the same bits. For large data the executor
cuts every message into segments and keeps several in flight, each a run of the whole
schedule: while one segment crosses the network (step 2) the next is being reduced inside
the hosts (step 1) and the previous gathered (step 3).

Broadcast: a binomial tree among the leaders from the root, then each leader to its host.
Allgather: each rank hands its part to its leader, the leaders pass the hosts' parts round
a ring (a host's ranks need not be adjacent: its parts go as one message per run of
adjacent ranks), then each leader hands everything to its host.

With one host the broadcast and allgather are those of one host; with one rank per host,
the flat binomial tree and ring. They all declare ``needs_hosts``:
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


def ring_reduce_scatter(ctx: Context, blocks: list[range]) -> Iterator[Step]:
    """Ring reduce-scatter over ``ctx.size`` blocks of chunks: at step s rank i passes block
    i - s - 1 to the right and folds in block i - s - 2 from the left; after size-1 steps
    rank i holds the reduction of block i."""
    p, i = ctx.size, ctx.rank
    right, left = (i + 1) % p, (i - 1) % p
    for s in range(p - 1):
        yield [Send(right, blocks[(i - s - 1) % p]), Reduce(left, blocks[(i - s - 2) % p])]


def ring_allgather(ctx: Context, blocks: list[range]) -> Iterator[Step]:
    """Ring allgather of ``ctx.size`` blocks, rank i starting with block i: pass the
    finished blocks on to the right, overwriting."""
    p, i = ctx.size, ctx.rank
    right, left = (i + 1) % p, (i - 1) % p
    for s in range(p - 1):
        yield [Send(right, blocks[(i - s) % p]), Recv(left, blocks[(i - s - 1) % p])]


def ring_allreduce(ctx: Context, blocks: list[range]) -> Iterator[Step]:
    """Ring allreduce over ``ctx.size`` blocks of chunks: reduce-scatter, then allgather."""
    yield from ring_reduce_scatter(ctx, blocks)
    yield from ring_allgather(ctx, blocks)


def star_allgather(ctx: Context, blocks: list[range]) -> Iterator[Step]:
    """Rank i, holding block i, sends it to every other rank in one step (on one host the
    shared-memory ring takes it in once for all of them) and receives theirs."""
    p, i = ctx.size, ctx.rank
    if p > 1:
        yield ([Send(r, blocks[i]) for r in range(p) if r != i]
               + [Recv(r, blocks[r]) for r in range(p) if r != i])


def cut(block: range, parts: int) -> list[range]:
    """``block`` (a range of chunks, at least ``parts`` long) cut into ``parts`` ranges."""
    a, n = block.start, len(block)
    return [range(a + j * n // parts, a + (j + 1) * n // parts) for j in range(parts)]


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
    collective = "allreduce"
    description = ("reduce-scatter in each host, k allreduces across hosts (one per local "
                   "rank), allgather in each host; 2(H-1)/H·n bytes leave a host")

    def chunks(self, size: int) -> int:
        return size  # k blocks of H pieces each fit: k·H <= p

    def lanes(self, per_host: list[int]) -> int:
        """k, the lanes (blocks) given the ranks of every host: the smallest host's ranks
        (1 would make this the leader form)."""
        return min(per_host)

    def schedule(self, ctx: Context) -> Schedule:
        hosts = [ctx.ranks_on(h) for h in range(ctx.nhosts)]
        k = self.lanes([len(ranks) for ranks in hosts])
        mine, i = ctx.local_ranks, ctx.local_rank % k  # my host, my lane
        lane = ctx.within(mine[i::k])  # my lane's ranks on my host, its first the root
        yield from lane.steps(tree_reduce(lane.ctx))  # 0. (uneven hosts) onto the lane's first
        if ctx.local_rank < k:
            blocks = [range(b * ctx.size // k, (b + 1) * ctx.size // k) for b in range(k)]
            host = ctx.within(mine[:k])
            yield from host.steps(ring_reduce_scatter(host.ctx, blocks))  # 1. block i here
            net = ctx.within([ranks[i] for ranks in hosts])  # lane i of every host
            pieces = cut(blocks[i], net.ctx.size)
            yield from net.steps(ring_allreduce(net.ctx, pieces))  # 2. across hosts
            yield from host.steps(star_allgather(host.ctx, blocks))  # 3. every block here
        yield from lane.steps(star_broadcast(lane.ctx))  # 4. (uneven hosts) to the lane

    def cost(self, work: Workload) -> Cost:
        n, waves, ctx = work.nbytes, work.waves, work.context
        per_host = [len(ctx.ranks_on(h)) for h in range(ctx.nhosts)]
        hosts, k = len(per_host), self.lanes(per_host)
        f = -(-max(per_host) // k)  # the most ranks of one lane on one host
        tree, star = lg(f), f - 1  # the lanes of uneven hosts (of every host, with one lane)
        block = n / k
        host_ring, net_ring = k - 1, 2 * (hosts - 1)
        across = 2 * (hosts - 1) / hosts * n  # the k lanes of a host share its link
        repeats = max(k - 2, 0) + max(star - 1, 0)
        return Cost(
            rounds=(tree + host_ring + net_ring + (k - 1) + star) * waves,
            sent=tree * n + host_ring * block + across + (k - 1) * block + star * n,
            reduced=tree * n + host_ring * block + across / k / 2,
            repeats=repeats * waves,
            repeated=max(k - 2, 0) * block + max(star - 1, 0) * n,
            remote_rounds=net_ring * waves,
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
