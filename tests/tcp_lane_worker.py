"""One peer process of tests/test_tcp_lane.py's killed-peer test, over TCP lanes.

    P2PCOLL_SHM=0 python tests/tcp_lane_worker.py URL RANK

Two peers over tcp run small allreduces (on the TCP lanes), then print ``{"ready": {"rank":
r, "on_lane": n}}``. Rank 0 then waits to be SIGKILLed; rank 1 keeps running small
allreduces and prints ``{"after": {"error": ..., "rank_named": ..., "seconds": ...}}``.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import numpy as np

import p2pcoll
from lanes_up import warm_up  # beside this script


async def main() -> None:
    url, rank = sys.argv[1], int(sys.argv[2])
    async with p2pcoll.join(url, world_size=2, rank=rank, transport="tcp", timeout=60,
                            collective_timeout=60) as g:
        x = np.ones(1024, np.float32)
        await warm_up(g)  # small allreduces until both have sent on their TCP lanes
        on_lane = g.session.transport.counters.messages_sent_lane
        print(json.dumps({"ready": {"rank": rank, "on_lane": on_lane}}), flush=True)
        if rank == 0:
            await asyncio.sleep(600)  # until SIGKILL
            return
        started = time.monotonic()
        error, named = "", None
        try:
            while time.monotonic() - started < 60:
                await g.allreduce(x)
                await asyncio.sleep(0.001)
        except p2pcoll.P2PCollError as exc:
            error, named = f"{type(exc).__name__}: {exc}", getattr(exc, "rank", None)
        print(json.dumps({"after": {"error": error, "rank_named": named,
                                    "seconds": time.monotonic() - started}}), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
