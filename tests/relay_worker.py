"""A peer for tests/test_relay_nat.py: joins from the environment, then by ``argv[1]``:

- ``collectives``: runs every collective on fixed inputs and prints one JSON line: the
  sha256 of each result, ``stats()``, and allreduce times (4 KiB, 16 MiB); with
  ``RELAY_WORKER_PAIR=A,B``, ranks A and B then send each other 16 MiB twice and say how
  many bytes passed relays meanwhile (``pair_relayed``) and how long it took; ``connect``:
  from the start of join to the end of the first allreduce (the links opened); then it waits for a line on stdin
  before leaving (the test looks at the host's listening sockets meanwhile);
- ``until-lost``: prints ``{"formed": ...}``, then allreduces until one fails and prints
  the error's type, message and ``rank`` if it names one.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import sys
import time

import numpy as np

import p2pcoll


def digest(*arrays: object) -> str:
    h = hashlib.sha256()
    for a in arrays:
        for x in (a if isinstance(a, list) else [a]):
            if x is not None:
                h.update(np.ascontiguousarray(x).tobytes())
    return h.hexdigest()[:16]


async def collectives(g: p2pcoll.Group, joined: float) -> None:
    r, n = g.rank, g.world_size
    rng = np.random.default_rng(r)
    x = rng.standard_normal(10_001).astype(np.float32)
    first = digest(await g.allreduce(x))
    connected = time.perf_counter() - joined  # join and the first allreduce: links opened
    out = {
        "allreduce": first,
        "allreduce_ring": digest(await g.allreduce(x, strategy="ring")),
        "reduce": digest(await g.reduce(x, root=1)),
        "reduce_scatter": digest(await g.reduce_scatter(x)),
        "broadcast": digest(await g.broadcast(x, root=3 % n)),
        "allgather": digest(await g.allgather(x)),
        "alltoall": digest(await g.alltoall([x[: 100 + i] for i in range(n)])),
        "gather": digest(await g.gather(x, root=2 % n)),
        "scatter": digest(await g.scatter([x[: 50 + i] for i in range(n)] if r == 0 else None,
                                          root=0)),
    }
    await g.barrier()
    times = {}
    for name, size in (("4KiB", 1024), ("16MiB", 4 << 20)):
        data = np.ones(size, np.float32)
        await g.allreduce(data)
        samples = []
        for _ in range(5 if size > 1024 else 20):
            await g.barrier()
            start = time.perf_counter()
            await g.allreduce(data)
            samples.append(time.perf_counter() - start)
        times[name] = sorted(samples)[len(samples) // 2]
    pair = [int(p) for p in os.environ.get("RELAY_WORKER_PAIR", "").split(",") if p]
    pair_relayed = None
    if r in pair:
        other = pair[1 - pair.index(r)]
        before = g.stats()["bytes_relayed"]
        data = np.full(4 << 20, r, np.float32)
        started = time.perf_counter()
        for _ in range(2):
            if r < other:
                await g.send(data, other)
                got = await g.recv(other)
            else:
                got = await g.recv(other)
                await g.send(data, other)
            assert np.all(np.asarray(got) == other)
        pair_relayed = g.stats()["bytes_relayed"] - before
        times["pair_16MiB_x2"] = time.perf_counter() - started
    await g.barrier()
    stats = g.stats()
    times["connect"] = connected
    print(json.dumps({"rank": r, "digests": out, "times": times,
                      "bytes_relayed": stats["bytes_relayed"],
                      "peer_links": stats["peer_links"], "pair_relayed": pair_relayed,
                      "direct_punched": stats["direct_punched"],
                      "punch_failed": stats["punch_failed"]}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)


async def until_lost(g: p2pcoll.Group) -> None:
    print(json.dumps({"formed": g.rank}), flush=True)
    x = np.ones(1 << 16, np.float32)
    try:
        while True:
            await g.allreduce(x, timeout=60)
            await asyncio.sleep(0.05)
    except p2pcoll.P2PCollError as exc:
        print(json.dumps({"rank": g.rank, "error": type(exc).__name__, "message": str(exc),
                          "lost": getattr(exc, "rank", None)}), flush=True)


async def main() -> None:
    if os.environ.get("RELAY_WORKER_LOG"):  # the relay's debug lines, to this file
        handler = logging.FileHandler(os.environ["RELAY_WORKER_LOG"])
        handler.setFormatter(logging.Formatter("%(asctime)s %(process)d %(message)s"))
        logging.getLogger("p2pcoll.relay").addHandler(handler)
        logging.getLogger("p2pcoll.relay").setLevel(logging.DEBUG)
    joined = time.perf_counter()
    g = await p2pcoll.join()
    if sys.argv[1] == "collectives":
        try:
            await collectives(g, joined)
        finally:
            await g.close()  # once the others have read all it sent
    else:
        try:
            await until_lost(g)
        finally:
            await g.close(wait=False)


if __name__ == "__main__":
    asyncio.run(main())
