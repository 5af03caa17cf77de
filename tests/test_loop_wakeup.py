"""The loop thread is woken from other threads without their letting go of the GIL
(p2pcoll.api.loop_thread._Loop): a torch backend's call from autograd's thread must not wait
for the loop thread's Python to hand the GIL back."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from p2pcoll.api import loop_thread
from p2pcoll.api.loop_thread import LoopThread
from p2pcoll.transport import gil_held, lane

WAIT_S = 30  # the longest a job may take to run before the test counts it as lost


def test_jobs_started_from_other_threads_wake_the_sleeping_loop() -> None:
    lt = LoopThread.acquire()
    try:
        assert isinstance(lt.loop, loop_thread._Loop)
        for _ in range(50):  # each one finds the loop asleep in select
            ran = threading.Event()
            lt.start(ran.set)
            assert ran.wait(WAIT_S)
    finally:
        LoopThread.release()


@pytest.mark.skipif(not gil_held.available(), reason="no libc send here")
def test_a_wake_up_calls_no_socket_method() -> None:
    """asyncio's own wake-up is ``socket.send``, which lets go of the GIL around the system
    call; the loop thread's is a ctypes call, which holds it (no Python C function runs)."""
    lt = LoopThread.acquire()
    called: list[str] = []

    def profile(frame: object, event: str, arg: object) -> None:
        if event == "c_call":
            called.append(getattr(arg, "__qualname__", repr(arg)))

    try:
        sys.setprofile(profile)
        try:
            lt.loop._write_to_self()  # type: ignore[attr-defined]
        finally:
            sys.setprofile(None)
        woken = threading.Event()
        lt.start(woken.set)  # and the loop still wakes
        assert woken.wait(WAIT_S)
    finally:
        LoopThread.release()
    assert not [name for name in called if "send" in name], called


def test_a_wake_up_after_close_does_nothing() -> None:
    loop = loop_thread._Loop()
    loop.close()
    loop._write_to_self()  # no socket: nothing to write to


def test_write_byte_writes_one_byte_and_names_a_full_pipe() -> None:
    reader, writer = os.pipe2(os.O_NONBLOCK)
    try:
        gil_held.write_byte(writer)
        assert os.read(reader, 16) == b"\0"
        with pytest.raises(BlockingIOError):  # (a wake-up is waiting already: callers pass)
            while True:
                gil_held.write_byte(writer)
    finally:
        os.close(reader)
        os.close(writer)
    with pytest.raises(OSError):  # closed: EBADF
        gil_held.write_byte(writer)


@pytest.mark.skipif(not gil_held.available(), reason="no libc write here")
def test_a_lane_wake_up_calls_no_os_write() -> None:
    """The lane's wake-up of a peer keeps the GIL too (os.write lets go of it)."""
    wakeup = lane.Wakeup()
    waker = lane.Waker(wakeup.name)
    called: list[str] = []

    def profile(frame: object, event: str, arg: object) -> None:
        if event == "c_call":
            called.append(getattr(arg, "__qualname__", repr(arg)))

    try:
        sys.setprofile(profile)
        try:
            waker.wake()
        finally:
            sys.setprofile(None)
        assert os.read(wakeup.fd, 16) == b"\0"
    finally:
        os.close(waker.fd)
        wakeup.close()
    assert "write" not in called, called
