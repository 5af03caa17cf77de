"""A repeated call takes the one path every call takes (:meth:`Runner.run`), its program
looked up by its key: what changes between repeats (an array reshaped or retyped in place,
the op, a CustomOp's function) is never served from a stale program, and every rule still
holds on a repeat: flight rows, stats, mismatches and deadlines.

Real peers: tasks of this process over ipc, so they share the host and small reductions go
on the shared-memory board; one test sends them as messages (``strategy="ring"``).
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

import p2pcoll
from p2pcoll.testing import run_ranks

P = 3
WARM = 5  # repeats before the change: the program is prepared and looked up


def _ran(g: p2pcoll.Group, collective: str) -> dict[str, int]:
    return dict(g.stats()["collectives_by_strategy"].get(collective, {}))


async def test_an_array_reshaped_or_retyped_in_place_is_prepared_again() -> None:
    async def fn(g: p2pcoll.Group) -> Any:
        x = np.full(32, g.rank + 1, np.float32)
        for _ in range(WARM):
            x[:] = g.rank + 1
            await g.allreduce(x, out=x)
        programs = len(g.session.runner.programs)
        x[:] = g.rank + 1
        x.shape = (4, 8)  # the same object, another shape: the key must see it
        shaped = (await g.allreduce(x, out=x)).copy()
        x.shape = (32,)
        x.dtype = np.int32  # the same bytes, another dtype (same item size)
        x[:] = g.rank + 1
        retyped = (await g.allreduce(x, out=x)).copy()
        x[:] = g.rank + 1
        biggest = (await g.allreduce(x, "max", out=x)).copy()  # another op, same arrays
        rows = g.flight_record()[-3:]
        return shaped, retyped, biggest, len(g.session.runner.programs) - programs, rows

    for shaped, retyped, biggest, new, rows in await run_ranks(P, fn, transport="ipc"):
        assert shaped.shape == (4, 8) and shaped.dtype == np.float32
        assert np.array_equal(shaped, np.full((4, 8), 6, np.float32))
        assert retyped.dtype == np.int32 and np.array_equal(retyped, np.full(32, 6, np.int32))
        assert np.array_equal(biggest, np.full(32, 3, np.int32))
        assert new == 3  # one program per changed key, none served stale
        assert [(r["dtype"], r["shapes"], r["strategy"]) for r in rows] == [
            ("float32", [[4, 8]], "shm"), ("int32", [[32]], "shm"), ("int32", [[32]], "shm")]


@pytest.mark.parametrize("strategy", [None, "ring"])  # the board, and messages
async def test_custom_ops_of_one_name_each_fold_with_their_own_function(
        strategy: str | None) -> None:
    # One name, so one key and one prepared program: the function is the call's own.
    def bigger(mine: np.ndarray, incoming: np.ndarray) -> None:
        np.maximum(mine, incoming, out=mine)

    def smaller(mine: np.ndarray, incoming: np.ndarray) -> None:
        np.minimum(mine, incoming, out=mine)

    async def fn(g: p2pcoll.Group) -> Any:
        x = np.arange(8, dtype=np.float64) * (g.rank + 1)
        got = []
        for fold in (bigger, bigger, smaller, smaller, bigger):
            got.append(await g.allreduce(x, p2pcoll.CustomOp("pick", fold),
                                         strategy=strategy))
        return got

    x = np.arange(8, dtype=np.float64)
    high, low = x * P, x
    for got in await run_ranks(P, fn, transport="ipc"):
        for result, want in zip(got, (high, high, low, low, high), strict=True):
            assert np.array_equal(result, want)


async def test_every_repeat_is_counted_and_recorded() -> None:
    calls = 40

    async def fn(g: p2pcoll.Group) -> Any:
        x = np.ones(1024, np.float32)
        before = _ran(g, "allreduce").get("shm", 0)
        first = g.session.seq
        for _ in range(calls):
            await g.allreduce(x, out=x)
        rows = [r for r in g.flight_record() if r["seq"] >= first]
        seconds = g.stats()["collective_seconds"]["allreduce"]
        return _ran(g, "allreduce")["shm"] - before, rows, seconds, x

    for counted, rows, seconds, x in await run_ranks(P, fn, transport="ipc"):
        assert counted == calls and seconds["count"] >= calls and seconds["sum"] > 0
        assert [r["seq"] for r in rows] == list(range(rows[0]["seq"], rows[0]["seq"] + calls))
        assert {(r["collective"], r["strategy"], r["state"], r["bytes"]) for r in rows} == {
            ("allreduce", "shm", "done", 4096)}
        assert np.array_equal(x, np.full(1024, P ** calls, np.float32))


@pytest.mark.parametrize("change", ["shape", "op", "dtype"])
async def test_a_repeat_that_one_rank_changes_is_a_mismatch_on_every_rank(
        change: str) -> None:
    async def fn(g: p2pcoll.Group) -> Any:
        x = np.ones(16, np.float32)
        for _ in range(WARM):
            await g.allreduce(x)
        op = "sum"
        if g.rank == 1:
            if change == "shape":
                x = np.ones(8, np.float32)
            elif change == "dtype":
                x = np.ones(16, np.int32)  # the same bytes as the others' float32
            else:
                op = "max"
        await g.allreduce(x, op, timeout=20)

    results = await run_ranks(P, fn, transport="ipc", return_exceptions=True)
    assert all(isinstance(r, p2pcoll.CollectiveMismatch) for r in results), results


async def test_a_repeat_past_its_deadline_is_a_timeout_and_counted() -> None:
    timed_out: list[int] = []
    both = asyncio.Event()

    async def fn(g: p2pcoll.Group) -> Any:
        x = np.ones(16, np.float32)
        for _ in range(WARM):
            await g.allreduce(x)
        if g.rank == 2:  # never comes to the sixth, and stays until the others are done
            await both.wait()
            return None
        try:
            await g.allreduce(x, timeout=0.5)
        except p2pcoll.CollectiveTimeout as exc:
            timed_out.append(g.rank)
            if len(timed_out) == 2:
                both.set()
            return exc, g.stats()["errors_by_type"], g.flight_record()[-1]["state"]
        return None

    results = await run_ranks(P, fn, transport="ipc", return_exceptions=True)
    for exc, errors, state in results[:2]:
        assert isinstance(exc, p2pcoll.CollectiveTimeout)
        assert errors.get("CollectiveTimeout") == 1 and state == "failed"
