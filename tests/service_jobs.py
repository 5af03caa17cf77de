"""Jobs for ``p2pcoll peer`` in tests/test_service.py (run with this folder as the cwd)."""

from __future__ import annotations

import asyncio
import os

import numpy as np

import p2pcoll

NOT_ASYNC = 42  # not a function at all


def sync_job(group: p2pcoll.Group) -> None:  # not async: refused before joining
    pass


async def sum_ranks(group: p2pcoll.Group) -> int:
    """Allreduce the ranks a few times; return $EXIT_CODE (default 0)."""
    for _ in range(3):
        total = await group.allreduce(np.array([group.rank], dtype=np.int64))
    print(f"total {int(total[0])}", flush=True)
    return int(os.environ.get("EXIT_CODE", "0"))


async def forever(group: p2pcoll.Group) -> None:
    """Allreduce until stopped, printing once the first one is done."""
    n = 0
    while True:
        await group.allreduce(np.ones(256, dtype=np.float32))
        n += 1
        if n == 1:
            print("running", flush=True)
        await asyncio.sleep(0.005)


async def fails(group: p2pcoll.Group) -> None:
    raise RuntimeError("the job's own bug")
