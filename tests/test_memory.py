"""The transport's memory fast path: pooled snapshot buffers and the allocator thresholds."""

from __future__ import annotations

import numpy as np
import pytest
import zmq

from p2pcoll.transport import memory
from p2pcoll.transport.memory import SnapshotPool, tune_malloc


class _Tracker:
    def __init__(self, done: bool) -> None:
        self.done = done


def _send_pair() -> tuple[zmq.Socket, zmq.Socket]:
    ctx = zmq.Context.instance()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    a.bind("inproc://snapshot-pool-test")
    b.connect("inproc://snapshot-pool-test")
    return a, b


def test_snapshot_holds_a_copy_that_later_writes_do_not_change() -> None:
    pool = SnapshotPool()
    x = np.arange(100_000, dtype=np.float32)
    frame = pool.snapshot(x)
    x[:] = -1
    got = np.frombuffer(frame.buffer, dtype=np.float32)
    np.testing.assert_array_equal(got, np.arange(100_000, dtype=np.float32))


def test_snapshot_of_a_non_contiguous_view() -> None:
    pool = SnapshotPool()
    x = np.arange(200_000, dtype=np.int64).reshape(1000, 200)[:, ::2]
    frame = pool.snapshot(x)
    np.testing.assert_array_equal(np.frombuffer(frame.buffer, np.int64), x.ravel())


def test_buffer_is_reused_once_released_and_not_before() -> None:
    pool = SnapshotPool()
    x = np.ones(300_000, np.uint8)
    first = pool.snapshot(x)
    first_addr = np.frombuffer(first.buffer, np.uint8).ctypes.data
    size_class = 1 << (x.nbytes - 1).bit_length()
    queue = pool._classes[size_class]
    buf, _ = queue[0]
    queue[0] = (buf, _Tracker(done=False))  # libzmq still holds it
    second = pool.snapshot(x)
    assert np.frombuffer(second.buffer, np.uint8).ctypes.data != first_addr
    assert pool.kept_bytes == 2 * size_class
    queue[0] = (buf, _Tracker(done=True))  # now released
    third = pool.snapshot(x * 3)
    assert np.frombuffer(third.buffer, np.uint8).ctypes.data == first_addr
    assert bytes(third.buffer) == bytes(x * 3)
    assert pool.kept_bytes == 2 * size_class


def test_pool_keeps_at_most_max_bytes() -> None:
    pool = SnapshotPool(max_bytes=1 << 20)
    x = np.zeros(400_000, np.uint8)  # 512 KiB class
    frames = [pool.snapshot(x) for _ in range(5)]
    assert pool.kept_bytes == 1 << 20
    assert len(pool._classes[512 << 10]) == 2
    assert all(len(f) == x.nbytes for f in frames)
    pool.clear()
    assert pool.kept_bytes == 0


def test_sent_snapshot_is_released_back_to_the_pool() -> None:
    a, b = _send_pair()
    try:
        pool = SnapshotPool()
        x = np.arange(50_000, dtype=np.float64)
        frame = pool.snapshot(x)
        a.send(frame, copy=False)
        del frame
        got = b.recv(copy=False)
        np.testing.assert_array_equal(np.frombuffer(got.buffer, np.float64), x)
        del got
        tracker = next(iter(pool._classes.values()))[0][1]
        tracker.wait(timeout=5)
        assert tracker.done
    finally:
        a.close(linger=0)
        b.close(linger=0)


def test_tune_malloc_is_idempotent_and_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "_tuned", False)
    monkeypatch.setenv("P2PCOLL_TUNE_MALLOC", "0")
    assert tune_malloc() is False
    monkeypatch.delenv("P2PCOLL_TUNE_MALLOC")
    first = tune_malloc()
    assert tune_malloc() is first
    try:
        import ctypes

        ctypes.CDLL(None).mallopt  # noqa: B018 - glibc exposes it
    except AttributeError:
        assert first is False
    else:
        assert first is True
