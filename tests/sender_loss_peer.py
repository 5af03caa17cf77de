"""One peer of tests/test_sender_loss.py: joins, says "ready", waits for "go", then runs one
scenario's operation in a loop until it fails, and prints what failed as a JSON line.

    python tests/sender_loss_peer.py URL RANK WORLD SCENARIO NBYTES

Scenarios (every rank runs the same loop; the test kills or stops one of them):
    send       rank 0 sends to rank 1, which receives
    recv       the same pair, seen from the receiver (the test kills rank 0)
    broadcast  root 0 broadcasts to the others
    gather     every rank gathers to root 0

The JSON line: ``error`` (the exception's class name or null), ``message``, ``rank`` (the
rank a PeerLost names), ``failed_at`` (wall-clock time of the failure: the test compares it
with the time it killed or stopped the victim) and ``done`` (operations completed).
Transports and timeouts come from the environment (P2PCOLL_TRANSPORT, P2PCOLL_SHM,
P2PCOLL_HEARTBEAT_TIMEOUT, P2PCOLL_TIMEOUT).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import numpy as np

import p2pcoll


async def step(g: p2pcoll.Group, scenario: str, data: np.ndarray) -> None:
    if scenario in ("send", "recv"):
        if g.rank == 0:
            await g.send(data, dst=1)
        else:
            await g.recv(src=0, out=np.empty_like(data))
    elif scenario == "broadcast":
        await g.broadcast(data if g.rank == 0 else np.empty_like(data), root=0)
    elif scenario == "gather":
        await g.gather(data, root=0)
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")


async def main() -> None:
    url, rank, world, scenario, nbytes = (sys.argv[1], int(sys.argv[2]), int(sys.argv[3]),
                                          sys.argv[4], int(sys.argv[5]))
    g = await p2pcoll.join(url, world_size=world, rank=rank, timeout=60)
    await g.barrier(timeout=60)  # every link is up
    print("ready", flush=True)
    loop = asyncio.get_running_loop()
    # A thread reads stdin, so the event loop runs meanwhile (and answers peers).
    go = await loop.run_in_executor(None, sys.stdin.readline)
    if go.strip() != "go":
        await g.close()
        return
    data = np.full(nbytes // 8, float(rank))
    done, out = 0, {}
    try:
        while True:
            await step(g, scenario, data)
            done += 1
    except p2pcoll.P2PCollError as exc:
        out = {"error": type(exc).__name__, "message": str(exc),
               "rank": getattr(exc, "rank", None)}
    out.update(failed_at=time.time(), done=done)
    print(json.dumps(out), flush=True)
    await g.close()


if __name__ == "__main__":
    asyncio.run(main())
