"""The collectives over the in-memory transport: exact at every size, under delay and
reordering, and failing the documented way when messages are lost or a peer is cut off."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest

import p2pcoll
from conftest import groups_of
from p2pcoll.transport.memory import Faults, MemoryNetwork

STRATEGIES = p2pcoll.available_strategies()


async def on_every_rank(groups: list[p2pcoll.Group],
                        fn: Callable[[p2pcoll.Group], Awaitable[Any]]) -> list[Any]:
    return list(await asyncio.gather(*(fn(g) for g in groups)))


def _data(rank: int, nelem: int, dtype: Any) -> np.ndarray:
    return (np.arange(nelem) % 7 + rank + 1).astype(dtype)


async def run_every_collective(g: p2pcoll.Group, strategies: dict[str, str | None],
                               nelem: int = 13, dtype: Any = np.float64) -> None:
    """Every collective once, each result checked exactly against numpy."""
    n, r = g.world_size, g.rank
    inputs = [_data(q, nelem, dtype) for q in range(n)]

    out = await g.allreduce(inputs[r], strategy=strategies.get("allreduce"))
    np.testing.assert_array_equal(out, np.sum(inputs, axis=0, dtype=dtype))
    out = await g.allreduce(inputs[r], op="max", strategy=strategies.get("allreduce"))
    np.testing.assert_array_equal(out, np.max(inputs, axis=0))

    root = n - 1
    red = await g.reduce(inputs[r], root=root, strategy=strategies.get("reduce"))
    if r == root:
        np.testing.assert_array_equal(red, np.sum(inputs, axis=0, dtype=dtype))
    else:
        assert red is None

    rows = [np.stack([inputs[q], inputs[q] * 2], axis=1) for q in range(n)]  # (nelem, 2)
    part = await g.reduce_scatter(rows[r], strategy=strategies.get("reduce_scatter"))
    whole = np.sum(rows, axis=0, dtype=dtype)
    np.testing.assert_array_equal(part, np.array_split(whole, n, axis=0)[r])

    tree = {"a": inputs[0].reshape(-1, 1), "b": [np.arange(3, dtype=np.int32), np.float32(2.5)]}
    got = await g.broadcast(tree if r == 0 else None, root=0,
                            strategy=strategies.get("broadcast"))
    np.testing.assert_array_equal(got["a"], tree["a"])
    np.testing.assert_array_equal(got["b"][0], tree["b"][0])
    assert got["b"][1] == np.float32(2.5)

    parts = await g.allgather(inputs[r], strategy=strategies.get("allgather"))
    assert len(parts) == n
    for q in range(n):
        np.testing.assert_array_equal(parts[q], inputs[q])

    gathered = await g.gather(inputs[r], root=root, strategy=strategies.get("gather"))
    if r == root:
        assert gathered is not None
        for q in range(n):
            np.testing.assert_array_equal(gathered[q], inputs[q])
    else:
        assert gathered is None

    scattered = [np.full(q + 1, q, dtype) for q in range(n)]  # shapes differ by rank
    mine = await g.scatter(scattered if r == 0 else None, root=0,
                           strategy=strategies.get("scatter"))
    np.testing.assert_array_equal(mine, scattered[r])

    await g.barrier(strategy=strategies.get("barrier"))
    assert g.state == "ready"


def _strategy_rounds() -> list[dict[str, str | None]]:
    """Enough rounds that every registered strategy of every collective runs once."""
    longest = max(len(names) for names in STRATEGIES.values())
    return [{coll: names[i % len(names)] for coll, names in STRATEGIES.items()}
            for i in range(longest)]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
async def test_every_collective_and_strategy_is_exact(n: int) -> None:
    async with groups_of(n) as groups:
        await on_every_rank(groups, lambda g: run_every_collective(g, {}))
        for strategies in _strategy_rounds():
            await on_every_rank(groups, lambda g: run_every_collective(g, strategies))
        await on_every_rank(groups, lambda g: run_every_collective(g, {}, nelem=0))
        await on_every_rank(groups, lambda g: run_every_collective(g, {}, nelem=1,
                                                                   dtype=np.int32))
        for g in groups:
            assert g.stats()["messages_dropped"] == 0


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
async def test_delay_and_reordering_are_harmless(seed: int) -> None:
    faults = Faults(delay=(0.0, 0.005), reorder=True, seed=seed)
    # Small segments, so a collective is many messages per link that may overtake each other.
    async with groups_of(4, faults=faults, segment_bytes=1 << 10, pipeline_depth=3) as groups:
        for strategies in _strategy_rounds()[:3]:
            await on_every_rank(groups, lambda g: run_every_collective(g, strategies,
                                                                       nelem=700))
        # Integers in float64: every summation order gives the same, exact, result.
        big = [np.random.default_rng(seed + q).integers(-1000, 1000, 5000).astype(np.float64)
               for q in range(4)]
        for name in STRATEGIES["allreduce"]:
            outs = await on_every_rank(groups, lambda g: g.allreduce(big[g.rank],
                                                                    strategy=name))
            for out in outs:  # every rank gets the same bits
                np.testing.assert_array_equal(out, outs[0])
            np.testing.assert_array_equal(outs[0], np.sum(big, axis=0))
        # Several collectives in flight at once, started in the same order everywhere.
        outs = await on_every_rank(groups, lambda g: asyncio.gather(
            *(g.allreduce(np.full(300, g.rank + k, np.int64)) for k in range(5))))
        for per_rank in outs:
            for k, out in enumerate(per_rank):
                np.testing.assert_array_equal(out, np.full(300, 6 + 4 * k))
        for g in groups:
            assert g.stats()["messages_dropped"] == 0


async def test_lost_messages_time_out_and_break_the_group() -> None:
    async with groups_of(3, faults=Faults(drop=1.0), collective_timeout=0.5) as groups:

        async def fn(g: p2pcoll.Group) -> p2pcoll.CollectiveTimeout:
            start = time.monotonic()
            with pytest.raises(p2pcoll.CollectiveTimeout) as info:
                await g.allreduce(np.ones(10), strategy="ring")
            assert time.monotonic() - start < 20 * 0.5  # it does not hang
            return info.value

        errors = await on_every_rank(groups, fn)
        for g, err in zip(groups, errors, strict=True):
            assert err.collective == "allreduce" and err.seq == 0
            assert err.waiting_on, err
            assert set(err.waiting_on) <= set(range(3)) - {g.rank}, err
            assert g.state == "broken"
            assert g.cause is not None
            with pytest.raises(p2pcoll.GroupBroken) as broken:
                await g.allreduce(np.ones(10))
            assert broken.value.__cause__ is g.cause
            with pytest.raises(p2pcoll.GroupBroken):
                await g.barrier()
        # In the ring every rank waits on its left neighbour.
        assert any(err.waiting_on == [(g.rank - 1) % 3]
                   for g, err in zip(groups, errors, strict=True)), errors


async def _cut_during(n: int, victim: int, before: bool) -> None:
    # Each data message takes 20-30 ms and the allreduce is dozens of 1 KiB segments, so it
    # is still running when the cut comes.
    net = MemoryNetwork(Faults(delay=(0.02, 0.03), seed=victim))
    async with groups_of(n, network=net, collective_timeout=10, segment_bytes=1 << 10,
                         pipeline_depth=2) as groups:
        endpoint = groups[victim].endpoint
        if before:
            net.cut(endpoint)

        async def fn(g: p2pcoll.Group) -> Any:
            start = time.monotonic()
            try:
                await g.allreduce(np.ones(10_000), strategy="ring")
            except p2pcoll.P2PCollError as exc:
                return exc, time.monotonic() - start
            return None, time.monotonic() - start

        tasks = [asyncio.create_task(fn(g)) for g in groups]
        if not before:
            await asyncio.sleep(0.05)  # the allreduce is under way
            assert not any(t.done() for t in tasks)
            net.cut(endpoint)
        # The victim, cut off, would wait for its deadline: it is cancelled once the others
        # are done (a short timeout of its own could pass before the cut on a loaded host).
        results = await asyncio.gather(*(t for r, t in enumerate(tasks) if r != victim))
        tasks[victim].cancel()
        await asyncio.gather(tasks[victim], return_exceptions=True)
        results.insert(victim, (None, 0.0))
        for g, (err, elapsed) in zip(groups, results, strict=True):
            if g.rank == victim:
                continue
            assert isinstance(err, p2pcoll.PeerLost), (g.rank, err)
            assert f"rank {victim}" in str(err), err
            assert err.rank in (victim, None), err  # None: reported by a peer's abort
            assert elapsed < 10 / 2, f"rank {g.rank} took {elapsed:.2f}s"  # not the timeout
            assert g.state == "broken"
            with pytest.raises(p2pcoll.GroupBroken):
                await g.barrier()
        # The ranks that waited on the victim itself name it in the error's rank.
        assert any(err.rank == victim for g, (err, _) in zip(groups, results, strict=True)
                   if g.rank != victim)


@pytest.mark.parametrize("n, victim", [(2, 1), (3, 0), (5, 2)])
async def test_a_peer_cut_off_before_an_allreduce_is_lost(n: int, victim: int) -> None:
    await _cut_during(n, victim, before=True)


@pytest.mark.parametrize("n, victim", [(2, 0), (4, 3), (5, 1)])
async def test_a_peer_cut_off_during_an_allreduce_is_lost(n: int, victim: int) -> None:
    await _cut_during(n, victim, before=False)
