"""Codecs in p2pcoll.training: allreduce_gradients and GradientReducer with ``codec=``, error
feedback, the codec in the agreement header, NaN under int8, and coded reductions in flight
together keeping their order on every rank. All over real peers on loopback."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest

import p2pcoll
from p2pcoll import training
from p2pcoll.codecs import BLOCK, reduce_coded
from p2pcoll.testing import run_ranks
from p2pcoll.types import CustomOp

TIMEOUT = 10.0


async def each_rank(n: int, fn: Callable[[p2pcoll.Group], Awaitable[Any]]) -> list[Any]:
    return await run_ranks(n, fn, return_exceptions=True, collective_timeout=TIMEOUT)


def same_bits(arrays: list[np.ndarray]) -> bool:
    return all(a.dtype == arrays[0].dtype and a.tobytes() == arrays[0].tobytes()
               for a in arrays)


def grads_of(rank: int) -> dict[str, np.ndarray]:
    """A small model's gradients: tensors of different scales, one of them float64."""
    rng = np.random.default_rng(rank)
    return {"layer1.w": (rng.standard_normal((40, 60)) * 0.01).astype(np.float32),
            "layer1.b": (rng.standard_normal(60) * 3).astype(np.float32),
            "layer2.w": rng.standard_normal((3000,)).astype(np.float64),
            "scale": np.float32(rng.standard_normal())}


def exact_mean(p: int) -> dict[str, np.ndarray]:
    per = [grads_of(r) for r in range(p)]
    return {k: np.mean([np.asarray(g[k], np.float64) for g in per], axis=0) for k in per[0]}


@pytest.mark.parametrize("codec", ["fp16", "bf16", "int8"])
async def test_error_feedback_delivers_every_gradient_over_rounds(codec: str) -> None:
    """The same gradients every round. int8's sums are exact, so with error feedback the
    sum of the results over K rounds is off from K times the exact mean by about one
    round's error (the last residual), where without it the error grows K times (12x
    smaller here). fp16 and bf16 also round their partial sums, which error feedback (of
    each rank's own encoding) does not see: their error is still smaller with it (about
    half here). Every round, every rank, the same bits."""
    p, rounds = 3, 12

    async def fn(g: p2pcoll.Group) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        fed, plain = [], []
        for _ in range(rounds):
            fed.append(await training.allreduce_gradients(g, grads_of(g.rank), codec=codec,
                                                          bucket_bytes=8192))
        for _ in range(rounds):
            plain.append(await training.allreduce_gradients(
                g, grads_of(g.rank), codec=codec, bucket_bytes=8192, error_feedback=False))
        return fed, plain

    results = await each_rank(p, fn)
    exact = exact_mean(p)
    for name, want in exact.items():
        fed = [np.sum([np.asarray(r[name], np.float64) for r in res[0]], axis=0)
               for res in results]
        plain = np.sum([np.asarray(r[name], np.float64) for r in results[0][1]], axis=0)
        for k in range(rounds):
            assert same_bits([np.asarray(res[0][k][name]) for res in results])
            assert same_bits([np.asarray(res[1][k][name]) for res in results])
        one_round = np.max(np.abs(np.asarray(results[0][1][0][name], np.float64) - want))
        fed_error = np.max(np.abs(fed[0] - rounds * want))
        plain_error = np.max(np.abs(plain - rounds * want))
        if codec == "int8":  # exact sums: only the last residual is missing
            assert fed_error <= 2 * one_round + 1e-12, (name, fed_error, one_round)
        if one_round > 0:
            assert fed_error < plain_error, (name, fed_error, plain_error)
    assert results[0][0][0]["layer2.w"].dtype == np.float64
    assert np.asarray(results[0][0][0]["scale"]).shape == ()


async def test_reducer_with_a_codec_and_many_buckets() -> None:
    """Many small buckets in flight at once under int8 (two collectives each): every rank
    gets the same bits as allreduce_gradients with the same codec gives."""
    p = 4

    async def fn(g: p2pcoll.Group) -> tuple[list[Any], list[Any]]:
        reducer = training.GradientReducer(g, grads_of(g.rank), codec="int8", bucket_bytes=4096)
        mine = [await reducer.allreduce(grads_of(g.rank)) for _ in range(3)]
        free = [await training.allreduce_gradients(g, grads_of(g.rank), codec="int8",
                                                   bucket_bytes=4096) for _ in range(3)]
        return mine, free

    results = await each_rank(p, fn)
    exact = exact_mean(p)
    for k in range(3):
        for name in exact:
            assert same_bits([np.asarray(r[0][k][name]) for r in results])
    for name, want in exact.items():
        got = np.asarray(results[0][0][0][name], np.float64)
        # First round, no residual yet: int8's bound for an average, s/2 per element.
        m = max(np.max(np.abs(grads_of(r)[name])) for r in range(p))
        assert np.max(np.abs(got - want)) <= m / (127 // p) / 2 * 1.001 + 1e-6, name


async def test_codec_traffic_in_training() -> None:
    p = 4

    async def fn(g: p2pcoll.Group) -> dict[str | None, int]:
        sent = {}
        grads = {"w": np.random.default_rng(g.rank).standard_normal(200_000).astype(np.float32)}
        for codec in (None, "fp16", "int8"):
            before = g.stats()["bytes_sent"]
            await training.allreduce_gradients(g, grads, codec=codec, strategy="ring")
            sent[codec] = g.stats()["bytes_sent"] - before
        return sent

    results = await each_rank(p, fn)
    total = {c: sum(r[c] for r in results) for c in results[0]}
    # The agreement header (48 bytes a rank) travels in every round, codec or not.
    assert total[None] / total["fp16"] == pytest.approx(2, rel=0.01)
    assert total[None] / total["int8"] == pytest.approx(4 / (1 + 4 / BLOCK), rel=0.01)


async def test_ranks_that_disagree_on_the_codec_are_told_before_anything_moves() -> None:
    async def fn(g: p2pcoll.Group) -> tuple[BaseException | None, Any]:
        try:
            await training.allreduce_gradients(g, grads_of(g.rank),
                                               codec="int8" if g.rank == 1 else None)
            error = None
        except p2pcoll.CollectiveMismatch as exc:
            error = exc
        # No gradient moved: the next round goes on.
        return error, await training.allreduce_gradients(g, grads_of(g.rank), codec="fp16")

    results = await each_rank(3, fn)
    for error, after in results:
        assert isinstance(error, p2pcoll.CollectiveMismatch)
        assert "codec is None on rank 0 but 'int8' on rank 1" in str(error)
        assert set(after) == {"layer1.w", "layer1.b", "layer2.w", "scale"}

    async def reducers(g: p2pcoll.Group) -> Any:
        reducer = training.GradientReducer(g, grads_of(g.rank),
                                           codec="fp16" if g.rank else "bf16")
        return await reducer.allreduce(grads_of(g.rank))

    for r in await each_rank(2, reducers):
        assert isinstance(r, p2pcoll.CollectiveMismatch)
        assert "codec is 'bf16' on rank 0 but 'fp16' on rank 1" in str(r)


async def test_nan_under_int8_is_nonfinite_gradients_on_every_rank() -> None:
    async def fn(g: p2pcoll.Group) -> tuple[Any, ...]:
        grads = grads_of(g.rank)
        if g.rank == 2:
            grads["layer1.b"][7] = np.nan
        try:
            await training.allreduce_gradients(g, grads, codec="int8", bucket_bytes=4096)
            raised = None
        except training.NonFiniteGradients as exc:
            raised = exc
        warned = await training.allreduce_gradients(g, grads, codec="int8",
                                                    nonfinite="ignore")
        reducer = training.GradientReducer(g, grads, codec="int8")
        try:
            await reducer.allreduce(grads)
            from_reducer = None
        except training.NonFiniteGradients as exc:
            from_reducer = exc
        # Every rank ran the same collectives: the group is usable and agrees.
        after = await training.allreduce_gradients(g, grads_of(g.rank), codec="int8")
        return raised, warned, from_reducer, after

    results = await each_rank(3, fn)
    for raised, warned, from_reducer, after in results:
        for exc in (raised, from_reducer):
            assert isinstance(exc, training.NonFiniteGradients), exc
            assert exc.tensors == ["layer1.b"] and "'int8'" in str(exc)
        # "ignore": the refused block is NaN on every rank, the other tensors are reduced.
        assert np.isnan(warned["layer1.b"]).all() and np.isfinite(warned["layer1.w"]).all()
        assert np.isfinite(after["layer1.b"]).all()
    assert same_bits([r[3]["layer1.w"] for r in results])
    assert same_bits([r[1]["layer1.b"] for r in results])


async def test_bad_codec_arguments_name_what_is_wrong() -> None:
    async def fn(g: p2pcoll.Group) -> list[str]:
        seen = []
        cases: list[tuple[type[BaseException], Callable[[], Awaitable[Any]]]] = [
            (TypeError, lambda: training.allreduce_gradients(
                g, {"steps": np.ones(3, np.int64)}, "sum", codec="int8")),
            (ValueError, lambda: training.allreduce_gradients(
                g, grads_of(0), "max", codec="int8")),
            (ValueError, lambda: training.allreduce_gradients(g, grads_of(0), codec="zip")),
            (ValueError, lambda: training.allreduce_gradients(
                g, grads_of(0), CustomOp("x", lambda a, b: None), codec="fp16")),
        ]
        for error, call in cases:
            with pytest.raises(error) as info:
                await call()
            seen.append(str(info.value))
        with pytest.raises(TypeError) as info:
            training.GradientReducer(g, {"mask": np.ones(3, bool)}, "sum", codec="fp16")
        seen.append(str(info.value))
        return seen

    messages = (await each_rank(1, fn))[0]
    assert "'steps'" in messages[0] and "int64" in messages[0] and "'int8'" in messages[0]
    assert "'int8'" in messages[1] and "'max'" in messages[1]
    assert "'zip'" in messages[2] and "'int8'" in messages[2]
    assert "CustomOp" in messages[3]
    assert "'mask'" in messages[4] and "bool" in messages[4] and "'fp16'" in messages[4]


class Delayed:
    """A group whose scale allreduces return after a delay that depends on the rank and
    the call, so their scales arrive in another order on every rank."""

    def __init__(self, group: p2pcoll.Group) -> None:
        self.group = group
        self.calls = 0

    @property
    def world_size(self) -> int:
        return self.group.world_size

    @property
    def turns(self) -> Any:
        return self.group.turns

    @property
    def rank(self) -> int:
        return self.group.rank

    async def allreduce(self, value: Any, op: Any = "sum", **kw: Any) -> Any:
        result = self.group.allreduce(value, op, **kw)
        if isinstance(op, CustomOp) and op.name.endswith("statistics-max"):
            k = self.calls
            self.calls += 1
            got = await result
            await asyncio.sleep(0.02 * ((k + self.rank) % 3))
            return got
        return await result

    async def reduce(self, *a: Any, **kw: Any) -> Any:
        return await self.group.reduce(*a, **kw)

    async def reduce_scatter(self, *a: Any, **kw: Any) -> Any:
        return await self.group.reduce_scatter(*a, **kw)


async def test_coded_reductions_in_flight_together_keep_their_order() -> None:
    """Six int8 reductions of different sizes started together: whatever order their
    scales come back in, each rank starts their data collectives in the order they were
    started, so each result is its own array's sum."""
    p = 3
    sizes = [100, 5000, 100, 2048, 7, 5000]

    def arrays(rank: int) -> list[np.ndarray]:
        return [np.full(n, float(rank + 1 + i), np.float32) for i, n in enumerate(sizes)]

    async def fn(g: p2pcoll.Group) -> list[np.ndarray]:
        slow = Delayed(g)
        done = await asyncio.gather(*(reduce_coded(slow, "int8", [a], "sum")
                                      for a in arrays(g.rank)))
        return [d[0] for d in done if d is not None]

    results = await each_rank(p, fn)
    for i, n in enumerate(sizes):
        want = sum(float(r + 1 + i) for r in range(p))
        for r in results:
            assert r[i].shape == (n,)
            np.testing.assert_allclose(r[i], want, rtol=0.02)
        assert same_bits([r[i] for r in results])


async def test_nan_under_int8_with_warn_names_the_tensor() -> None:
    async def fn(g: p2pcoll.Group) -> Any:
        grads = grads_of(g.rank)
        grads["layer2.w"][-1] = np.inf * (g.rank - 0.5)
        return await training.allreduce_gradients(g, grads, codec="int8", nonfinite="warn")

    with pytest.warns(RuntimeWarning, match="'layer2.w'") as caught:
        results = await each_rank(2, fn)
    assert len(caught) == 2  # one per rank
    for r in results:
        tail = r["layer2.w"][-(3000 % BLOCK):]  # the last block, refused
        assert np.isnan(tail).all() and np.isfinite(r["layer2.w"][:2 * BLOCK]).all()
    assert same_bits([r["layer2.w"] for r in results])


async def test_plain_collectives_started_meanwhile_keep_their_place() -> None:
    """Plain collectives started while int8 reductions wait for their (delayed) scales
    start after them, in the order they were started, on every rank."""
    p = 3

    async def fn(g: p2pcoll.Group) -> list[Any]:
        slow = Delayed(g)
        x = np.full(3000, g.rank + 1.0, np.float32)
        return list(await asyncio.gather(
            reduce_coded(slow, "int8", [x], "sum"),
            g.allreduce(np.array([g.rank], np.int64)),
            reduce_coded(slow, "int8", [x[:10]], "avg"),
            g.broadcast(np.arange(5) if g.rank == 1 else None, root=1),
            reduce_coded(slow, "fp16", [x[:7]], "sum"),
            g.allgather(np.array([g.rank * 10])),
            reduce_coded(slow, "int8", [x[:2000]], "sum"),
            g.barrier(),
        ))

    for r in await each_rank(p, fn):
        assert np.allclose(r[0][0], 6.0, rtol=0.02) and r[0][0].shape == (3000,)
        assert r[1].tolist() == [3]
        assert np.allclose(r[2][0], 2.0, rtol=0.02) and r[2][0].shape == (10,)
        assert r[3].tolist() == [0, 1, 2, 3, 4]
        assert r[4][0].tolist() == [6.0] * 7
        assert [a.tolist() for a in r[5]] == [[0], [10], [20]]
        assert np.allclose(r[6][0], 6.0, rtol=0.02) and r[6][0].shape == (2000,)


class LateScales(Delayed):
    """Rank 1's scales come back late (once ``go`` is set), rank 0's at once."""

    def __init__(self, group: p2pcoll.Group) -> None:
        super().__init__(group)
        self.back = asyncio.Event()  # rank 1's scales are here, held back
        self.go = asyncio.Event()

    async def allreduce(self, value: Any, op: Any = "sum", **kw: Any) -> Any:
        got = await self.group.allreduce(value, op, **kw)
        if isinstance(op, CustomOp) and op.name.endswith("statistics-max") and self.rank:
            self.back.set()
            await self.go.wait()
        return got


@pytest.mark.parametrize("strategy", [None, "ring"])
async def test_a_collective_started_while_the_scales_are_out_waits_its_turn(
        strategy: str | None) -> None:
    """An allreduce started during an int8 reduction: rank 0 (20 ms after it) has started
    the int8 data collective by then, rank 1 (its scales held back until the allreduce has
    had 60 ms to run ahead) has not. Without the session's turns the allreduce would take rank 1's next sequence number before the data does, and the two
    ranks would pair different collectives; with them it waits, and both results are
    right (the default path puts both on the board, "ring" sends messages)."""

    async def fn(g: p2pcoll.Group) -> list[Any]:
        slow = LateScales(g)
        x = np.full(4096, g.rank + 1.0, np.float32)

        async def later() -> Any:
            ones = np.array([g.rank + 1.0] * 3)
            if g.rank == 0:
                await asyncio.sleep(0.02)
                return await g.allreduce(ones, strategy=strategy)
            await slow.back.wait()
            assert g.turns.busy  # rank 1's int8 call still holds its turn
            task = asyncio.ensure_future(g.allreduce(ones, strategy=strategy))
            await asyncio.sleep(0.06)  # the time it has to run ahead of the data
            slow.go.set()
            return await task

        return list(await asyncio.gather(
            reduce_coded(slow, "int8", [x], "sum", strategy=strategy), later()))

    for coded, plain in await each_rank(2, fn):
        assert np.allclose(coded[0], 3.0, rtol=0.02)
        assert plain.tolist() == [3.0] * 3
