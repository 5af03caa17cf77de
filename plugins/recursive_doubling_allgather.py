"""Recursive doubling allgather (MPICH ``MPIR_Allgather_intra_recursive_doubling``), with
Bruck's dissemination allgather for group sizes that are not powers of two.

Part r starts on rank r. With p a power of two, before round k every rank holds the aligned
block of 2^k parts that contains its own; in round k it swaps that block with
``rank XOR 2^k``, whose block is the neighbouring one, and so holds twice as many. After
lg p rounds everyone holds all p parts, having sent 1 + 2 + ... + p/2 = p-1 parts:
(p-1)/p·n bytes in lg p rounds, where the ring takes p-1.

Other p (Bruck, Kandalla & al.; MPICH ``MPIR_Allgather_intra_brucks``): before round k every
rank r holds the 2^k parts r, r+1, ... (mod p); in round k it sends them, cut to the
``min(2^k, p - 2^k)`` that are still missing there, to ``r - 2^k`` and receives as many from
``r + 2^k``. After ceil(lg p) rounds everyone holds all parts, again having sent p-1 parts:
every part but ``r - 1``. Parts are numbered globally here, so Bruck's final local rotation
is not needed; but a run of parts that wraps past p - 1 is two ranges, so such a round sends
(and receives) two messages. The second send is posted together with the first, so the
round still costs one latency term.
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


class RecursiveDoublingAllgather(Strategy):
    name = "recursive_doubling"
    collective = "allgather"
    description = (
        "lg p rounds of doubling swaps (Bruck's dissemination for other p);"
        " (p-1)/p of the gathered data per rank"
    )

    def schedule(self, ctx: Context) -> Schedule:
        p, rank = ctx.size, ctx.rank
        if p & (p - 1) == 0:
            yield from _recursive_doubling(rank, p)
        else:
            yield from _bruck(rank, p)

    def cost(self, work: Workload) -> Cost:
        p, n = work.size, work.nbytes
        return Cost((p - 1).bit_length() * work.waves, (p - 1) / p * n)

    def traffic(self, work: Workload) -> Traffic:
        # Every rank sends p-1 parts, one message per round; in Bruck's rounds a run of
        # parts that wraps past p-1 goes as two.
        p, part = work.size, work.part(0, work.size)
        messages = []
        for rank in range(p):
            count, distance = 0, 1
            while distance < p:
                wraps = p & (p - 1) != 0 and rank + min(distance, p - distance) > p
                count += 1 + wraps
                distance <<= 1
            messages.append(count * work.segments)
        return Traffic(tuple(messages), ((p - 1) * part,) * p)


def _recursive_doubling(rank: int, p: int) -> Schedule:
    mask = 1
    while mask < p:
        mine = rank & ~(mask - 1)  # first part of the block I hold
        theirs = mine ^ mask  # the partner's block sits right next to mine
        yield [Send(rank ^ mask, range(mine, mine + mask)),
               Recv(rank ^ mask, range(theirs, theirs + mask))]
        mask <<= 1


def _bruck(rank: int, p: int) -> Schedule:
    def cyclic(start: int, count: int) -> list[range]:
        """Parts start, start+1, ... (count of them, mod p) as one or two ranges."""
        stop = start + count
        return [range(start, min(stop, p))] + ([range(stop - p)] if stop > p else [])

    distance = 1
    while distance < p:
        count = min(distance, p - distance)
        to, frm = (rank - distance) % p, (rank + distance) % p
        sends = [Send(to, r) for r in cyclic(rank, count)]
        recvs = [Recv(frm, r) for r in cyclic(frm, count)]
        # One peer per direction per step, so a second message goes in a step of its own:
        # post both sends before waiting for the first receive.
        if len(sends) == 2:
            yield sends[0]
        yield [sends[-1], recvs[0]]
        if len(recvs) == 2:
            yield recvs[1]
        distance <<= 1
