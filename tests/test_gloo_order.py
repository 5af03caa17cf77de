"""Gloo's order of summation (``gloo_ring``), chunks placed by a strategy (``cuts``), and
reductions of the caller's own (``CustomOp``), over real peers on loopback.

Gloo's own bits are checked against torch's Gloo backend in test_torch_backend.py; here the
strategy is checked against the order written out in numpy, for sizes and pytrees that
leave Gloo's last blocks short or empty and make chunks span arrays.
"""

from __future__ import annotations

import numpy as np
import pytest
from p2pcoll_plugins.gloo_ring import gloo_cuts, gloo_reduce_cuts

import p2pcoll
from p2pcoll.engine.layout import Layout
from p2pcoll.engine.plan import chunking
from p2pcoll.registry import registry
from p2pcoll.strategy import Strategy
from p2pcoll.testing import run_ranks


def gloo_sum(xs: list[np.ndarray], blocks=gloo_cuts) -> np.ndarray:
    """Block b of Gloo's ring: x[b] + (x[b+1] + (... + (x[b-2] + x[b-1])))."""
    p, out = len(xs), np.empty_like(xs[0])
    cuts = blocks(p, xs[0].size, xs[0].itemsize)
    for b in range(p):
        lo, hi = cuts[b], cuts[b + 1]
        acc = xs[(b - 1) % p][lo:hi].copy()
        for k in range(2, p + 1):
            acc = xs[(b - k) % p][lo:hi] + acc
        out[lo:hi] = acc
    return out


def test_gloo_cuts_are_gloos_blocks() -> None:
    # 6,553,600 float32 over 4 ranks: 28 segments of 234,058 elements, 7 per block.
    assert gloo_cuts(4, 6_553_600, 4) == [0, 1_638_406, 3_276_812, 4_915_218, 6_553_600]
    # Small data: 2p segments; the last blocks short or empty.
    assert gloo_cuts(4, 7, 4) == [0, 2, 4, 6, 7]
    assert gloo_cuts(3, 1, 8) == [0, 1, 1, 1]
    assert gloo_cuts(1, 5, 4) == [0, 5]


def test_gloo_reduce_cuts_are_gloos_reduce_blocks() -> None:
    # gloo::reduce: segments of ceil(n/2p) elements (at most 1 MiB), then as the allreduce.
    assert gloo_reduce_cuts(4, 6_553_600, 4) == [0, 1_835_008, 3_670_016, 5_505_024, 6_553_600]
    assert gloo_reduce_cuts(4, 7, 4) == [0, 2, 4, 6, 7]
    assert gloo_reduce_cuts(3, 1000, 8) == [0, 334, 668, 1000]
    assert gloo_reduce_cuts(2, 0, 4) == [0, 0, 0]


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("n", [0, 7, 300_001])
async def test_gloo_ring_reduce_adds_in_gloos_order_onto_any_root(p: int, n: int) -> None:
    rng = np.random.default_rng(10 * n + p)
    xs = [rng.standard_normal(n).astype(np.float32) for _ in range(p)]
    want = gloo_sum(xs, gloo_reduce_cuts) if p > 1 else xs[0]
    for root in {0, p - 1}:
        results = await run_ranks(
            p, lambda g, root=root: g.reduce(xs[g.rank], root, strategy="gloo_ring"))
        assert results[root].tobytes() == want.tobytes()
        assert all(r is None for k, r in enumerate(results) if k != root)


@pytest.mark.parametrize("p", [2, 3, 4, 5])
@pytest.mark.parametrize("n", [0, 1, 7, 1000, 300_001])
async def test_gloo_ring_adds_in_gloos_order(p: int, n: int) -> None:
    rng = np.random.default_rng(10 * n + p)
    xs = [rng.standard_normal(n).astype(np.float32) for _ in range(p)]
    results = await run_ranks(p, lambda g: g.allreduce(xs[g.rank], strategy="gloo_ring"))
    want = gloo_sum(xs)
    for r in results:
        assert r.tobytes() == want.tobytes()
    if p > 2 and n >= 1000:  # the order matters: a left fold differs
        assert (np.sum(xs, axis=0, dtype=np.float32) != want).any()


async def test_gloo_ring_cuts_a_pytree_as_one_flat_buffer() -> None:
    # As Gloo's allreduce_coalesced (one flattened buffer): blocks span the leaves.
    p, sizes = 3, (5, 1, 0, 11)
    rng = np.random.default_rng(7)
    trees = [[rng.standard_normal(k) for k in sizes] for _ in range(p)]
    results = await run_ranks(p, lambda g: g.allreduce(trees[g.rank], strategy="gloo_ring"))
    want = gloo_sum([np.concatenate(t) for t in trees])
    for r in results:
        assert np.concatenate(r).tobytes() == want.tobytes()


@pytest.mark.parametrize("collective", ["allreduce", "reduce"])
def test_auto_never_picks_gloo_ring(collective: str) -> None:
    picks = {registry.auto_name(collective, n, p) for p in range(2, 9)
             for n in (4 << 10, 1 << 20, 64 << 20)}
    assert "gloo_ring" not in picks and picks


def test_bad_cuts_are_named() -> None:
    arrays = [np.zeros(4), np.zeros(3)]
    layout = Layout.cut(arrays, [0, 2, 6, 7])
    assert layout.chunks == [[(0, 0, 2)], [(0, 2, 4), (1, 0, 2)], [(1, 2, 3)]]

    class Cutter(Strategy):
        name = "cutter"
        collective = "allreduce"
        given: list[int] = []  # noqa: RUF012

        def chunks(self, size: int) -> int:
            return len(self.given) - 1

        def cuts(self, size: int, count: int, itemsize: int) -> list[int]:
            return self.given

    for bad in ([0, 5], [1, 7], [0, 5, 3, 7], [0, 7, 7, 7, 7, 6]):
        Cutter.given = bad
        with pytest.raises(p2pcoll.PluginValidationError,
                           match=r"allreduce strategy 'cutter' gave cuts \[.*; they must run "
                                 r"non-decreasing from 0 to 7"):
            chunking(Cutter(), 2, 7, 8)
    Cutter.given = [0, 2, 6, 7]
    assert chunking(Cutter(), 2, 7, 8) == (3, (0, 2, 6, 7))


def _max_abs(mine: np.ndarray, incoming: np.ndarray) -> None:
    np.copyto(mine, np.where(np.abs(incoming) > np.abs(mine), incoming, mine))


async def test_a_custom_op_reduces_with_every_strategy() -> None:
    op = p2pcoll.CustomOp("max-abs", _max_abs)
    p = 5
    data = [np.array([1.0, -2.0 * r, 0.5 * r, 3.0]) for r in range(p)]
    want = np.array([1.0, -8.0, 2.0, 3.0])
    strategies = p2pcoll.available_strategies()["allreduce"]

    async def every(g: p2pcoll.Group) -> list[np.ndarray]:  # one group, each strategy in turn
        return [await g.allreduce(data[g.rank], op, strategy=s) for s in strategies]

    for results in await run_ranks(p, every):
        for strategy, r in zip(strategies, results, strict=True):
            assert np.array_equal(r, want), strategy


async def test_custom_ops_of_other_names_are_a_mismatch() -> None:
    ops = [p2pcoll.CustomOp("max-abs", _max_abs), p2pcoll.CustomOp("other", _max_abs)]
    results = await run_ranks(2, lambda g: g.allreduce(np.ones(3), ops[g.rank]),
                              return_exceptions=True)
    assert all(isinstance(r, p2pcoll.CollectiveMismatch) for r in results), results
    assert "custom:max-abs" in str(results[0]) and "custom:other" in str(results[0])


def test_a_malformed_custom_op_is_refused() -> None:
    from p2pcoll.types import as_op

    with pytest.raises(ValueError, match="non-empty name and a callable fold"):
        as_op(p2pcoll.CustomOp("", _max_abs))
    with pytest.raises(ValueError, match="non-empty name and a callable fold"):
        as_op(p2pcoll.CustomOp("x", None))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="or a CustomOp"):
        as_op("mode")
