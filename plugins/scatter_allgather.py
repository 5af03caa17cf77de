"""Scatter + allgather broadcast (van de Geijn; MPICH ``MPIR_Bcast_intra_scatter_ring_allgather``).

Ranks are renumbered relative to the root, ``q = (rank - root) mod p`` (``ctx.relative``;
``ctx.real(v)`` maps back), and the data is cut
into p chunks, chunk q being the one relative rank q is responsible for. First a binomial
scatter: rank q receives the chunks of its subtree, ``[q, q + lowbit(q))`` (cut at p), from
its parent ``q - lowbit(q)``, then hands each child ``q + 2^k`` (for every ``2^k < lowbit(q)``,
farthest first) that child's subtree range ``[q + 2^k, q + 2^(k+1))``. The root's lowbit is
the first power of two >= p, so it sends all but chunk 0. Then a ring allgather over the
relative ranks: in step s rank q sends chunk ``q - s`` to ``q + 1`` and receives chunk
``q - s - 1`` from ``q - 1``, so it sends every chunk but chunk ``q + 1``.

The root sends about 2(p-1)/p·n bytes and every other rank about (p-1)/p·n plus its part of
the scatter, instead of the ceil(lg p)·n that the binomial tree puts on the root: the choice
for large data. ceil(lg p) + p - 1 rounds. Bytes with c_i the size of chunk i: relative rank q
sends ``c[q+1 .. q+lowbit(q))`` in the scatter and ``n - c[(q+1) mod p]`` in the ring.
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


class ScatterAllgatherBroadcast(Strategy):
    name = "scatter_allgather"
    collective = "broadcast"
    description = "binomial scatter of p chunks, then ring allgather; ~2(p-1)/p·n from the root"

    def chunks(self, size: int) -> int:
        return size

    def schedule(self, ctx: Context) -> Schedule:
        p, q, real = ctx.size, ctx.relative, ctx.real

        def subtree(v: int, width: int) -> range:
            return range(v, min(v + width, p))

        # Scatter: receive my subtree's chunks from my parent (q with its lowest bit cleared).
        mask = 1
        while mask < p:
            if q & mask:
                yield Recv(real(q - mask), subtree(q, mask))
                break
            mask <<= 1
        # Then give each child its subtree's chunks, farthest first.
        mask >>= 1
        while mask > 0:
            if q + mask < p:
                yield Send(real(q + mask), subtree(q + mask, mask))
            mask >>= 1

        # Ring allgather: forward the chunk that arrived in the previous step (mine at first).
        right, left = real(q + 1), real(q - 1)
        for s in range(p - 1):
            yield [Send(right, (q - s) % p), Recv(left, (q - s - 1) % p)]

    def cost(self, work: Workload) -> Cost:
        p, n = work.size, work.nbytes
        return Cost(((p - 1).bit_length() + p - 1) * work.waves, 2 * (p - 1) / p * n)

    def traffic(self, work: Workload) -> Traffic:
        p, n, s = work.size, work.nbytes, work.segments
        messages, sent = [], []
        for q in range(p):
            top = q & -q if q else 1 << (p - 1).bit_length()
            kids = [1 << k for k in range(top.bit_length() - 1) if q + (1 << k) < p]
            scatter = sum(work.span(q + m, min(q + 2 * m, p), p) for m in kids)
            messages.append((len(kids) + p - 1) * s)
            sent.append(scatter + n - work.part((q + 1) % p, p))
        return Traffic(tuple(messages), tuple(sent))
