"""One peer process of tests/test_mesh_scale.py: join, check every collective, report.

    P2PCOLL_RENDEZVOUS=... WORLD_SIZE=N RANK=r python tests/mesh_worker.py DIR [--collectives]

With ``--collectives`` it runs every collective (allreduce under ring, recursive doubling
and auto; broadcast, allgather, reduce_scatter, gather, scatter, barrier) and checks each
result against what numpy computes. Then it prints one JSON line ``{"ready": ...}``: its
rank, data links opened, heartbeat probes, open file descriptors, RSS and whether every
result was right. It waits for DIR/go to appear (the test kills a victim first), runs a
ring allreduce and prints ``{"after": ...}``: the error it raised (a survivor should get the
victim's PeerLost) and the seconds from DIR/go to the error, and leaves. The soft limit of
open files is whatever the parent set (the test runs some under ``ulimit -n 256``).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

import numpy as np

import p2pcoll


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def collectives(g: p2pcoll.Group) -> list[str]:
    """Every collective once; the names of those whose result was wrong."""
    r, p = g.rank, g.world_size
    wrong = []
    mine = np.arange(1000, dtype=np.float64) + r
    total = np.arange(1000, dtype=np.float64) * p + p * (p - 1) / 2
    for strategy in ("ring", "recursive_doubling", None):
        got = await g.allreduce(mine, strategy=strategy)
        if not np.array_equal(got, total):
            wrong.append(f"allreduce {strategy}")
    big = await g.allreduce(np.full(1 << 18, float(r), np.float32))
    if not np.all(big == p * (p - 1) / 2):
        wrong.append("allreduce 1 MiB")
    root = p - 1
    got = await g.broadcast(np.arange(7.0) if r == root else None, root=root)
    if not np.array_equal(got, np.arange(7.0)):
        wrong.append("broadcast")
    gathered = await g.allgather(np.array([r, r * r], np.int64))
    if not np.array_equal(gathered, np.array([[q, q * q] for q in range(p)])):
        wrong.append("allgather")
    part = await g.reduce_scatter(np.ones(p * 3, np.int64) * (r + 1))
    if not np.array_equal(part, np.full(3, p * (p + 1) // 2)):
        wrong.append("reduce_scatter")
    at_root = await g.gather(np.array([r]), root=0)
    if r == 0 and not np.array_equal(np.ravel(at_root), np.arange(p)):
        wrong.append("gather")
    piece = await g.scatter([np.array([q * 10]) for q in range(p)] if r == 0 else None)
    if not np.array_equal(piece, np.array([r * 10])):
        wrong.append("scatter")
    await g.barrier()
    return wrong


async def main() -> None:
    where = sys.argv[1]
    go = os.path.join(where, "go")
    async with p2pcoll.join(timeout=300, collective_timeout=120) as g:
        wrong = await collectives(g) if "--collectives" in sys.argv else []
        t = g.session.transport
        print(json.dumps({"ready": {"rank": g.rank, "links": t.links, "probes": t.probes,
                                    "fds": fds(), "rss": rss(), "wrong": wrong}}), flush=True)
        while not os.path.exists(go):
            await asyncio.sleep(0.02)
        start = os.stat(go).st_mtime
        error = ""
        try:
            await g.allreduce(np.ones(4), strategy="ring", timeout=60)
        except p2pcoll.P2PCollError as exc:
            error = f"{type(exc).__name__}: {exc}"
        print(json.dumps({"after": {"rank": g.rank, "error": error,
                                    "seconds": time.time() - start}}), flush=True)
        # and leaves at once: a survivor that closes right after its failure is another
        # departure, whose goodbye carries the victim's loss to slower survivors (the root
        # cause, not "rank X left the group"; see p2pcoll.session.session).

if __name__ == "__main__":
    asyncio.run(main())
