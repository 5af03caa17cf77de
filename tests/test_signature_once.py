"""The readable signature travels once per peer and digest, not with every collective, and
a mismatch is still described field by field when the differing digest was told earlier."""

from __future__ import annotations

import asyncio
from collections import Counter

import numpy as np
import pytest

import p2pcoll
from p2pcoll.engine.executor import Wire
from p2pcoll.testing import memory_groups


def counting(wire: Wire, told: Counter[tuple[int, int, bytes]], rank: int) -> Wire:
    """``wire`` with every readable signature it sends counted by (rank, peer, digest)."""

    async def send_many(dsts, headers, pieces=(), *, copy=False):  # type: ignore[no-untyped-def]
        for to, h in zip(dsts, headers, strict=True):
            assert h.collective  # every data header names its collective
            if h.described is not None:
                told[rank, to, h.sig] += 1
        return await wire.send_many(dsts, headers, pieces, copy=copy)

    return Wire(send_many, wire.get, wire.combine)


async def test_described_once_per_peer_and_digest() -> None:
    groups = await memory_groups(3)
    told: Counter[tuple[int, int, bytes]] = Counter()
    for g in groups:
        g.session.executor.wire = counting(g.session.executor.wire, told, g.rank)
    try:
        for shape in (9, 9, 9, 20, 20, 9):
            out = await asyncio.gather(*(g.allreduce(np.full(shape, g.rank + 1.0),
                                                     strategy="ring") for g in groups))
            assert all((o == 6.0).all() for o in out)
        # Two signatures (two shapes), each described once to the one peer a rank of a
        # ring sends to (its right neighbour).
        assert len({digest for _, _, digest in told}) == 2
        assert set(told.values()) == {1}
        assert {(r, to) for r, to, _ in told} == {(0, 1), (1, 2), (2, 0)}
        assert len(told) == 2 * 3
    finally:
        await asyncio.gather(*(g.close() for g in groups))


@pytest.mark.parametrize("strategy", ["ring", "recursive_doubling"])
async def test_mismatch_named_from_a_signature_told_earlier(strategy: str) -> None:
    """Both ranks ran "max" and "sum" before (each digest told once), then rank 0 runs sum
    while rank 1 runs max: rank 1's message carries no readable signature, and the mismatch
    still names the op on both ranks."""
    groups = await memory_groups(2, collective_timeout=10)
    try:
        for op in ("max", "sum"):
            await asyncio.gather(*(g.allreduce(np.ones(8), op=op, strategy=strategy)
                                   for g in groups))
        results = await asyncio.gather(
            groups[0].allreduce(np.ones(8), op="sum", strategy=strategy),
            groups[1].allreduce(np.ones(8), op="max", strategy=strategy),
            return_exceptions=True)
        for r in results:
            assert isinstance(r, p2pcoll.CollectiveMismatch), repr(r)
            assert "op: rank" in str(r) and "'sum'" in str(r) and "'max'" in str(r), str(r)
    finally:
        await asyncio.gather(*(g.close() for g in groups))
