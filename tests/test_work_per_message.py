"""The work per message does not grow with the group, counted: the Python functions called
(and C functions called from Python) during one allreduce over the in-memory transport,
divided by the data messages it sent, at p = 16 and p = 128.

A loop in Python over the peers, the chunks or the schedule once per message (a message of
p pieces, a per-send rescan of the later steps: each was there once) multiplies this count
by about p/16 at p = 128; what is allowed is the fixed cost of a call spread over more or
fewer messages. A scan inside one C call (``list.index`` over the roster, also there once)
counts as one call: that kind is left to the benchmark. Time per message is measured, not
asserted, by benchmarks/scale_memory.py.
"""

from __future__ import annotations

import asyncio
import sys
from types import FrameType
from typing import Any

import numpy as np
import pytest

from p2pcoll.testing import memory_groups

pytestmark = pytest.mark.slow

STRATEGIES = ["ring", "gloo_ring", "recursive_doubling", "rabenseifner", "reduce_broadcast"]


async def calls_per_message(p: int, strategy: str) -> float:
    groups = await memory_groups(p)
    try:
        data = [np.full(1000, r + 1, np.float32) for r in range(p)]

        async def once() -> list[np.ndarray]:
            return list(await asyncio.gather(*(g.allreduce(data[g.rank], strategy=strategy)
                                               for g in groups)))

        await once()  # compiles the programs, opens what is opened once
        sent = sum(g.stats()["messages_sent"] for g in groups)
        calls = 0

        def count(frame: FrameType, event: str, arg: Any) -> None:
            nonlocal calls
            if event in ("call", "c_call"):
                calls += 1

        sys.setprofile(count)
        try:
            outs = await once()
        finally:
            sys.setprofile(None)
        messages = sum(g.stats()["messages_sent"] for g in groups) - sent
        expected = np.full(1000, p * (p + 1) / 2, np.float32)
        for out in outs:
            np.testing.assert_array_equal(out, expected)
        return calls / messages
    finally:
        await asyncio.gather(*(g.close() for g in groups))


@pytest.mark.parametrize("strategy", STRATEGIES)
async def test_calls_per_message_do_not_grow_with_p(strategy: str) -> None:
    small, large = await calls_per_message(16, strategy), await calls_per_message(128, strategy)
    # Measured: flat or falling (ring 110 -> 103, rabenseifner 132 -> 123 at p = 256).
    assert large <= 1.1 * small, (strategy, small, large)
