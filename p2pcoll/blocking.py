"""A blocking API for plain synchronous scripts (and mpi4py habits): no asyncio needed.

    import numpy as np
    import p2pcoll.blocking

    with p2pcoll.blocking.join() as g:               # the same arguments as p2pcoll.join
        total = g.allreduce(np.ones(4))              # blocks; the same result as the async API
        h = g.allreduce(np.ones(4), async_op=True)   # returns a Handle at once (Iallreduce)
        ...                                          # compute meanwhile
        total = h.wait()                             # the result, or the collective's error

:func:`join` forms an ordinary :class:`p2pcoll.Group` on the process's loop thread
(:mod:`p2pcoll.api.loop_thread`, the one the torch backend uses) and returns a
:class:`Group` that forwards each call there. Every collective has the names, arguments,
results and errors of :class:`p2pcoll.Group`'s, and an ``async_op`` flag: False (the
default) waits for the result; True returns a :class:`Handle` at once. Calls start in the
order they are made (``async_op`` or not), so ranks that make the same calls in the same
order match them up, as with the async API.

While an ``async_op`` call is in flight its arrays belong to the group: do not change its
input (nor read its ``out=``) before ``wait()`` returns, as with MPI's nonblocking calls.

Interrupting: a KeyboardInterrupt (Ctrl-C) or any other exception raised in the caller
while it waits propagates at once and cancels the call it interrupted, which breaks the
group (the peers get an abort naming this rank rather than waiting for their deadline).

Closing: :meth:`Group.close`, the end of a ``with`` block, or, for a group still open when
the interpreter exits, an atexit hook: the peers always get a goodbye, never a timeout.

Where not to block: a blocking call (or :meth:`Handle.wait`) made on a thread that is
running an asyncio event loop would stall that loop (and deadlock on p2pcoll's own loop
thread), so it raises :class:`LoopBlocked` at once. Use the async API there; ``async_op=True``
is allowed anywhere, and ``await asyncio.to_thread(handle.wait)`` waits without blocking.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Coroutine, Mapping, Sequence
from types import TracebackType
from typing import Any, Generic, Literal, Self, TypeVar, overload

import numpy as np

from .api.group import Group as AsyncGroup
from .api.join import _join, takes_arguments_of
from .api.join import join as _async_join
from .api.loop_thread import LoopBlocked, LoopThread, wait
from .errors import GroupBroken
from .session.failure import GroupState
from .session.flight import arm_signal
from .settings import Settings
from .types import CustomOp, Membership, Pytree, ReduceOp

T = TypeVar("T")
Op = str | ReduceOp | CustomOp


class Handle(Generic[T]):
    """A call started with ``async_op=True`` (like torch's Work, mpi4py's Request)."""

    __slots__ = ("_future", "_what")

    def __init__(self, future: concurrent.futures.Future[T], what: str) -> None:
        self._future = future
        self._what = what

    def done(self) -> bool:
        """True once the call has finished, with its result or its error."""
        return self._future.done()

    def wait(self, timeout: float | None = None) -> T:
        """Wait for the call and return its result (the async API's, e.g. the reduced array).

        Args:
            timeout: seconds to wait here; None waits as long as the call takes (the call
                has its own deadline, the group's ``collective_timeout`` or its ``timeout=``).

        Raises:
            whatever the call raises (CollectiveTimeout, PeerLost, GroupBroken, ValueError
                for bad arguments, ...), on every wait.
            TimeoutError: ``timeout`` passed first; the call goes on, and ``wait`` may be
                called again.
            LoopBlocked: called, before the call has finished, on a thread running an
                event loop (once ``done()``, ``wait()`` returns at once anywhere).
            KeyboardInterrupt: Ctrl-C while waiting; the call is cancelled first, which
                breaks the group.
        """
        if not self._future.done():
            LoopThread.check_may_block(f"{self._what}'s Handle.wait()")
        try:
            return self._future.result(timeout)
        except TimeoutError:
            if self._future.done():
                raise
            raise TimeoutError(f"{self._what} did not finish in {timeout:g}s") from None
        except BaseException:
            if not self._future.done():
                self._future.cancel()
            raise

    def __repr__(self) -> str:
        return f"<Handle {self._what} {'done' if self.done() else 'pending'}>"


class Group:
    """A :class:`p2pcoll.Group` for synchronous callers. Made by :func:`join`.

    Each collective takes the async method's arguments plus ``async_op``; see
    :class:`p2pcoll.Group` for what each does, returns and raises. A blocking call's error is
    raised in the caller; an ``async_op`` call's by its :meth:`Handle.wait`.

    Any method may be called from any thread (the calls are serialized in the order they
    reach the loop thread). After :meth:`close` every call raises GroupBroken.

    Raises (besides what the async method raises):
        GroupBroken: the group is closed (raised at once, also with ``async_op``).
        LoopBlocked: a blocking call (``async_op`` False), :meth:`stats` or :meth:`close`
            on a thread running an asyncio event loop; nothing is started.
        KeyboardInterrupt: Ctrl-C while blocked; the interrupted call is cancelled, which
            breaks the group (the peers get an abort at once).
    """

    def __init__(self, group: AsyncGroup, loop_thread: LoopThread) -> None:
        self._group = group
        self._loop_thread = loop_thread
        self._lock = threading.Lock()
        self._closed = False
        self._exit_key = LoopThread.close_at_exit(self._close_at_exit)

    # --- what a group is ----------------------------------------------------------------

    @property
    def aio(self) -> AsyncGroup:
        """The asyncio Group underneath, for coroutines run on the loop thread."""
        return self._group

    @property
    def settings(self) -> Settings:
        return self._group.settings

    @property
    def state(self) -> GroupState:
        """``forming``, ``ready``, ``degraded``, ``broken`` or ``closed`` (see p2pcoll.Group)."""
        return self._group.state

    @property
    def cause(self) -> BaseException | None:
        """The failure that broke the group, or None."""
        return self._group.cause

    @property
    def membership(self) -> Membership:
        """The roster this group was formed with (a frozen value)."""
        return self._group.membership

    @property
    def rank(self) -> int:
        """This peer's rank, 0..world_size-1."""
        return self._group.rank

    @property
    def world_size(self) -> int:
        """The number of peers."""
        return self._group.world_size

    @property
    def endpoint(self) -> str:
        """The first address this peer receives on."""
        return self._group.endpoint

    @property
    def timeout(self) -> float:
        """The default deadline of each collective, seconds."""
        return self._group.timeout

    def stats(self) -> dict[str, Any]:
        """Traffic and collectives since join (see :meth:`p2pcoll.Group.stats`).

        Raises:
            GroupBroken: the group is closed.
            LoopBlocked: called on a thread running an event loop (read ``g.aio.stats()``
                in a coroutine on the loop thread instead).
        """
        self._check_open("stats")
        return self._loop_thread.call(self._group.stats)

    def flight_record(self) -> list[dict[str, Any]]:
        """This rank's last calls, oldest first (see :meth:`p2pcoll.Group.flight_record`).

        Raises:
            GroupBroken: the group is closed.
            LoopBlocked: called on a thread running an event loop.
        """
        self._check_open("flight_record")
        return self._loop_thread.call(self._group.flight_record)

    # --- the calls ----------------------------------------------------------------------

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise GroupBroken(f"{what}: the group is closed")

    def _call(self, what: str, coro: Coroutine[Any, Any, T], async_op: bool) -> T | Handle[T]:
        if self._closed:
            coro.close()
            raise GroupBroken(f"{what}: the group is closed")
        if async_op:
            return Handle(self._loop_thread.submit(coro), what)
        try:
            self._loop_thread.check_may_block(f"{what}()")
        except LoopBlocked:
            coro.close()
            raise
        return wait(self._loop_thread.submit(coro, here=True))

    @overload
    def allreduce(self, value: Pytree, op: Op = ..., *, strategy: str | None = ...,
                  timeout: float | None = ..., out: Pytree | None = ...,
                  codec: str | None = ..., trim: int | None = ...,
                  async_op: Literal[False] = ...) -> Pytree: ...
    @overload
    def allreduce(self, value: Pytree, op: Op = ..., *, strategy: str | None = ...,
                  timeout: float | None = ..., out: Pytree | None = ...,
                  codec: str | None = ..., trim: int | None = ...,
                  async_op: Literal[True]) -> Handle[Pytree]: ...
    @overload
    def allreduce(self, value: Pytree, op: Op = ..., *, strategy: str | None = ...,
                  timeout: float | None = ..., out: Pytree | None = ...,
                  codec: str | None = ..., trim: int | None = ...,
                  async_op: bool = ...) -> Pytree | Handle[Pytree]: ...
    def allreduce(self, value: Pytree, op: Op = "sum", *, strategy: str | None = None,
                  timeout: float | None = None, out: Pytree | None = None,
                  codec: str | None = None, trim: int | None = None,
                  async_op: bool = False) -> Pytree | Handle[Pytree]:
        """Reduce ``value`` over all ranks; the result on every rank
        (:meth:`p2pcoll.Group.allreduce`, ``codec`` and ``trim`` too)."""
        return self._call("allreduce", self._group.allreduce(
            value, op, strategy=strategy, timeout=timeout, out=out, codec=codec, trim=trim),
            async_op)

    @overload
    def reduce(self, value: Pytree, root: int = ..., op: Op = ..., *,
               strategy: str | None = ..., timeout: float | None = ...,
               codec: str | None = ..., async_op: Literal[False] = ...) -> Pytree | None: ...
    @overload
    def reduce(self, value: Pytree, root: int = ..., op: Op = ..., *,
               strategy: str | None = ..., timeout: float | None = ...,
               codec: str | None = ..., async_op: Literal[True]) -> Handle[Pytree | None]: ...
    @overload
    def reduce(self, value: Pytree, root: int = ..., op: Op = ..., *,
               strategy: str | None = ..., timeout: float | None = ...,
               codec: str | None = ...,
               async_op: bool = ...) -> Pytree | Handle[Pytree | None] | None: ...
    def reduce(self, value: Pytree, root: int = 0, op: Op = "sum", *,
               strategy: str | None = None, timeout: float | None = None,
               codec: str | None = None,
               async_op: bool = False) -> Pytree | Handle[Pytree | None] | None:
        """Reduce ``value`` over all ranks; the result on ``root``, None elsewhere."""
        return self._call("reduce", self._group.reduce(
            value, root, op, strategy=strategy, timeout=timeout, codec=codec), async_op)

    @overload
    def reduce_scatter(self, array: np.ndarray, op: Op = ..., *, strategy: str | None = ...,
                       timeout: float | None = ..., codec: str | None = ...,
                       async_op: Literal[False] = ...) -> np.ndarray: ...
    @overload
    def reduce_scatter(self, array: np.ndarray, op: Op = ..., *, strategy: str | None = ...,
                       timeout: float | None = ..., codec: str | None = ...,
                       async_op: Literal[True]) -> Handle[np.ndarray]: ...
    @overload
    def reduce_scatter(self, array: np.ndarray, op: Op = ..., *, strategy: str | None = ...,
                       timeout: float | None = ..., codec: str | None = ...,
                       async_op: bool = ...) -> np.ndarray | Handle[np.ndarray]: ...
    def reduce_scatter(self, array: np.ndarray, op: Op = "sum", *,
                       strategy: str | None = None, timeout: float | None = None,
                       codec: str | None = None,
                       async_op: bool = False) -> np.ndarray | Handle[np.ndarray]:
        """Reduce ``array`` over all ranks and give rank r part r of the result."""
        return self._call("reduce_scatter", self._group.reduce_scatter(
            array, op, strategy=strategy, timeout=timeout, codec=codec), async_op)

    @overload
    def broadcast(self, value: Pytree | None, root: int = ..., *, strategy: str | None = ...,
                  timeout: float | None = ..., async_op: Literal[False] = ...) -> Pytree: ...
    @overload
    def broadcast(self, value: Pytree | None, root: int = ..., *, strategy: str | None = ...,
                  timeout: float | None = ..., async_op: Literal[True]) -> Handle[Pytree]: ...
    @overload
    def broadcast(self, value: Pytree | None, root: int = ..., *, strategy: str | None = ...,
                  timeout: float | None = ..., async_op: bool = ...) -> Pytree | Handle[Pytree]: ...
    def broadcast(self, value: Pytree | None, root: int = 0, *, strategy: str | None = None,
                  timeout: float | None = None,
                  async_op: bool = False) -> Pytree | Handle[Pytree]:
        """Give every rank the root's ``value`` (a buffer elsewhere is filled in place)."""
        return self._call("broadcast", self._group.broadcast(
            value, root, strategy=strategy, timeout=timeout), async_op)

    @overload
    def allgather(self, array: np.ndarray, *, strategy: str | None = ...,
                  timeout: float | None = ...,
                  async_op: Literal[False] = ...) -> list[np.ndarray]: ...
    @overload
    def allgather(self, array: np.ndarray, *, strategy: str | None = ...,
                  timeout: float | None = ...,
                  async_op: Literal[True]) -> Handle[list[np.ndarray]]: ...
    @overload
    def allgather(self, array: np.ndarray, *, strategy: str | None = ...,
                  timeout: float | None = ...,
                  async_op: bool = ...) -> list[np.ndarray] | Handle[list[np.ndarray]]: ...
    def allgather(self, array: np.ndarray, *, strategy: str | None = None,
                  timeout: float | None = None,
                  async_op: bool = False) -> list[np.ndarray] | Handle[list[np.ndarray]]:
        """Every rank's ``array``, in rank order, on every rank."""
        return self._call("allgather", self._group.allgather(
            array, strategy=strategy, timeout=timeout), async_op)

    @overload
    def alltoall(self, parts: Sequence[np.ndarray], *, strategy: str | None = ...,
                 timeout: float | None = ..., out: Sequence[np.ndarray] | None = ...,
                 async_op: Literal[False] = ...) -> list[np.ndarray]: ...
    @overload
    def alltoall(self, parts: Sequence[np.ndarray], *, strategy: str | None = ...,
                 timeout: float | None = ..., out: Sequence[np.ndarray] | None = ...,
                 async_op: Literal[True]) -> Handle[list[np.ndarray]]: ...
    @overload
    def alltoall(self, parts: Sequence[np.ndarray], *, strategy: str | None = ...,
                 timeout: float | None = ..., out: Sequence[np.ndarray] | None = ...,
                 async_op: bool = ...) -> list[np.ndarray] | Handle[list[np.ndarray]]: ...
    def alltoall(self, parts: Sequence[np.ndarray], *, strategy: str | None = None,
                 timeout: float | None = None, out: Sequence[np.ndarray] | None = None,
                 async_op: bool = False) -> list[np.ndarray] | Handle[list[np.ndarray]]:
        """``parts[j]`` to rank j; the parts received, ``[i]`` from rank i (alltoallv)."""
        return self._call("alltoall", self._group.alltoall(
            parts, strategy=strategy, timeout=timeout, out=out), async_op)

    @overload
    def gather(self, array: np.ndarray, root: int = ..., *, strategy: str | None = ...,
               timeout: float | None = ...,
               async_op: Literal[False] = ...) -> list[np.ndarray] | None: ...
    @overload
    def gather(self, array: np.ndarray, root: int = ..., *, strategy: str | None = ...,
               timeout: float | None = ...,
               async_op: Literal[True]) -> Handle[list[np.ndarray] | None]: ...
    @overload
    def gather(self, array: np.ndarray, root: int = ..., *, strategy: str | None = ...,
               timeout: float | None = ...,
               async_op: bool = ...,
               ) -> list[np.ndarray] | Handle[list[np.ndarray] | None] | None: ...
    def gather(self, array: np.ndarray, root: int = 0, *, strategy: str | None = None,
               timeout: float | None = None, async_op: bool = False,
               ) -> list[np.ndarray] | Handle[list[np.ndarray] | None] | None:
        """Every rank's ``array`` in rank order on ``root``; None elsewhere."""
        return self._call("gather", self._group.gather(
            array, root, strategy=strategy, timeout=timeout), async_op)

    @overload
    def scatter(self, parts: Sequence[np.ndarray] | None, root: int = ..., *,
                strategy: str | None = ..., timeout: float | None = ...,
                async_op: Literal[False] = ...) -> np.ndarray: ...
    @overload
    def scatter(self, parts: Sequence[np.ndarray] | None, root: int = ..., *,
                strategy: str | None = ..., timeout: float | None = ...,
                async_op: Literal[True]) -> Handle[np.ndarray]: ...
    @overload
    def scatter(self, parts: Sequence[np.ndarray] | None, root: int = ..., *,
                strategy: str | None = ..., timeout: float | None = ...,
                async_op: bool = ...) -> np.ndarray | Handle[np.ndarray]: ...
    def scatter(self, parts: Sequence[np.ndarray] | None, root: int = 0, *,
                strategy: str | None = None, timeout: float | None = None,
                async_op: bool = False) -> np.ndarray | Handle[np.ndarray]:
        """Rank r gets ``parts[r]`` of the root's list (ignored elsewhere)."""
        return self._call("scatter", self._group.scatter(
            parts, root, strategy=strategy, timeout=timeout), async_op)

    @overload
    def barrier(self, *, strategy: str | None = ..., timeout: float | None = ...,
                async_op: Literal[False] = ...) -> None: ...
    @overload
    def barrier(self, *, strategy: str | None = ..., timeout: float | None = ...,
                async_op: Literal[True]) -> Handle[None]: ...
    @overload
    def barrier(self, *, strategy: str | None = ..., timeout: float | None = ...,
                async_op: bool = ...) -> Handle[None] | None: ...
    def barrier(self, *, strategy: str | None = None, timeout: float | None = None,
                async_op: bool = False) -> Handle[None] | None:
        """Return once every rank has entered the barrier."""
        return self._call("barrier", self._group.barrier(strategy=strategy, timeout=timeout),
                          async_op)

    @overload
    def send(self, value: Pytree, dst: int, *, tag: int = ..., timeout: float | None = ...,
             async_op: Literal[False] = ...) -> None: ...
    @overload
    def send(self, value: Pytree, dst: int, *, tag: int = ..., timeout: float | None = ...,
             async_op: Literal[True]) -> Handle[None]: ...
    @overload
    def send(self, value: Pytree, dst: int, *, tag: int = ..., timeout: float | None = ...,
             async_op: bool = ...) -> Handle[None] | None: ...
    def send(self, value: Pytree, dst: int, *, tag: int = 0, timeout: float | None = None,
             async_op: bool = False) -> Handle[None] | None:
        """Send ``value`` to rank ``dst`` (its ``recv(src=<this rank>, tag=tag)`` gets it).
        With ``async_op`` (mpi4py's Isend), ``value`` must not change until ``wait()``."""
        return self._call("send", self._group.send(value, dst, tag=tag, timeout=timeout),
                          async_op)

    @overload
    def recv(self, src: int, *, tag: int = ..., out: Pytree | None = ...,
             timeout: float | None = ..., async_op: Literal[False] = ...) -> Pytree: ...
    @overload
    def recv(self, src: int, *, tag: int = ..., out: Pytree | None = ...,
             timeout: float | None = ..., async_op: Literal[True]) -> Handle[Pytree]: ...
    @overload
    def recv(self, src: int, *, tag: int = ..., out: Pytree | None = ...,
             timeout: float | None = ..., async_op: bool = ...) -> Pytree | Handle[Pytree]: ...
    def recv(self, src: int, *, tag: int = 0, out: Pytree | None = None,
             timeout: float | None = None, async_op: bool = False) -> Pytree | Handle[Pytree]:
        """Receive the next value rank ``src`` sends this rank with ``tag``."""
        return self._call("recv", self._group.recv(src, tag=tag, out=out, timeout=timeout),
                          async_op)

    @overload
    def recv_any(self, *, tag: int = ..., out: Pytree | None = ...,
                 timeout: float | None = ...,
                 async_op: Literal[False] = ...) -> tuple[int, Pytree]: ...
    @overload
    def recv_any(self, *, tag: int = ..., out: Pytree | None = ...,
                 timeout: float | None = ...,
                 async_op: Literal[True]) -> Handle[tuple[int, Pytree]]: ...
    @overload
    def recv_any(self, *, tag: int = ..., out: Pytree | None = ...,
                 timeout: float | None = ...,
                 async_op: bool = ...) -> tuple[int, Pytree] | Handle[tuple[int, Pytree]]: ...
    def recv_any(self, *, tag: int = 0, out: Pytree | None = None,
                 timeout: float | None = None, async_op: bool = False,
                 ) -> tuple[int, Pytree] | Handle[tuple[int, Pytree]]:
        """Receive the next value any rank sends this rank with ``tag``: ``(source, value)``."""
        return self._call("recv_any", self._group.recv_any(tag=tag, out=out, timeout=timeout),
                          async_op)

    # --- closing ------------------------------------------------------------------------

    def close(self, reason: str = "") -> None:
        """Leave the group: tell the peers, wait (at most the heartbeat timeout) until they
        have read the goodbye, close every socket. Idempotent; calls still in flight raise
        GroupBroken. See :meth:`p2pcoll.Group.close`.

        Raises:
            LoopBlocked: called on a thread running an event loop (use ``await g.aio.close()``
                there, then ``close()`` elsewhere, or close from a thread).
        """
        self._close(reason, None)

    def shrink(self, exclude: Sequence[int], *, timeout: float | None = None,
               strategies: Mapping[str, str] | None = None, abort: bool = False) -> Group:
        """A new group of the ranks not in ``exclude``, formed over this one's links with
        no rendezvous or store: :meth:`p2pcoll.Group.shrink` (same arguments, same
        Raises; also LoopBlocked). Close this group too, when done with it."""
        self._check_open("shrink")
        self._loop_thread.check_may_block("shrink()")
        new = wait(self._loop_thread.submit(self._group.shrink(
            exclude, timeout=timeout, strategies=strategies, abort=abort)))
        return Group(new, LoopThread.acquire())

    def _close(self, reason: str, crash: BaseException | None) -> None:
        """:meth:`close`; ``crash``: the error that left the ``with`` block, which the
        peers' PeerLost names (they read that this rank crashed, not that it closed)."""
        with self._lock:
            if self._closed:
                return
            self._loop_thread.check_may_block("close()")
            self._closed = True
        LoopThread.forget(self._exit_key)
        try:
            wait(self._loop_thread.submit(self._group._leave(reason, crash)))
        finally:
            LoopThread.release()

    def _close_at_exit(self) -> None:
        self.close("the process exited")

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        # Left by an error of the program: the peers are told this rank crashed, and why,
        # as by the async Group's ``async with`` (a Ctrl-C or SystemExit is a close).
        self._close("", exc if isinstance(exc, Exception) else None)

    def __repr__(self) -> str:
        return f"<blocking {self._group!r}>"


@takes_arguments_of(_async_join)
def join(*args: Any, **kwargs: Any) -> Group:
    """Join a group of peers, blocking until it has formed; ``g = join(...)`` or
    ``with join(...) as g:``. The arguments are :func:`p2pcoll.join`'s, the one list
    (below), each read from the environment when None in the same way.

    Raises:
        SettingsError: a bad argument or environment variable (before anything else).
        RendezvousError: the group did not form (see :func:`p2pcoll.join`).
        UnknownStrategy: ``strategies`` names a strategy that is not installed.
        LoopBlocked: called on a thread running an asyncio event loop (use
            ``await p2pcoll.join(...)`` there).
        KeyboardInterrupt: Ctrl-C while joining; every socket opened so far is closed.
    """
    settings = _async_join(*args, **kwargs).settings
    LoopThread.check_may_block("p2pcoll.blocking.join()")
    if settings.flight_dir:  # the loop's thread cannot set a signal handler: this one may
        arm_signal()
    loop_thread = LoopThread.acquire()
    try:
        group = wait(loop_thread.submit(_join(settings)))
    except BaseException:
        LoopThread.release()
        raise
    return Group(group, loop_thread)


__all__ = ["Group", "Handle", "LoopBlocked", "join"]
