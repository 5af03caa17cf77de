"""One peer of tests/test_busy_peers.py: joins, runs ROUNDS allreduces, each checked bit for
bit, and between two of them holds its event loop with synchronous work when it is one of
BUSY; prints one JSON line (``done``, and ``error``/``message``/``rank`` if a collective
failed).

    python tests/busy_peer.py URL RANK WORLD ROUNDS BUSY HOLD_S KIND [LEAVER]

BUSY: comma-separated ranks that hold their loop; KIND: ``spin`` (a pure-Python loop that
keeps the GIL) or ``sleep`` (time.sleep: the loop blocked, the GIL released). LEAVER: a rank
that closes its group ``HOLD_S / 3`` seconds into the first hold and stops (the others'
next collective fails naming it). The heartbeat timeout comes from the environment
(P2PCOLL_HEARTBEAT_TIMEOUT).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

import numpy as np

import p2pcoll

N = 1000


def hold(kind: str, seconds: float) -> None:
    """Keep this thread (the event loop's) busy for ``seconds``."""
    if kind == "sleep":
        time.sleep(seconds)
        return
    end = time.monotonic() + seconds
    while time.monotonic() < end:  # the GIL is held but for the interpreter's switches
        pass


async def main() -> None:
    url, rank, world, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    busy = {int(r) for r in sys.argv[5].split(",") if r}
    seconds, kind = float(sys.argv[6]), sys.argv[7]
    leaver = int(sys.argv[8]) if len(sys.argv) > 8 else -1
    g = await p2pcoll.join(url, world_size=world, rank=rank, timeout=60)
    await g.barrier(timeout=60)
    out: dict[str, Any] = {"done": 0}
    try:
        for r in range(rounds):
            data = np.arange(N, dtype=np.float64) * (rank + 1) + r
            total = await g.allreduce(data)
            expected = np.arange(N, dtype=np.float64) * (world * (world + 1) // 2) + world * r
            if not np.array_equal(total, expected):
                raise SystemExit(f"rank {rank}: round {r} is not bit-exact")
            out["done"] += 1
            if rank == leaver:
                await asyncio.sleep(seconds / 3)
                break
            if rank in busy:
                hold(kind, seconds)
    except p2pcoll.P2PCollError as exc:
        out.update(error=type(exc).__name__, message=str(exc), rank=getattr(exc, "rank", None))
    print(json.dumps(out), flush=True)
    await g.close()


if __name__ == "__main__":
    asyncio.run(main())
