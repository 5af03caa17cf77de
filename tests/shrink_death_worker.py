"""One peer of tests/test_shrink_processes.py: a group of 4 loses rank 3 (SIGKILL), the
survivors shrink without it, and rank 2 dies during that shrink.

    python tests/shrink_death_worker.py WHEN

WHEN is the moment rank 2 SIGKILLs itself, inside its own ``Group.shrink`` (its module
functions replaced in this process only, so the moment is exact, not a sleep's race):

- ``offer``: before it sends its offer (the others wait for it over the old links);
- ``forming``: after every offer has come and gone (the others have its new endpoint and
  wait for its hello in the new group).

Ranks 0 and 1 print ``{"shrink": {"error": class, "rank": PeerLost.rank, "message": str,
"seconds": from the call to its error}}`` (``"error": null`` if it returned a group).
The rendezvous, world size and rank come from the environment (tests/peer_processes.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from typing import Any, NoReturn

import numpy as np

import p2pcoll
from p2pcoll import P2PCollError, PeerLost
from p2pcoll.session import shrink as shrinking

VICTIM, FIRST = 2, 3  # rank 2 dies during the shrink that leaves out rank 3


def say(key: str, value: object) -> None:
    print(json.dumps({key: value}), flush=True)


def die(*args: Any, **kwargs: Any) -> NoReturn:
    os.kill(os.getpid(), signal.SIGKILL)
    raise AssertionError("unreachable")


async def main() -> None:
    when = sys.argv[1]
    g = await p2pcoll.join()
    await g.allreduce(np.ones(4))  # every rank is in
    if g.rank == FIRST:
        die()
    try:
        await g.allreduce(np.ones(4))
    except P2PCollError:
        pass  # PeerLost naming rank 3 (or the abort of a peer that saw it first)
    if g.rank == VICTIM:
        if when == "offer":
            shrinking._exchange = die  # type: ignore[assignment]
        else:
            shrinking.handshake = die  # type: ignore[assignment]
    started = time.monotonic()
    try:
        new = await g.shrink([FIRST])
    except P2PCollError as exc:
        rank = exc.rank if isinstance(exc, PeerLost) else None
        say("shrink", {"error": type(exc).__name__, "rank": rank, "message": str(exc),
                       "seconds": time.monotonic() - started})
    else:
        say("shrink", {"error": None, "rank": None, "message": "",
                       "seconds": time.monotonic() - started})
        await new.close()
    await g.close()


if __name__ == "__main__":
    asyncio.run(main())
