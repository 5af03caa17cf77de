"""The robust reductions: allreduce(op="median") and allreduce(op="trimmed_mean", trim=k).

Every rank and every allgather strategy gives the same bits, equal to numpy's median and to
a sorted-trim reference; bad input is a ValueError naming it before anything moves; ranks
that disagree on the op or the trim get a CollectiveMismatch naming it. The matrix runs over
the memory transport on the virtual clock; one pass runs over real sockets.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest

import p2pcoll
from p2pcoll import CollectiveMismatch, training
from p2pcoll.api.robust import predict
from p2pcoll.engine.costs import CostModel
from p2pcoll.engine.robust import EXCHANGE, Exchange, stage_size
from p2pcoll.strategy import Workload
from p2pcoll.testing import memory_groups, run_ranks, run_virtual

DTYPES = (np.float16, np.float32, np.float64)
SIZES = (0, 1, 13, 1000)


def trimmed_reference(xs: np.ndarray, trim: int) -> np.ndarray:
    """Sort each element's values, drop ``trim`` at each end, sum the rest in ascending
    order (float16 in float32, as numpy's mean), divide by the count; NaN stays NaN."""
    ordered = np.sort(xs, axis=0)
    keep = ordered[trim:len(xs) - trim]
    wide = np.float32 if xs.dtype == np.float16 else xs.dtype.type
    total = np.zeros(xs.shape[1:], wide)
    for row in keep:
        total = (total + row.astype(wide)).astype(wide)
    mean = (total / wide(len(keep))).astype(xs.dtype)
    mean[np.isnan(xs).any(axis=0)] = np.nan
    return mean


def on_groups(p: int, fn: Callable[[p2pcoll.Group], Awaitable[Any]]) -> list[Any]:
    """``fn`` on every rank of a memory group of ``p``, on the virtual clock."""
    async def main() -> list[Any]:
        groups = await memory_groups(p)
        try:
            return list(await asyncio.gather(*(fn(g) for g in groups)))
        finally:
            await asyncio.gather(*(g.close() for g in groups))
    return run_virtual(main())


@pytest.mark.parametrize("p", range(1, 10))
def test_matrix_equals_numpy_on_every_rank_and_strategy(p: int) -> None:
    strategies = [None, *p2pcoll.available_strategies()["allgather"]]
    rng = np.random.default_rng(p)
    inputs = {(n, d): rng.standard_normal((p, n)).astype(d) for n in SIZES for d in DTYPES}
    ops = [("median", None)] + [("trimmed_mean", k) for k in range((p + 1) // 2)]

    async def rank(g: p2pcoll.Group) -> dict[Any, bytes]:
        got = {}
        for (n, d), xs in inputs.items():
            for op, trim in ops:
                # every allgather strategy on one shape; auto's choice on the others
                for s in strategies if (n, d) == (1000, np.float32) else [None]:
                    r = await g.allreduce(xs[g.rank], op, trim=trim, strategy=s)
                    assert r.dtype == d and r.shape == (n,)
                    got[n, d, op, trim, s] = r.tobytes()
        return got

    results = on_groups(p, rank)
    for key, bits in results[0].items():
        n, d, op, trim, _ = key
        assert all(r[key] == bits for r in results), key  # every rank, same bits
        xs = inputs[n, d]
        want = (np.median(xs, axis=0).astype(d) if op == "median"
                else trimmed_reference(xs, trim))
        assert want.tobytes() == bits, key
    # Every strategy gives the same bits.
    for op, trim in ops:
        assert len({results[0][1000, np.float32, op, trim, s] for s in strategies}) == 1


def test_median_of_even_count_is_the_mean_of_the_middle_two() -> None:
    got = on_groups(4, lambda g: g.allreduce(np.array([[1.0, 10.0][g.rank % 2] * (g.rank + 1)]),
                                             "median"))
    # values 1, 20, 3, 40: sorted 1, 3, 20, 40 -> (3 + 20) / 2
    assert [float(r[0]) for r in got] == [11.5] * 4


def test_nan_propagates_and_inf_is_trimmed() -> None:
    def value(rank: int) -> np.ndarray:
        x = np.full(3, float(rank), np.float32)
        if rank == 0:
            x[0] = np.nan  # element 0: one NaN among five values
            x[1] = np.inf  # element 1: one Inf, trimmed away
        return x

    for op, trim in (("median", None), ("trimmed_mean", 1)):
        got = on_groups(5, lambda g, op=op, trim=trim: g.allreduce(value(g.rank), op, trim=trim))
        xs = np.stack([value(r) for r in range(5)])
        np.testing.assert_array_equal(got[0][0], np.float32(np.nan))
        assert np.isnan(np.median(xs, axis=0)[0])  # as numpy does
        assert got[0][1] == 3.0  # inf, 1, 2, 3, 4: median 3; trimmed mean of 2, 3, 4 too
        assert got[0][2] == 2.0
        assert all(r.tobytes() == got[0].tobytes() for r in got)


def test_one_scaled_rank_moves_neither_median_nor_trimmed_mean_much() -> None:
    def value(rank: int) -> np.ndarray:
        x = np.linspace(-1, 1, 64, dtype=np.float32) + np.float32(rank) * 1e-3
        return x * 100 if rank == 3 else x

    clean = np.linspace(-1, 1, 64, dtype=np.float32)
    for op, trim in (("median", None), ("trimmed_mean", 1)):
        got = on_groups(8, lambda g, op=op, trim=trim: g.allreduce(value(g.rank), op, trim=trim))
        assert np.abs(got[0] - clean).max() < 0.01
    avg = on_groups(8, lambda g: g.allreduce(value(g.rank), "avg"))
    assert np.abs(avg[0] - clean).max() > 10  # what the robust ops are for


def test_pytree_of_several_dtypes_out_and_0d() -> None:
    def tree(rank: int) -> dict[str, np.ndarray]:
        return {"a": np.float32(rank * 2.0) * np.ones((2, 3), np.float32),
                "b": np.array(float(rank), np.float64), "c": np.arange(4, dtype=np.float32) + rank}

    async def rank(g: p2pcoll.Group) -> tuple[Any, Any]:
        plain = await g.allreduce(tree(g.rank), "median")
        out = {k: np.empty_like(v) for k, v in tree(0).items()}
        given = await g.allreduce(tree(g.rank), "trimmed_mean", trim=1, out=out)
        assert given is out
        return plain, out

    got = on_groups(5, rank)
    for plain, out in got:
        np.testing.assert_array_equal(plain["a"], np.full((2, 3), 4.0))
        assert plain["b"].shape == () and plain["b"] == 2.0
        np.testing.assert_array_equal(plain["c"], np.arange(4) + 2.0)
        np.testing.assert_array_equal(out["c"], np.arange(4) + 2.0)


def test_bfloat16_tensors_reduce_in_float32_rounded_once() -> None:
    torch = pytest.importorskip("torch")
    values = [torch.tensor([1.0, 2.5, -3.0, 7.0]) * (r + 1) for r in range(4)]

    got = on_groups(4, lambda g: g.allreduce(values[g.rank].to(torch.bfloat16), "median"))
    want = torch.from_numpy(np.median(np.stack([v.to(torch.bfloat16).float().numpy()
                                                for v in values]), axis=0).astype(np.float32))
    for r in got:
        assert r.dtype == torch.bfloat16
        assert torch.equal(r, want.to(torch.bfloat16))


def test_concurrent_calls_keep_their_order() -> None:
    async def rank(g: p2pcoll.Group) -> list[np.ndarray]:
        x = np.full(10, float(g.rank), np.float32)
        return list(await asyncio.gather(g.allreduce(x, "median"), g.allreduce(x, "sum"),
                                         g.allreduce(x, "trimmed_mean", trim=1),
                                         g.allreduce(x, "max")))

    for med, total, trimmed, top in on_groups(3, rank):
        assert med[0] == 1 and total[0] == 3 and trimmed[0] == 1 and top[0] == 2


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"op": "trimmed_mean", "trim": 2}, "trim=2"),  # 2 * 2 >= 4: nothing left
    ({"op": "trimmed_mean", "trim": -1}, "trim"),
    ({"op": "trimmed_mean"}, "trim=k"),
    ({"op": "median", "trim": 1}, "trim=1"),
    ({"op": "sum", "trim": 1}, "trim=1"),
    ({"op": "median", "dtype": np.int32}, "'median'"),
    ({"op": "trimmed_mean", "trim": 1, "dtype": np.int64}, "'trimmed_mean'"),
    ({"op": "median", "codec": "int8"}, "codec"),
    ({"op": "median", "strategy": "rabenseifner"}, "strategy='rabenseifner'"),
])
def test_bad_input_is_a_value_error_naming_it_and_the_group_stays_usable(
        kwargs: dict[str, Any], words: str) -> None:
    dtype = kwargs.pop("dtype", np.float32)

    async def rank(g: p2pcoll.Group) -> float:
        with pytest.raises(ValueError, match=words.replace("(", r"\(").replace("[", r"\[")):
            await g.allreduce(np.ones(5, dtype), **kwargs)
        return float((await g.allreduce(np.ones(5, np.float32), "median"))[0])

    assert on_groups(4, rank) == [1.0] * 4


def test_robust_ops_are_for_allreduce_only() -> None:
    async def rank(g: p2pcoll.Group) -> None:
        for call in (g.reduce(np.ones(3), 0, "median"), g.reduce_scatter(np.ones(3), "median")):
            with pytest.raises(ValueError, match="only allreduce"):
                await call

    on_groups(2, rank)


@pytest.mark.parametrize(("mine", "theirs", "shown"), [
    (("median", None), ("trimmed_mean", 1), "trimmed_mean(trim=1)"),
    (("trimmed_mean", 1), ("trimmed_mean", 2), "trim=2"),
    (("median", None), ("avg", None), "op"),
])
def test_ranks_that_disagree_get_a_mismatch_naming_it(
        mine: tuple[str, int | None], theirs: tuple[str, int | None], shown: str) -> None:
    async def rank(g: p2pcoll.Group) -> str:
        op, trim = theirs if g.rank == 2 else mine
        with pytest.raises(CollectiveMismatch) as caught:
            await g.allreduce(np.ones(8, np.float32), op, trim=trim)
        return str(caught.value)

    for message in on_groups(5, rank):
        assert shown in message


def test_cost_model_knows_the_exchange() -> None:
    work = Workload(size=4, nbytes=4000)
    cost = EXCHANGE.cost(work)
    assert cost.rounds == 3 and cost.sent == 3000
    assert EXCHANGE.traffic(work).bytes_sent == (3000,) * 4
    model = CostModel()
    assert predict(model, 4_000_000, 8) > predict(model, 4_000, 8) > 0
    # n = 5 on 3 ranks: parts 2, 2, 1; rank 2's stage: a slot of 2 for each other rank's
    # part 2 (1 element, after the spare chunk 0 holding the rest), then its own row
    assert stage_size(5, 3) == 9
    assert Exchange(2, 5).cuts(3, 9, 4) == [0, 1, 1, 2, 3, 3, 4, 6, 8, 9]


def test_stats_count_the_exchange_and_the_allgather() -> None:
    async def rank(g: p2pcoll.Group) -> dict[str, Any]:
        await g.allreduce(np.ones(1000, np.float32), "median", strategy="ring")
        return g.stats()

    for s in on_groups(4, rank):
        # (p-1)/p of 4000 bytes in the exchange and again in the ring allgather
        assert s["bytes_sent"] == 2 * 3000
        assert s["collectives_by_strategy"]["allreduce"] == {"exchange": 1}
        assert s["collectives_by_strategy"]["allgather"] == {"ring": 1}


async def test_over_real_sockets() -> None:
    rng = np.random.default_rng(7)
    xs = rng.standard_normal((3, 5000)).astype(np.float32)

    async def rank(g: p2pcoll.Group) -> tuple[bytes, bytes]:
        med = await g.allreduce(xs[g.rank], "median")
        trimmed = await g.allreduce(xs[g.rank], "trimmed_mean", trim=1,
                                    strategy="recursive_doubling")
        return med.tobytes(), trimmed.tobytes()

    got = await run_ranks(3, rank, transport="tcp")
    assert all(r == got[0] for r in got)
    assert got[0][0] == np.median(xs, axis=0).tobytes()
    assert got[0][1] == trimmed_reference(xs, 1).tobytes()


# --- the training modes -----------------------------------------------------------------------


def params(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal((8, 6)).astype(np.float32),
            "b": rng.standard_normal(6).astype(np.float32)}


@pytest.mark.parametrize(("op", "trim"), [("median", None), ("trimmed_mean", 1)])
def test_diloco_with_a_robust_op_keeps_replicas_equal_and_ignores_one_bad_peer(
        op: str, trim: int | None) -> None:
    """Rank 2 scales its pseudo-gradient by 100: the robust outer step stays near the
    clean one (the others' pseudo-gradients agree), and every replica has the same bits."""
    async def rank(g: p2pcoll.Group) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        mine = params()
        diloco = training.DiLoCo(g, mine, inner_steps=2, op=op, trim=trim)
        for step in range(6):
            for v in mine.values():
                v -= np.float32(0.01 * (1 + step % 2))  # every worker's own step: the same
            if g.rank == 2 and (step + 1) % 2 == 0:  # its pseudo-gradient times 100
                for name, v in mine.items():
                    anchor = diloco.anchor[diloco.model.names.index(name)]
                    v[...] = anchor - 100 * (anchor - v)
            await diloco.after_inner_step()
        return mine, diloco.global_state()["params"]

    got = on_groups(5, rank)
    anchors = [a for _, a in got]
    for a in anchors[1:]:
        assert all(a[k].tobytes() == anchors[0][k].tobytes() for k in a)
    # The clean run: each outer step sees the same pseudo-gradient from every honest peer.
    clean = on_groups(5, lambda g: _clean(g))
    for k in anchors[0]:
        np.testing.assert_allclose(anchors[0][k], clean[0][k], rtol=1e-5, atol=1e-5)


async def _clean(g: p2pcoll.Group) -> dict[str, np.ndarray]:
    mine = params()
    diloco = training.DiLoCo(g, mine, inner_steps=2)
    for step in range(6):
        for v in mine.values():
            v -= np.float32(0.01 * (1 + step % 2))
        await diloco.after_inner_step()
    return diloco.global_state()["params"]  # type: ignore[no-any-return]


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"op": "sum"}, "op must be"),
    ({"op": "trimmed_mean", "trim": 2}, "trim=2"),
    ({"op": "trimmed_mean"}, "trim=k"),
    ({"op": "avg", "trim": 1}, "trim=1"),
    ({"op": "median", "codec": "int8"}, "codec='int8'"),
    ({"op": "median", "compressor": "topk2bit"}, "compressor='topk2bit'"),
])
def test_diloco_refuses_a_bad_op_or_trim_at_construction(kwargs: dict[str, Any],
                                                          words: str) -> None:
    async def rank(g: p2pcoll.Group) -> None:
        with pytest.raises(ValueError, match=words):
            training.DiLoCo(g, params(), inner_steps=2, **kwargs)

    on_groups(4, rank)


def test_diloco_ranks_that_disagree_on_the_op_are_told_before_anything_moves() -> None:
    async def rank(g: p2pcoll.Group) -> str:
        trim = 2 if g.rank == 0 else 1
        diloco = training.DiLoCo(g, params(), inner_steps=1, op="trimmed_mean", trim=trim)
        with pytest.raises(CollectiveMismatch) as caught:
            await diloco.after_inner_step()
        return str(caught.value)

    for message in on_groups(5, rank):
        assert "trim" in message


def test_allreduce_gradients_takes_a_robust_op() -> None:
    async def rank(g: p2pcoll.Group) -> dict[str, np.ndarray]:
        grads = {k: v * (100 if g.rank == 0 else 1) + g.rank * 1e-3 for k, v in params().items()}
        return await training.allreduce_gradients(g, grads, "trimmed_mean", trim=1)  # type: ignore[no-any-return]

    got = on_groups(4, rank)
    want = params()
    for r in got:
        for k in want:
            assert r[k].tobytes() == got[0][k].tobytes()
            # the scaled value and one honest extreme are dropped: the middle two remain
            middle = np.where(want[k] > 0, want[k] + 2.5e-3, want[k] + 1.5e-3)
            np.testing.assert_allclose(r[k], middle, rtol=1e-5, atol=1e-5)


def test_gradient_reducer_takes_a_robust_op_and_checks_trim_at_construction() -> None:
    async def rank(g: p2pcoll.Group) -> dict[str, np.ndarray]:
        with pytest.raises(ValueError, match="trim=2"):
            training.GradientReducer(g, params(), "trimmed_mean", trim=2)
        reducer = training.GradientReducer(g, params(), "median")
        grads = {k: v * (100 if g.rank == 0 else 1) for k, v in params().items()}
        return await reducer.allreduce(grads)  # type: ignore[no-any-return]

    got = on_groups(3, rank)
    for r in got:
        for k, v in params().items():
            # values v * 100, v, v: the median is v whatever the sign
            assert r[k].tobytes() == v.tobytes()
