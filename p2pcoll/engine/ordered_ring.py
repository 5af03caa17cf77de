"""The ring allreduce along a measured ring order, with the bits of the ring in rank order.

Floating-point folds are commutative but not associative: the ring in rank order
(``plugins/ring.py``) gives chunk c the value ``((x_c + x_{c+1}) + x_{c+2}) + ... + x_{c-1}``
(ranks mod p), its chain starting at rank c. A ring in another order folds along *its*
order, which would change the last bits of the result with the topology. So along the
order ``ring`` this allreduce does not fold on the way: the ring *carries* the
contributions, and each chunk's owner folds them in the chain's order.

Chunk c is owned by rank c. Its path runs along the ring from the rank after c round to
the rank before c; every rank on it forwards the contributions it received and adds its
own, unreduced, so the k-th hop carries k contributions. On the last hop the rank before c
sends them to c one message each, in chain order (``x_{c+1}``, then ``x_{c+2}``, ...), and c
folds each into its own ``x_c`` as it arrives: the rank-order ring's chain exactly. Then a
ring allgather along the same order hands every rank every finished chunk (copies only).

Cost, against the ring in rank order: the reduce-scatter sends ``(1 + 2 + ... + (p-1)) / p``
of the data per rank instead of ``(p-1)/p`` (p/2 times as much: 1.5 n instead of 0.75 n
for p = 4), the allgather the same; in all ``(p+2)/4`` times the ring's bytes, paid for
when the slowest hop of the ordered ring is that much faster than rank order's
(:func:`pays`). The contributions in transit sit in a scratch area after the data (the
*stage*): ``(p-1)(p-2)/2`` slots of ``ceil(n/p) + 1`` elements, about ``p/2`` times the data,
only the pages written being touched.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from functools import lru_cache

from ..strategy import Context, Cost, Recv, Reduce, Schedule, Send, Strategy, Step, Workload

__all__ = ["OrderedRing", "ordered_ring", "pays", "scratch_size"]


def _split(n: int, p: int, c: int) -> int:
    """Start of part c when n items are split like ``numpy.array_split`` into p parts."""
    q, r = divmod(n, p)
    return c * q + min(c, r)


def _slots(p: int) -> int:
    """Contributions a rank holds on their way: 1 + 2 + ... + (p-2)."""
    return (p - 1) * (p - 2) // 2


def scratch_size(sizes: Sequence[int], p: int) -> int:
    """Elements of the scratch area for leaves of ``sizes`` elements on ``p`` ranks."""
    return _slots(p) * sum(-(-n // p) + 1 for n in sizes)


def pays(ordered: float, rank_order: float, p: int) -> bool:
    """Whether the carried ring along a ring whose slowest hop moves ``ordered`` bytes/s
    beats the plain ring in rank order, whose slowest moves ``rank_order``: it sends
    ``(p+2)/4`` times the bytes, so its bottleneck must be faster by more than that."""
    return p >= 3 and ordered > rank_order * (p + 2) / 4


class OrderedRing(Strategy):
    """The carried ring allreduce of one rank over leaves of ``sizes`` elements along
    ``ring`` (a cyclic order of the ranks). Not registered: the topology runs it in place of
    ``ring`` (:mod:`p2pcoll.session.topology`). Chunk ids: ``i * p + c`` is chunk c of leaf
    i; after the data, slot k of the scratch holds one contribution, leaf i's part of it in
    id ``D + 2 * (k * L + i)`` and the rest of the slot in the id after (moved by nobody)."""

    name = "ring"
    collective = "allreduce"
    description = "ring along the measured order, contributions carried, folded in rank order"
    automatic = False

    def __init__(self, ring: Sequence[int], sizes: Sequence[int], rank: int) -> None:
        self.ring, self.sizes, self.rank = tuple(ring), tuple(sizes), rank
        p = len(self.ring)
        if sorted(self.ring) != list(range(p)):
            raise ValueError(f"ring {self.ring} is not an order of the ranks 0..{p - 1}")
        self.p, self.nleaves = p, len(self.sizes)
        self.data_ids = self.nleaves * p
        self.position = self.ring.index(rank)

    def chunks(self, size: int) -> int:
        return self.data_ids + 2 * _slots(self.p) * self.nleaves

    def _part(self, leaf: int, chunk: int) -> int:
        n = self.sizes[leaf]
        return _split(n, self.p, chunk + 1) - _split(n, self.p, chunk)

    def _slot_chunk(self, k: int) -> int:
        """The chunk whose contribution slot k holds on this rank: slots fill step by step,
        step s receiving s+1 contributions of the chunk owned s+2 places back."""
        s = 0
        while (s + 1) * (s + 2) // 2 <= k:
            s += 1
        return self.ring[(self.position - 2 - s) % self.p]

    def cuts(self, size: int, count: int, itemsize: int) -> list[int]:
        lengths = [self._part(i, c) for i in range(self.nleaves) for c in range(self.p)]
        for k in range(_slots(self.p)):
            chunk = self._slot_chunk(k)
            for i in range(self.nleaves):
                used = self._part(i, chunk)
                # At least one element of gap after every part: the executor joins pieces
                # adjacent in memory into one, and sender and receiver must cut alike.
                lengths += [used, -(-self.sizes[i] // self.p) - used + 1]
        cuts = [0]
        for length in lengths:
            cuts.append(cuts[-1] + length)
        return cuts

    # --- the schedule ---------------------------------------------------------------------

    def _data(self, chunk: int) -> tuple[int, ...]:
        return tuple(i * self.p + chunk for i in range(self.nleaves))

    def _slot(self, k: int) -> tuple[int, ...]:
        return tuple(self.data_ids + 2 * (k * self.nleaves + i) for i in range(self.nleaves))

    def schedule(self, ctx: Context) -> Schedule:
        yield from self._steps()

    def _steps(self) -> Iterator[Step]:
        p, q, ring, r = self.p, self.position, self.ring, self.rank
        if p < 2:
            return
        right, left = ring[(q + 1) % p], ring[(q - 1) % p]
        # Reduce-scatter, carried. At step s this rank passes on the chunk owned s+1 places
        # back along the ring (the s contributions received for it, then its own) and
        # receives the s+1 contributions of the chunk owned s+2 places back into slots
        # base(s) .. base(s)+s, in the order of their origin along the ring.
        held: list[tuple[tuple[int, ...], int]] = []  # (slot ids, origin rank), last step's
        for s in range(p - 2):
            chunk = ring[(q - 1 - s) % p]
            base = s * (s + 1) // 2
            into = [self._slot(base + j) for j in range(s + 1)]
            send = tuple(i for ids, _ in held for i in ids) + self._data(chunk)
            yield [Send(right, send), Recv(left, tuple(i for ids in into for i in ids))]
            origins = [ring[(q - 1 - s + j) % p] for j in range(s + 1)]
            held = list(zip(into, origins, strict=True))
        # Last hop: the right neighbour owns the chunk; send it every contribution, one
        # message each, in its chain's order (rank order from it), and fold the ones for my
        # own chunk into it in that order as they arrive.
        owner = right
        items = [*held, (self._data(owner), r)]
        items.sort(key=lambda item: (item[1] - owner) % p)
        for ids, _ in items:
            yield [Send(right, ids), Reduce(left, self._data(r))]
        # Allgather along the ring: pass on the chunk that arrived last (my own first).
        for s in range(p - 1):
            yield [Send(right, self._data(ring[(q - s) % p])),
                   Recv(left, self._data(ring[(q - 1 - s) % p]))]

    def cost(self, work: Workload) -> Cost:
        p, n = work.size, work.nbytes
        carried = (p - 1) / 2 * n  # 1 + 2 + ... + (p-1) parts of n/p
        return Cost((3 * p - 4) * work.waves, carried + (p - 1) / p * n, (p - 1) / p * n)


@lru_cache(maxsize=64)
def ordered_ring(ring: tuple[int, ...], sizes: tuple[int, ...], rank: int) -> OrderedRing:
    """The carried ring of ``rank`` (one instance per arguments, so plans are cached)."""
    return OrderedRing(ring, sizes, rank)
