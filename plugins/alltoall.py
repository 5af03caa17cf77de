"""All-to-all (MPI's ``MPI_Alltoallv``): rank i's block for rank j ends on rank j.

The data is one block per pair of ranks, ``ctx.block(i, j)`` being what rank i sends rank j
(blocks may differ in length; every rank knows every length). Rank r starts with its row
``block(r, *)`` and ends with its column ``block(*, r)``; its own block ``block(r, r)``
never moves. A rank that forwards others' blocks (Bruck, a host's leader) holds each in a
buffer of its own, so a message may carry any set of blocks: a tuple of their numbers.

Pairwise exchange (MPICH ``MPIR_Alltoall_intra_pairwise``, Thakur & al. 2005): in round s,
1 <= s < p, rank r sends its block to ``r + s`` and receives from ``r - s``. p-1 rounds, each
block sent once and straight to its owner: (p-1)/p of a rank's data, the least there is;
the choice for large blocks, which the executor cuts into segments that overlap.

Scattered (MPICH ``MPIR_Alltoall_intra_scattered``, Gloo's alltoall): the same p-1 shifted
exchanges, posted together in round order, so no round waits for the one before it; the
choice for blocks of one segment, where there is no pipeline to overlap them.

Bruck (Bruck & al. 1997; MPICH ``MPIR_Alltoall_intra_brucks``): in round k (distance 2^k,
k = 0 .. ceil(lg p)-1) rank r sends to ``r + 2^k`` every block whose distance ``d`` from its
source to its destination (``dst - src`` mod p) has bit k set, and receives as many from
``r - 2^k``. A block climbs its distance bit by bit, so before round k the block at
distance d held on rank r came from ``src = r - (d mod 2^k)`` and is ``block(src, src+d)``.
ceil(lg p) rounds instead of p-1, each carrying about half the blocks: lg p / 2 times the
bytes of the pairwise exchange, in far fewer messages; the choice for small blocks.

Hierarchical (two levels, ``ctx.hosts``): the blocks between ranks of one host go
pairwise among them; every other rank hands its blocks for other hosts to its host's
leader in one message; the leaders run the pairwise exchange over hosts, leader of host h
sending leader of host g every block from a rank of h to a rank of g in one message; each
leader hands its host's ranks their blocks from other hosts, one message each. H-1
messages cross the network per host instead of (p-1) per rank.
"""

from collections.abc import Iterator

from p2pcoll.strategy import (
    Context,
    Cost,
    Recv,
    Schedule,
    Send,
    Step,
    Strategy,
    Traffic,
    Workload,
)


class PairwiseAlltoall(Strategy):
    name = "pairwise"
    collective = "alltoall"
    description = "p-1 rounds of shifted exchanges, each block straight to its owner"

    def chunks(self, size: int) -> int:
        return size * size

    def schedule(self, ctx: Context) -> Schedule:
        p, r = ctx.size, ctx.rank
        for s in range(1, p):
            to, frm = (r + s) % p, (r - s) % p
            yield [Send(to, ctx.block(r, to)), Recv(frm, ctx.block(frm, r))]

    def cost(self, work: Workload) -> Cost:
        p, n = work.size, work.nbytes
        return Cost((p - 1) * work.waves, (p - 1) / p * n)

    def traffic(self, work: Workload) -> Traffic:
        return _traffic(self, work)


class ScatteredAlltoall(Strategy):
    name = "scattered"
    collective = "alltoall"
    description = "the pairwise exchanges posted together; for blocks of one segment"

    def chunks(self, size: int) -> int:
        return size * size

    def schedule(self, ctx: Context) -> Schedule:
        p, r = ctx.size, ctx.rank
        rounds = [((r + s) % p, (r - s) % p) for s in range(1, p)]
        yield [Send(to, ctx.block(r, to)) for to, _ in rounds] + \
              [Recv(frm, ctx.block(frm, r)) for _, frm in rounds]

    def cost(self, work: Workload) -> Cost:
        p, n = work.size, work.nbytes
        if work.segments > 1:
            # Every segment of every block at once overfills the shared-memory rings, and
            # the messages queue one behind the other: no wave of segments overlaps.
            return Cost((p - 1) * work.segments, (p - 1) / p * n)
        # The p-1 messages go out together: where peers read shared memory their latencies
        # overlap as a root's repeats do (the transport's ``repeat`` share of alpha, 0 over
        # the rings); a single port (sockets) pays each. Their bytes are all distinct.
        return Cost(p - 1, (p - 1) / p * n, repeats=max(p - 2, 0))

    def traffic(self, work: Workload) -> Traffic:
        return _traffic(self, work)


class BruckAlltoall(Strategy):
    name = "bruck"
    collective = "alltoall"
    description = "ceil(lg p) rounds, each block forwarded by distance bits; for small blocks"

    def chunks(self, size: int) -> int:
        return size * size

    def schedule(self, ctx: Context) -> Schedule:
        p, r = ctx.size, ctx.rank
        k = 0
        while (1 << k) < p:
            step = 1 << k
            to, frm = (r + step) % p, (r - step) % p
            moving = [d for d in range(1, p) if d & step]
            # Before round k the block at distance d came from r - (d mod 2^k); after it,
            # from r - (d mod 2^(k+1)): the sender's labels are the receiver's, shifted.
            out = tuple(_held(ctx, r, d, k) for d in moving)
            into = tuple(_held(ctx, r, d, k + 1) for d in moving)
            yield [Send(to, out), Recv(frm, into)]
            k += 1

    # Priced (so offered to auto) for blocks up to this many bytes only, the short blocks
    # MPICH and Open MPI use it for: beyond, the bytes it forwards and the buffers it
    # forwards them through cost more than the messages it saves, which the model's per-
    # message CPU term does not see (measured: benchmarks, p = 4 and 8, 1 MiB and up).
    largest_block = 16 << 10

    def cost(self, work: Workload) -> Cost | None:
        p, n = work.size, work.nbytes
        if n > self.largest_block * p:
            return None
        rounds = (p - 1).bit_length()
        moved = sum(1 for k in range(rounds) for d in range(1, p) if d >> k & 1)
        return Cost(rounds * work.waves, moved * n / p)

    def traffic(self, work: Workload) -> Traffic:
        return _traffic(self, work)


def _held(ctx: Context, r: int, d: int, k: int) -> int:
    """The block at distance ``d`` on rank ``r`` before Bruck's round ``k``."""
    src = r - d % (1 << k)
    return ctx.block(src, src + d)


class HierarchicalAlltoall(Strategy):
    name = "hierarchical"
    collective = "alltoall"
    description = ("blocks within a host pairwise, the rest through one leader per host; "
                   "H-1 network messages per host")
    needs_hosts = True

    def chunks(self, size: int) -> int:
        return size * size

    def schedule(self, ctx: Context) -> Schedule:
        r, local, leader = ctx.rank, ctx.local_ranks, ctx.leader
        others = [q for q in range(ctx.size) if ctx.host_of(q) != ctx.host]
        # 1. Within the host, pairwise among its ranks (the rounds posted together).
        n, i = len(local), ctx.local_rank
        rounds = [(local[(i + s) % n], local[(i - s) % n]) for s in range(1, n)]
        yield [Send(to, ctx.block(r, to)) for to, _ in rounds] + \
              [Recv(frm, ctx.block(frm, r)) for _, frm in rounds]
        if not others:
            return
        # 2. Every other rank hands its blocks for other hosts to its leader.
        if r != leader:
            yield Send(leader, tuple(ctx.block(r, j) for j in others))
        else:
            yield [Recv(q, tuple(ctx.block(q, j) for j in others)) for q in local if q != r]
            # 3. The leaders exchange pairwise over hosts: host h's blocks for host g.
            hosts, h = ctx.nhosts, ctx.host
            pairs = [((h + s) % hosts, (h - s) % hosts) for s in range(1, hosts)]
            yield [Send(ctx.leaders[g], _between(ctx, local, ctx.ranks_on(g)))
                   for g, _ in pairs] + \
                  [Recv(ctx.leaders[g], _between(ctx, ctx.ranks_on(g), local)) for _, g in pairs]
        # 4. The leader hands each rank of its host its blocks from other hosts.
        if r == leader:
            yield [Send(q, tuple(ctx.block(i, q) for i in others)) for q in local if q != r]
        else:
            yield Recv(leader, tuple(ctx.block(i, r) for i in others))

    def cost(self, work: Workload) -> Cost:
        ctx = work.context
        p, hosts, block = work.size, ctx.nhosts, work.nbytes / max(work.size, 1)
        if hosts == 1:  # the pairwise exchange of one host
            return Cost((p - 1) * work.waves, (p - 1) * block)
        k = max(len(ctx.ranks_on(h)) for h in range(hosts))
        # Critical path: the leader's k-1 exchanges in its host, k-1 receipts, H-1
        # exchanges with the other leaders (k*k blocks each), k-1 hand-outs.
        remote = (hosts - 1) * k * k * block
        local = (k - 1) * block + 2 * (k - 1) * (p - k) * block
        return Cost((3 * (k - 1) + hosts - 1) * work.waves, local + remote,
                    remote_rounds=(hosts - 1) * work.waves, remote_sent=remote)

    def traffic(self, work: Workload) -> Traffic:
        return _traffic(self, work)


def _between(ctx: Context, frm: tuple[int, ...], to: tuple[int, ...]) -> tuple[int, ...]:
    """Every block from a rank of ``frm`` to a rank of ``to``, in one order both sides
    compute alike."""
    return tuple(ctx.block(i, j) for i in frm for j in to)


def _traffic(strategy: Strategy, work: Workload) -> Traffic:
    """What every rank sends, read off its schedule: block (i, j) is ``work.part(j, p)``
    bytes (rank i's part j of its ``nbytes``), and every segment repeats every message."""
    p = work.size
    messages, sent = [], []
    for rank in range(p):
        ctx = Context(rank, p, 0, work.hosts)
        count = nbytes = 0
        for op in _ops(strategy.schedule(ctx)):
            if isinstance(op, Send):
                count += 1
                blocks = op.chunk if isinstance(op.chunk, tuple) else (op.chunk,)
                nbytes += sum(work.part(b % p, p) for b in blocks if isinstance(b, int))
        messages.append(count * work.segments)
        sent.append(nbytes)
    return Traffic(tuple(messages), tuple(sent))


def _ops(schedule: Schedule) -> Iterator[Send | Recv]:
    for step in schedule:
        yield from _flat(step)


def _flat(step: Step) -> Iterator[Send | Recv]:
    ops = [step] if isinstance(step, (Send, Recv)) else step
    for op in ops:
        if isinstance(op, (Send, Recv)):
            yield op
