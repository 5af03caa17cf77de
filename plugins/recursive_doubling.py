"""Recursive doubling allreduce (MPICH ``MPIR_Allreduce_intra_recursive_doubling``).

With p a power of two: in round k every rank swaps its whole data with ``rank XOR 2^k`` and
folds the partner's in; after lg p rounds everyone holds the reduction. lg p latency terms,
but lg p·n bytes per rank, so it suits small data.

Other p, the MPICH fold: let p' be the largest power of two <= p and r = p - p'. Among the
first 2r ranks, each even rank hands its data to the odd rank above it and sits out; the p'
remaining ranks (renumbered 0..p'-1) run the power-of-two rounds; then every odd rank below
2r hands the result back to its even neighbour.
"""

from p2pcoll.strategy import Context, Recv, Reduce, Schedule, Send, Strategy


class RecursiveDoubling(Strategy):
    name = "recursive_doubling"
    collective = "allreduce"
    description = "lg p rounds of full-data swaps; non-powers of two folded the MPICH way"

    def schedule(self, ctx: Context) -> Schedule:
        p, rank = ctx.size, ctx.rank
        pof2 = 1 << (p.bit_length() - 1)
        extra = p - pof2

        # Fold the extra ranks in.
        if rank < 2 * extra:
            if rank % 2 == 0:
                yield Send(rank + 1)
                newrank = -1
            else:
                yield Reduce(rank - 1)
                newrank = rank // 2
        else:
            newrank = rank - extra

        if newrank >= 0:
            mask = 1
            while mask < pof2:
                partner = newrank ^ mask
                peer = 2 * partner + 1 if partner < extra else partner + extra
                yield [Send(peer), Reduce(peer)]
                mask <<= 1

        # Fold them back out.
        if rank < 2 * extra:
            if rank % 2:
                yield Send(rank - 1)
            else:
                yield Recv(rank + 1)
