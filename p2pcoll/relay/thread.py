"""The event loop every relay splice of a process runs on: a thread of its own.

A connection through a relay passes up to three splices in Python (the sender's entrance,
the relay, the target's attachment). ZMTP's heartbeats pass them too, and a peer's liveness
must not depend on its event loop (a loop busy with a long step, or blocked by the
program, would look like a dead peer: see ``SocketFactory.mesh_probe``). So the splices,
and a relay a peer's rendezvous hosts, run on one asyncio loop per process, on a daemon
thread started on first use; the calling loop only starts and stops them
(:func:`run`) and is told of a lost relay through ``call_soon_threadsafe``. Python holds
one lock for both threads, but lets go of it every few milliseconds and during I/O and
numpy's or torch's long operations, which is what a splice needs.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["loop", "run", "submit"]

T = TypeVar("T")

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None


def loop() -> asyncio.AbstractEventLoop:
    """The relay loop of this process, started if need be."""
    global _loop
    with _lock:
        if _loop is None or _loop.is_closed():
            made = asyncio.new_event_loop()
            threading.Thread(target=made.run_forever, name="p2pcoll-relay",
                             daemon=True).start()
            _loop = made
        return _loop


def submit(coro: Coroutine[Any, Any, T]) -> asyncio.Future[T]:
    """Start ``coro`` on the relay loop; its outcome, awaitable from the calling loop."""
    return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, loop()))


async def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` on the relay loop and return what it returns (raises what it raises).

    Cancellation: ``coro`` is cancelled too."""
    return await submit(coro)
