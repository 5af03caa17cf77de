"""One peer process of tests/test_abort_spread.py: a peer is SIGKILLed while the others wait
for it in a ring allreduce; each survivor reports what it raised and the links it opened.

    P2PCOLL_RENDEZVOUS=... WORLD_SIZE=N RANK=r python tests/abort_spread_worker.py DIR VICTIM

Every peer joins and runs a ring allreduce (its links are open), then prints
``{"ready": {"rank": r, "opened": n}}`` (``stats()["links_opened"]``). The VICTIM then waits
to be SIGKILLed; every other peer runs the next ring allreduce, which fails, waits a moment
for the aborts still on their way, and prints ``{"after": {"rank": r, "error": ...,
"rank_named": ..., "opened": n, "links": n}}``, then stays until DIR/done appears (so no
goodbye is in question).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

import numpy as np

import p2pcoll


async def main() -> None:
    where, victim = sys.argv[1], int(sys.argv[2])
    async with p2pcoll.join(timeout=120, collective_timeout=60) as g:
        await g.allreduce(np.ones(4), strategy="ring")
        print(json.dumps({"ready": {"rank": g.rank, "opened": g.stats()["links_opened"]}}),
              flush=True)
        if g.rank == victim:
            await asyncio.sleep(600)  # until SIGKILL
            return
        error, named = "", None
        try:
            await g.allreduce(np.ones(4), strategy="ring")
        except p2pcoll.P2PCollError as exc:
            error = f"{type(exc).__name__}: {exc}"
            named = getattr(exc, "rank", None)
        await asyncio.sleep(1.0)  # the aborts passed on over the fingers have come
        print(json.dumps({"after": {"rank": g.rank, "error": error, "rank_named": named,
                                    "opened": g.stats()["links_opened"],
                                    "links": g.session.transport.links}}), flush=True)
        deadline = time.monotonic() + 120
        while not os.path.exists(os.path.join(where, "done")) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)


if __name__ == "__main__":
    asyncio.run(main())
