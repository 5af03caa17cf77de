"""The caller's thread driving the loop (:meth:`LoopThread.drive`), which the torch backend
uses for small calls: calls keep their order with the jobs queued before them, a call that
has to wait goes on on the loop thread, and nothing runs here while the loop is busy.

Single process, no sockets: the loop thread and coroutines only. The torch backend's side
(results, order and errors of small calls mixed with large ones, over real ranks) is in
tests/test_torch_backend.py (mode ``drive`` of tests/torch_worker.py).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import pytest

from p2pcoll.api.loop_thread import LoopThread

WAIT_S = 10  # the longest anything here may take before the test counts it as hung
Job = Callable[[], None]
Done = Callable[[], bool]


@pytest.fixture
def loop_thread() -> Iterator[LoopThread]:
    lt = LoopThread.acquire()
    try:
        yield lt
    finally:
        LoopThread.release()


def drive_when_idle(lt: LoopThread, make: Callable[[], tuple[Job, Done]]) -> Done:
    """``lt.drive(*make())`` until it runs here (returns that call's ``done``). A loop
    thread that just woke for something takes its lock back first, and then drive queues
    the job for it instead: the test waits for the loop thread to sleep (on its lock, not
    on a clock) and tries again with a new job."""
    for _ in range(100):
        with lt.idle:  # taken: the loop thread sleeps in select (or waits for this lock)
            pass
        job, done = make()
        if lt.drive(job, done):
            return done
        lt.run(asyncio.sleep(0))  # the queued job has run
    pytest.fail("the loop thread never slept")


_tasks: set[asyncio.Task[None]] = set()


def spawn(lt: LoopThread, call: Callable[[], Coroutine[Any, Any, None]]) -> Job:
    """A job that makes ``call()`` a task of the loop (kept until it is done)."""
    def job() -> None:
        task = lt.loop.create_task(call())
        _tasks.add(task)
        task.add_done_callback(_tasks.discard)
    return job


def test_a_call_that_needs_no_wait_runs_on_the_callers_thread(
        loop_thread: LoopThread) -> None:
    ran_on: list[threading.Thread] = []

    def make() -> tuple[Job, Done]:
        finished = threading.Event()

        async def call() -> None:
            assert asyncio.current_task() is not None  # a task, as on the loop thread
            ran_on.append(threading.current_thread())
            finished.set()

        return spawn(loop_thread, call), finished.is_set

    done = drive_when_idle(loop_thread, make)
    assert done()  # done before drive returned
    assert ran_on[-1] is threading.current_thread()


def test_a_call_that_waits_goes_on_on_the_loop_thread(loop_thread: LoopThread) -> None:
    # The call sleeps on a timer the loop thread did not know of when it went to sleep:
    # drive must wake it, or this hangs (the loop thread would sleep in select forever).
    threads: list[list[threading.Thread]] = []

    def make() -> tuple[Job, Done]:
        finished = threading.Event()
        mine: list[threading.Thread] = []
        threads.append(mine)

        async def call() -> None:
            mine.append(threading.current_thread())
            await asyncio.sleep(0.01)
            mine.append(threading.current_thread())
            finished.set()

        return spawn(loop_thread, call), finished.is_set

    done = drive_when_idle(loop_thread, make)
    for _ in range(WAIT_S * 100):
        if done():
            break
        threading.Event().wait(0.01)
    assert done()
    assert threads[-1][0] is threading.current_thread()
    assert threads[-1][1].name == "p2pcoll-loop"


def test_calls_keep_their_order_with_jobs_queued_before(loop_thread: LoopThread) -> None:
    # The loop thread is busy (a job blocks it), so drive cannot take the loop: it queues
    # its job behind the one queued before it.
    order: list[str] = []
    busy, release = threading.Event(), threading.Event()

    def block() -> None:
        busy.set()
        release.wait(WAIT_S)

    loop_thread.start(block)
    assert busy.wait(WAIT_S)
    loop_thread.start(lambda: order.append("queued first"))
    assert not loop_thread.drive(lambda: order.append("driven"), lambda: bool(order))
    release.set()
    loop_thread.run(asyncio.sleep(0))  # after both
    assert order == ["queued first", "driven"]


def test_a_job_queued_but_not_yet_run_runs_first_when_the_caller_drives(
        loop_thread: LoopThread) -> None:
    # Queued for the loop thread while it sleeps, then driven before it woke: the caller
    # runs the loop's ready callbacks in order, the queued job first.
    order: list[str] = []
    for _ in range(1000):
        with loop_thread.idle:  # the loop thread sleeps (or waits for this lock)
            loop_thread.start(lambda: order.append("queued first"))
        if loop_thread.drive(lambda: order.append("driven"), lambda: len(order) == 2):
            break
        loop_thread.run(asyncio.sleep(0))
        order.clear()
    loop_thread.run(asyncio.sleep(0))
    assert order == ["queued first", "driven"]


def test_drive_on_a_thread_running_an_event_loop_queues_the_job(
        loop_thread: LoopThread) -> None:
    ran_on: list[threading.Thread] = []

    async def inside() -> bool:
        return loop_thread.drive(lambda: ran_on.append(threading.current_thread()),
                                 lambda: bool(ran_on))

    assert asyncio.run(inside()) is False
    loop_thread.submit(asyncio.sleep(0)).result(WAIT_S)  # (run() would drive the loop here)
    assert [t.name for t in ran_on] == ["p2pcoll-loop"]
