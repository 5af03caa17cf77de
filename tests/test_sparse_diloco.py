"""DiLoCo with sparse 2-bit pseudo-gradients (``compressor="topk2bit"``) over real peers
(memory groups): replicas stay bit-identical, the accumulator keeps exactly what was not
sent, the sparse and dense ways of summing agree, bytes drop by thousands, and bad
arguments or ranks that disagree are told what is wrong before anything moves."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import pytest

import p2pcoll
from p2pcoll import training
from p2pcoll.testing import memory_groups
from p2pcoll.training.compressors import CHUNK, TopK2Bit

TIMEOUT = 10.0
T = TypeVar("T")


async def on_groups(n: int, fn: Callable[[p2pcoll.Group], Awaitable[T]]) -> list[T]:
    groups = await memory_groups(n)
    try:
        return list(await asyncio.gather(*(fn(g) for g in groups)))
    finally:
        for g in groups:
            await g.close()


def model(seed: int = 0) -> dict[str, np.ndarray]:
    """Tensors of one chunk, of a chunk and a tail, and of a few elements."""
    rng = np.random.default_rng(seed)
    return {"big": rng.standard_normal((100, 50)).astype(np.float32),   # 4096 + 904
            "small": rng.standard_normal((16, 24)).astype(np.float32),
            "bias": rng.standard_normal(7).astype(np.float32)}


def digest(arrays: Sequence[np.ndarray]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def local_steps(params: dict[str, np.ndarray], rank: int, step: int) -> None:
    """One inner step of rank's own: a pull towards a rank-specific target, plus noise."""
    rng = np.random.default_rng([rank, step])
    for v in params.values():
        v -= (0.05 * (v - rank) + 0.01 * rng.standard_normal(v.shape)).astype(v.dtype)


# --- identical replicas -----------------------------------------------------------------------


@pytest.mark.parametrize("n, fragments, overlap", [(2, 1, 0), (3, 1, 0), (4, 2, 1)])
async def test_replicas_stay_bit_identical_under_topk2bit(n: int, fragments: int,
                                                          overlap: int) -> None:
    start = digest(model().values())

    async def rank(group: p2pcoll.Group) -> tuple[str, int]:
        params = model()
        diloco = training.DiLoCo(group, params, inner_steps=4, compressor="topk2bit",
                                 density=0.015, fragments=fragments, overlap=overlap,
                                 timeout=TIMEOUT)
        for step in range(1, 17):
            local_steps(params, group.rank, step)
            await diloco.after_inner_step()
        await diloco.flush()
        leaves = [a for _, a in training.named_leaves(diloco.global_state())]
        return digest(leaves), diloco.outer_steps

    results = await on_groups(n, rank)
    assert len({d for d, _ in results}) == 1, "every replica holds the same global state"
    assert results[0][0] != start and results[0][1] == 4 * fragments


# --- what is sent and what is kept -------------------------------------------------------------


async def exchange(n: int, compressor: TopK2Bit, deltas: list[list[np.ndarray]],
                   residuals: list[list[np.ndarray]]) -> list[list[np.ndarray]]:
    """One exchange of rank r's ``deltas[r]`` with its ``residuals[r]`` (updated in place)."""
    async def rank(group: p2pcoll.Group) -> list[np.ndarray]:
        r = group.rank
        return await compressor.average(group, deltas[r], residuals[r],
                                        names=[str(i) for i in range(len(deltas[r]))],
                                        round_no=1, nonfinite="raise", strategy=None,
                                        timeout=TIMEOUT)
    return await on_groups(n, rank)


def inputs(n: int, shapes: Sequence[tuple[int, ...]], seed: int
           ) -> tuple[list[list[np.ndarray]], list[list[np.ndarray]]]:
    rng = np.random.default_rng(seed)
    deltas = [[rng.standard_normal(s).astype(np.float32) for s in shapes] for _ in range(n)]
    residuals = [[(0.1 * rng.standard_normal(s)).astype(np.float32) for s in shapes]
                 for _ in range(n)]
    return deltas, residuals


@pytest.mark.parametrize("density", [0.015, 0.2, 0.9])  # 0.9: the dense way
async def test_the_accumulator_keeps_exactly_what_was_not_sent(density: float) -> None:
    """Per rank: where nothing was sent the accumulator is delta + residual bit for bit;
    k entries per chunk were sent, each a code in {-2, -1, 1, 2} times the chunk's step
    (the same step on every rank); sent + kept equals delta + residual to half a unit in
    the last place of the kept value; and the average is the sum of what was sent, / p."""
    n, shapes = 3, [(CHUNK + 904,), (5, 7), (1,)]
    compressor = TopK2Bit(density)
    deltas, residuals = inputs(n, shapes, seed=1)
    before = [[d + e for d, e in zip(ds, es, strict=True)]
              for ds, es in zip(deltas, residuals, strict=True)]
    averaged = await exchange(n, compressor, deltas, residuals)

    for out in averaged[1:]:
        assert digest(out) == digest(averaged[0])
    for t, shape in enumerate(shapes):
        size = int(np.prod(shape))
        starts = list(range(0, size, CHUNK))
        sent = [(before[r][t] - residuals[r][t]).astype(np.float64).reshape(-1)
                for r in range(n)]
        exact = [np.zeros(size) for _ in range(n)]  # code times step, exactly
        for lo in starts:
            hi = min(size, lo + CHUNK)
            k = compressor.k_of(hi - lo)
            chosen: list[np.ndarray] = []
            for r in range(n):
                a = before[r][t].reshape(-1)[lo:hi]
                kept = residuals[r][t].reshape(-1)[lo:hi]
                where = np.flatnonzero(a != kept)
                assert where.size == k
                unsent = np.ones(hi - lo, bool)
                unsent[where] = False
                np.testing.assert_array_equal(kept[unsent], a[unsent])
                # sent + kept == a, to half an ulp of the kept value (one rounding).
                err = np.abs(a.astype(np.float64) - (kept.astype(np.float64)
                                                     + sent[r][lo:hi]))
                assert np.all(err <= np.spacing(np.abs(kept)) / 2)
                chosen.append(where)
            # The step s is half the largest selected magnitude over the ranks (the rank
            # that held it sent exactly 2 s); every rank sent a code in {-2, -1, 1, 2} times
            # s (a - kept is that up to kept's rounding, see above).
            step = max(np.abs(sent[r][lo:hi][w]).max() for r, w in enumerate(chosen)) / 2
            for r, where in enumerate(chosen):
                codes = np.rint(sent[r][lo:hi][where] / step)
                assert set(codes.tolist()) <= {-2, -1, 1, 2}
                np.testing.assert_allclose(sent[r][lo:hi][where], codes * step, rtol=1e-6)
                exact[r][lo:hi][where] = codes * step
        total = np.sum(exact, axis=0)
        np.testing.assert_allclose(averaged[0][t].reshape(-1).astype(np.float64) * n, total,
                                   rtol=1e-6, atol=0)


async def test_error_feedback_sends_over_rounds_what_one_round_held_back() -> None:
    """A constant pseudo-gradient: what was sent over R exchanges plus what is still held
    equals R times the input (the accumulator loses nothing), and most of it got through."""
    n, rounds, shape = 2, 40, (CHUNK,)
    compressor = TopK2Bit(0.05)
    rng = np.random.default_rng(7)
    deltas = [[rng.standard_normal(shape).astype(np.float32)] for _ in range(n)]
    residuals = [[np.zeros(shape, np.float32)] for _ in range(n)]
    got = np.zeros(shape)
    for _ in range(rounds):
        got += (await exchange(n, compressor, deltas, residuals))[0][0]
    want = sum(d[0].astype(np.float64) for d in deltas) / n * rounds
    held = sum(r[0].astype(np.float64) for r in residuals) / n
    np.testing.assert_allclose(got + held, want, rtol=0, atol=1e-3 * rounds)
    assert np.abs(held).max() < 0.25 * np.abs(want).max()


async def test_the_sparse_and_the_dense_sums_give_the_same_bits() -> None:
    class SparseAlways(TopK2Bit):
        def dense(self, sizes: Sequence[int], world_size: int) -> bool:
            return False

    n, shapes, density = 2, [(CHUNK + 10,), (3,)], 0.9
    assert TopK2Bit(density).dense([CHUNK + 10, 3], n), "this density sums densely"
    deltas, residuals = inputs(n, shapes, seed=3)
    dense_res = [[e.copy() for e in es] for es in residuals]
    dense = await exchange(n, TopK2Bit(density), deltas, dense_res)
    sparse = await exchange(n, SparseAlways(density), deltas, residuals)
    assert digest(dense[0]) == digest(sparse[0]) == digest(sparse[1])
    for mine, theirs in zip(dense_res, residuals, strict=True):
        assert digest(mine) == digest(theirs)


# --- bytes -------------------------------------------------------------------------------------


async def test_bytes_are_thousands_of_times_fewer_than_per_step_fp32() -> None:
    """density 1.5 %, H = 50: each rank hands ~0.035 bytes per element per exchange."""
    async def rank(group: p2pcoll.Group) -> training.DiLoCo:
        params = {"w": np.zeros((16, CHUNK), np.float32)}
        diloco = training.DiLoCo(group, params, inner_steps=50, compressor="topk2bit",
                                 density=0.015, timeout=TIMEOUT)
        for step in range(1, 101):
            local_steps(params, group.rank, step)
            await diloco.after_inner_step()
        return diloco

    for diloco in await on_groups(4, rank):
        selected = 16 * 62  # ceil(0.015 * 4096) of each chunk
        per_exchange = 16 * 4 + 3 * selected // 2 + selected // 4  # maxima, indices, codes
        assert diloco.traffic.rounds == 2
        assert diloco.traffic.sent_bytes == 2 * per_exchange
        assert diloco.traffic.ratio >= 3000


# --- bad input and disagreement ----------------------------------------------------------------


@pytest.mark.parametrize("kwargs, match", [
    ({"compressor": "topk2bit", "density": 0}, "density"),
    ({"compressor": "topk2bit", "density": 1.5}, "density"),
    ({"compressor": "topk2bit", "density": -0.1}, "density"),
    ({"compressor": "topk2bit", "density": float("nan")}, "density"),
    ({"compressor": "topk2bit", "density": "0.1"}, "density"),
    ({"compressor": "topk2bit", "density": True}, "density"),
    ({"compressor": "topk3bit"}, "compressor"),
    ({"compressor": 2}, "compressor"),
    ({"density": 0.1}, "density"),
    ({"compressor": "topk2bit", "codec": "int8"}, "compressor"),
])
async def test_bad_arguments_are_refused_when_diloco_is_made(kwargs: dict[str, Any],
                                                             match: str) -> None:
    async def rank(group: p2pcoll.Group) -> None:
        with pytest.raises(ValueError, match=match):
            training.DiLoCo(group, model(), inner_steps=4, **kwargs)
    await on_groups(1, rank)


@pytest.mark.parametrize("settings, words", [
    ([{"compressor": "topk2bit", "density": 0.015}, {"compressor": "topk2bit",
                                                      "density": 0.03}],
     "density is 0.015 on rank 0 but 0.03 on rank 1"),
    ([{}, {"compressor": "topk2bit"}], "compressor is None on rank 0 but 'topk2bit' on rank 1"),
])
async def test_ranks_that_disagree_are_told_before_anything_moves(
        settings: list[dict[str, Any]], words: str) -> None:
    start = model()

    async def rank(group: p2pcoll.Group) -> None:
        params = model()
        diloco = training.DiLoCo(group, params, inner_steps=2, timeout=TIMEOUT,
                                 **settings[group.rank])
        local_steps(params, group.rank, 1)
        await diloco.after_inner_step()
        local_steps(params, group.rank, 2)
        with pytest.raises(p2pcoll.CollectiveMismatch, match=words):
            await diloco.after_inner_step()
        for name, anchor in zip(sorted(start), diloco.anchor, strict=True):
            np.testing.assert_array_equal(anchor, start[name])  # nothing applied
        if diloco.residuals is not None:
            assert not any(r.any() for r in diloco.residuals)  # nothing kept either
        # and the group is still usable
        got = await group.allreduce(np.ones(3), timeout=TIMEOUT)
        np.testing.assert_array_equal(got, np.full(3, 2.0))

    await on_groups(2, rank)


async def test_nan_in_a_pseudo_gradient_is_reported_by_name_and_not_applied() -> None:
    async def rank(group: p2pcoll.Group) -> None:
        params = model()
        diloco = training.DiLoCo(group, params, inner_steps=1, compressor="topk2bit",
                                 timeout=TIMEOUT)
        if group.rank == 1:
            params["small"][3, 4] = np.nan
        with pytest.raises(training.NonFiniteGradients, match="'small'"):
            await diloco.after_inner_step()
        for name, anchor in zip(sorted(params), diloco.anchor, strict=True):
            np.testing.assert_array_equal(anchor, model()[name])  # nothing applied
        assert diloco.residuals is not None
        assert not any(r.any() for r in diloco.residuals)  # nothing kept either

    await on_groups(2, rank)
