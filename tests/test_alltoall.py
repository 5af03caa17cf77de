"""All-to-all (issue 38): every strategy, p from 1 to 9, lengths per pair including zero,
bit-exact against a numpy reference; the bad inputs; the traffic formulas; a lost peer.

The wide matrix runs over the memory transport on the virtual clock (``run_virtual``);
one pass runs over real sockets on loopback. The expected traffic is written out from the
textbook schedules, independently of the plugins: pairwise, every block once straight to
its owner in p-1 messages; Bruck, ceil(lg p) messages, round k carrying the blocks whose
distance has bit k set; hierarchical, a rank's blocks inside its host directly, the rest
through its host's leader.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest

import p2pcoll
from p2pcoll.engine.costs import DEFAULT_CONSTANTS, CostModel
from p2pcoll.registry import registry
from p2pcoll.strategy import Workload
from p2pcoll.testing import Faults, MemoryNetwork, memory_groups, run_ranks, run_virtual

STRATEGIES = ("pairwise", "scattered", "bruck", "hierarchical")
SIZES = range(1, 10)
DTYPES = (np.float32, np.int64, np.uint8, np.float64)


def lengths(p: int, seed: int, top: int = 6) -> np.ndarray:
    """rows[i, j]: what rank i sends rank j; about a quarter of them zero."""
    rng = np.random.default_rng(seed)
    rows = rng.integers(1, top, (p, p))
    rows[rng.random((p, p)) < 0.25] = 0
    return rows


def block(i: int, j: int, rows: int, dtype: Any, width: int = 0) -> np.ndarray:
    """What rank i sends rank j: distinct values per pair, ``width`` columns (0: 1-D)."""
    n = rows * max(width, 1)
    values = (np.arange(n) * 7 + 1000 * i + 31 * j) % 251
    a = values.astype(dtype)
    return a.reshape(rows, width) if width else a


async def exchange(groups: list[p2pcoll.Group], rows: np.ndarray, dtype: Any,
                   strategy: str | None, width: int = 0) -> None:
    """Every rank's alltoall, checked bit for bit against the blocks sent."""
    p = len(groups)

    async def one(g: p2pcoll.Group) -> list[np.ndarray]:
        r = g.rank
        return await g.alltoall([block(r, j, rows[r, j], dtype, width) for j in range(p)],
                                strategy=strategy)

    got = await asyncio.gather(*(one(g) for g in groups))
    for r in range(p):
        assert len(got[r]) == p
        for i in range(p):
            want = block(i, r, rows[i, r], dtype, width)
            assert got[r][i].dtype == want.dtype and got[r][i].shape == want.shape
            assert got[r][i].tobytes() == want.tobytes(), (strategy, p, r, i)


def hosts_of(p: int) -> list[str]:
    """Uneven hosts: 3, then 2, then the rest one each (p=1: one host)."""
    return [f"h{0 if r < 3 else 1 if r < 5 else r - 3}" for r in range(p)]


@pytest.mark.parametrize("p", SIZES)
def test_every_strategy_matches_numpy_for_every_size(p: int) -> None:
    async def main() -> None:
        for hosts in (None, hosts_of(p)):
            groups = await memory_groups(p, hosts=hosts)
            try:
                for n, strategy in enumerate((*STRATEGIES, None)):
                    for k, dtype in enumerate(DTYPES):
                        await exchange(groups, lengths(p, 10 * p + n + k), dtype, strategy)
                    await exchange(groups, np.zeros((p, p), int), np.float32, strategy)
                    await exchange(groups, lengths(p, p, 4), np.float32, strategy, width=3)
            finally:
                await asyncio.gather(*(g.close() for g in groups))

    run_virtual(main())


def test_large_blocks_are_cut_into_segments_and_still_exact() -> None:
    async def main() -> None:
        groups = await memory_groups(3, segment_bytes=4096)
        try:
            rows = np.array([[5000, 0, 3000], [1, 4097, 2500], [0, 6000, 0]])
            for strategy in STRATEGIES:
                await exchange(groups, rows, np.float32, strategy)
        finally:
            await asyncio.gather(*(g.close() for g in groups))

    run_virtual(main())


def test_out_receives_in_place_and_tensors_come_back_as_tensors() -> None:
    async def main() -> None:
        groups = await memory_groups(3)
        rows = lengths(3, 5)
        try:
            outs = [[np.full(rows[i, r], -1.0, np.float32) for i in range(3)] for r in range(3)]

            async def one(g: p2pcoll.Group) -> list[np.ndarray]:
                r = g.rank
                return await g.alltoall([block(r, j, rows[r, j], np.float32)
                                         for j in range(3)], out=outs[r])

            got = await asyncio.gather(*(one(g) for g in groups))
            for r in range(3):
                for i in range(3):
                    assert got[r][i] is outs[r][i]
                    assert np.array_equal(outs[r][i], block(i, r, rows[i, r], np.float32))
        finally:
            await asyncio.gather(*(g.close() for g in groups))

    run_virtual(main())


def test_calls_in_flight_together_start_in_the_callers_order_on_every_rank() -> None:
    """An alltoall is two collectives; others started after it (and a second alltoall)
    must not take their sequence numbers between them on some ranks."""
    async def main() -> None:
        groups = await memory_groups(4)
        try:
            async def one(g: p2pcoll.Group) -> list[Any]:
                r, a, b = g.rank, lengths(4, 1), lengths(4, 2)
                return list(await asyncio.gather(
                    g.alltoall([block(r, j, a[r, j], np.float32) for j in range(4)]),
                    g.allreduce(np.full(3, r + 1.0)),
                    g.alltoall([block(r, j, b[r, j], np.int64) for j in range(4)],
                               strategy="bruck"),
                    g.broadcast(np.arange(5) if r == 1 else None, root=1)))

            got = await asyncio.gather(*(one(g) for g in groups))
            a, b = lengths(4, 1), lengths(4, 2)
            for r, (x, total, y, z) in enumerate(got):
                assert all(np.array_equal(x[i], block(i, r, a[i, r], np.float32)) and
                           np.array_equal(y[i], block(i, r, b[i, r], np.int64))
                           for i in range(4))
                assert total.tolist() == [10.0] * 3 and z.tolist() == list(range(5))
        finally:
            await asyncio.gather(*(g.close() for g in groups))

    run_virtual(main())


def test_over_real_sockets_and_the_board() -> None:
    """Every strategy over sockets; auto on one host puts every call on the board (shm),
    one over a slot in its window."""
    async def rank_main(g: p2pcoll.Group) -> dict[str, int]:
        p, r = g.world_size, g.rank
        for n, strategy in enumerate((*STRATEGIES, None, None)):
            rows = lengths(p, 40 + n)
            if n == len(STRATEGIES) + 1:  # the last: 80 KB a rank, over a slot (64 KiB)
                rows = np.full((p, p), 5000) * (rows > 0)
                rows[:, 0] = 5000
            got = await g.alltoall([block(r, j, rows[r, j], np.float32) for j in range(p)],
                                   strategy=strategy)
            for i in range(p):
                assert np.array_equal(got[i], block(i, r, rows[i, r], np.float32))
        return dict(g.stats()["collectives_by_strategy"]["alltoall"])

    async def main() -> None:
        used = await run_ranks(4, rank_main)
        assert all(u["shm"] == 2 and sum(u.values()) == len(STRATEGIES) + 2
                   for u in used), used
        await run_ranks(5, rank_main, host_ids=["a", "a", "b", "b", "b"])

    asyncio.run(main())


# --- bad input ---------------------------------------------------------------------------


async def outcome(aw: Awaitable[Any]) -> Any:
    try:
        return await aw
    except (p2pcoll.P2PCollError, ValueError, TypeError) as exc:
        return exc


def run_bad(p: int, bad: Callable[[p2pcoll.Group], Awaitable[Any]]) -> list[Any]:
    """``bad(g)`` on every rank, then a correct alltoall; returns what ``bad`` gave."""
    async def main() -> list[Any]:
        groups = await memory_groups(p)
        try:
            got = await asyncio.gather(*(outcome(bad(g)) for g in groups))
            await exchange(groups, lengths(p, 3), np.float32, None)  # the group is usable
            assert all(g.state is p2pcoll.GroupState.READY for g in groups)
            return got
        finally:
            await asyncio.gather(*(g.close() for g in groups))

    return run_virtual(main())


def parts(g: p2pcoll.Group, n: int = 2, dtype: Any = np.float32) -> list[np.ndarray]:
    return [np.ones(n, dtype) for _ in range(g.world_size)]


def test_a_wrong_number_of_parts_is_a_mismatch_on_every_rank() -> None:
    got = run_bad(4, lambda g: g.alltoall(parts(g)[:3] if g.rank == 2 else parts(g)))
    for exc in got:
        assert isinstance(exc, p2pcoll.CollectiveMismatch)
        assert "rank 2 passed 3 parts" in str(exc)


def test_dtypes_that_differ_across_ranks_are_a_mismatch_naming_the_pair() -> None:
    got = run_bad(3, lambda g: g.alltoall(parts(g, dtype=np.int32 if g.rank == 1
                                                 else np.float32)))
    for exc in got:
        assert isinstance(exc, p2pcoll.CollectiveMismatch)
        assert "rank 0 sends float32, rank 1 sends int32" in str(exc)


def test_lengths_the_sender_and_receiver_disagree_on_are_a_mismatch_naming_them() -> None:
    def call(g: p2pcoll.Group) -> Awaitable[Any]:
        out = [np.empty(2, np.float32) for _ in range(3)]
        if g.rank == 2:
            out[0] = np.empty(5, np.float32)  # rank 0 sends 2
        return g.alltoall(parts(g), out=out)

    for exc in run_bad(3, call):
        assert isinstance(exc, p2pcoll.CollectiveMismatch)
        assert "rank 0 sends rank 2 2 rows, rank 2 expects 5 from rank 0" in str(exc)


def test_row_shapes_that_differ_across_ranks_are_a_mismatch() -> None:
    got = run_bad(2, lambda g: g.alltoall([np.ones((1, 2 + g.rank))] * 2))
    for exc in got:
        assert isinstance(exc, p2pcoll.CollectiveMismatch)
        assert "rank 1's 3" in str(exc)


@pytest.mark.parametrize("given, error, words", [
    (np.ones(4), TypeError, "sequence of 2 arrays"),
    ([np.array(1.0), np.array(2.0)], ValueError, "0-d"),
    ([np.ones(2, np.float32), np.ones(2, np.int32)], ValueError, "one dtype"),
    ([np.ones(2, object), np.ones(2, object)], TypeError, "object"),
])
def test_local_mistakes_raise_before_anything_is_sent(given: Any, error: type, words: str
                                                      ) -> None:
    async def main() -> None:
        groups = await memory_groups(2)
        try:
            with pytest.raises(error, match=words):
                await groups[0].alltoall(given)
            with pytest.raises(ValueError, match="out= needs 2 arrays"):
                await groups[0].alltoall(parts(groups[0]), out=[np.empty(2)])
            await exchange(groups, lengths(2, 1), np.float32, None)  # nothing was started
        finally:
            await asyncio.gather(*(g.close() for g in groups))

    run_virtual(main())


def _read_only(n: int) -> np.ndarray:
    a = np.empty(n, np.float32)
    a.flags.writeable = False
    return a


@pytest.mark.parametrize("bad, words", [
    (lambda n: np.empty(n, np.float64), "float64"),
    (_read_only, "writable"),
    (lambda n: np.empty(2 * n, np.float32)[::2], "C-contiguous"),
    (lambda n: np.empty((n, 1), np.float32), r"\[.*, 1\]"),
])
def test_bad_out_buffers_raise_before_anything_is_sent(bad: Any, words: str) -> None:
    async def main() -> None:
        groups = await memory_groups(2)
        try:
            rows = lengths(2, 1)
            out = [np.empty(rows[i, 0], np.float32) for i in range(2)]
            out[1] = bad(rows[1, 0])
            with pytest.raises(ValueError, match=f"out\\[1\\] must be.*{words}"):
                await groups[0].alltoall(parts(groups[0]), out=out)
            await exchange(groups, rows, np.float32, None)  # nothing was started
        finally:
            await asyncio.gather(*(g.close() for g in groups))

    run_virtual(main())


def test_a_peer_lost_mid_exchange_is_peer_lost_naming_it_on_every_survivor() -> None:
    async def main() -> list[Any]:
        # Every data message takes 0.5 s, so the exchange is under way at t = 1.2 s.
        net = MemoryNetwork(Faults(delay=(0.5, 0.5)))
        groups = await memory_groups(4, network=net)
        try:
            calls = [asyncio.ensure_future(outcome(g.alltoall(parts(g, 1000),
                                                              strategy="pairwise")))
                     for g in groups]
            await asyncio.sleep(1.2)
            net.cut(3)
            return await asyncio.gather(*calls[:3])
        finally:
            await asyncio.gather(*(g.close() for g in groups[:3]))

    for exc in run_virtual(main()):
        assert isinstance(exc, p2pcoll.PeerLost), exc
        assert exc.rank == 3


# --- traffic and costs ---------------------------------------------------------------------


def pairwise_traffic(p: int, sizes: list[int], segments: int) -> tuple[list[int], list[int]]:
    return [(p - 1) * segments] * p, [sum(sizes) - sizes[r] for r in range(p)]


def bruck_traffic(p: int, sizes: list[int], segments: int) -> tuple[list[int], list[int]]:
    """Round k: rank r sends the blocks at distances d with bit k set; the one at distance
    d came from ``r - (d mod 2^k)`` and goes to that plus d."""
    rounds = (p - 1).bit_length()
    sent = [sum(sizes[(r - d % (1 << k) + d) % p]
                for k in range(rounds) for d in range(1, p) if d >> k & 1) for r in range(p)]
    return [rounds * segments] * p, sent


def hierarchical_traffic(hosts: list[str], sizes: list[int]
                         ) -> tuple[list[int], list[int]]:
    """Inside a host every rank sends each other rank its block; a non-leader sends its
    leader its blocks for other hosts in one message; a leader sends each other leader its
    host's blocks for that host, and each rank of its host its blocks from other hosts."""
    p = len(hosts)
    names = list(dict.fromkeys(hosts))
    members = {h: [r for r in range(p) if hosts[r] == h] for h in names}
    messages, sent = [], []
    for r in range(p):
        mine = members[hosts[r]]
        away = [j for j in range(p) if hosts[j] != hosts[r]]
        m = len(mine) - 1
        b = sum(sizes[j] for j in mine if j != r)
        if away and r != mine[0]:
            m, b = m + 1, b + sum(sizes[j] for j in away)
        elif away:
            m += len(names) - 1 + len(mine) - 1
            b += sum(len(mine) * sizes[j] for j in away)  # a host's blocks for each rank
            b += sum(len(away) * sizes[q] for q in mine if q != r)
        messages.append(m)
        sent.append(b)
    return messages, sent


async def measured(groups: list[p2pcoll.Group], call: Callable[[p2pcoll.Group], Awaitable[Any]]
                   ) -> tuple[list[int], list[int]]:
    before = [g.stats() for g in groups]
    await asyncio.gather(*(call(g) for g in groups))
    after = [g.stats() for g in groups]
    return ([a["messages_sent"] - b["messages_sent"] for a, b in zip(after, before)],
            [a["bytes_sent"] - b["bytes_sent"] for a, b in zip(after, before)])


@pytest.mark.parametrize("p", [2, 3, 4, 5, 7, 8, 9])
def test_traffic_is_the_textbooks(p: int) -> None:
    """Measured through stats(), less the agreement (an allreduce of the same table, run on
    its own), against the formulas; and each strategy's traffic() says the same."""
    hosts = hosts_of(p)

    async def main() -> None:
        groups = await memory_groups(p, hosts=hosts, segment_bytes=1 << 12)
        table = np.zeros((p, 2 * p + 4), np.int64)
        try:
            for count in (3, 1500):  # 1500 float32: two segments of 4 KiB
                sizes = [count * 4] * p
                segments = math.ceil(count * 4 / 4096)
                for strategy in STRATEGIES:
                    agree = await measured(groups, lambda g: g.allreduce(table))
                    m, b = await measured(groups, lambda g: g.alltoall(
                        [np.ones(count, np.float32)] * p, strategy=strategy))
                    messages = [x - y for x, y in zip(m, agree[0])]
                    sent = [x - y for x, y in zip(b, agree[1])]
                    if strategy in ("pairwise", "scattered"):
                        want = pairwise_traffic(p, sizes, segments)
                    elif strategy == "bruck":
                        want = bruck_traffic(p, sizes, segments)
                    else:
                        m1, b1 = hierarchical_traffic(hosts, sizes)
                        want = ([x * segments for x in m1], b1)
                    assert (messages, sent) == (list(want[0]), list(want[1])), strategy
                    work = CostModel(segment_bytes=1 << 12).workload(
                        registry.get("alltoall", strategy), count * 4 * p, p)
                    work = Workload(work.size, work.nbytes, 1, work.segments, work.depth,
                                    tuple(int(h[1:]) for h in hosts))
                    modelled = registry.get("alltoall", strategy).traffic(work)
                    assert modelled is not None
                    assert (list(modelled.messages), list(modelled.bytes_sent)) == \
                        (list(want[0]), list(want[1])), strategy
        finally:
            await asyncio.gather(*(g.close() for g in groups))

    run_virtual(main())


def test_auto_takes_bruck_or_scattered_for_small_blocks_and_pairwise_for_large() -> None:
    """Over sockets each of the p-1 messages pays its latency, so Bruck's lg p rounds win
    for small blocks; over the shared-memory rings the latencies of messages posted together
    overlap (scattered). Blocks of several segments go pairwise. Bruck is not priced for
    blocks over 16 KiB, even on a host whose ranks outnumber its cores (where the model
    counts messages, which Bruck has fewer of)."""
    sockets = CostModel(DEFAULT_CONSTANTS["tcp"])
    rings = CostModel(DEFAULT_CONSTANTS["ipc"])
    crowded = CostModel(DEFAULT_CONSTANTS["ipc"], local=8, cores=2)
    bruck = registry.get("alltoall", "bruck")
    assert bruck.cost(sockets.workload(bruck, (16 << 10) * 4, 4)) is not None
    assert bruck.cost(sockets.workload(bruck, (16 << 10) * 4 + 4, 4)) is None
    for p in (4, 8):
        assert registry.choose("alltoall", None, None, (4 << 20) * p, p, crowded).name == \
            "pairwise"
        small = registry.choose("alltoall", None, None, 64 * p, p, sockets)
        large = registry.choose("alltoall", None, None, (4 << 20) * p, p, sockets)
        assert (small.name, large.name) == ("bruck", "pairwise")
        small = registry.choose("alltoall", None, None, 64 * p, p, rings)
        large = registry.choose("alltoall", None, None, (4 << 20) * p, p, rings)
        assert (small.name, large.name) == ("scattered", "pairwise")
