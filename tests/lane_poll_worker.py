"""One peer process of tests/test_lane_poll.py: small allreduces over TCP lanes, polled.

    P2PCOLL_SHM=0 P2PCOLL_TCP_LANES=1 python tests/lane_poll_worker.py URL RANK

Two peers over tcp run 4 KiB allreduces of values whose sums float32 holds exactly, and
check every result. After 200 calls each prints ``{"ready": {...}}`` and goes on; rank 0
goes on until a line comes on its standard input (the test stops and continues rank 1
meanwhile), then tells rank 1 inside the next allreduce, and both print ``{"after":
{"calls", "wrong", "lane_polls", "found", "parked"}}``: calls made, results that were not
exact, and the counters of the poll path (:class:`p2pcoll.transport.lane_poll.LanePoll`,
:class:`p2pcoll.engine.polling.MessageWait`), or -1 where there is none.
"""

from __future__ import annotations

import asyncio
import json
import sys

import numpy as np

import p2pcoll


async def main() -> None:
    url, rank = sys.argv[1], int(sys.argv[2])
    loop = asyncio.get_running_loop()
    told = asyncio.Event()
    if rank == 0:
        loop.add_reader(sys.stdin.fileno(), told.set)
    async with p2pcoll.join(url, world_size=2, rank=rank, transport="tcp", timeout=60,
                            collective_timeout=60) as g:
        base = np.arange(1024, dtype=np.float32)
        calls = wrong = 0
        while True:
            x = base + rank * 1000 + calls % 7
            x[0] = 1.0 if told.is_set() else 0.0  # rank 0 says stop: the sum says so
            want = 2 * base + 1000 + 2 * (calls % 7)
            got = await g.allreduce(x)
            done = got[0] > 0
            got[0] = want[0]
            wrong += int(not np.array_equal(got, want))
            calls += 1
            if calls == 200:
                print(json.dumps({"ready": {"rank": rank}}), flush=True)
            if done and calls > 200:
                break
        poll = g.session.matcher.poll
        waits = getattr(g.session.matcher, "waits", None)
        print(json.dumps({"after": {
            "calls": calls, "wrong": wrong,
            "lane_polls": getattr(poll, "lane_polls", -1),
            "found": waits.found if waits is not None else -1,
            "parked": waits.parked if waits is not None else -1}}), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
