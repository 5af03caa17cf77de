"""One peer of tests/test_sender_loss.py: joins, says "ready", waits for "go", then runs one
scenario's operation in a loop until it fails, and prints what failed as a JSON line.

    python tests/sender_loss_peer.py URL RANK WORLD SCENARIO NBYTES [API]

Scenarios (every rank runs the same loop; the test kills or stops one of them):
    send       rank 0 sends to rank 1, which receives
    recv       the same pair, seen from the receiver (the test kills rank 0)
    broadcast  root 0 broadcasts to the others
    gather     every rank gathers to root 0
    allreduce  every rank allreduces

API is ``async`` (the default, ``p2pcoll.join``) or ``blocking`` (``p2pcoll.blocking``, its
loop thread; the same operations as blocking calls).

The JSON line: ``error`` (the exception's class name or null), ``message``, ``rank`` (the
rank a PeerLost names), ``failed_at`` (wall-clock time of the failure: the test compares it
with the time it killed or stopped the victim), ``done`` (operations completed) and
``on_lane`` (messages this peer sent on TCP lanes). Transports, host ids and timeouts come
from the environment (P2PCOLL_TRANSPORT, P2PCOLL_SHM, P2PCOLL_HOST_ID,
P2PCOLL_HEARTBEAT_TIMEOUT, P2PCOLL_TIMEOUT).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import numpy as np

from typing import Any

import p2pcoll
import p2pcoll.blocking

from lanes_up import warm_up, warm_up_blocking  # beside this script


def step(g: Any, scenario: str, data: np.ndarray) -> Any:
    """One operation of the scenario: a coroutine of an async group, done on a blocking one."""
    if scenario in ("send", "recv"):
        if g.rank == 0:
            return g.send(data, dst=1)
        return g.recv(src=0, out=np.empty_like(data))
    if scenario == "broadcast":
        return g.broadcast(data if g.rank == 0 else np.empty_like(data), root=0)
    if scenario == "gather":
        return g.gather(data, root=0)
    if scenario == "allreduce":
        return g.allreduce(data)
    raise SystemExit(f"unknown scenario {scenario!r}")


def result(g: p2pcoll.Group, out: dict[str, Any], done: int, warm: int) -> str:
    out.update(failed_at=time.time(), done=done, warm_lane=warm,
               on_lane=int(g.session.transport.counters.messages_sent_lane))
    return json.dumps(out)


def main_blocking(url: str, rank: int, world: int, scenario: str, data: np.ndarray) -> None:
    g = p2pcoll.blocking.join(url, world_size=world, rank=rank, timeout=60)
    g.barrier(timeout=60)
    warm_up_blocking(g)  # small allreduces until every rank has sent on its TCP lanes
    warm = int(g.aio.session.transport.counters.messages_sent_lane)
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        g.close()
        return
    done, out = 0, {}
    try:
        while True:
            step(g, scenario, data)
            done += 1
    except p2pcoll.P2PCollError as exc:
        out = {"error": type(exc).__name__, "message": str(exc),
               "rank": getattr(exc, "rank", None)}
    print(result(g.aio, out, done, warm), flush=True)
    g.close()


async def main() -> None:
    url, rank, world, scenario, nbytes = (sys.argv[1], int(sys.argv[2]), int(sys.argv[3]),
                                          sys.argv[4], int(sys.argv[5]))
    g = await p2pcoll.join(url, world_size=world, rank=rank, timeout=60)
    await g.barrier(timeout=60)  # every link is up
    await warm_up(g)  # small allreduces until every rank has sent on its TCP lanes
    warm = int(g.session.transport.counters.messages_sent_lane)
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
    print(result(g, out, done, warm), flush=True)
    await g.close()


if __name__ == "__main__":
    if sys.argv[6:] == ["blocking"]:
        main_blocking(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4],
                      np.full(int(sys.argv[5]) // 8, float(sys.argv[2])))
    else:
        asyncio.run(main())
