"""One peer process of tests/test_cause_travels.py: a survivor that closes at once after a
peer was lost must not hide that loss behind its own goodbye.

    P2PCOLL_RENDEZVOUS=... WORLD_SIZE=N RANK=r python tests/cause_worker.py DIR VICTIM CLOSER MODE \
        [BYSTANDER ...]

Every peer joins and runs an allreduce (so the ring's links are open), a gather to the
CLOSER and a scatter from it (so the closer has a link to every peer, and every peer to it),
then prints ``{"ready": {"rank": r}}``. Then:

- the VICTIM waits to be SIGKILLed by the test (it never starts the next collective, so the
  others are blocked in it when it dies);
- the CLOSER closes the group at once when it learns of the loss: in MODE ``idle`` it never
  starts the collective and leaves as soon as its group is degraded; in MODE ``failing`` it
  takes part in the collective, which fails with the victim's PeerLost, and leaves at once;
- a BYSTANDER runs no collective and stays until DIR/done appears (the victim's other
  watcher, say: it spreads the news of the loss over the fingers without failing a
  collective, so no abort of its own goes to everyone at once);
- every other peer runs the collective and prints ``{"after": {"rank": r, "error": ...,
  "rank_named": ..., "links": ...}}``: the class and message of what it raised, the rank its
  PeerLost names and the data links it has open then. It then stays until DIR/done appears, so that its own goodbye is not in question.
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
    where, victim, closer, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    bystanders = {int(r) for r in sys.argv[5:]}
    done = os.path.join(where, "done")
    async with p2pcoll.join(timeout=120, collective_timeout=60) as g:
        await g.allreduce(np.ones(4), strategy="ring")
        # The closer gathers from and scatters to everyone: it has a link to each peer, so
        # its goodbye goes straight to all of them (as rank 0's did in CI).
        await g.gather(np.array([g.rank]), root=closer)
        await g.scatter([np.array([r]) for r in range(g.world_size)] if g.rank == closer
                        else None, root=closer)
        print(json.dumps({"ready": {"rank": g.rank}}), flush=True)
        if g.rank == victim:
            await asyncio.sleep(600)  # until SIGKILL
            return
        if g.rank == closer and mode == "idle":
            while g.state is p2pcoll.GroupState.READY:
                await asyncio.sleep(0.001)
            print(json.dumps({"after": {"rank": g.rank, "state": str(g.state)}}), flush=True)
            return  # leaves the group at once: the goodbye goes out now
        if g.rank in bystanders:
            await stay(done)
            return
        error, named = "", None
        try:
            await g.allreduce(np.ones(4), strategy="ring")
        except p2pcoll.P2PCollError as exc:
            error = f"{type(exc).__name__}: {exc}"
            named = getattr(exc, "rank", None)
        links = getattr(g.session.transport, "links", None)  # after the failure's aborts
        print(json.dumps({"after": {"rank": g.rank, "error": error, "rank_named": named,
                                    "links": links}}), flush=True)
        if g.rank == closer:
            return  # failing mode: leaves at once after its collective failed
        await stay(done)


async def stay(done: str) -> None:
    """Until ``done`` exists (two minutes at most)."""
    deadline = time.monotonic() + 120
    while not os.path.exists(done) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


if __name__ == "__main__":
    asyncio.run(main())
