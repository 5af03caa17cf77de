"""The ring solver (p2pcoll.engine.ring_order): the exact solver against brute force, the
heuristic against rank order, and the solvers' determinism."""

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pcoll.engine.ring_order import (
    best_ring,
    bottleneck,
    exact_ring,
    heuristic_ring,
)

# Few distinct values, so that ties (the hard case for "which ring") are common.
BANDWIDTHS = st.sampled_from([1e6, 1e7, 5e7, 1e8, 1.25e8, 1e9])


@st.composite
def matrices(draw: st.DrawFn, low: int = 2, high: int = 7) -> list[list[float]]:
    p = draw(st.integers(low, high))
    return [[0.0 if i == j else draw(BANDWIDTHS) for j in range(p)] for i in range(p)]


def brute_force(m: list[list[float]]) -> float:
    """The largest bottleneck over every ring from rank 0."""
    p = len(m)
    return max(bottleneck((0, *rest), m) for rest in itertools.permutations(range(1, p)))


def is_ring(order: tuple[int, ...], p: int) -> bool:
    return len(order) == p and sorted(order) == list(range(p)) and order[0] == 0


@settings(max_examples=150, deadline=None)
@given(matrices())
def test_exact_equals_brute_force(m: list[list[float]]) -> None:
    order = exact_ring(m)
    assert is_ring(order, len(m))
    assert bottleneck(order, m) == brute_force(m)


@settings(max_examples=100, deadline=None)
@given(matrices())
def test_exact_keeps_rank_order_when_it_is_best(m: list[list[float]]) -> None:
    identity = tuple(range(len(m)))
    if bottleneck(identity, m) == brute_force(m):
        assert exact_ring(m) == identity
    else:
        assert exact_ring(m) != identity


@settings(max_examples=40, deadline=None)
@given(matrices(4, 14), st.integers(0, 1000))
def test_heuristic_never_worse_than_rank_order(m: list[list[float]], moves: int) -> None:
    order = heuristic_ring(m, moves=moves)
    assert is_ring(order, len(m))
    assert bottleneck(order, m) >= bottleneck(tuple(range(len(m))), m)


def test_slow_pair_is_avoided() -> None:
    # Four ranks at 1 Gbit/s, the pair 0-1 at 100 Mbit/s both ways: every ring through
    # 0 -> 1 or 1 -> 0 runs at 100 Mbit/s; the best ones avoid both.
    fast, slow = 1.25e8, 1.25e7
    m = [[0.0 if i == j else fast for j in range(4)] for i in range(4)]
    m[0][1] = m[1][0] = slow
    order = best_ring(m)
    assert bottleneck(order, m) == fast
    assert order == (0, 2, 1, 3)  # the lexicographically smallest of the two
    assert bottleneck(tuple(range(4)), m) == slow


def test_large_group_uses_the_heuristic_and_is_deterministic() -> None:
    p = 20
    m = [[0.0 if i == j else 1e9 for j in range(p)] for i in range(p)]
    for i in range(p):  # every hop i -> i+1 of rank order slow: rank order is the worst
        m[i][(i + 1) % p] = 1e6
    first = best_ring(m, moves=20_000)
    assert first == best_ring(m, moves=20_000)
    assert bottleneck(first, m) == 1e9


def test_one_and_two_ranks() -> None:
    assert best_ring([[0.0]]) == (0,)
    assert best_ring([[0.0, 5.0], [1.0, 0.0]]) == (0, 1)
    assert bottleneck((0,), [[0.0]]) == math.inf


@pytest.mark.parametrize("bad", [
    [[0.0, 1.0]],  # not square
    [[0.0, -1.0], [1.0, 0.0]],
    [[0.0, math.nan], [1.0, 0.0]],
])
def test_bad_matrices_are_refused(bad: list[list[float]]) -> None:
    with pytest.raises(ValueError, match="bandwidth"):
        best_ring(bad)
