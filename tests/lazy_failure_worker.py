"""One peer process of tests/test_lazy_link_failures.py.

    P2PCOLL_RENDEZVOUS=... WORLD_SIZE=N RANK=r P2PCOLL_HOST_ID=host-r \
        python tests/lazy_failure_worker.py DIR VICTIM OPENER [--early]

Every peer is on a host of its own (so no shared-memory board links everyone), joins and
runs a ring allreduce, then prints ``{"ready": {"rank", "linked"}}``: the ranks it has
opened links to. It waits for DIR/go (the test freezes VICTIM first). OPENER, which never
had a link to VICTIM, then sends to it (opening that link: its handshake cannot complete,
VICTIM's process is stopped), prints ``{"opening": ...}`` and waits for VICTIM's answer;
every other survivor waits until it knows VICTIM has gone. Each then prints
``{"after": {"rank", "error"}}``: the error the opener's receive raised, or for the others
the PeerLost they hold for VICTIM; then it waits for DIR/done.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from typing import Any

import numpy as np

import p2pcoll


def say(**event: object) -> None:
    print(json.dumps(event), flush=True)


async def early_death(g: p2pcoll.Group, where: str, victim: int) -> None:
    """With ``--early``: VICTIM is killed (by the test) right after the group forms, before
    any data went to it; the others then run a ring allreduce, which needs it."""
    mesh: Any = g.session.transport
    say(ready={"rank": g.rank, "linked": sorted(mesh.routes.routes), "right": True})
    while not os.path.exists(os.path.join(where, "go")):
        await asyncio.sleep(0.02)
    error = ""
    try:
        await g.allreduce(np.ones(8), strategy="ring", timeout=60)
    except p2pcoll.P2PCollError as exc:
        error = f"{type(exc).__name__}: {exc}"
    say(after={"rank": g.rank, "error": error})
    while not os.path.exists(os.path.join(where, "done")):
        await asyncio.sleep(0.02)


async def main() -> None:
    where, victim, opener = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    early = "--early" in sys.argv
    async with p2pcoll.join(timeout=300, collective_timeout=120) as g:
        if early:
            await early_death(g, where, victim)
            return
        got = await g.allreduce(np.full(16, float(g.rank)), strategy="ring")
        right = bool(np.all(got == g.world_size * (g.world_size - 1) / 2))
        mesh: Any = g.session.transport  # a ZmqMesh: its links are what this test is about
        linked = sorted(mesh.routes.routes)
        say(ready={"rank": g.rank, "linked": linked, "right": right})
        while not os.path.exists(os.path.join(where, "go")):
            await asyncio.sleep(0.02)
        error = ""
        if g.rank == opener:
            await g.send(np.arange(3.0), victim, timeout=60)
            say(opening={"rank": g.rank, "linked": victim in mesh.routes.routes})
            try:
                await g.recv(victim, timeout=60)
            except p2pcoll.P2PCollError as exc:
                error = f"{type(exc).__name__}: {exc}"
        else:
            deadline = time.monotonic() + 60
            while victim not in g.session.peers.gone() and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            lost = g.session.peers.lost(victim)
            error = f"{type(lost).__name__}: {lost}" if lost is not None else ""
        say(after={"rank": g.rank, "error": error})
        while not os.path.exists(os.path.join(where, "done")):
            await asyncio.sleep(0.02)


if __name__ == "__main__":
    asyncio.run(main())
