"""Recursive doubling allreduce (MPICH ``MPIR_Allreduce_intra_recursive_doubling``).

With p a power of two: in round k every rank swaps its whole data with ``rank XOR 2^k`` and
folds the partner's in; after lg p rounds everyone holds the reduction. lg p latency terms,
but lg p·n bytes per rank, so it suits small data.

Other p, the MPICH fold (``p2pcoll.strategy.Fold``): let p' be the largest power of two <= p
and r = p - p'. Among the first 2r ranks, each even rank hands its data to the odd rank above
it and sits out; the p' remaining ranks (renumbered 0..p'-1) run the power-of-two rounds;
then every odd rank below 2r hands the result back to its even neighbour.
"""

from p2pcoll.strategy import (
    Context,
    Cost,
    Fold,
    Reduce,
    Schedule,
    Send,
    Strategy,
    Traffic,
    Workload,
    largest_power_of_two,
)


class RecursiveDoubling(Strategy):
    name = "recursive_doubling"
    collective = "allreduce"
    description = "lg p rounds of full-data swaps; non-powers of two folded the MPICH way"

    def schedule(self, ctx: Context) -> Schedule:
        fold = Fold(ctx)
        yield from fold.fold_in()  # the extra ranks hand their data in
        if fold.newrank is not None:
            # Round k: swap everything with the core rank that differs in bit k, fold it in.
            mask = 1
            while mask < fold.pof2:
                partner = fold.real(fold.newrank ^ mask)
                yield [Send(partner), Reduce(partner)]
                mask <<= 1
        yield from fold.fold_out()  # and get the result back

    def cost(self, work: Workload) -> Cost:
        # lg p' swaps of n, plus the fold's hand-in and hand-back when p is not p'.
        p, n = work.size, work.nbytes
        swaps = largest_power_of_two(p).bit_length() - 1
        folded = p != largest_power_of_two(p)
        return Cost((swaps + 2 * folded) * work.waves, (swaps + 2 * folded) * n,
                    (swaps + folded) * n)

    def traffic(self, work: Workload) -> Traffic:
        # Even ranks below 2r send n once; odd ones lg p' + 1 times; the rest lg p' times.
        p, n = work.size, work.nbytes
        pof2 = largest_power_of_two(p)
        swaps, extra = pof2.bit_length() - 1, p - pof2
        sends = [(1 if r % 2 == 0 else swaps + 1) if r < 2 * extra else swaps for r in range(p)]
        return Traffic(tuple(k * work.segments for k in sends), tuple(k * n for k in sends))
