"""Helpers for testing code that uses p2pcoll: run N real peers as tasks in one event loop.

    results = await run_ranks(4, lambda g: g.allreduce(np.ones(3)))

Each peer is a real :class:`~p2pcoll.Group` with its own sockets (tcp on 127.0.0.1 by
default, or ``transport="ipc"`` / ``"inproc"``), so this tests exactly what runs in
production, minus the process boundary.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from .group import Group, join
from .rendezvous import RendezvousServer

T = TypeVar("T")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


async def run_ranks(
    n: int,
    fn: Callable[[Group], Awaitable[T]],
    *,
    return_exceptions: bool = False,
    join_timeout: float = 30.0,
    **join_kwargs: Any,
) -> list[T]:
    """Form a group of ``n`` peers in this event loop, run ``fn(group)`` on each, close them.

    Returns the results in rank order. With ``return_exceptions`` an exception raised by
    ``fn`` on a rank is returned in that rank's place instead of cancelling the others.
    """
    # Host the rendezvous here on a port the OS picks, so concurrent test runs never collide.
    server = RendezvousServer("tcp://127.0.0.1:0")
    url = server.bind()

    async def peer(rank: int) -> Any:
        async with join(url, world_size=n, rank=rank, timeout=join_timeout, **join_kwargs) as g:
            if return_exceptions:
                try:
                    return await fn(g)
                except Exception as exc:
                    return exc
            return await fn(g)

    try:
        return list(await asyncio.gather(*(peer(r) for r in range(n))))
    finally:
        await server.aclose()
