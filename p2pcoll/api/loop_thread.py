"""The loop thread: one asyncio event loop, on a thread of its own, that runs the p2pcoll
groups of synchronous callers, the torch backend's and :mod:`p2pcoll.blocking`'s alike.

A caller on another thread hands the loop a coroutine (:meth:`LoopThread.submit`) and gets a
:class:`concurrent.futures.Future` back; :meth:`LoopThread.run` waits for it. Submissions
run in the order they were made: they are queued (:meth:`LoopThread.start`), the loop is
woken once for all those queued before it gets to them, and it makes their tasks in queue
order, so collectives started one after another take their sequence numbers in that order
(every p2pcoll collective takes its number in its first step), the same order on every
rank. A task sets its future's outcome in its own last step, so the caller is woken as
soon as the coroutine is done.

There is one loop thread per process, shared by every user: :meth:`LoopThread.acquire`
starts it for the first user and :meth:`LoopThread.release` stops it when the last one
is done. At interpreter exit (atexit, which runs before daemon threads are frozen) the
closers registered with :meth:`LoopThread.close_at_exit` run first (newest first), then the
loop stops, so no thread of ours is inside zmq when the interpreter finalizes. A forked
child starts afresh (a thread does not survive a fork).

Calling :meth:`LoopThread.run` from the loop thread itself, or from any thread whose own
event loop is running, would block that loop: it raises :class:`LoopBlocked` instead.

Driving from the caller's thread (:meth:`LoopThread.drive`). Handing a call to the loop
thread and being woken when it is done costs two thread wake-ups (~50 us on a quiet host,
a scheduler slice on a busy one), more than a small collective on the shared-memory board
takes. So the loop thread holds a lock, :attr:`LoopThread.idle`, at all times except while
it sleeps in its selector waiting for I/O or a timer; a caller that takes it there owns the
loop for as long as it holds it and runs the loop's ready callbacks itself, its own call's
first steps among them, in the order the loop would (so calls keep their order with those
queued before). A call that finishes in those steps (a board collective whose peers are
there) never touches the loop thread; one that has to wait goes on on the loop thread, which
the caller wakes if it left it anything to do sooner than it planned to wake up.

Waking the loop without letting go of the GIL (:class:`_Loop`). asyncio wakes a loop from
another thread by writing a byte to its self-pipe with ``socket.send``, which releases the
GIL around the system call; taking it back waits until the loop thread lets go of it, up to
the switch interval (5 ms) while the loop thread runs Python. Under DDP every gradient
bucket's allreduce is such a wake-up from autograd's thread, which stalled the backward pass
5 ms a bucket while the loop thread worked on the bucket before. The loop's self-pipe write
is one write of a byte that never blocks (the socket is non-blocking; a full pipe already
holds a wake-up), made here with the GIL held (:mod:`p2pcoll.transport.gil_held`).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import logging
import math
import os
import selectors
import threading
from collections.abc import Callable, Coroutine
from typing import Any, ClassVar, Self, TypeVar

from ..transport import gil_held

T = TypeVar("T")
_log = logging.getLogger("p2pcoll")
# The most callbacks a caller runs when it drives the loop (LoopThread.drive): a board
# collective takes one or two; a bound keeps a caller from running a busy loop's work.
DRIVE_STEPS = 64


class LoopBlocked(RuntimeError):
    """A blocking p2pcoll call was made where it would block a running event loop (it
    would deadlock, or stall every other task of that loop). Use the async API there
    (``await group.allreduce(...)``), or ``async_op=True`` and await the handle's result
    in a thread (``await asyncio.to_thread(handle.wait)``)."""


class Shared:
    """A process-wide instance, made for its first user (:meth:`acquire`) and stopped
    (:meth:`_stop`) when the last one is done (:meth:`release`) or at exit
    (:meth:`stop_now`). Each subclass has its own instance, count and lock."""

    _lock: ClassVar[threading.Lock]
    _instance: ClassVar[Any]
    _users: ClassVar[int]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._forget()

    @classmethod
    def _forget(cls) -> None:
        """No instance and no users (also in a forked child, whose threads are gone)."""
        cls._lock = threading.Lock()
        cls._instance = None
        cls._users = 0

    @classmethod
    def acquire(cls) -> Self:
        """The process's instance, made if nobody uses it; pair with :meth:`release`."""
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
            cls._users += 1
            instance: Self = cls._instance
            return instance

    @classmethod
    def release(cls) -> None:
        """One user is done; the last one stops the instance."""
        with cls._lock:
            cls._users -= 1
            if cls._users > 0 or cls._instance is None:
                return
            instance, cls._instance = cls._instance, None
        instance._stop()

    @classmethod
    def stop_now(cls) -> None:
        """Stop the instance whoever still uses it (at interpreter exit)."""
        with cls._lock:
            instance, cls._instance = cls._instance, None
            cls._users = 0
        if instance is not None:
            instance._stop()

    def _stop(self) -> None:
        raise NotImplementedError


class LoopThread(Shared):
    """One event loop on a daemon thread; see the module docstring. :meth:`release` stops
    the loop (after its other tasks finish, briefly) and waits for the thread."""

    # Called at exit before the loop stops: id -> closer, in registration order.
    _closers: ClassVar[dict[int, Callable[[], None]]] = {}

    def __init__(self) -> None:
        # Held by the loop thread except while it sleeps in select (see the module docstring).
        self.idle = threading.Lock()
        self.loop: asyncio.AbstractEventLoop = _Loop(_Selector(self.idle))
        # Jobs queued for the loop, and whether its callback that runs them is pending.
        self._queue_lock = threading.Lock()
        self._queued: list[Callable[[], None]] = []
        self._woken = False
        self._tasks: set[asyncio.Task[Any]] = set()  # submitted, not yet done
        self._driver: int | None = None  # the thread that drives the loop now (see drive)
        self._thread = threading.Thread(target=self._serve, name="p2pcoll-loop", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.idle.acquire()
        try:
            self.loop.run_forever()
        finally:
            try:
                self.loop.close()
            finally:
                self.idle.release()

    # --- sharing ------------------------------------------------------------------------

    @classmethod
    def close_at_exit(cls, closer: Callable[[], None]) -> int:
        """Run ``closer()`` at interpreter exit, before the loop stops, unless
        :meth:`forget` is called with the number returned first."""
        with cls._lock:
            key = id(closer)
            while key in cls._closers:
                key += 1
            cls._closers[key] = closer
            return key

    @classmethod
    def forget(cls, key: int) -> None:
        with cls._lock:
            cls._closers.pop(key, None)

    # --- running ------------------------------------------------------------------------

    @property
    def on_loop(self) -> bool:
        """True on the loop thread itself, and on a thread while it drives the loop."""
        me = threading.get_ident()
        return me == self._thread.ident or me == self._driver

    @classmethod
    def check_may_block(cls, what: str) -> None:
        """Raise :class:`LoopBlocked` if waiting on this thread would block a running event
        loop: p2pcoll's own (a deadlock) or the caller's."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return
        instance = cls._instance
        if instance is not None and instance.on_loop:
            raise LoopBlocked(f"{what} was called on p2pcoll's loop thread, which it would "
                              "block forever; await the async API there instead")
        raise LoopBlocked(
            f"{what} blocks, and this thread is running an asyncio event loop that it would "
            "stall; await the async API here (p2pcoll.join), or pass async_op=True and "
            "await asyncio.to_thread(handle.wait)")

    def start(self, job: Callable[[], None]) -> None:
        """Call ``job()`` on the loop thread, after every job started (or coroutine
        submitted) before it, and return at once. The loop is woken once for all the jobs
        queued before it runs them. ``job`` must not block; what it raises is logged.

        Raises:
            RuntimeError: the loop is closed (``job`` is not queued).
        """
        with self._queue_lock:
            if self.loop.is_closed():
                raise RuntimeError("p2pcoll's loop thread has stopped")
            self._queued.append(job)
            if self._woken:
                return  # the loop's callback, not yet run, takes this job too
            self._woken = True
        try:
            self.loop.call_soon_threadsafe(self._run_queued)
        except BaseException:
            with self._queue_lock:
                self._queued.remove(job)
                self._woken = False
            raise

    def drive(self, job: Callable[[], None], done: Callable[[], bool],
              steps: int = DRIVE_STEPS) -> bool:
        """:meth:`start` ``job``, then, if the loop is idle, run it and what follows it
        here on the calling thread, until ``done()`` or nothing is ready to run (at most
        ``steps`` callbacks); see the module docstring. Returns whether it ran here (False:
        the loop was busy, or this thread runs an event loop of its own, and ``job`` was
        queued for the loop thread as by :meth:`start`).

        Raises:
            RuntimeError: the loop is closed (``job`` is not queued).
        """
        loop = self.loop
        if (asyncio._get_running_loop() is not None or loop.get_debug()
                or not isinstance(loop, asyncio.BaseEventLoop)
                or not self.idle.acquire(blocking=False)):
            self.start(job)
            return False
        wake = False
        try:
            with self._queue_lock:
                if loop.is_closed():
                    raise RuntimeError("p2pcoll's loop thread has stopped")
                self._queued.append(job)
                first = not self._woken
                self._woken = True
            # asyncio's own state, which it keeps thread-safe only by running on one
            # thread: the lock makes this that thread for now.
            ready: Any = loop._ready  # type: ignore[attr-defined]
            timers: list[Any] = loop._scheduled  # type: ignore[attr-defined]
            due = timers[0].when() if timers else math.inf
            if first:
                loop.call_soon(self._run_queued)
            asyncio._set_running_loop(loop)
            self._driver = threading.get_ident()
            try:
                while steps > 0 and ready and not done():
                    handle = ready.popleft()
                    if not handle.cancelled():
                        handle._run()
                        steps -= 1
            finally:
                self._driver = None
                asyncio._set_running_loop(None)
            # The loop thread sleeps until the timer that was first when it went to
            # sleep, or I/O: wake it if it has callbacks to run, or an earlier timer.
            wake = bool(ready) or bool(timers and timers[0].when() < due)
        finally:
            self.idle.release()
        if wake:
            with contextlib.suppress(RuntimeError):  # closed meanwhile
                loop.call_soon_threadsafe(_nothing)
        return True

    def _run_queued(self) -> None:
        with self._queue_lock:
            jobs, self._queued = self._queued, []
            self._woken = False
        for job in jobs:
            try:
                job()
            except Exception:
                _log.exception("a job on p2pcoll's loop thread failed")

    def submit(self, coro: Coroutine[Any, Any, T], *,
               here: bool = False) -> concurrent.futures.Future[T]:
        """Start ``coro`` on the loop (after every earlier submission) and return at once;
        ``here``: its first steps on this thread if the loop is idle (:meth:`drive`), for
        a caller that waits for the result next.

        The future gets ``coro``'s result or exception; cancelling the future cancels
        ``coro`` (unstarted: closed; running: its task cancelled)."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()

        def begin() -> None:
            if future.cancelled():
                coro.close()
                return
            try:
                task = self.loop.create_task(_into(coro, future))
            except BaseException as exc:  # the loop is closing
                coro.close()
                with contextlib.suppress(concurrent.futures.InvalidStateError):
                    future.set_exception(exc)
                raise
            self._tasks.add(task)  # the loop keeps only weak references to tasks
            task.add_done_callback(self._tasks.discard)
            future.add_done_callback(lambda f: self._cancel(f, task))

        if here:
            self.drive(begin, future.done)
        else:
            self.start(begin)
        return future

    def _cancel(self, future: concurrent.futures.Future[Any], task: asyncio.Task[Any]) -> None:
        """A submission's future is done: if it was cancelled, cancel its task."""
        if future.cancelled():
            with contextlib.suppress(RuntimeError):  # the loop has stopped meanwhile
                self.loop.call_soon_threadsafe(task.cancel)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for its result here.

        Raises:
            LoopBlocked: called on the loop thread, or on a thread running an event loop
                (``coro`` is closed unstarted).
            TimeoutError: ``timeout`` passed first (``coro`` is cancelled).
            whatever ``coro`` raises. A KeyboardInterrupt (or any exception) raised here
            while waiting cancels ``coro`` and propagates.
        """
        try:
            self.check_may_block("a blocking p2pcoll call")
        except LoopBlocked:
            coro.close()
            raise
        future = self.submit(coro, here=True)
        return wait(future, timeout)

    def call(self, fn: Callable[[], T]) -> T:
        """Call ``fn()`` on the loop thread (for state the loop owns) and return its result."""
        if self.on_loop:
            return fn()

        async def call() -> T:
            return fn()

        return self.run(call())

    def _stop(self) -> None:
        """Let the loop's last tasks (collectives aborted by a close) finish, briefly,
        then stop it and wait for the thread."""
        if not self.on_loop and not self.loop.is_closed():
            with contextlib.suppress(Exception):
                self.submit(_drain()).result(5)
        if not self.loop.is_closed():
            with contextlib.suppress(RuntimeError):  # closed meanwhile
                self.loop.call_soon_threadsafe(self.loop.stop)
        if not self.on_loop:
            self._thread.join(10)


class _Selector(selectors.DefaultSelector):
    """The loop thread's selector: it lets go of the loop's ``idle`` lock while it sleeps
    (a select that may block), and takes it back before the loop goes on."""

    def __init__(self, idle: threading.Lock) -> None:
        super().__init__()
        self._idle = idle

    def select(self, timeout: float | None = None) -> list[tuple[Any, int]]:
        if timeout is not None and timeout <= 0:
            return super().select(timeout)
        self._idle.release()
        try:
            return super().select(timeout)
        finally:
            self._idle.acquire()


class _Loop(asyncio.SelectorEventLoop):
    """The loop thread's event loop: woken from other threads without releasing the GIL
    (see the module docstring)."""

    def _write_to_self(self) -> None:
        csock = self._csock  # type: ignore[attr-defined]
        if not gil_held.available() or csock is None:
            super()._write_to_self()  # type: ignore[misc]
            return
        # With the GIL held from here to the write, a close on another thread (which marks
        # the socket closed, -1, before it lets go of the GIL to close the descriptor)
        # cannot slip in between: a descriptor seen open is this socket's.
        fd = csock.fileno()
        if fd >= 0:
            with contextlib.suppress(OSError):  # full: a wake-up is waiting already
                gil_held.write_byte(fd)


def _nothing() -> None:
    """A callback that only wakes the loop (see :meth:`LoopThread.drive`)."""


async def _into(coro: Coroutine[Any, Any, T], future: concurrent.futures.Future[T]) -> None:
    """Run ``coro`` and give ``future`` its outcome (unless the future was cancelled)."""
    try:
        result = await coro
    except asyncio.CancelledError:
        future.cancel()
        raise
    except BaseException as exc:
        with contextlib.suppress(concurrent.futures.InvalidStateError):  # cancelled
            future.set_exception(exc)
        if not isinstance(exc, Exception):
            raise
    else:
        with contextlib.suppress(concurrent.futures.InvalidStateError):  # cancelled
            future.set_result(result)


def wait(future: concurrent.futures.Future[T], timeout: float | None = None) -> T:
    """``future.result(timeout)``, but an exception raised while waiting (KeyboardInterrupt
    from Ctrl-C, SystemExit, a TimeoutError of ``timeout``) cancels the work first. The lock
    the wait sleeps on is interrupted by signals, so Ctrl-C reaches the main thread at once.
    """
    try:
        return future.result(timeout)
    except BaseException as exc:
        if future.done():
            raise  # the work's own outcome
        future.cancel()
        if isinstance(exc, TimeoutError) and timeout is not None:
            raise TimeoutError(f"no result in {timeout:g}s") from None
        raise


async def _drain() -> None:
    """Wait (briefly) for the loop's other tasks, so their completions are submitted."""
    others = asyncio.all_tasks() - {asyncio.current_task()}
    if others:
        await asyncio.wait(others, timeout=2)


def _at_exit() -> None:
    """Close what was left open (newest first), then stop the loop thread."""
    while True:
        with LoopThread._lock:
            if not LoopThread._closers:
                break
            _, closer = LoopThread._closers.popitem()
        try:
            closer()
        except Exception:
            _log.debug("closing a p2pcoll group at exit failed", exc_info=True)
    LoopThread.stop_now()


def _after_fork_in_child() -> None:
    """A forked child has no loop thread (only the forking thread survives a fork): forget
    the parent's, so a group joined in the child starts its own. The parent's groups are
    unusable in the child, and nothing closes them there."""
    LoopThread._forget()
    LoopThread._closers = {}


atexit.register(_at_exit)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)

__all__ = ["LoopBlocked", "LoopThread", "wait"]
