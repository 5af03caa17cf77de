"""Traffic of the second set of strategies (issue 4), through ``g.stats()`` deltas.

Rabenseifner allreduce, the pipelined chain and scatter + allgather broadcasts, and the
recursive doubling allgather. Expected bytes are written out from the textbook schedules
(``/work/shared/ANCHORS.md`` section 3, C2, C5, C6, C7) independently of the plugins, with
p2pcoll's chunking made explicit where chunks are uneven:

- Rabenseifner cuts the data into p' = 2^floor(lg p) blocks like ``numpy.array_split``, which
  is also MPICH's convention for this algorithm (``count // p'`` each, one more for the first
  ``count % p'``), so C7's column holds exactly.
- scatter + allgather cuts the data into p chunks of *elements* like ``numpy.array_split``;
  MPICH cuts ``ceil(nbytes / p)``-byte chunks, so for p = 3 and 6 (1000 float32) C7's
  per-rank numbers differ from ours by a few bytes; the formula below uses ours.

As in tests/test_traffic.py, each measurement is a delta of ``stats()`` around one collective
with all ranks lined up by an in-process ``asyncio.Barrier`` before and after, and every
result is checked against numpy as well.
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

F32 = 4  # bytes per float32 element
SMALL = 1000  # the count of table C7: n = 4000 bytes
SEGMENTED = 2**18 + 5  # float32 elements in a bit more than one 1 MiB pipeline segment
KEYS = ("bytes_sent", "bytes_received", "messages_sent", "messages_received")


@dataclass
class Traffic:
    """One collective's traffic as every rank counted it."""

    sent: list[int]  # payload bytes, by rank
    received: list[int]
    messages_sent: list[int]
    messages_received: list[int]


Call = Callable[[p2pcoll.Group], Awaitable[Any]]
Check = Callable[[int, Any], None]  # (rank, result) -> assert


async def measure_all(p: int, calls: list[tuple[Call, Check]]) -> list[Traffic]:
    """Form one group of ``p`` ranks; run each call in turn, check its result, count bytes."""
    line_up = asyncio.Barrier(p)

    async def rank_main(g: p2pcoll.Group) -> list[dict[str, int]]:
        deltas = []
        for call, check in calls:
            await line_up.wait()
            before = g.stats()
            await line_up.wait()  # nobody starts before everyone has its "before"
            result = await call(g)
            await line_up.wait()  # everyone is done, so everything sent has been received
            after = g.stats()
            check(g.rank, result)
            deltas.append({k: after[k] - before[k] for k in KEYS})
        return deltas

    per_rank = await run_ranks(p, rank_main)
    out = []
    for i in range(len(calls)):
        t = Traffic(*([per_rank[r][i][k] for r in range(p)] for k in KEYS))
        assert sum(t.received) == sum(t.sent), t
        assert sum(t.messages_received) == sum(t.messages_sent), t
        out.append(t)
    return out


def chunk_bytes(count: int, parts: int) -> list[int]:
    """Bytes of each of ``parts`` float32 chunks, ``numpy.array_split`` convention."""
    return [F32 * len(c) for c in np.array_split(np.empty(count, np.uint8), parts)]


def inputs(rank: int, count: int) -> np.ndarray:
    """Small integers: float32 sums are exact in any order."""
    return ((np.arange(count) * 7 + rank * 3) % 11).astype(np.float32)


def allreduce_call(count: int, p: int, strategy: str) -> tuple[Call, Check]:
    expected = sum(inputs(r, count) for r in range(p))

    def check(rank: int, result: Any) -> None:
        np.testing.assert_array_equal(result, expected, err_msg=f"rank {rank}")

    return (lambda g: g.allreduce(inputs(g.rank, count), strategy=strategy)), check


def broadcast_call(count: int, root: int, strategy: str) -> tuple[Call, Check]:
    data = inputs(root, count)

    def check(rank: int, result: Any) -> None:
        np.testing.assert_array_equal(result, data, err_msg=f"rank {rank}")

    def call(g: p2pcoll.Group) -> Awaitable[Any]:
        return g.broadcast(data.copy() if g.rank == root else None, root=root,
                           strategy=strategy)

    return call, check


def allgather_call(part: int, p: int, strategy: str) -> tuple[Call, Check]:
    def check(rank: int, result: Any) -> None:
        assert len(result) == p
        for j, got in enumerate(result):
            np.testing.assert_array_equal(got, inputs(j, part), err_msg=f"rank {rank} part {j}")

    return (lambda g: g.allgather(inputs(g.rank, part), strategy=strategy)), check


# --- expected traffic, from the textbook schedules ---------------------------------------------


def lowbit(q: int, p: int) -> int:
    """Width of relative rank q's binomial subtree: q's lowest set bit, for the root the
    first power of two >= p."""
    if q:
        return q & -q
    return 1 << math.ceil(math.log2(p)) if p > 1 else 1


def rabenseifner_bytes(count: int, p: int) -> list[int]:
    """C5 on p' = 2^floor(lg p) blocks of ``array_split`` sizes, with the C4 fold.

    In the reduce-scatter (partner distance 1, 2, 4, ...: MPICH's order) newrank d gives away
    every block but the one it ends up owning, whose index is d's lg p' bits reversed. In the
    allgather it sends the aligned runs of 1, 2, ..., p'/2 blocks that contain that block.
    Evens below 2r send their n in; odds below 2r also send the n of the result back out.
    """
    pof2 = 1 << (p.bit_length() - 1)
    extra, bits = p - pof2, pof2.bit_length() - 1
    c = chunk_bytes(count, pof2)
    n = F32 * count

    def halving_doubling(d: int) -> int:
        own = int(format(d, f"0{bits}b")[::-1], 2) if bits else 0
        gathered = sum(sum(c[own & ~(w - 1):(own & ~(w - 1)) + w])
                       for w in (1 << k for k in range(bits)))
        return (n - c[own]) + gathered

    out = []
    for rank in range(p):
        if rank < 2 * extra and rank % 2 == 0:
            out.append(n)
        elif rank < 2 * extra:
            out.append(halving_doubling(rank // 2) + n)
        else:
            out.append(halving_doubling(rank - extra))
    return out


def scatter_allgather_bytes(count: int, p: int, root: int) -> list[int]:
    """C2: relative rank q sends its subtree's chunks but its own, [q+1, q+lowbit(q)), in the
    binomial scatter, then every chunk but chunk q+1 in the ring allgather."""
    c = chunk_bytes(count, p)
    n = F32 * count
    out = [0] * p
    for q in range(p):
        scatter = sum(c[q + 1:min(q + lowbit(q, p), p)])
        ring = n - c[(q + 1) % p] if p > 1 else 0
        out[(q + root) % p] = scatter + ring
    return out


def scatter_allgather_messages(p: int, root: int) -> list[int]:
    """One message per binomial child, then p-1 around the ring."""
    out = [0] * p
    for q in range(p):
        children = sum(1 for k in range(lowbit(q, p).bit_length() - 1) if q + (1 << k) < p)
        out[(q + root) % p] = children + (p - 1)
    return out


# Table C7: bytes sent by rank 0..p-1, count = 1000 float32, root 0.
C7_RABENSEIFNER = {
    2: [4000, 4000],
    3: [4000, 8000, 4000],
    4: [6000] * 4,
    5: [4000, 10000, 6000, 6000, 6000],
    6: [4000, 10000, 4000, 10000, 6000, 6000],
    8: [7000] * 8,
}
C7_SCATTER_RING = {  # MPICH's byte chunks; ours agree wherever p divides 1000
    2: [4000, 2000],
    3: [5332, 2668, 2666],
    4: [6000, 3000, 4000, 3000],
    5: [6400, 3200, 4000, 3200, 3200],
    6: [6666, 3333, 4000, 3333, 4000, 3333],
    8: [7000, 3500, 4000, 3500, 5000, 3500, 4000, 3500],
}
# Ours with array_split element chunks: p = 3 chunks 1336/1332/1332 bytes; p = 6 chunks
# 668 x 4, 664 x 2 bytes.
ARRAY_SPLIT_SCATTER_RING = {
    3: [5332, 2668, 2664],
    6: [6664, 3332, 4000, 3336, 4000, 3332],
}


def test_expected_tables_agree_with_the_formulas() -> None:
    for p, row in C7_RABENSEIFNER.items():
        assert rabenseifner_bytes(SMALL, p) == row
        assert sum(row) == 2 * (p - 1) * F32 * SMALL
    for p, row in C7_SCATTER_RING.items():
        ours = scatter_allgather_bytes(SMALL, p, 0)
        assert ours == (row if SMALL % p == 0 else ARRAY_SPLIT_SCATTER_RING[p])
        # In all: chunk j travels popcount(j) hops down the tree, and the ring sends (p-1)n.
        c = chunk_bytes(SMALL, p)
        tree = sum(j.bit_count() * c[j] for j in range(p))
        assert sum(ours) == tree + (p - 1) * F32 * SMALL


# --- the measurements ---------------------------------------------------------------------------


@pytest.mark.parametrize("p", [2, 3, 4, 5, 6, 7, 8])
async def test_rabenseifner_allreduce(p: int) -> None:
    """2(p-1)/p·n per rank for p a power of two dividing the count (C5); the fold otherwise;
    C7's vectors at 1000 elements; 2(p-1)·n on the wire in all, whatever the chunks."""
    pof2 = 1 << (p.bit_length() - 1)
    extra, rounds = p - pof2, 2 * (pof2.bit_length() - 1)
    counts = [SMALL, 1001, 3, 64 * pof2]  # C7; uneven blocks; fewer elements than blocks
    if p in (4, 6):
        counts.append(SEGMENTED * pof2)  # blocks just over one pipeline segment
    calls = [allreduce_call(count, p, "rabenseifner") for count in counts]
    for t, count in zip(await measure_all(p, calls), counts, strict=True):
        n = F32 * count
        assert t.sent == rabenseifner_bytes(count, p), count
        assert sum(t.sent) == 2 * (p - 1) * n, count
        if count % pof2 == 0:
            folded = 2 * (pof2 - 1) * n // pof2
            assert t.sent == [n if r < 2 * extra and r % 2 == 0
                              else folded + n if r < 2 * extra else folded for r in range(p)]
            if extra == 0:
                assert t.sent == [2 * (p - 1) * n // p] * p
        if count == SMALL and p in C7_RABENSEIFNER:
            assert t.sent == C7_RABENSEIFNER[p]
        if count != SEGMENTED * pof2:
            assert t.messages_sent == [1 if r < 2 * extra and r % 2 == 0
                                       else rounds + 1 if r < 2 * extra else rounds
                                       for r in range(p)]


@pytest.mark.parametrize("p", [2, 3, 4, 5, 6, 7, 8])
async def test_scatter_allgather_broadcast(p: int) -> None:
    """C2: binomial scatter of p chunks, then a ring allgather; C7's vectors where p divides
    1000, our element chunking otherwise; other roots are the same tree, shifted."""
    cases = [(0, SMALL), (p - 1, SMALL), (p // 2, 13)]
    if p in (3, 8):
        cases.append((1, SEGMENTED * p))
    calls = [broadcast_call(count, root, "scatter_allgather") for root, count in cases]
    for t, (root, count) in zip(await measure_all(p, calls), cases, strict=True):
        n = F32 * count
        assert t.sent == scatter_allgather_bytes(count, p, root), (root, count)
        # Relative rank q receives its subtree's chunks from its parent, then every chunk
        # but its own around the ring (the root: only the ring).
        c = chunk_bytes(count, p)
        for q in range(p):
            subtree = sum(c[q:min(q + lowbit(q, p), p)]) if q else 0
            assert t.received[(q + root) % p] == subtree + n - c[q], (root, count, q)
        if count == SMALL and root == 0:
            if SMALL % p == 0 and p in C7_SCATTER_RING:
                assert t.sent == C7_SCATTER_RING[p]
            if p in ARRAY_SPLIT_SCATTER_RING:
                assert t.sent == ARRAY_SPLIT_SCATTER_RING[p]
        if count == SMALL:
            assert t.messages_sent == scatter_allgather_messages(p, root)
        if count % p == 0:  # the root sends 2(p-1)/p·n; a leaf (odd q) (p-1)/p·n
            assert t.sent[root] == 2 * (p - 1) * n // p
            assert t.sent[(root + 1) % p] == (p - 1) * n // p


@pytest.mark.parametrize("p", [2, 3, 5, 8])
async def test_pipeline_broadcast(p: int) -> None:
    """Every rank but the last of the chain sends the whole data once, the last nothing;
    every rank but the root receives it once. Segmentation multiplies messages only."""
    cases = [(0, SMALL), (p // 2, SMALL), (p - 1, SEGMENTED * 3)]
    calls = [broadcast_call(count, root, "pipeline") for root, count in cases]
    for t, (root, count) in zip(await measure_all(p, calls), cases, strict=True):
        n = F32 * count
        last = (root - 1) % p
        assert t.sent == [0 if r == last else n for r in range(p)], (root, count)
        assert t.received == [0 if r == root else n for r in range(p)], (root, count)
        if count == SMALL:
            assert t.messages_sent == [0 if r == last else 1 for r in range(p)]
        else:  # several segments, one message each along every link
            segments = t.messages_sent[root]
            assert segments > 1
            assert t.messages_sent == [0 if r == last else segments for r in range(p)]


@pytest.mark.parametrize("p", [2, 3, 4, 5, 6, 7, 8])
async def test_recursive_doubling_allgather(p: int) -> None:
    """(p-1)/p of the gathered data per rank (C6): lg p messages for p a power of two;
    ceil(lg p) rounds for other p (Bruck), a round whose run of parts wraps past the last
    rank taking two messages."""
    parts = [250, 1]
    if p in (3, 4):
        parts.append(SEGMENTED)
    calls = [allgather_call(part, p, "recursive_doubling") for part in parts]
    lg = math.ceil(math.log2(p))
    for t, part in zip(await measure_all(p, calls), parts, strict=True):
        assert t.sent == [(p - 1) * F32 * part] * p, part
        assert t.received == t.sent
        if part == SEGMENTED:
            continue
        if p & (p - 1) == 0:
            assert t.messages_sent == [lg] * p
        else:
            # Round k sends the 2^k-run starting at my own part, cut to the p - 2^k missing.
            wraps = [sum(1 for k in range(lg) if r + min(1 << k, p - (1 << k)) > p)
                     for r in range(p)]
            assert t.messages_sent == [lg + w for w in wraps]


async def test_a_group_of_one_sends_nothing() -> None:
    calls = [
        allreduce_call(SMALL, 1, "rabenseifner"),
        broadcast_call(SMALL, 0, "pipeline"),
        broadcast_call(SMALL, 0, "scatter_allgather"),
        allgather_call(SMALL, 1, "recursive_doubling"),
    ]
    for t in await measure_all(1, calls):
        assert t == Traffic([0], [0], [0], [0])
