"""Rabenseifner's allreduce (MPICH ``MPIR_Allreduce_intra_reduce_scatter_allgather``).

A reduce-scatter by recursive halving, then an allgather by recursive doubling. With p a
power of two, the data is cut into p blocks. In the first round every rank pairs with
``rank XOR 1``: the lower of the two keeps the lower half of the blocks, sends the upper half
to its partner and folds in the lower half it receives; the upper one does the opposite. Each
later round pairs with ``rank XOR 2^k`` and halves the kept range again, so after lg p rounds
every rank holds one fully reduced block (rank q the block whose index is q's bits reversed).
The allgather retraces those rounds backwards: each rank sends the range it holds to the
partner of that round and receives the partner's, doubling its range, until it holds all.

Each phase sends n/2 + n/4 + ... + n/p bytes, so 2(p-1)/p·n per rank, the same as the ring,
in 2 lg p rounds instead of 2(p-1). Every block is reduced by exactly one rank and copied
from there, so the results are bitwise identical on every rank.

Other p, the MPICH fold (``p2pcoll.strategy.Fold``, as in plugins/recursive_doubling.py):
let p' be the largest power of two <= p and r = p - p'. Among the first 2r ranks each even
rank hands all its data to the odd rank above it and sits out; the p' others (renumbered
0..p'-1) run the rounds above on p' blocks; then each odd rank below 2r hands the result
back. The even ranks send n, the odd ones below 2r 2(p'-1)/p'·n + n, the rest
2(p'-1)/p'·n; 2 lg p' + 2 rounds.
"""

from p2pcoll.strategy import (
    Context,
    Cost,
    Fold,
    Recv,
    Reduce,
    Schedule,
    Send,
    Strategy,
    Traffic,
    Workload,
    largest_power_of_two,
)


class RabenseifnerAllreduce(Strategy):
    name = "rabenseifner"
    collective = "allreduce"
    description = (
        "recursive-halving reduce-scatter + recursive-doubling allgather; 2(p-1)/p·n bytes,"
        " 2 lg p rounds"
    )

    def chunks(self, size: int) -> int:
        return largest_power_of_two(size)  # the p' blocks that the halving splits

    def schedule(self, ctx: Context) -> Schedule:
        fold = Fold(ctx)
        yield from fold.fold_in()  # the extra ranks hand their data in
        newrank = fold.newrank
        if newrank is not None:
            # Reduce-scatter by recursive halving: keep one half of my range, send the other.
            kept = range(fold.pof2)
            rounds = []  # (partner, the half I kept, the half I gave away), in order
            mask = 1
            while mask < fold.pof2:
                partner = fold.real(newrank ^ mask)
                half = (kept.start + kept.stop) // 2
                lower, upper = range(kept.start, half), range(half, kept.stop)
                keep, give = (lower, upper) if newrank & mask == 0 else (upper, lower)
                yield [Send(partner, give), Reduce(partner, keep)]
                rounds.append((partner, keep, give))
                kept = keep
                mask <<= 1

            # Allgather by recursive doubling: the same rounds backwards, copying instead.
            for partner, keep, give in reversed(rounds):
                yield [Send(partner, keep), Recv(partner, give)]
        yield from fold.fold_out()  # and get the result back

    def cost(self, work: Workload) -> Cost:
        p, n = work.size, work.nbytes
        pof2 = largest_power_of_two(p)
        steps, folded = pof2.bit_length() - 1, p != pof2
        share = (pof2 - 1) / pof2 * n  # what one phase sends: n/2 + n/4 + ... + n/p'
        return Cost((2 * steps + 2 * folded) * work.waves, 2 * share + 2 * folded * n,
                    share + folded * n)

    def traffic(self, work: Workload) -> Traffic:
        # The halving gives away the half it does not keep, the doubling sends what it kept:
        # per round the two halves of the range held before it, so the bytes are exact for
        # chunks of unequal size too.
        p, n = work.size, work.nbytes
        pof2 = largest_power_of_two(p)
        steps, extra = pof2.bit_length() - 1, p - pof2
        messages, sent = [], []
        for rank in range(p):
            fold = Fold(Context(rank, p))
            if fold.newrank is None:  # an even rank below 2r: hands its data in, sits out
                messages.append(work.segments)
                sent.append(n)
                continue
            kept, total, mask = range(pof2), 0, 1
            while mask < pof2:
                half = (kept.start + kept.stop) // 2
                lower, upper = range(kept.start, half), range(half, kept.stop)
                keep, give = (lower, upper) if fold.newrank & mask == 0 else (upper, lower)
                total += work.span(give.start, give.stop, pof2)
                total += work.span(keep.start, keep.stop, pof2)
                kept, mask = keep, mask << 1
            back = rank < 2 * extra  # an odd rank below 2r hands the result back
            messages.append((2 * steps + back) * work.segments)
            sent.append(total + back * n)
        return Traffic(tuple(messages), tuple(sent))
