"""The ring allreduce along a measured ring order, with the bits of the ring in rank order.

Floating-point folds are commutative but not associative: the ring in rank order
(``plugins/ring.py``) gives chunk c the value ``((x_c + x_{c+1}) + x_{c+2}) + ... + x_{c-1}``
(ranks mod p): the *chain* of chunk c, rank order from c. A ring in another order would fold
along *its* order and change the last bits with the topology. So along another order the
ring folds only what the chain allows and *carries* the rest:

Each chunk travels the ring once, p-1 hops from the rank where its path starts to the one
where it ends (its owner). A message carries a *partial* (the chain's first m contributions,
folded) and raw contributions not yet foldable. A rank that receives the chunk folds when
its own contribution is the chain's next (after the partial; or it is one of the chain's
first two and the other has come): into its own contribution it folds the partial, then
every raw contribution that follows in the chain, one message each, in chain order (the
executor folds ``mine = op(mine, received)``, and a commutative op makes ``op(x_w, P)`` equal
to ``op(P, x_w)``). Whatever it cannot fold it stores and passes on with its own. At the
owner everything must fold: the path's start is chosen per chunk so that it does, and so
that every rank owns one chunk, fewest contributions carried first (an assignment solved
over subsets up to :data:`EXACT_LIMIT` ranks; above, each chunk's path ends at rank c, where
everything is carried and folded at the end, always valid). Then a ring allgather along the
same order hands every rank every finished chunk (copies only).

Cost, against the ring in rank order: rank order itself carries nothing; for p = 4 with one
pair avoided, 15 contributions move in the reduce-scatter instead of 12; carrying
everything would cost ``(1 + 2 + ... + (p-1))`` per chunk (24 for p = 4). :func:`factor`
gives the ratio of bytes, which :func:`pays` weighs against the measured hops. Raw
contributions in transit sit in a scratch area after the data, one slot each.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from ..strategy import Context, Cost, Recv, Reduce, Schedule, Send, Strategy, Step, Workload

__all__ = ["EXACT_LIMIT", "OrderedAllgather", "OrderedRing", "factor", "ordered_allgather",
           "ordered_ring", "pays", "starts"]

EXACT_LIMIT = 12  # largest group whose path starts are assigned exactly
Item = tuple[int, int]  # (-1, m): the partial of the chain's first m; (0, rank): a raw one


def pays(ordered: float, rank_order: float, ring: tuple[int, ...]) -> bool:
    """Whether the ring along ``ring``, whose slowest hop moves ``ordered`` bytes/s, beats
    the ring in rank order, whose slowest moves ``rank_order``: it sends :func:`factor`
    times the bytes, so its bottleneck must be that much faster (and a little more, so
    that the noise of a measurement does not reorder a ring for nothing)."""
    p = len(ring)
    return p >= 3 and ordered > rank_order * factor(ring) * 1.1


@lru_cache(maxsize=64)
def factor(ring: tuple[int, ...]) -> float:
    """The bytes one rank sends along ``ring`` over those of the ring in rank order: the
    contributions its chunks' paths carry, then the allgather's p-1 chunks, over 2(p-1)."""
    p = len(ring)
    if p < 2:
        return 1.0
    chosen = starts(ring)
    carried = sum(_carried(ring, c, chosen[c]) or 0 for c in range(p))
    return (carried / p + p - 1) / (2 * (p - 1))


def _split(n: int, p: int, c: int) -> int:
    """Start of part c when n items are split like ``numpy.array_split`` into p parts."""
    q, r = divmod(n, p)
    return c * q + min(c, r)


# --- the chain: what one chunk's path carries, hop by hop ------------------------------------

def _index(rank: int, chunk: int, p: int) -> int:
    """Where ``rank``'s contribution comes in chunk ``chunk``'s chain."""
    return (rank - chunk) % p


def _folds(items: Sequence[Item], rank: int, chunk: int, p: int) -> tuple[int, int]:
    """How many leading ``items`` (canonical order) ``rank`` folds into its contribution,
    and the partial's length after (0, 0: it folds nothing)."""
    if not items:
        return 0, 0
    mine = _index(rank, chunk, p)
    kind, value = items[0]
    if kind < 0:
        if mine != value:
            return 0, 0
        n, m = 1, value + 1
    elif {mine, _index(value, chunk, p)} == {0, 1}:
        n, m = 1, 2
    else:
        return 0, 0
    while n < len(items) and items[n][0] == 0 and _index(items[n][1], chunk, p) == m:
        n, m = n + 1, m + 1
    return n, m


def _canonical(items: list[Item], chunk: int, p: int) -> list[Item]:
    """The order items travel in: the partial first, then raw ones in chain order."""
    return sorted(items, key=lambda it: -1 if it[0] < 0 else _index(it[1], chunk, p))


def _path(ring: tuple[int, ...], chunk: int, start: int) -> list[list[Item]] | None:
    """What each hop of ``chunk``'s path from ring position ``start`` carries (hop t: from
    ``ring[start+t]`` to the next), or None when the owner (the last rank) could not fold
    everything."""
    p = len(ring)
    carried: list[Item] = [(0, ring[start % p])]
    hops = [carried]
    for t in range(1, p):
        rank = ring[(start + t) % p]
        n, m = _folds(carried, rank, chunk, p)
        kept = carried[n:]
        if t == p - 1:
            return hops if n == len(carried) and m == p else None
        carried = _canonical([(-1, m), *kept] if n else [*kept, (0, rank)], chunk, p)
        hops.append(carried)
    return hops  # p == 1: nothing travels


@lru_cache(maxsize=64)
def starts(ring: tuple[int, ...]) -> tuple[int, ...]:
    """Where each chunk's path starts (a ring position, distinct for every chunk, so every
    rank owns one): fewest contributions carried in all, exactly up to
    :data:`EXACT_LIMIT` ranks; above, every chunk's path ends at its own rank."""
    p = len(ring)
    position = {r: i for i, r in enumerate(ring)}
    everything = tuple((position[c] + 1) % p for c in range(p))
    if p > EXACT_LIMIT or ring == tuple(range(p)):
        return tuple(c % p for c in range(p)) if ring == tuple(range(p)) else everything
    cost = [[_carried(ring, c, k) for k in range(p)] for c in range(p)]
    # best[mask]: (the least cost of chunks 0..popcount-1 on starts mask, their starts)
    best: dict[int, tuple[int, tuple[int, ...]]] = {0: (0, ())}
    for mask in sorted(range(1 << p), key=lambda m: (bin(m).count("1"), m)):
        if mask not in best:
            continue
        total, chosen = best[mask]
        c = len(chosen)
        if c == p:
            continue
        for k in range(p):
            here = cost[c][k]
            if mask >> k & 1 or here is None:
                continue
            candidate = (total + here, (*chosen, k))
            old = best.get(mask | 1 << k)
            if old is None or candidate < old:
                best[mask | 1 << k] = candidate
    return best[(1 << p) - 1][1]


def _carried(ring: tuple[int, ...], chunk: int, start: int) -> int | None:
    hops = _path(ring, chunk, start)
    return None if hops is None else sum(len(h) for h in hops)


# --- the strategy -----------------------------------------------------------------------------

class OrderedRing(Strategy):
    """The ring allreduce of one rank over leaves of ``sizes`` elements along ``ring`` (a
    cyclic order of the ranks), folding in the rank-order ring's chain order. Not
    registered: the topology runs it in place of ``ring``
    (:mod:`p2pcoll.api.topology`). Chunk ids: ``i * p + c`` is chunk c of leaf i; after
    the data, slot k of this rank's scratch holds one contribution in transit, leaf i's
    part in id ``D + 2 * (k * L + i)`` and one element of gap in the id after (the executor
    joins pieces adjacent in memory, and sender and receiver must cut alike)."""

    name = "ring"
    collective = "allreduce"
    description = "ring along the measured order, folded in rank order (some carried)"
    automatic = False

    def __init__(self, ring: Sequence[int], sizes: Sequence[int], rank: int) -> None:
        self.ring, self.sizes, self.rank = tuple(ring), tuple(sizes), rank
        p = len(self.ring)
        if sorted(self.ring) != list(range(p)):
            raise ValueError(f"ring {self.ring} is not an order of the ranks 0..{p - 1}")
        self.p, self.nleaves = p, len(self.sizes)
        self.data_ids = self.nleaves * p
        self.starts = starts(self.ring)
        self._steps: list[Step] = []
        self._slots: list[int] = []  # the chunk of each scratch slot, in order
        self._compile()

    @property
    def scratch_elements(self) -> int:
        """Elements of this rank's scratch area."""
        return sum(self._part(i, c) + 1 for c in self._slots for i in range(self.nleaves))

    def chunks(self, size: int) -> int:
        return self.data_ids + 2 * len(self._slots) * self.nleaves

    def _part(self, leaf: int, chunk: int) -> int:
        n = self.sizes[leaf]
        return _split(n, self.p, chunk + 1) - _split(n, self.p, chunk)

    def cuts(self, size: int, count: int, itemsize: int) -> list[int]:
        lengths = [self._part(i, c) for i in range(self.nleaves) for c in range(self.p)]
        for chunk in self._slots:
            for i in range(self.nleaves):
                lengths += [self._part(i, chunk), 1]
        cuts = [0]
        for length in lengths:
            cuts.append(cuts[-1] + length)
        return cuts

    def schedule(self, ctx: Context) -> Schedule:
        yield from self._steps

    def _data(self, chunk: int) -> tuple[int, ...]:
        return tuple(i * self.p + chunk for i in range(self.nleaves))

    def _slot(self, chunk: int) -> tuple[int, ...]:
        k = len(self._slots)
        self._slots.append(chunk)
        return tuple(self.data_ids + 2 * (k * self.nleaves + i) for i in range(self.nleaves))

    def _compile(self) -> None:
        """This rank's steps: in reduce-scatter step t every chunk makes hop t of its path;
        this rank sends the chunk whose path is at it and receives the one whose path
        comes to it, as messages paired into sub-steps. Then the allgather."""
        p, ring, r = self.p, self.ring, self.rank
        if p < 2:
            return
        q = ring.index(r)
        right, left = ring[(q + 1) % p], ring[(q - 1) % p]
        held: dict[tuple[int, Item], tuple[int, ...]] = {}  # (chunk, item) -> my slot ids
        paths = {c: _path(ring, c, self.starts[c]) for c in range(p)}
        for t in range(p - 1):
            out_chunk = next(c for c in range(p) if (self.starts[c] + t) % p == q)
            in_chunk = next(c for c in range(p) if (self.starts[c] + t + 1) % p == q)
            sends = self._messages(paths[out_chunk], t, out_chunk, right, held, mine=True)
            recvs = self._messages(paths[in_chunk], t, in_chunk, r, held, mine=False)
            for k in range(max(len(sends), len(recvs))):
                step = [*sends[k:k + 1], *recvs[k:k + 1]]
                self._steps.append(step)
        # Allgather along the ring: pass on the chunk that arrived last (my own first).
        owner = {(self.starts[c] + p - 1) % p: c for c in range(p)}  # position -> chunk
        for s in range(p - 1):
            self._steps.append([Send(right, self._data(owner[(q - s) % p])),
                                Recv(left, self._data(owner[(q - 1 - s) % p]))])

    def _messages(self, hops: list[list[Item]] | None, t: int, chunk: int, to: int,
                  held: dict[tuple[int, Item], tuple[int, ...]], *, mine: bool
                  ) -> list[Send | Recv | Reduce]:
        """Hop t of ``chunk`` as messages: the items its receiver ``to`` folds, one each,
        then the rest in one. ``mine``: this rank sends them (else it receives them)."""
        assert hops is not None
        items = hops[t]
        n, _ = _folds(items, to, chunk, self.p)
        groups = [[it] for it in items[:n]] + ([items[n:]] if n < len(items) else [])
        ops: list[Send | Recv | Reduce] = []
        for group in groups:
            if mine:
                ids = tuple(i for it in group for i in (
                    held.pop((chunk, it)) if (chunk, it) in held else self._data(chunk)))
                ops.append(Send(to, ids))
            elif len(ops) < n:
                ops.append(Reduce(self.ring[(self.ring.index(to) - 1) % self.p],
                                  self._data(chunk)))
            else:
                ids = ()
                for it in group:
                    held[(chunk, it)] = slot = self._slot(chunk)
                    ids += slot
                ops.append(Recv(self.ring[(self.ring.index(to) - 1) % self.p], ids))
        return ops

    def cost(self, work: Workload) -> Cost:
        # The contributions the paths carry (their messages on one rank's link), then the
        # allgather's p-1 parts; a hop's messages one round each.
        p, n = work.size, work.nbytes
        if len(self.ring) != p:
            return Cost(2 * (p - 1) * work.waves, 2 * (p - 1) / p * n, (p - 1) / p * n)
        carried = sum(_carried(self.ring, c, self.starts[c]) or 0 for c in range(p))
        per_rank = carried / p  # every rank sends one chunk's hop per step
        return Cost((per_rank + p - 1) * work.waves, (per_rank + p - 1) / p * n,
                    (p - 1) / p * n)


class OrderedAllgather(Strategy):
    """The ring allgather along ``ring``: step s, each rank passes on to the next on the
    ring the part that came to it last (its own first). Copies only, so any order gives the
    same result. Not registered: the topology runs it in place of ``ring``."""

    name = "ring"
    collective = "allgather"
    description = "allgather ring along the measured order"
    automatic = False

    def __init__(self, ring: Sequence[int]) -> None:
        self.ring = tuple(ring)

    def schedule(self, ctx: Context) -> Schedule:
        p, ring = ctx.size, self.ring
        q = ring.index(ctx.rank)
        right, left = ring[(q + 1) % p], ring[(q - 1) % p]
        for s in range(p - 1):
            yield [Send(right, ring[(q - s) % p]), Recv(left, ring[(q - 1 - s) % p])]

    def cost(self, work: Workload) -> Cost:
        p, n = work.size, work.nbytes
        return Cost((p - 1) * work.waves, (p - 1) / p * n)


@lru_cache(maxsize=64)
def ordered_allgather(ring: tuple[int, ...]) -> OrderedAllgather:
    """The ring allgather along ``ring`` (one instance per ring, so plans are cached)."""
    return OrderedAllgather(ring)


@lru_cache(maxsize=64)
def ordered_ring(ring: tuple[int, ...], sizes: tuple[int, ...], rank: int) -> OrderedRing:
    """The ordered ring of ``rank`` (one instance per arguments, so plans are cached)."""
    return OrderedRing(ring, sizes, rank)
