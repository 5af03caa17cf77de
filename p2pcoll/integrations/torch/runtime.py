"""The threads behind the torch backend: the process's loop thread that runs every p2pcoll
group (:mod:`p2pcoll.api.loop_thread`, shared with :mod:`p2pcoll.blocking`), and the
completer that finishes torch's futures.

torch calls a backend from its own threads and expects a :class:`~torch.distributed.Work`
back at once; the collective runs on the loop thread. The hop there and back is kept to
one wake-up each way:

- There: :meth:`Runtime.start` queues the call on the loop thread
  (:meth:`LoopThread.start`: one ``call_soon_threadsafe`` for all the calls queued before
  the loop gets to them); the loop creates each call's tasks, and the task that finishes a
  call settles its Work in its own last step (no gather, no done-callback round, no
  queue or thread per call).
- Or neither: a small call made while nothing else of the backend is in flight runs its
  first steps on the caller's thread when the loop thread is idle (:meth:`Runtime.drive`,
  :meth:`LoopThread.drive`), and a board collective whose peers are there is done before
  the call returns its Work.
- Back: a Work whose future nobody has asked for (``dist.all_reduce(x)``, a Work only
  waited on) is settled on the loop thread itself: its outcome recorded and its lock
  released, which wakes the thread blocked in ``Work.wait()``. Nothing else runs there: no callback
  can exist, because callbacks hang on the future and there is none yet (one asked for
  later is made complete). A Work whose future was asked for first goes through the
  completer, as below.

A future's ``.then()`` callbacks (torch's C++ ones, DDP's, and Python's) run inside
``set_result``, on the thread that completes it, and some callbacks (the PowerSGD hook's)
start a collective and wait for it. So futures are never completed on the loop thread
(that would block the loop), and not on one fixed thread either (that would deadlock):
the completer is one thread at a time, completing in order, and a completer that blocks
in ``Work.wait()`` first hands its job to a new thread.

Order matters too: every rank must start collectives in the same order. Each torch call
becomes tasks created in one callback on the loop, in the order of the calls, and every
p2pcoll collective takes its sequence number in its first step, so the order of calls is
the order of sequence numbers; :meth:`Runtime.run` and the loop thread's other users
(:mod:`p2pcoll.blocking`) queue theirs in the same queue.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable, Coroutine
from typing import Any, ClassVar, TypeVar

from ...api.loop_thread import LoopThread, Shared
from ...errors import GroupBroken, P2PCollError

T = TypeVar("T")
_log = logging.getLogger("p2pcoll")


class Completer:
    """Runs completion callbacks in order on one thread at a time (see the module docstring)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._current: threading.Thread | None = None
        self._threads: list[threading.Thread] = []  # every one started and not yet done
        self._stopped = False
        self._spawn()

    def _spawn(self) -> None:
        thread = threading.Thread(target=self._run, name="p2pcoll-torch-completer",
                                  daemon=True)
        self._current = thread
        self._threads.append(thread)
        thread.start()

    def _run(self) -> None:
        me = threading.current_thread()
        try:
            while True:
                job = self._jobs.get()
                if job is None:
                    return
                try:
                    job()
                except Exception:
                    _log.debug("a torch future's callback failed", exc_info=True)
                with self._lock:
                    if self._current is not me:
                        return  # replaced while this job blocked: the new thread goes on
        finally:
            with self._lock:
                self._threads.remove(me)

    def submit(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)

    def blocking(self) -> None:
        """Called before a wait that may block: if on the completer, hand the job over."""
        with self._lock:
            if threading.current_thread() is self._current and not self._stopped:
                self._spawn()

    def stop(self, timeout: float = 10.0) -> None:
        """Finish the jobs submitted so far, then end the threads and wait for them (up
        to ``timeout``; not for the calling thread itself). A thread still inside torch
        when the interpreter finalizes is what aborts the process with "terminate called
        without an active exception", so they are joined here."""
        with self._lock:
            self._stopped = True
        self._jobs.put(None)
        deadline = time.monotonic() + timeout
        me = threading.current_thread()
        while True:
            with self._lock:
                others = [t for t in self._threads if t is not me]
            if not others:
                return
            left = deadline - time.monotonic()
            if left <= 0:
                return
            others[0].join(left)


class Runtime(Shared):
    """The torch backend's share of the process's loop thread (:mod:`p2pcoll.api.loop_thread`,
    which :mod:`p2pcoll.blocking` shares too) and the completer, shared by every p2pcoll
    process group of the process; started by the first group, stopped when the last one
    shuts down."""

    # The shutdown() of every process group still open, which the exit hook calls first.
    _open: ClassVar[weakref.WeakSet[Any]] = weakref.WeakSet()

    def __init__(self) -> None:
        self._loop_thread = LoopThread.acquire()
        self.loop = self._loop_thread.loop
        self.completer = Completer()
        self._tasks: set[asyncio.Task[None]] = set()  # the calls' tasks still running

    def _stop(self) -> None:
        """Let the loop's last tasks (collectives aborted by a close) and then the
        completer finish, then let go of the loop thread (stopped if nobody else uses it)."""
        if not self._loop_thread.on_loop and not self.loop.is_closed():
            with contextlib.suppress(Exception):
                self._loop_thread.submit(_drain()).result(5)
        self.completer.stop()
        LoopThread.release()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for its result here."""
        return self._loop_thread.submit(coro).result(timeout)

    def start(self, make: Callable[[], list[Coroutine[Any, Any, Any]]],
              settle: Callable[[BaseException | None], None]) -> None:
        """Create the tasks ``make()`` returns on the loop, after those of every earlier
        call (so in call order), then call ``settle(error)`` on the loop thread once all
        have finished (``error``: the most telling of their errors, or None).

        ``settle`` runs on the loop: it must be quick and run no user code (Work's hands
        anything else to the completer). A ``make()`` that raises settles with its error.

        Raises:
            RuntimeError: the loop is closed (the call is not queued).
        """
        self._loop_thread.start(lambda: self._start_call(make, settle))

    def drive(self, make: Callable[[], list[Coroutine[Any, Any, Any]]],
              settle: Callable[[BaseException | None], None],
              done: Callable[[], bool]) -> bool:
        """:meth:`start`, but when nothing of this runtime is in flight and the loop is
        idle, the call's first steps run here on the caller's thread, in call order, until
        ``done()`` or it has to wait (then it goes on on the loop thread): a small
        collective whose peers are there costs no hop between threads
        (:meth:`LoopThread.drive`). Returns whether it ran here.

        Raises:
            RuntimeError: the loop is closed (the call is not queued).
        """
        def job() -> None:
            self._start_call(make, settle)

        if self._tasks:  # calls in flight: the loop thread is theirs
            self._loop_thread.start(job)
            return False
        return self._loop_thread.drive(job, done)

    def _start_call(self, make: Callable[[], list[Coroutine[Any, Any, Any]]],
                    settle: Callable[[BaseException | None], None]) -> None:
        """On the loop: create the call's tasks."""
        try:
            coros = make()
        except BaseException as exc:
            settle(exc)
            return
        if len(coros) == 1:
            self._spawn(coros[0], settle)
        elif not coros:
            settle(None)
        else:
            _Join(len(coros), settle).spawn(self, coros)

    def _spawn(self, coro: Coroutine[Any, Any, Any],
               settle: Callable[[BaseException | None], None]) -> None:
        task = self.loop.create_task(_settled(coro, settle, self._tasks))
        self._tasks.add(task)  # the loop keeps only weak references to tasks


class _Join:
    """Settles a call of several tasks once the last has finished."""

    __slots__ = ("errors", "left", "settle")

    def __init__(self, count: int, settle: Callable[[BaseException | None], None]) -> None:
        self.left = count
        self.errors: list[BaseException] = []
        self.settle = settle

    def spawn(self, runtime: Runtime, coros: list[Coroutine[Any, Any, Any]]) -> None:
        for coro in coros:
            runtime._spawn(coro, self.one_done)

    def one_done(self, error: BaseException | None) -> None:
        if error is not None:
            self.errors.append(error)
        self.left -= 1
        if self.left == 0:
            self.settle(_first(self.errors))


async def _settled(coro: Coroutine[Any, Any, Any],
                   settle: Callable[[BaseException | None], None],
                   tasks: set[asyncio.Task[None]]) -> None:
    """Run ``coro``, then ``settle`` with its error or None (in this task's last step).
    Exceptions are handed to ``settle`` only; others (KeyboardInterrupt, a cancellation
    of the loop's tasks) are re-raised after it."""
    try:
        await coro
    except Exception as exc:
        settle(exc)
    except BaseException as exc:
        settle(exc)
        raise
    else:
        settle(None)
    finally:
        task = asyncio.current_task()
        if task is not None:
            tasks.discard(task)


async def _drain() -> None:
    """Wait (briefly) for the loop's other tasks, so their completions are submitted."""
    others = asyncio.all_tasks() - {asyncio.current_task()}
    if others:
        await asyncio.wait(others, timeout=2)


def _first(errors: list[BaseException]) -> BaseException | None:
    """The most telling of several errors: a p2pcoll error that is no GroupBroken first."""
    tests: tuple[Callable[[BaseException], bool], ...] = (
        lambda e: isinstance(e, P2PCollError) and not isinstance(e, GroupBroken),
        lambda e: isinstance(e, Exception), lambda e: True)
    for test in tests:
        for e in errors:
            if test(e):
                return e
    return None


def _at_exit() -> None:
    """At interpreter exit (atexit runs before daemon threads are frozen): close the
    groups that were never destroyed, then stop the completer and let go of the loop
    thread, so no thread of ours is inside torch or zmq when the interpreter finalizes.
    Registered after the loop thread's own exit hook, so it runs before it."""
    for group in list(Runtime._open):
        try:
            group.shutdown(timeout=10)
        except Exception:
            _log.debug("closing a p2pcoll process group at exit failed", exc_info=True)
    Runtime.stop_now()


atexit.register(_at_exit)

__all__ = ["Completer", "Runtime"]
