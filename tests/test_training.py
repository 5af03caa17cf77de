"""p2pcoll.training: buckets, training rounds over real peers, and every check they make.

Training tests run real groups on loopback (``run_ranks``) and compare with numpy computed
in this process: N peers each computing the gradient of its own shard and averaging must end
with the same weights as one process taking full-batch steps on all the data.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest

import p2pcoll
from p2pcoll import training
from p2pcoll.testing import run_ranks
from p2pcoll.training import BucketPlan, TensorSpec, named_leaves, replace_leaves

TIMEOUT = 10.0  # per collective: a hang fails the test instead of stalling it
Tree = Any


async def each_rank(n: int, fn: Callable[[p2pcoll.Group], Awaitable[Any]]) -> list[Any]:
    """Run ``fn`` on n peers; exceptions come back in their rank's place."""
    return await run_ranks(n, fn, return_exceptions=True, collective_timeout=TIMEOUT)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


# --- the package: imported on first use, errors under P2PCollError ---------------------------


def run_python(code: str) -> None:
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_import_p2pcoll_does_not_import_training() -> None:
    run_python("import sys, p2pcoll\n"
               "assert 'p2pcoll.training' not in sys.modules, 'training was imported'\n")


def test_p2pcoll_training_is_imported_on_first_use() -> None:
    run_python("import p2pcoll\n"
               "fn = p2pcoll.training.allreduce_gradients\n"
               "from p2pcoll import training\n"
               "from p2pcoll.training import allreduce_gradients\n"
               "assert fn is training.allreduce_gradients is allreduce_gradients\n"
               "assert 'training' in p2pcoll.__all__\n")


def test_training_errors_are_p2pcoll_errors() -> None:
    assert issubclass(training.NonFiniteGradients, p2pcoll.P2PCollError)
    assert issubclass(training.NonFiniteGradients, FloatingPointError)
    assert issubclass(training.RoundError, p2pcoll.P2PCollError)
    assert issubclass(training.RoundError, RuntimeError)


# --- names and buckets (no communication) ----------------------------------------------------


def awkward_tree() -> Tree:
    """Nested dicts, a list and a tuple; 0-d, empty and non-contiguous leaves; eight dtypes."""
    rng = np.random.default_rng(7)
    return {
        "encoder": {
            "w": rng.normal(size=(6, 5)).astype(np.float32),
            "b": rng.normal(size=5).astype(np.float32),
            "scale": np.array(3.5, dtype=np.float64),                       # 0-d
            "empty": np.zeros((0, 3), dtype=np.float32),                     # no elements
        },
        "blocks": [
            {"w": rng.normal(size=(4, 4)).T, "count": np.arange(7, dtype=np.int64)},  # .T
            (np.array([1, 0, 1], dtype=bool), rng.normal(size=3).astype(np.float16)),
        ],
        "steps": np.array(12, dtype=np.int8),
        "z": (rng.normal(size=4) + 1j * rng.normal(size=4)).astype(np.complex64),
        "bytes": np.arange(300, dtype=np.uint8).reshape(3, 100),
        "nothing": np.zeros(0, dtype=np.int64),
    }


def test_named_leaves_are_paths_in_leaf_order() -> None:
    tree = {"fc": {"w": np.ones(1), "b": np.ones(1)}, "blocks": [np.ones(1), (np.ones(1),)]}
    # The one pytree order (p2pcoll.pytree): dict keys sorted at each level, items by position.
    assert [name for name, _ in named_leaves(tree)] == ["blocks.0", "blocks.1.0", "fc.b", "fc.w"]
    assert [name for name, _ in named_leaves(np.ones(2))] == [""]
    with pytest.raises(ValueError, match=r"'a\.b'"):
        named_leaves({"a": {"b": np.ones(1)}, "a.b": np.ones(1)})
    with pytest.raises(TypeError, match="None"):
        named_leaves({"a": None})


@pytest.mark.parametrize("bucket_bytes", [0, 1, 24, 100, 1 << 20, None])
def test_buckets_round_trip_any_pytree_exactly(bucket_bytes: int | None) -> None:
    tree = awkward_tree()
    named = named_leaves(tree)
    specs = [TensorSpec.of(name, leaf) for name, leaf in named]
    plan = BucketPlan(specs, bucket_bytes)
    flats = plan.pack([leaf for _, leaf in named])

    assert len(flats) == len(plan.buckets)
    placed: list[int] = []
    for bucket, flat in zip(plan.buckets, flats, strict=True):
        assert flat.ndim == 1 and flat.dtype == bucket.dtype and flat.size == bucket.size
        assert {specs[i].dtype for i in bucket.members} == {bucket.dtype}
        if len(bucket.members) > 1:
            assert flat.nbytes <= plan.bucket_bytes
        placed += bucket.members
    nonempty = [i for i, s in enumerate(specs) if s.size]
    assert sorted(placed) == nonempty, "every non-empty tensor is in exactly one bucket"
    if bucket_bytes == 0:
        assert len(plan.buckets) == len(nonempty)
    if bucket_bytes is None:
        assert len(plan.buckets) == len({s.dtype for s in specs if s.size}), "one per dtype"

    back = replace_leaves(tree, plan.unpack(flats))
    assert named_leaves(back)[0][0] == named[0][0]
    assert isinstance(back["blocks"], list) and isinstance(back["blocks"][1], tuple)
    for (name, want), (name2, got) in zip(named, named_leaves(back), strict=True):
        assert name == name2
        assert same_bits(got, np.array(want, order="C")), name
        if got.size:
            assert any(np.shares_memory(got, f) for f in flats), f"{name} is a view"


def test_bucket_plan_rejects_wrong_input() -> None:
    plan = BucketPlan([TensorSpec.of("w", np.zeros((2, 3), np.float32))])
    with pytest.raises(ValueError, match="'w' is float64"):
        plan.pack([np.zeros((2, 3))])
    with pytest.raises(ValueError, match=r"'w' is float32\[3, 2\]"):
        plan.pack([np.zeros((3, 2), np.float32)])
    with pytest.raises(ValueError, match="expected 1 arrays"):
        plan.pack([])
    with pytest.raises(ValueError, match="bucket_bytes"):
        BucketPlan([], -1)
    with pytest.raises(TypeError, match="cannot be communicated"):
        TensorSpec.of("s", np.array(["text"]))


def test_buckets_are_ordered_by_their_last_tensor() -> None:
    specs = [TensorSpec("a", np.dtype("f4"), (4,)), TensorSpec("b", np.dtype("f8"), (2,)),
             TensorSpec("c", np.dtype("f4"), (4,)), TensorSpec("d", np.dtype("f4"), (4,))]
    plan = BucketPlan(specs, bucket_bytes=32)  # a+c fill one float32 bucket, d starts the next
    assert [b.members for b in plan.buckets] == [(1,), (0, 2), (3,)]


# --- allreduce_gradients -------------------------------------------------------------------


def rank_grads(rank: int) -> Tree:
    """Integer-valued gradients, so every sum is exact whatever the order of additions."""
    return {
        "fc": {"w": np.full((3, 4), rank + 1, np.float32), "b": np.arange(4.0) * rank},
        "emb": [np.array(float(rank)), np.zeros((0, 2), np.float32)],
        "half": np.full(5, rank, np.float16),
    }


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("op", ["avg", "sum", "max"])
async def test_allreduce_gradients_reduces_every_tensor(n: int, op: str) -> None:
    async def fn(g: p2pcoll.Group) -> Tree:
        return await training.allreduce_gradients(g, rank_grads(g.rank), op, bucket_bytes=40)

    results = await run_ranks(n, fn)
    ufunc = {"avg": np.add, "sum": np.add, "max": np.maximum}[op]
    for name, want in named_leaves(rank_grads(0)):
        expect = want.copy()
        for r in range(1, n):
            expect = ufunc(expect, dict(named_leaves(rank_grads(r)))[name])
        if op == "avg":
            expect = (expect / n).astype(want.dtype)
        for res in results:
            got = dict(named_leaves(res))[name]
            assert got.shape == want.shape and got.dtype == want.dtype
            np.testing.assert_array_equal(got, expect, err_msg=name)
            assert same_bits(got, dict(named_leaves(results[0]))[name])


async def test_gradients_in_a_long_list_come_back_in_their_places() -> None:
    # Leaf order takes list positions as numbers ("10" after "9"), on every rank alike.
    async def fn(g: p2pcoll.Group) -> Tree:
        grads = {"layers": [np.full(i + 1, float(i + g.rank)) for i in range(12)]}
        return await training.allreduce_gradients(g, grads, "sum", bucket_bytes=48)

    for out in await run_ranks(2, fn):
        assert len(out["layers"]) == 12
        for i, got in enumerate(out["layers"]):
            np.testing.assert_array_equal(got, np.full(i + 1, 2.0 * i + 1))


async def test_round_numbers_belong_to_the_group() -> None:
    async def reducer_round(reducer: training.GradientReducer) -> int:
        async with reducer.start_round() as rnd:
            rnd.add("w", np.ones(2))
            await rnd.wait()
        return rnd.number

    async def fn(g: p2pcoll.Group) -> None:
        await training.allreduce_gradients(g, {"w": np.ones(2)})           # round 0
        reducer = training.GradientReducer(g, {"w": np.ones(2)})
        assert await reducer_round(reducer) == 1                            # the group's next
        await training.allreduce_gradients(g, {"w": np.ones(2)}, round=7)  # jumps ahead
        assert await reducer_round(reducer) == 8

    await run_ranks(2, fn, collective_timeout=TIMEOUT)
    await run_ranks(2, fn, collective_timeout=TIMEOUT)  # a new group counts from 0 again


async def test_empty_gradients_are_a_no_op_without_communication() -> None:
    async def fn(g: p2pcoll.Group) -> tuple[Tree, Tree, int]:
        before = g.stats()["collectives"]
        out = await training.allreduce_gradients(g, {})
        nested = await training.allreduce_gradients(g, {"a": {}, "b": []})
        return out, nested, g.stats()["collectives"] - before

    for out, nested, used in await run_ranks(2, fn):
        assert out == {} and nested == {"a": {}, "b": []} and used == 0


async def test_bad_arguments_are_refused_before_communicating() -> None:
    async def fn(g: p2pcoll.Group) -> None:
        with pytest.raises(ValueError, match=r"gradient 'steps'.*avg"):
            await training.allreduce_gradients(g, {"steps": np.arange(3)})
        with pytest.raises(ValueError, match="nonfinite"):
            await training.allreduce_gradients(g, {"w": np.ones(2)}, nonfinite="maybe")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="unknown reduce op"):
            await training.allreduce_gradients(g, {"w": np.ones(2)}, "mean")
        with pytest.raises(ValueError, match="bucket_bytes"):
            await training.allreduce_gradients(g, {"w": np.ones(2)}, bucket_bytes=-5)
        assert g.stats()["collectives"] == 0

    await run_ranks(2, fn)


# --- training equals single-process training ---------------------------------------------------

FEATURES, CLASSES, HIDDEN, SAMPLES, ROUNDS, LR = 6, 3, 8, 48, 12, 0.5


def dataset() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(SAMPLES, FEATURES))
    y = (x[:, 0] + x[:, 1] > 0).astype(int) + (x[:, 2] > 1).astype(int)
    return x, y


def init_params(seed: int) -> Tree:
    rng = np.random.default_rng(seed)
    return {
        "hidden": {"w": rng.normal(size=(FEATURES, HIDDEN)) * 0.5, "b": np.zeros(HIDDEN)},
        "out": {"w": rng.normal(size=(HIDDEN, CLASSES)) * 0.5, "b": np.zeros(CLASSES)},
    }


def gradients(p: Tree, x: np.ndarray, y: np.ndarray) -> Tree:
    """Gradient of the mean cross-entropy of a tanh MLP over (x, y)."""
    h = np.tanh(x @ p["hidden"]["w"] + p["hidden"]["b"])
    logits = h @ p["out"]["w"] + p["out"]["b"]
    prob = np.exp(logits - logits.max(axis=1, keepdims=True))
    prob /= prob.sum(axis=1, keepdims=True)
    d_logits = prob
    d_logits[np.arange(len(y)), y] -= 1
    d_logits /= len(y)
    d_h = (d_logits @ p["out"]["w"].T) * (1 - h * h)
    return {
        "hidden": {"w": x.T @ d_h, "b": d_h.sum(axis=0)},
        "out": {"w": h.T @ d_logits, "b": d_logits.sum(axis=0)},
    }


def sgd(p: Tree, g: Tree) -> None:
    for (_, param), (_, grad) in zip(named_leaves(p), named_leaves(g), strict=True):
        param -= LR * grad


def single_process_training() -> Tree:
    x, y = dataset()
    p = init_params(seed=0)
    for _ in range(ROUNDS):
        sgd(p, gradients(p, x, y))
    return p


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("how", ["allreduce_gradients", "GradientReducer"])
async def test_data_parallel_training_equals_single_process_training(n: int, how: str) -> None:
    x, y = dataset()
    strategies = p2pcoll.available_strategies()["allreduce"]

    async def worker(g: p2pcoll.Group) -> Tree:
        params = await training.broadcast_parameters(g, init_params(seed=g.rank), root=0)
        shard = slice(g.rank * SAMPLES // n, (g.rank + 1) * SAMPLES // n)  # equal shards
        reducer = training.GradientReducer(g, params, bucket_bytes=200, check_every=5)
        for step in range(ROUNDS):
            grads = gradients(params, x[shard], y[shard])
            strategy = strategies[step % len(strategies)]
            if how == "allreduce_gradients":
                grads = await training.allreduce_gradients(g, grads, bucket_bytes=200,
                                                           strategy=strategy)
            else:
                grads = await reducer.allreduce(grads)
            sgd(params, grads)
        await training.check_replicas(g, params)
        return params

    results = await run_ranks(n, worker, collective_timeout=TIMEOUT)
    reference = single_process_training()
    for name, want in named_leaves(reference):
        for params in results:
            got = dict(named_leaves(params))[name]
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=0, err_msg=name)
            assert same_bits(got, dict(named_leaves(results[0]))[name]), "replicas differ"


# --- broadcast_parameters ----------------------------------------------------------------------


async def test_broadcast_parameters_fills_the_callers_own_arrays() -> None:
    async def fn(g: p2pcoll.Group) -> tuple[Tree, Tree, float]:
        base = np.full((4, 3), float(g.rank))
        mine = {"w": np.full((2, 3), float(g.rank)), "t": base.T,   # .T: not contiguous
                "n": [np.array(g.rank, np.int32)], "x": float(g.rank)}
        out = await training.broadcast_parameters(g, mine, root=1)
        return mine, out, float(base[0, 0])

    for mine, out, base_value in await run_ranks(3, fn):
        assert out["w"] is mine["w"] and out["t"] is mine["t"] and out["n"][0] is mine["n"][0]
        np.testing.assert_array_equal(out["w"], np.full((2, 3), 1.0))
        np.testing.assert_array_equal(out["t"], np.full((3, 4), 1.0))
        assert base_value == 1.0, "the view's base was written through"
        assert out["n"][0] == 1 and out["n"][0].dtype == np.int32
        assert isinstance(out["x"], np.ndarray) and out["x"] == 1.0


async def test_broadcast_parameters_names_the_tensor_that_differs() -> None:
    async def fn(g: p2pcoll.Group) -> float:
        params = {"a": np.ones(3), "b": np.ones((2, 2) if g.rank != 2 else (2, 3))}
        with pytest.raises(p2pcoll.CollectiveMismatch, match=r"'b' is float64\[2, 2\] on rank 0 "
                                                             r"but float64\[2, 3\] on rank 2"):
            await training.broadcast_parameters(g, params)
        return float((await g.allreduce(np.ones(1)))[0])   # the group is still usable

    assert await run_ranks(3, fn, collective_timeout=TIMEOUT) == [3.0, 3.0, 3.0]


async def test_broadcast_parameters_refuses_read_only_arrays() -> None:
    async def fn(g: p2pcoll.Group) -> None:
        frozen = np.ones(3)
        frozen.flags.writeable = False
        if g.rank == 0:
            await training.broadcast_parameters(g, {"w": frozen})  # the root only reads
            await training.broadcast_parameters(g, {"w": np.ones(3)}, root=1)
        else:
            with pytest.raises(ValueError, match="'w' is read-only"):
                await training.broadcast_parameters(g, {"w": frozen})
            await training.broadcast_parameters(g, {"w": np.ones(3)})
            await training.broadcast_parameters(g, {"w": np.ones(3)}, root=1)

    await run_ranks(2, fn, collective_timeout=TIMEOUT)


# --- the checks --------------------------------------------------------------------------------


def params_of(rank: int) -> Tree:
    return {"layer": {"w": np.linspace(0, 1, 12).reshape(3, 4), "b": np.zeros(4, np.float32)},
            "head": np.ones(2)}


@pytest.mark.parametrize("bad", [{2: "layer.b"}, {1: "head", 2: "layer.w"}])
async def test_check_replicas_names_the_ranks_and_first_tensor(bad: dict[int, str]) -> None:
    async def fn(g: p2pcoll.Group) -> None:
        params = params_of(g.rank)
        await training.check_replicas(g, params)  # identical: returns None
        if g.rank in bad:
            leaf = dict(named_leaves(params))[bad[g.rank]]
            leaf.flat[1] = np.nextafter(leaf.flat[1], np.inf)  # one ulp
        await training.check_replicas(g, params)

    results = await each_rank(3, fn)
    first = min(bad)
    for exc in results:
        assert isinstance(exc, p2pcoll.ReplicaDivergence), exc
        assert exc.ranks == sorted(bad) and exc.tensor == bad[first]
        assert f"{bad[first]!r} holds different values on rank 0 and rank {first}" in str(exc)


async def test_check_replicas_reports_a_missing_tensor() -> None:
    async def fn(g: p2pcoll.Group) -> None:
        params = params_of(g.rank)
        if g.rank == 1:
            del params["head"]
        await training.check_replicas(g, params)

    for exc in await each_rank(2, fn):
        assert isinstance(exc, p2pcoll.ReplicaDivergence) and exc.ranks == [1]
        assert exc.tensor == "head" and "'head' is on rank 0 but not on rank 1" in str(exc)


async def test_reducer_compares_replicas_every_k_rounds() -> None:
    async def fn(g: p2pcoll.Group) -> int:
        params = params_of(0)
        reducer = training.GradientReducer(g, params, check_every=3)
        grads = {"layer": {"w": np.ones((3, 4)), "b": np.ones(4, np.float32)},
                 "head": np.ones(2)}
        for _ in range(8):
            try:
                out = await reducer.allreduce(grads)
            except p2pcoll.ReplicaDivergence as exc:
                assert exc.ranks == [1] and exc.tensor == "head"
                assert "(round 3)" in str(exc)
                return reducer._open.number if reducer._open else -1
            for name, param in named_leaves(params):
                param -= dict(named_leaves(out))[name]
            if g.rank == 1:
                params["head"][0] += 1e-3  # drifts after round 0; seen at round 3
        return -1

    assert await run_ranks(2, fn, collective_timeout=TIMEOUT) == [3, 3]


async def test_ranks_in_different_rounds_are_a_mismatch() -> None:
    async def fn(g: p2pcoll.Group) -> None:
        await training.allreduce_gradients(g, {"w": np.ones(2)}, round=4 + g.rank)

    for exc in await each_rank(2, fn):
        assert isinstance(exc, p2pcoll.CollectiveMismatch)
        assert "rank 0 in allreduce_gradients round 4, rank 1 in allreduce_gradients round 5" in (
            str(exc))


async def test_a_rank_that_skipped_a_round_is_caught_at_the_next() -> None:
    async def fn(g: p2pcoll.Group) -> None:
        if g.rank == 0:
            await training.allreduce_gradients(g, {})  # "nothing to do": still round 0
        await training.allreduce_gradients(g, {"w": np.ones(2)})

    for exc in await each_rank(2, fn):
        assert isinstance(exc, p2pcoll.CollectiveMismatch) and "round 1, rank 1" in str(exc)


async def test_another_training_call_at_the_same_point_is_a_mismatch() -> None:
    async def fn(g: p2pcoll.Group) -> None:
        if g.rank == 0:
            await training.check_replicas(g, {"w": np.ones(2)})
        else:
            await training.allreduce_gradients(g, {"w": np.ones(2)})

    for exc in await each_rank(2, fn):
        assert isinstance(exc, p2pcoll.CollectiveMismatch)
        assert "rank 0 in check_replicas, rank 1 in allreduce_gradients round 0" in str(exc)


MISMATCHES: dict[str, tuple[dict[str, np.ndarray], str]] = {
    "shape": ({"b": np.ones(3)}, r"'b' is float64\[4\] on rank 0 but float64\[3\] on rank 2"),
    "dtype": ({"b": np.ones(4, np.float32)}, r"'b' is float64\[4\] on rank 0 but float32\[4\]"),
    "name": ({"c": np.ones(4)}, r"'b' is on rank 0 but not on rank 2"),
    "extra": ({"z": np.ones(1)}, r"'z' is on rank 2 only"),
}


@pytest.mark.parametrize("case", sorted(MISMATCHES))
async def test_gradient_mismatch_names_the_first_tensor_on_every_rank(case: str) -> None:
    change, words = MISMATCHES[case]

    async def fn(g: p2pcoll.Group) -> float:
        grads: dict[str, np.ndarray] = {"a": np.ones((2, 2)), "b": np.ones(4)}
        if g.rank == 2:
            if case == "name":
                del grads["b"]
            grads.update(change)
        with pytest.raises(p2pcoll.CollectiveMismatch, match=words) as info:
            await training.allreduce_gradients(g, grads, bucket_bytes=1 << 10)
        assert "ranks [2] disagree with rank 0" in str(info.value)
        return float((await g.allreduce(np.ones(1)))[0])   # no garbage, no broken group

    assert await run_ranks(3, fn, collective_timeout=TIMEOUT) == [3.0, 3.0, 3.0]


@pytest.mark.parametrize(("setting", "value", "words"), [
    ("op", "sum", "op is 'avg' on rank 0 but 'sum' on rank 1"),
    ("bucket_bytes", 8, "bucket_bytes is 64 on rank 0 but 8 on rank 1"),
])
async def test_settings_that_shape_the_buckets_must_agree(setting: str, value: Any,
                                                          words: str) -> None:
    async def fn(g: p2pcoll.Group) -> None:
        kwargs: dict[str, Any] = {"op": "avg", "bucket_bytes": 64}
        if g.rank == 1:
            kwargs[setting] = value
        await training.allreduce_gradients(g, {"a": np.ones(4), "b": np.ones(4)}, **kwargs)

    for exc in await each_rank(2, fn):
        assert isinstance(exc, p2pcoll.CollectiveMismatch) and words in str(exc)


async def test_nan_or_inf_in_the_result_is_reported_by_name() -> None:
    async def fn(g: p2pcoll.Group) -> Tree:
        grads: dict[str, np.ndarray] = {"ok": np.ones(3), "bad": np.ones(4, np.float32),
                                        "n": np.arange(2)}
        if g.rank == 1:
            grads["bad"][2] = np.nan
            grads["ok"][0] = np.inf
        with pytest.raises(FloatingPointError, match=r"'ok' \(1 of 3 values\)") as info:
            await training.allreduce_gradients(g, grads, "sum")
        assert isinstance(info.value, training.NonFiniteGradients)
        assert info.value.round == 0 and sorted(info.value.tensors) == ["bad", "ok"]
        await training.allreduce_gradients(g, grads, "sum", nonfinite="warn")
        return await training.allreduce_gradients(g, grads, "sum", nonfinite="ignore")

    # One catch_warnings around both ranks: the filters it swaps are global, not per task.
    with pytest.warns(RuntimeWarning) as record:
        results = await run_ranks(2, fn, collective_timeout=TIMEOUT)
    assert len(record) == 2
    for warning in record:
        assert "round 1 hold NaN or Inf" in str(warning.message)
        assert "'bad' (1 of 4 values)" in str(warning.message)
        assert warning.filename == __file__, "the warning points at the caller"
    for out in results:
        assert np.isnan(out["bad"][2]) and np.isinf(out["ok"][0])


# --- overlap -------------------------------------------------------------------------------------


async def test_full_buckets_are_reduced_while_later_gradients_are_still_coming() -> None:
    layers = [f"layer{i}" for i in range(4)]

    async def fn(g: p2pcoll.Group) -> tuple[list[int], Tree]:
        params = {name: np.zeros(256) for name in layers}        # 2 KiB each
        reducer = training.GradientReducer(g, params, bucket_bytes=4096, timeout=TIMEOUT)
        started = []
        async with reducer.start_round() as rnd:
            for name in reversed(layers):                         # the backward pass
                rnd.add(name, np.full(256, float(g.rank + layers.index(name))))
                await asyncio.sleep(0.05)                         # "computing" the next one
                started.append(g.stats()["collectives"])
            grads = await rnd.wait()
        return started, grads

    for started, grads in await run_ranks(2, fn):
        # header at once; layers 3+2 fill bucket 0, whose allreduce starts before layer 1 exists
        assert started[0] == 1 and started[1] == 2 and started[3] == 3
        for i, name in enumerate(layers):
            np.testing.assert_array_equal(grads[name], np.full(256, i + 0.5))
        assert list(grads) == layers


async def test_a_failed_round_raises_its_error_at_the_next_add() -> None:
    async def fn(g: p2pcoll.Group) -> None:
        reducer = training.GradientReducer(g, {"a": np.zeros(2), "b": np.zeros(3)})
        if g.rank == 0:
            await training.allreduce_gradients(g, {"a": np.zeros(2), "b": np.zeros(3)})
            return
        async with reducer.start_round() as rnd:
            await asyncio.sleep(0.2)  # the header exchange fails meanwhile
            with pytest.raises(p2pcoll.CollectiveMismatch,
                               match="rank 0 in allreduce_gradients round 0, "
                                     "rank 1 in a GradientReducer round 0"):
                rnd.add("a", np.zeros(2))

    results = await each_rank(2, fn)
    assert isinstance(results[0], p2pcoll.CollectiveMismatch) and results[1] is None


async def test_round_misuse_is_refused() -> None:
    async def fn(g: p2pcoll.Group) -> None:
        reducer = training.GradientReducer(g, {"a": np.zeros(2), "b": np.zeros(3)},
                                           bucket_bytes=0)
        async with reducer.start_round() as rnd:
            with pytest.raises(training.RoundError, match="round 0 is still open"):
                reducer.start_round()
            with pytest.raises(ValueError, match="'c' is not one of"):
                rnd.add("c", np.zeros(2))
            with pytest.raises(ValueError, match=r"'a' is float64\[3\], expected float64\[2\]"):
                rnd.add("a", np.zeros(3))
            rnd.add("a", np.zeros(2))
            with pytest.raises(ValueError, match="already added"):
                rnd.add("a", np.zeros(2))
            rnd.add("b", np.ones(3))
            grads = await rnd.wait()
        np.testing.assert_array_equal(grads["b"], np.ones(3))
        with pytest.raises(ValueError, match="order must list every"):
            training.GradientReducer(g, {"a": np.zeros(2)}, order=["a", "b"])

    await run_ranks(2, fn, collective_timeout=TIMEOUT)


async def test_reducer_buckets_follow_the_backward_pass_of_a_listed_model() -> None:
    # The default order is the parameters as listed, reversed, even past ten layers, where
    # the leaf order ("10" before "2") would not be the order a backward pass produces.
    async def fn(g: p2pcoll.Group) -> list[str]:
        params = {f"{i}.weight": np.zeros(4) for i in range(12)}
        reducer = training.GradientReducer(g, params, bucket_bytes=0)
        return [spec.name for spec in reducer.plan.specs]

    (names,) = await run_ranks(1, fn)
    assert names == [f"{i}.weight" for i in reversed(range(12))]


# --- torch tensors ---------------------------------------------------------------------------


async def test_cpu_torch_tensors_are_used_in_place() -> None:
    import torch  # CI installs the torch extra: this must not skip

    async def fn(g: p2pcoll.Group) -> None:
        model = torch.nn.Linear(3, 2)
        torch.manual_seed(g.rank)
        torch.nn.init.normal_(model.weight)
        params = dict(model.named_parameters())
        out = await training.broadcast_parameters(g, params)
        assert out["weight"] is model.weight
        await training.check_replicas(g, params)
        model(torch.full((4, 3), float(g.rank + 1))).sum().backward()
        grads = {name: p.grad for name, p in model.named_parameters()}
        reduced = await training.allreduce_gradients(g, grads)
        assert isinstance(reduced["weight"], torch.Tensor)
        torch.testing.assert_close(reduced["bias"], torch.full((2,), 4.0))  # mean of 4 and 4
        torch.testing.assert_close(reduced["weight"], torch.full((2, 3), 6.0))  # of 4 and 8

    await run_ranks(2, fn, collective_timeout=TIMEOUT)
