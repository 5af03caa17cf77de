"""Helpers for testing code that uses p2pcoll.

    results = await run_ranks(4, lambda g: g.allreduce(np.ones(3)))

:func:`run_ranks` runs N real peers as tasks in one event loop: each is a real
:class:`~p2pcoll.Group` with its own sockets (tcp on 127.0.0.1 by default, or
``transport="ipc"`` / ``"inproc"``), so this tests exactly what runs in production, minus
the process boundary. :func:`memory_groups` forms N groups over the in-memory transport
instead (no sockets, no rendezvous), whose :class:`MemoryNetwork` can drop, delay and
reorder messages, freeze a peer, cut a link or cut a peer off.

:func:`run_virtual` runs a coroutine on an event loop with a virtual clock that jumps to
the next timer whenever every task waits (trio's ``MockClock(autojump_threshold=0)``): over
``memory_groups``, deadlines, heartbeats and blame then cost no wall time::

    def test_a_frozen_peer_is_lost() -> None:
        async def main() -> None:
            network = MemoryNetwork()
            groups = await memory_groups(4, network=network)
            network.freeze(2)  # the survivors name rank 2 after the 5 s heartbeat
            ...
        run_virtual(main())
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from concurrent.futures import Executor
from typing import Any, TypeVar, TypeVarTuple

from .api import Group, form_group, join
from .rendezvous import RendezvousServer
from .settings import Settings
from .transport.endpoints import free_port
from .transport.memory import Faults, MemoryNetwork
from .types import Membership

T = TypeVar("T")
Ts = TypeVarTuple("Ts")


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

    ``settings`` are :class:`~p2pcoll.Settings` fields (``collective_timeout=2``,
    ``heartbeat_timeout=1`` ...). Close the groups when done. Pass a :class:`MemoryNetwork`
    to inject faults while they run: ``network.freeze(2)`` (rank 2 stops; its watchers lose
    it after the heartbeat), ``network.cut(0, 1)`` (the link between ranks 0 and 1),
    ``network.cut(2)`` (rank 2 crashes). ``hosts[r]`` names the host rank r is on (any
    values; equal means one host), as a roster does: strategies see them as ``ctx.hosts``
    and auto's cost model charges messages between hosts the tcp constants. Without it
    every rank is on one host.
    The network itself is the same for all: hosts change what is chosen, not how it moves.

    Raises:
        ValueError: ``hosts`` does not name one host per rank.
    """
    if hosts is not None and len(hosts) != n:
        raise ValueError(f"hosts must name one host per rank: {n} values, got {len(hosts)}")
    roster = tuple(str(h) for h in hosts) if hosts is not None else ()
    net = network or MemoryNetwork(faults or Faults())
    base = Settings.resolve({}, **settings)
    transports = [net.transport(heartbeat_s=base.heartbeat_timeout) for _ in range(n)]
    endpoints = tuple([(await t.bind())[0] for t in transports])
    group_id = f"memory-{id(net):x}"
    return list(await asyncio.gather(*(
        form_group(base, transport=transport,
                   membership=Membership(group_id, 0, rank, n, endpoints, roster))
        for rank, transport in enumerate(transports))))


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock stands still while anything is ready to run, and jumps to
    the next timer when nothing is: every task waits on a timer, on an event or on another
    task, no file descriptor is ready and no thread started by ``run_in_executor`` (or
    ``asyncio.to_thread``) is still running.

    ``asyncio.sleep``, ``asyncio.timeout``, ``asyncio.wait_for`` and ``call_later`` all
    read :meth:`time`, so a 5 s heartbeat or a 30 s deadline passes in one turn of the loop.
    While an executor's thread runs the loop waits for it in real time, the clock not
    moving faster than the wall's. Sockets get no such care (the loop cannot know that a
    reply is on its way): this clock is for groups that do no I/O (``memory_groups``), not
    for peers over tcp. With no timer at all and nothing ready, the loop waits for I/O as
    any loop does.

    The clock starts at 0.
    """

    def __init__(self) -> None:
        self._now = 0.0
        self._threads = 0  # executor calls not done yet
        super().__init__(_JumpingSelector(self))

    def time(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        """Move the clock ``seconds`` forward (the loop does so itself when all wait).

        Raises:
            ValueError: ``seconds`` is negative or not a number.
        """
        if not seconds >= 0:
            raise ValueError(f"the clock only moves forward, not by {seconds!r} seconds")
        self._now += seconds

    @property
    def waiting_for_threads(self) -> bool:
        """Whether a call handed to an executor has not finished yet."""
        return self._threads > 0

    def run_in_executor(self, executor: Executor | None, func: Callable[[*Ts], T],
                        *args: *Ts) -> asyncio.Future[T]:
        future = super().run_in_executor(executor, func, *args)
        self._threads += 1
        future.add_done_callback(self._thread_done)
        return future

    def _thread_done(self, _: object) -> None:
        self._threads -= 1


class _JumpingSelector(selectors.DefaultSelector):
    """The loop's selector: ``select(timeout)`` is the one place a loop waits (see
    ``BaseEventLoop._run_once``: the timeout is 0 while callbacks are ready, else the time
    to the next timer, or None without timers). Here it polls without waiting, and if
    nothing is ready (nor a thread running) moves the clock by the timeout instead of
    sleeping through it."""

    def __init__(self, loop: VirtualClockLoop) -> None:
        super().__init__()
        self._loop = loop

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        events = super().select(0)
        if events or (timeout is not None and timeout <= 0):
            return events
        if timeout is None or self._loop.waiting_for_threads:
            return super().select(timeout)  # what wakes the loop is a thread's, in real time
        self._loop.advance(timeout)
        return []


def run_virtual(coro: Coroutine[Any, Any, T], *, debug: bool | None = None) -> T:
    """Run ``coro`` to completion on a new :class:`VirtualClockLoop`, as ``asyncio.run``.

    Inside it, ``asyncio.get_running_loop().time()`` is the virtual time: a test asserts
    how much of it passed (a heartbeat, a deadline), never the wall time.

    Raises:
        RuntimeError: called from a running event loop.
        Whatever ``coro`` raises.
    """
    with asyncio.Runner(debug=debug, loop_factory=VirtualClockLoop) as runner:
        return runner.run(coro)


__all__ = ["Faults", "MemoryNetwork", "VirtualClockLoop", "free_port", "memory_groups",
           "run_ranks", "run_virtual"]
