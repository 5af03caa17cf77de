"""Dissemination barrier (Hensgen, Finkel & Manber): ceil(lg p) rounds of empty messages.

In round k rank r signals ``r + 2^k`` and waits for ``r - 2^k`` (mod p). After the last round
every rank has heard, directly or through others, from every rank.
"""

from p2pcoll.strategy import Context, Recv, Schedule, Send, Strategy


class DisseminationBarrier(Strategy):
    name = "dissemination"
    collective = "barrier"
    description = "ceil(lg p) rounds of empty messages"

    def schedule(self, ctx: Context) -> Schedule:
        distance = 1
        while distance < ctx.size:
            yield [Send((ctx.rank + distance) % ctx.size), Recv((ctx.rank - distance) % ctx.size)]
            distance <<= 1
