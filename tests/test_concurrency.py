"""Several collectives in flight on one group, several groups in one process, long sequences.

Messages are matched by (group, collective sequence number, step, source), so collectives
started in the same order on every rank may overlap freely. Every result is checked against
numpy: a message delivered to the wrong collective or group would show up as a wrong value.
The inputs of concurrent collectives have identical shapes and dtypes where that makes a
mix-up harder to notice by anything but the values.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

import p2pcoll
from p2pcoll.testing import run_ranks

BIG = 3 * 2**20 // 4  # 3 MiB of float32, pipelined in 1 MiB segments
TIMEOUT = 30.0


def value(rank: int, n: int, tag: int, dtype: Any = np.float32) -> np.ndarray:
    """Rank ``rank``'s input to the collective tagged ``tag``: small integers, exact sums."""
    return ((np.arange(n) * 3 + rank * 5 + tag * 7) % 13).astype(dtype)


def total(p: int, n: int, tag: int, dtype: Any = np.float32) -> np.ndarray:
    return sum((value(r, n, tag, dtype) for r in range(p)), np.zeros(n, dtype))


def assert_equal(got: object, want: np.ndarray, what: str) -> None:
    assert isinstance(got, np.ndarray), f"{what}: got {type(got).__name__}"
    assert got.dtype == want.dtype and got.shape == want.shape, f"{what}: {got.dtype}{got.shape}"
    assert np.array_equal(got, want), f"{what}: wrong values"


@pytest.mark.parametrize(
    ("p", "transport"),
    [(2, None), (3, None), (5, None), (8, None), (4, "tcp"), (4, "ipc"), (4, "inproc")],
)
async def test_different_collectives_in_flight_together(p: int, transport: str | None) -> None:
    """An allreduce of 3 MiB, small allreduces with two strategies, a broadcast, an
    allgather, a reduce_scatter and a barrier, all started at once with asyncio.gather
    (over the default transport, then over each one forced)."""

    async def fn(g: p2pcoll.Group) -> None:
        r = g.rank
        await asyncio.sleep(0.001 * r)  # ranks start at different moments
        root = p - 1
        results = await asyncio.gather(
            g.allreduce(value(r, BIG, 1)),
            g.broadcast(value(r, 5000, 2) if r == root else None, root=root),
            g.allgather(value(r, 300, 3)),
            g.barrier(),
            g.allreduce(value(r, 300, 4), strategy="ring"),
            g.allreduce(value(r, 300, 5), strategy="recursive_doubling"),
            g.reduce_scatter(value(r, 1000, 6, np.int64), op="sum"),
            g.broadcast(value(r, BIG // 2, 7) if r == 0 else None, root=0),
            g.reduce(value(r, 300, 8), root=root, op="max"),
        )
        big, bcast, gathered, barrier, ring, rd, scattered, big_bcast, reduced = results
        assert_equal(big, total(p, BIG, 1), "3 MiB allreduce")
        assert_equal(bcast, value(root, 5000, 2), "broadcast")
        assert isinstance(gathered, list) and len(gathered) == p
        for q, part in enumerate(gathered):
            assert_equal(part, value(q, 300, 3), f"allgather part {q}")
        assert barrier is None
        assert_equal(ring, total(p, 300, 4), "ring allreduce")
        assert_equal(rd, total(p, 300, 5), "recursive doubling allreduce")
        want = np.array_split(total(p, 1000, 6, np.int64), p)[r]
        assert_equal(scattered, want, "reduce_scatter")
        assert_equal(big_bcast, value(0, BIG // 2, 7), "1.5 MiB broadcast")
        if r == root:
            want = np.max([value(q, 300, 8) for q in range(p)], axis=0)
            assert_equal(reduced, want, "reduce max")
        else:
            assert reduced is None

    await run_ranks(p, fn, collective_timeout=TIMEOUT, transport=transport)


async def test_many_collectives_in_flight() -> None:
    """Forty allreduces of the same shape in flight at once, every strategy, every one with
    its own data; then the group still works."""
    p, n = 4, 257
    names = p2pcoll.available_strategies()["allreduce"]

    async def fn(g: p2pcoll.Group) -> None:
        calls = [g.allreduce(value(g.rank, n, tag), strategy=names[tag % len(names)])
                 for tag in range(40)]
        for tag, got in enumerate(await asyncio.gather(*calls)):
            assert_equal(got, total(p, n, tag), f"allreduce #{tag} ({names[tag % len(names)]})")
        assert_equal(await g.allreduce(value(g.rank, n, 99)), total(p, n, 99), "afterwards")

    await run_ranks(p, fn, collective_timeout=TIMEOUT)


async def test_two_groups_in_one_process_at_once() -> None:
    """Two groups (3 and 4 peers) run the same-shaped collectives at the same time in one
    event loop; each gets its own group's results."""
    n, rounds = 1000, 20

    def make(p: int, salt: int) -> Any:
        async def fn(g: p2pcoll.Group) -> None:
            for i in range(rounds):
                tag = salt + i
                got = await g.allreduce(value(g.rank, n, tag))
                assert_equal(got, total(p, n, tag), f"group of {p}, round {i}")
                got = await g.broadcast(value(0, n, tag) if g.rank == 0 else None)
                assert_equal(got, value(0, n, tag), f"group of {p}, broadcast {i}")
            big = await g.allreduce(value(g.rank, BIG, salt))
            assert_equal(big, total(p, BIG, salt), f"group of {p}, 3 MiB")

        return fn

    await asyncio.gather(
        run_ranks(3, make(3, 0), collective_timeout=TIMEOUT),
        run_ranks(4, make(4, 100), collective_timeout=TIMEOUT),
    )


async def test_nested_groups() -> None:
    """Each rank of an outer group forms an inner group of its own while the outer group
    keeps running collectives: three groups alive at once, none mixed up."""
    outer_p, inner_p, n = 2, 3, 500

    async def inner(g: p2pcoll.Group, salt: int) -> list[np.ndarray]:
        return [await g.allreduce(value(g.rank, n, salt + i)) for i in range(5)]

    async def outer(g: p2pcoll.Group) -> None:
        salt = 1000 * (g.rank + 1)
        inner_run = run_ranks(inner_p, lambda h: inner(h, salt), collective_timeout=TIMEOUT)
        outer_runs = [g.allreduce(value(g.rank, n, i)) for i in range(5)]
        inner_results, *outer_results = await asyncio.gather(inner_run, *outer_runs)
        for i, got in enumerate(outer_results):
            assert_equal(got, total(outer_p, n, i), f"outer allreduce {i}")
        for rank_results in inner_results:
            for i, got in enumerate(rank_results):
                assert_equal(got, total(inner_p, n, salt + i), f"inner allreduce {i}")

    await run_ranks(outer_p, outer, collective_timeout=TIMEOUT)


async def test_long_sequence_stays_correct() -> None:
    """200 small allreduces one after the other (the strategy changing as they go), each
    with new data, and a broadcast every 25: every result right, nothing left over."""
    p, n = 4, 64
    names = p2pcoll.available_strategies()["allreduce"]

    async def fn(g: p2pcoll.Group) -> dict[str, int]:
        for i in range(200):
            got = await g.allreduce(value(g.rank, n, i, np.int32),
                                    strategy=names[i % len(names)])
            assert_equal(got, total(p, n, i, np.int32), f"allreduce {i}")
            if i % 25 == 0:
                root = (i // 25) % p
                got = await g.broadcast(value(root, n, i) if g.rank == root else None, root=root)
                assert_equal(got, value(root, n, i), f"broadcast {i}")
        return dict(g.stats())

    for stats in await run_ranks(p, fn, collective_timeout=TIMEOUT):
        assert stats["messages_received"] > 0
        assert stats.get("messages_dropped", 0) == 0, stats
