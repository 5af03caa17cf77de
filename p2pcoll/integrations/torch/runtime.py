"""The threads behind the torch backend: the process's loop thread that runs every p2pcoll
group (:mod:`p2pcoll.api.loop_thread`, shared with :mod:`p2pcoll.blocking`), and the
completer that finishes torch's futures.

torch calls a backend from its own threads and expects a :class:`~torch.distributed.Work`
back at once; the collective runs on the loop thread. A future's ``.then()`` callbacks run
inside ``set_result``, on the thread that completes it, and some callbacks (the PowerSGD
hook's) start a collective and wait for it. So futures are never completed on the loop
thread (that would block the loop), and not on one fixed thread either (that would
deadlock): the completer is one thread at a time, completing in order, and a completer
that blocks in ``Work.wait()`` first hands its job to a new thread.

Order matters too: every rank must start collectives in the same order. Each torch call
becomes tasks created in one callback on the loop, in the order of the calls, and every
p2pcoll collective takes its sequence number in its first step, so the order of calls is
the order of sequence numbers.
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
              done: Callable[[BaseException | None], None]) -> None:
        """Create the tasks ``make()`` returns, in one callback on the loop (so in call
        order), then call ``done(error)`` on the completer once all have finished."""

        def launch() -> None:
            try:
                tasks = [self.loop.create_task(c) for c in make()]
            except BaseException as exc:
                failed: BaseException = exc
                self.completer.submit(lambda: done(failed))
                return

            async def join() -> None:
                results = await asyncio.gather(*tasks, return_exceptions=True)
                errors = [r for r in results if isinstance(r, BaseException)]
                error = _first(errors)
                self.completer.submit(lambda: done(error))

            self.loop.create_task(join())

        self.loop.call_soon_threadsafe(launch)


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
