"""Prepared programs give the same bits as programs built afresh for every call.

Random sequences of calls (collectives, shapes, dtypes, strategies, ``out=`` reuse, shape
changes between calls, collectives in flight together) run twice on the in-memory
transport: once as users get it (a call's program is built on its first call and looked up
after), once with every rank's programs dropped before each call. Every result must be the
same bits. Mismatched calls still fail with a CollectiveMismatch naming the field when
the cache is warm on some ranks and cold on others.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import p2pcoll
from p2pcoll.testing import memory_groups

P = 3
SHAPES = [(5,), (7, 3), (1,), (), (64,)]
DTYPES = ["float32", "float64", "int32", "int64"]
ALLREDUCE = [None, "ring", "recursive_doubling", "rabenseifner", "reduce_broadcast"]

call = st.one_of(
    st.tuples(st.just("allreduce"), st.sampled_from(SHAPES), st.sampled_from(DTYPES),
              st.sampled_from(["sum", "max", "min"]), st.sampled_from(ALLREDUCE),
              st.booleans()),
    st.tuples(st.just("reduce"), st.sampled_from(SHAPES), st.sampled_from(DTYPES),
              st.integers(0, P - 1)),
    st.tuples(st.just("broadcast"), st.sampled_from(SHAPES), st.sampled_from(DTYPES),
              st.integers(0, P - 1), st.sampled_from([None, "binomial", "root"])),
    st.tuples(st.just("allgather"), st.sampled_from(SHAPES[:3]), st.sampled_from(DTYPES)),
    st.tuples(st.just("reduce_scatter"), st.sampled_from([(6,), (7, 2)]),
              st.sampled_from(DTYPES)),
    st.tuples(st.just("barrier")),
)
# A step is one call, or several started together.
step = st.one_of(call.map(lambda c: [c]), st.lists(call, min_size=2, max_size=3))


def _data(shape: tuple[int, ...], dtype: str, rank: int, i: int) -> np.ndarray:
    rng = np.random.default_rng(1000 * i + rank)
    if np.dtype(dtype).kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    return rng.integers(-50, 50, size=shape).astype(dtype)


async def _one(g: p2pcoll.Group, c: tuple[Any, ...], i: int, outs: dict[Any, Any]) -> Any:
    kind = c[0]
    if kind == "allreduce":
        _, shape, dtype, op, strategy, reuse = c
        x = _data(shape, dtype, g.rank, i)
        if reuse:  # out= reused across calls of one shape: the program keeps the key
            out = outs.setdefault((shape, dtype), np.empty(shape, dtype))
            return (await g.allreduce(x, op, strategy=strategy, out=out)).copy()
        return await g.allreduce(x, op, strategy=strategy)
    if kind == "reduce":
        _, shape, dtype, root = c
        return await g.reduce(_data(shape, dtype, g.rank, i), root=root)
    if kind == "broadcast":
        _, shape, dtype, root, strategy = c
        value = _data(shape, dtype, g.rank, i) if g.rank == root else None
        return await g.broadcast(value, root=root, strategy=strategy)
    if kind == "allgather":
        _, shape, dtype = c
        return await g.allgather(_data(shape, dtype, g.rank, i))
    if kind == "reduce_scatter":
        _, shape, dtype = c
        return await g.reduce_scatter(_data(shape, dtype, g.rank, i))
    await g.barrier()
    return None


async def _run(steps: list[list[tuple[Any, ...]]], cold: bool) -> list[list[Any]]:
    groups = await memory_groups(P)
    try:
        async def rank(g: p2pcoll.Group) -> list[Any]:
            outs: dict[Any, Any] = {}
            results = []
            for i, calls in enumerate(steps):
                if cold:
                    g.session.runner.programs.clear()
                results.append(await asyncio.gather(
                    *(_one(g, c, 10 * i + j, outs) for j, c in enumerate(calls))))
            return results

        return list(await asyncio.gather(*(rank(g) for g in groups)))
    finally:
        await asyncio.gather(*(g.close() for g in groups))


def _bits(value: Any) -> Any:
    if value is None:
        return None
    if isinstance(value, list):
        return [_bits(v) for v in value]
    a = np.asarray(value)
    return (a.dtype.str, a.shape, a.tobytes())


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(step, min_size=1, max_size=6))
def test_prepared_programs_give_the_bits_of_fresh_ones(steps: list[list[Any]]) -> None:
    warm = asyncio.run(_run(steps, cold=False))
    cold = asyncio.run(_run(steps, cold=True))
    assert _bits(warm) == _bits(cold)
    # The programs were reused: a repeated key costs a lookup (checked on rank 0's runner
    # in test_programs_are_built_once_per_key).


async def test_programs_are_built_once_per_key_and_bounded() -> None:
    groups = await memory_groups(2)
    try:
        async def rank(g: p2pcoll.Group) -> int:
            x = np.ones(10, np.float32)
            for _ in range(5):
                await g.allreduce(x, strategy="ring")
            await g.allreduce(np.ones(11, np.float32), strategy="ring")  # another shape
            await g.allreduce(x, strategy="recursive_doubling")  # another strategy
            return len(g.session.runner.programs)

        assert await asyncio.gather(*(rank(g) for g in groups)) == [3, 3]
    finally:
        await asyncio.gather(*(g.close() for g in groups))


@pytest.mark.parametrize("field, other", [
    ("data", lambda x: x.astype(np.float64)),
    ("op", None),
])
async def test_a_mismatch_is_named_with_warm_and_cold_caches(field: str, other: Any) -> None:
    groups = await memory_groups(P, collective_timeout=10)
    try:
        async def rank(g: p2pcoll.Group) -> str:
            x = np.ones(8, np.float32)
            if g.rank != 2:  # ranks 0 and 1 warm their cache for this key
                for _ in range(3):
                    await g.allreduce(x, strategy="ring")
            else:
                g.session.runner.programs.clear()  # rank 2 is cold
                for _ in range(3):
                    await g.allreduce(x, strategy="ring")
                g.session.runner.programs.clear()
            with pytest.raises(p2pcoll.CollectiveMismatch) as info:
                if g.rank == 2 and other is not None:
                    await g.allreduce(other(x), strategy="ring")
                elif g.rank == 2:
                    await g.allreduce(x, op="max", strategy="ring")
                else:
                    await g.allreduce(x, strategy="ring")
            return str(info.value)

        for message in await asyncio.gather(*(rank(g) for g in groups)):
            assert f"{field}:" in message or "did not expect" in message, message
    finally:
        await asyncio.gather(*(g.close() for g in groups))
