"""Helpers for testing code that uses p2pcoll.

    results = await run_ranks(4, lambda g: g.allreduce(np.ones(3)))

:func:`run_ranks` runs N real peers as tasks in one event loop: each is a real
:class:`~p2pcoll.Group` with its own sockets (tcp on 127.0.0.1 by default, or
``transport="ipc"`` / ``"inproc"``), so this tests exactly what runs in production, minus
the process boundary. :func:`memory_groups` forms N groups over the in-memory transport
instead (no sockets, no rendezvous), whose network can drop, delay and reorder messages
or cut a peer off.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from .api import Group, form_group, join
from .rendezvous import RendezvousServer
from .settings import Settings
from .transport.endpoints import free_port
from .transport.memory import Faults, MemoryNetwork
from .types import Membership

T = TypeVar("T")


async def run_ranks(
    n: int,
    fn: Callable[[Group], Awaitable[T]],
    *,
    return_exceptions: bool = False,
    join_timeout: float = 30.0,
    host_ids: Sequence[str] | None = None,
    **join_kwargs: Any,
) -> list[T]:
    """Form a group of ``n`` peers in this event loop, run ``fn(group)`` on each, close them.

    Returns the results in rank order. With ``return_exceptions`` an exception raised by
    ``fn`` on a rank is returned in that rank's place instead of cancelling the others.
    ``host_ids[r]`` is the host rank r counts as on (``join(host_id=...)``): peers with
    different values reach each other over tcp only, as on different machines, and the
    group's strategies see them on different hosts (``ctx.hosts``).

    Raises:
        ValueError: ``host_ids`` does not name one host per rank.
    """
    if host_ids is not None:
        if len(host_ids) != n or not all(isinstance(h, str) and h for h in host_ids):
            raise ValueError(f"host_ids must be {n} non-empty strings, one per rank, got "
                             f"{host_ids!r}")
        if "host_id" in join_kwargs:
            raise ValueError("give host_ids (one per rank) or host_id (all alike), not both")
    # Host the rendezvous here on a port the OS picks, so concurrent test runs never collide.
    server = RendezvousServer("tcp://127.0.0.1:0")
    url = server.bind()

    async def peer(rank: int) -> Any:
        kwargs = dict(join_kwargs)
        if host_ids is not None:
            kwargs["host_id"] = host_ids[rank]
        async with join(url, world_size=n, rank=rank, timeout=join_timeout, **kwargs) as g:
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


async def memory_groups(
    n: int, *, faults: Faults | None = None, network: MemoryNetwork | None = None,
    hosts: Sequence[object] | None = None, **settings: Any,
) -> list[Group]:
    """Form ``n`` groups over one in-memory network (``faults`` applied to data messages).

    ``settings`` are :class:`~p2pcoll.Settings` fields (``collective_timeout=2`` ...). Close
    the groups when done. ``groups[r].session.transport.network.cut(endpoint)`` simulates
    the crash of a peer. ``hosts[r]`` names the host rank r is on (any values; equal means
    one host), as a roster does: strategies see them as ``ctx.hosts`` and auto's cost model
    charges messages between hosts the tcp constants. Without it every rank is on one host.
    The network itself is the same for all: hosts change what is chosen, not how it moves.

    Raises:
        ValueError: ``hosts`` does not name one host per rank.
    """
    if hosts is not None and len(hosts) != n:
        raise ValueError(f"hosts must name one host per rank: {n} values, got {len(hosts)}")
    roster = tuple(str(h) for h in hosts) if hosts is not None else ()
    net = network or MemoryNetwork(faults or Faults())
    base = Settings.resolve({}, **settings)
    transports = [net.transport() for _ in range(n)]
    endpoints = tuple([(await t.bind())[0] for t in transports])
    group_id = f"memory-{id(net):x}"
    return list(await asyncio.gather(*(
        form_group(base, transport=transport,
                   membership=Membership(group_id, 0, rank, n, endpoints, roster))
        for rank, transport in enumerate(transports))))


__all__ = ["free_port", "memory_groups", "run_ranks"]
