"""A job for ``p2pcoll peer`` in tests/test_readyz.py (run with this folder as the cwd)."""

from __future__ import annotations

import asyncio

import numpy as np

import p2pcoll


async def hold(group: p2pcoll.Group) -> None:
    """One allreduce, then idle (no collective) until stopped."""
    await group.allreduce(np.ones(16, dtype=np.float32))
    print("idle", flush=True)
    await asyncio.Event().wait()
