"""The order of a ring that a slow pair of ranks slows least: a bottleneck asymmetric TSP.

A ring allreduce moves the same bytes over every hop in lockstep, so its pace is the
slowest hop's: the ring to choose is the cyclic order of the ranks whose slowest directed
hop ``order[k] -> order[k+1]`` is fastest (the bottleneck travelling-salesman problem,
asymmetric because a link may be faster one way than the other).

- :func:`exact_ring` (up to :data:`EXACT_LIMIT` ranks): the largest threshold ``t`` for
  which the hops of bandwidth >= ``t`` still hold a Hamiltonian cycle, found by bisecting
  the distinct bandwidths, each test a dynamic programme over subsets (bitsets, about
  ``2^p * p`` steps). Among the rings of that bottleneck it returns rank order if rank order
  is one of them, else the lexicographically smallest (from rank 0).
- :func:`heuristic_ring` (any size): rank order and a greedy ring (from rank 0, always
  the fastest hop to a rank not yet visited), each improved by 2-opt (reverse a stretch)
  and Or-opt (move a stretch of 1 to 3 ranks elsewhere) while a move raises the bottleneck
  or, at equal bottleneck, lowers the sum of the hops' seconds per byte. It starts from rank
  order and accepts only improvements, so it is never worse than rank order.

Both are deterministic functions of the matrix: every rank that solves the same (agreed)
matrix gets the same ring. That is why the heuristic's budget is a count of moves
evaluated, not a clock: ranks stopped by a clock would stop at different rings.

Every ring starts at rank 0 (a ring has p rotations; this is the one returned).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

__all__ = ["EXACT_LIMIT", "MOVES", "Matrix", "best_ring", "bottleneck", "exact_ring",
           "heuristic_ring", "seconds_per_byte"]

Matrix = Sequence[Sequence[float]]  # m[i][j]: bytes per second from rank i to rank j
EXACT_LIMIT = 12  # largest group solved exactly (2^12 subsets per threshold tested)
MOVES = 200_000  # the heuristic's budget: moves evaluated (about a second of Python)


def bottleneck(order: Sequence[int], bandwidth: Matrix) -> float:
    """The bandwidth of the slowest hop of the ring ``order`` (inf for one rank)."""
    p = len(order)
    if p < 2:
        return math.inf
    return min(bandwidth[order[k]][order[(k + 1) % p]] for k in range(p))


def seconds_per_byte(order: Sequence[int], bandwidth: Matrix) -> float:
    """The sum over the ring's hops of 1 / bandwidth (the tie-break among equal
    bottlenecks: a ring whose other hops are faster too)."""
    p = len(order)
    if p < 2:
        return 0.0
    return sum(_inverse(bandwidth[order[k]][order[(k + 1) % p]]) for k in range(p))


def best_ring(bandwidth: Matrix, *, moves: int = MOVES) -> tuple[int, ...]:
    """The ring order for ``bandwidth``: :func:`exact_ring` up to :data:`EXACT_LIMIT`
    ranks, :func:`heuristic_ring` above.

    Raises:
        ValueError: the matrix is not square, or holds a negative or NaN bandwidth.
    """
    p = _check(bandwidth)
    if p <= EXACT_LIMIT:
        return exact_ring(bandwidth)
    return heuristic_ring(bandwidth, moves=moves)


def exact_ring(bandwidth: Matrix) -> tuple[int, ...]:
    """A ring of the largest bottleneck (exactly; for up to about :data:`EXACT_LIMIT`
    ranks): rank order if it is one, else the lexicographically smallest.

    Raises:
        ValueError: as :func:`best_ring`, or more than 20 ranks (2^p subsets).
    """
    p = _check(bandwidth)
    if p > 20:
        raise ValueError(f"exact_ring solves up to 20 ranks, not {p}")
    identity = tuple(range(p))
    if p <= 2:
        return identity
    # Bisect the distinct hop bandwidths for the largest threshold that leaves a cycle.
    values = sorted({bandwidth[i][j] for i in range(p) for j in range(p) if i != j})
    lo, hi = 0, len(values) - 1  # values[lo] always has a cycle (the complete graph)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _finishers(bandwidth, values[mid])[1] & 1:
            lo = mid
        else:
            hi = mid - 1
    threshold = values[lo]
    if bottleneck(identity, bandwidth) >= threshold:
        return identity
    return _smallest_cycle(bandwidth, threshold)


def heuristic_ring(bandwidth: Matrix, *, moves: int = MOVES) -> tuple[int, ...]:
    """A good ring for any size, never worse than rank order (see the module docstring);
    ``moves`` bounds the moves evaluated.

    Raises:
        ValueError: as :func:`best_ring`, or ``moves`` below 0.
    """
    p = _check(bandwidth)
    if moves < 0:
        raise ValueError(f"moves must be >= 0, got {moves}")
    identity = list(range(p))
    if p <= 3:
        return exact_ring(bandwidth) if p == 3 else tuple(identity)
    budget = [moves]
    best = _improve(identity, bandwidth, budget)
    greedy = _improve(_greedy(bandwidth), bandwidth, budget)
    if _key(greedy, bandwidth) > _key(best, bandwidth):
        best = greedy
    return tuple(best)


# --- exact: subsets as bitsets ------------------------------------------------------------

def _finishers(bandwidth: Matrix, threshold: float) -> tuple[list[int], int]:
    """``fin[mask]``: the bitset of ranks v in ``mask`` (which holds rank 0) from which a
    path over hops >= ``threshold`` visits every rank outside ``mask`` once and returns to
    rank 0. Returns (fin, fin[{0}]): bit 0 of the latter says a cycle exists."""
    p = len(bandwidth)
    full = (1 << p) - 1
    into = [0] * p  # into[w]: the ranks with a hop >= threshold to w
    for v in range(p):
        for w in range(p):
            if v != w and bandwidth[v][w] >= threshold:
                into[w] |= 1 << v
    fin = [0] * (1 << p)
    fin[full] = into[0]
    # Masks holding rank 0, largest first (a superset is always a larger number).
    for mask in range(full - 2, 0, -2):
        reach = 0
        rest = full & ~mask
        while rest:
            low = rest & -rest
            w = low.bit_length() - 1
            if fin[mask | low] >> w & 1:
                reach |= into[w]
            rest ^= low
        fin[mask] = reach & mask
    return fin, fin[1]


def _smallest_cycle(bandwidth: Matrix, threshold: float) -> tuple[int, ...]:
    """The lexicographically smallest cycle from rank 0 over hops >= ``threshold`` (one
    must exist)."""
    p = len(bandwidth)
    fin, _ = _finishers(bandwidth, threshold)
    order, mask, at = [0], 1, 0
    while len(order) < p:
        for w in range(p):
            low = 1 << w
            if not mask & low and bandwidth[at][w] >= threshold and fin[mask | low] >> w & 1:
                order.append(w)
                mask, at = mask | low, w
                break
        else:  # pragma: no cover - fin says a cycle exists, so a next rank does
            raise AssertionError("no next rank on a cycle that exists")
    return tuple(order)


# --- heuristic: local search --------------------------------------------------------------

def _key(order: Sequence[int], bandwidth: Matrix) -> tuple[float, float]:
    """What the heuristic maximises: the bottleneck, then minus the seconds per byte."""
    return bottleneck(order, bandwidth), -seconds_per_byte(order, bandwidth)


def _greedy(bandwidth: Matrix) -> list[int]:
    """From rank 0, always the fastest hop to a rank not yet visited (lowest rank on ties)."""
    p = len(bandwidth)
    order, left = [0], set(range(1, p))
    while left:
        at = order[-1]
        nxt = max(sorted(left), key=lambda w: bandwidth[at][w])
        order.append(nxt)
        left.discard(nxt)
    return order


def _improve(order: list[int], bandwidth: Matrix, budget: list[int]) -> list[int]:
    """2-opt and Or-opt moves, first improvement, until none improves or ``budget[0]``
    (shared by the caller's runs) is spent. Rank 0 stays first."""
    p = len(order)
    best = list(order)
    best_key = _key(best, bandwidth)
    improved = True
    while improved and budget[0] > 0:
        improved = False
        for candidate in _neighbours(best):
            budget[0] -= 1
            key = _key(candidate, bandwidth)
            if key > best_key:
                best, best_key, improved = candidate, key, True
                break
            if budget[0] <= 0:
                break
    assert len(best) == p
    return best


def _neighbours(order: list[int]) -> Iterator[list[int]]:
    """Every 2-opt and Or-opt move of ``order`` that keeps rank 0 first, one at a time."""
    p = len(order)
    for i in range(1, p - 1):  # 2-opt: reverse order[i..j]
        for j in range(i + 1, p):
            yield order[:i] + order[i:j + 1][::-1] + order[j + 1:]
    for length in (1, 2, 3):  # Or-opt: move order[i..i+length-1] before position k
        for i in range(1, p - length + 1):
            stretch = order[i:i + length]
            rest = order[:i] + order[i + length:]
            for k in range(1, len(rest) + 1):
                if k == i:
                    continue
                yield rest[:k] + stretch + rest[k:]


# --- checks -------------------------------------------------------------------------------

def _inverse(b: float) -> float:
    return math.inf if b <= 0 else 1.0 / b


def _check(bandwidth: Matrix) -> int:
    p = len(bandwidth)
    for i, row in enumerate(bandwidth):
        if len(row) != p:
            raise ValueError(f"the bandwidth matrix must be square: row {i} has {len(row)} "
                             f"entries for {p} ranks")
        for j, b in enumerate(row):
            if i != j and not (b >= 0):  # NaN fails this too
                raise ValueError(f"bandwidth[{i}][{j}] is {b!r}; bandwidths are >= 0")
    return p
