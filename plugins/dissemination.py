"""Dissemination barrier (Hensgen, Finkel & Manber): ceil(lg p) rounds of empty messages.

In round k rank r signals ``r + 2^k`` and waits for ``r - 2^k`` (mod p). After the last round
every rank has heard, directly or through others, from every rank.
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


class DisseminationBarrier(Strategy):
    name = "dissemination"
    collective = "barrier"
    description = "ceil(lg p) rounds of empty messages"

    def schedule(self, ctx: Context) -> Schedule:
        distance = 1
        while distance < ctx.size:
            yield [Send((ctx.rank + distance) % ctx.size), Recv((ctx.rank - distance) % ctx.size)]
            distance <<= 1

    def cost(self, work: Workload) -> Cost:
        return Cost((work.size - 1).bit_length(), 0)

    def traffic(self, work: Workload) -> Traffic:
        rounds = (work.size - 1).bit_length()
        return Traffic((rounds * work.segments,) * work.size, (0,) * work.size)
