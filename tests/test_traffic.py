"""The traffic formulas, through ``g.stats()`` (payload bytes only, never headers).

Expected numbers come from the textbook schedules (``/work/shared/ANCHORS.md`` section 3,
tables C1-C4 and the exact vectors of C7), written out below independently of the plugins.
The one convention taken from p2pcoll itself is how the ring cuts data into chunks: like
``numpy.array_split`` (1000 elements over 3 ranks: 334, 333, 333), where MPICH cuts
``ceil(count/p)``-sized chunks (334, 334, 332). So the ring's uneven per-rank bytes differ from
C7's MPICH column, and are derived here from p2pcoll's convention.

Every measurement is a delta of ``stats()`` around one collective, with the ranks lined up by
an in-process ``asyncio.Barrier`` (all ranks are tasks of one event loop) so that no rank has
sent or received anything of the collective before every rank has taken its "before", and
every rank has received all of it before anyone takes its "after". Sizes include data large
enough to be pipelined in segments (chunks just over the executor's 1 MiB segment): the byte
formulas must hold exactly either way.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

import p2pcoll
from p2pcoll.testing import run_ranks

WORLD_SIZES = range(2, 9)
F32 = 4  # bytes per float32 element
SMALL = 1000  # the count of table C7
SEGMENTED = 2**18 + 5  # float32 elements in a bit more than one 1 MiB segment
KEYS = ("bytes_sent", "bytes_received", "messages_sent", "messages_received")


@dataclass
class Traffic:
    """One collective's traffic as every rank counted it."""

    sent: list[int]  # payload bytes, by rank
    received: list[int]
    messages_sent: list[int]
    messages_received: list[int]

    def check_conservation(self) -> None:
        """Whatever was sent was received: equal totals of bytes and of messages."""
        assert sum(self.received) == sum(self.sent), self
        assert sum(self.messages_received) == sum(self.messages_sent), self


Call = Callable[[p2pcoll.Group], Awaitable[Any]]


async def measure_all(p: int, calls: list[Call], **join_kwargs: Any) -> list[Traffic]:
    """Form one group of ``p`` ranks and measure each call's traffic in turn."""
    line_up = asyncio.Barrier(p)

    async def rank_main(g: p2pcoll.Group) -> list[dict[str, int]]:
        deltas = []
        for call in calls:
            await line_up.wait()
            before = g.stats()
            await line_up.wait()  # nobody starts before everyone has its "before"
            await call(g)
            await line_up.wait()  # everyone is done, so everything sent has been received
            after = g.stats()
            deltas.append({k: after[k] - before[k] for k in KEYS})
        return deltas

    per_rank = await run_ranks(p, rank_main, **join_kwargs)
    out = []
    for i in range(len(calls)):
        d = [per_rank[r][i] for r in range(p)]
        t = Traffic(*([x[k] for x in d] for k in KEYS))
        t.check_conservation()
        out.append(t)
    return out


def ones(n: int, dtype: Any = np.float32) -> np.ndarray:
    return np.ones(n, dtype)


# --- expected traffic, from the textbook schedules ---------------------------------------------


def array_split_sizes(count: int, parts: int) -> list[int]:
    return [len(c) for c in np.array_split(np.empty(count, np.uint8), parts)]


def ring_allreduce_bytes(count: int, p: int, itemsize: int = F32) -> list[int]:
    """Rank r sends every chunk but chunk r+1 while reducing and every chunk but r+2 while
    gathering (plugins/ring.py): ``(T - c[r+1]) + (T - c[r+2])``."""
    c = [n * itemsize for n in array_split_sizes(count, p)]
    total = count * itemsize
    return [(total - c[(r + 1) % p]) + (total - c[(r + 2) % p]) for r in range(p)]


def recursive_doubling_bytes(nbytes: int, p: int) -> list[int]:
    """C4: with p' the largest power of two <= p and r = p - p', even ranks below 2r send
    once, odd ones below 2r send lg p' + 1 times, the others lg p' times."""
    pof2 = 1 << (p.bit_length() - 1)
    extra, rounds = p - pof2, pof2.bit_length() - 1
    out = []
    for rank in range(p):
        if rank < 2 * extra:
            out.append(nbytes * (rounds + 1 if rank % 2 else 1))
        else:
            out.append(nbytes * rounds)
    return out


def binomial_broadcast_messages(p: int, root: int) -> list[int]:
    """C1: relative rank q sends to q + 2^k for every 2^k below lowbit(q) with q + 2^k < p
    (the root's lowbit being the first power of two >= p)."""
    out = [0] * p
    for q in range(p):
        lowbit = q & -q if q else 1 << math.ceil(math.log2(p))
        out[(q + root) % p] = sum(1 for k in range(lowbit.bit_length() - 1)
                                  if q + (1 << k) < p)
    return out


# Table C7: bytes sent by rank 0..p-1, count = 1000 float32, root 0.
C7_BINOMIAL_BROADCAST = {
    2: [4000, 0],
    3: [8000, 0, 0],
    4: [8000, 0, 4000, 0],
    5: [12000, 0, 4000, 0, 0],
    6: [12000, 0, 4000, 0, 4000, 0],
    8: [12000, 0, 4000, 0, 8000, 0, 4000, 0],
}
C7_RECURSIVE_DOUBLING = {
    3: [4000, 8000, 4000],
    5: [4000, 12000, 8000, 8000, 8000],
    6: [4000, 12000, 4000, 12000, 8000, 8000],
}
# The ring with numpy.array_split chunks (see the module docstring); C7's MPICH column reads
# [5328, 5336, 5336] for p = 3 and [6664 x 4, 6672 x 2] for p = 6.
ARRAY_SPLIT_RING = {
    3: [5336, 5332, 5332],
    6: [6664, 6664, 6668, 6672, 6668, 6664],
}


def test_expected_tables_agree_with_the_formulas() -> None:
    """The independent formulas above reproduce the literal vectors (and their totals)."""
    for p, row in C7_BINOMIAL_BROADCAST.items():
        assert [m * 4000 for m in binomial_broadcast_messages(p, 0)] == row
    for p, row in C7_RECURSIVE_DOUBLING.items():
        assert recursive_doubling_bytes(4000, p) == row
    for p, row in ARRAY_SPLIT_RING.items():
        assert ring_allreduce_bytes(SMALL, p) == row
        assert sum(row) == 2 * (p - 1) * 4000


# --- the measurements ---------------------------------------------------------------------------


@pytest.mark.parametrize("p", WORLD_SIZES)
async def test_ring_allreduce(p: int) -> None:
    """2(p-1)/p of the data per rank when p divides the count; C7-style vectors otherwise."""
    counts = [SMALL * p, SEGMENTED * p, SMALL]
    calls = [lambda g, n=n: g.allreduce(ones(n), strategy="ring") for n in counts]
    small, segmented, uneven = await measure_all(p, calls)
    for t, n in ((small, SMALL * p), (segmented, SEGMENTED * p)):
        assert t.sent == [2 * (p - 1) * F32 * n // p] * p, n
    assert uneven.sent == ring_allreduce_bytes(SMALL, p)
    if p in ARRAY_SPLIT_RING:
        assert uneven.sent == ARRAY_SPLIT_RING[p]
    # One message per step, 2(p-1) steps; segmentation multiplies the messages, not the bytes.
    assert small.messages_sent == [2 * (p - 1)] * p
    base = 2 * (p - 1)
    assert all(m > base and m % base == 0 for m in segmented.messages_sent), segmented


@pytest.mark.parametrize("p", WORLD_SIZES)
async def test_recursive_doubling_allreduce(p: int) -> None:
    """lg p times the data per rank for p a power of two; the MPICH fold otherwise (C4, C7)."""
    counts = [SMALL, SEGMENTED]
    calls = [lambda g, n=n: g.allreduce(ones(n), strategy="recursive_doubling")
             for n in counts]
    for t, n in zip(await measure_all(p, calls), counts, strict=True):
        expected = recursive_doubling_bytes(F32 * n, p)
        assert t.sent == expected, n
        if p & (p - 1) == 0:
            assert t.sent == [int(math.log2(p)) * F32 * n] * p
        if n == SMALL:
            assert t.messages_sent == [b // (F32 * n) for b in expected]
            if p in C7_RECURSIVE_DOUBLING:
                assert t.sent == C7_RECURSIVE_DOUBLING[p]


@pytest.mark.parametrize("p", WORLD_SIZES)
async def test_root_broadcast(p: int) -> None:
    """The root sends (p-1) copies of the data, in p-1 messages; the others send nothing."""
    cases = [(root, SMALL) for root in range(p)] + [(p - 1, SEGMENTED)]
    calls = [
        lambda g, root=root, n=n: g.broadcast(ones(n) if g.rank == root else None, root=root,
                                              strategy="root")
        for root, n in cases
    ]
    for t, (root, n) in zip(await measure_all(p, calls), cases, strict=True):
        assert t.sent == [(p - 1) * F32 * n if r == root else 0 for r in range(p)], (root, n)
        assert t.received == [0 if r == root else F32 * n for r in range(p)], (root, n)
        if n == SMALL:
            assert t.messages_sent == [p - 1 if r == root else 0 for r in range(p)]


@pytest.mark.parametrize("p", WORLD_SIZES)
async def test_binomial_broadcast(p: int) -> None:
    """C7's vectors for root 0; the same tree shifted for other roots; p-1 messages in all,
    ceil(lg p) of them from the root."""
    cases = [(0, SMALL), (p - 1, SMALL), (p // 2, SEGMENTED)]
    calls = [
        lambda g, root=root, n=n: g.broadcast(ones(n) if g.rank == root else None, root=root,
                                              strategy="binomial")
        for root, n in cases
    ]
    for t, (root, n) in zip(await measure_all(p, calls), cases, strict=True):
        messages = binomial_broadcast_messages(p, root)
        assert t.sent == [m * F32 * n for m in messages], (root, n)
        assert sum(t.sent) == (p - 1) * F32 * n
        assert t.sent[root] == math.ceil(math.log2(p)) * F32 * n
        if n == SMALL:
            assert t.messages_sent == messages
            if root == 0 and p in C7_BINOMIAL_BROADCAST:
                assert t.sent == C7_BINOMIAL_BROADCAST[p]


@pytest.mark.parametrize("p", [2, 3, 5, 8])
async def test_other_ring_collectives_and_barrier(p: int) -> None:
    """Ring allgather and reduce_scatter send (p-1)/p of the data; a barrier sends messages
    but no payload bytes (headers are not counted)."""
    part = 250  # float32 per rank in the allgather; the reduce_scatter reduces 1000
    calls = [
        lambda g: g.allgather(ones(part), strategy="ring"),
        lambda g: g.reduce_scatter(ones(SMALL), strategy="ring"),
        lambda g: g.barrier(strategy="dissemination"),
    ]
    allgather, reduce_scatter, barrier = await measure_all(p, calls)
    assert allgather.sent == [(p - 1) * F32 * part] * p
    # Rank r sends every chunk but its own (the one it ends up holding).
    chunks = array_split_sizes(SMALL, p)
    assert reduce_scatter.sent == [F32 * (SMALL - chunks[r]) for r in range(p)]
    assert barrier.sent == [0] * p
    assert barrier.messages_sent == [math.ceil(math.log2(p))] * p


async def test_a_group_of_one_sends_nothing() -> None:
    calls = [
        lambda g: g.allreduce(ones(SMALL), strategy="ring"),
        lambda g: g.allreduce(ones(SMALL), strategy="recursive_doubling"),
        lambda g: g.broadcast(ones(SMALL), strategy="binomial"),
        lambda g: g.barrier(),
    ]
    for t in await measure_all(1, calls):
        assert t == Traffic([0], [0], [0], [0])


async def test_stats_count_since_join() -> None:
    """stats() has the documented keys as ints; nothing is counted as sent by join itself."""

    async def fn(g: p2pcoll.Group) -> tuple[int, dict[str, int], dict[str, int]]:
        first = dict(g.stats())
        await g.allreduce(ones(SMALL), strategy="ring")
        return g.rank, first, dict(g.stats())

    for rank, first, after in await run_ranks(3, fn):
        assert all(isinstance(first[key], int) for key in KEYS), first
        # (Peers that start sooner may already have sent to this one: only sends are 0.)
        assert first["bytes_sent"] == first["messages_sent"] == 0, first
        assert after["bytes_sent"] == ring_allreduce_bytes(SMALL, 3)[rank]
        assert after["messages_sent"] == 2 * (3 - 1)
