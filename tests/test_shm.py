"""Shared-memory rings between peers of one host: placement, flow control, validation,
clean-up, and real groups that use them (and fall back to the socket when they are full)."""

from __future__ import annotations

import asyncio
import os
import time

import msgpack
import numpy as np
import pytest
import zmq
import zmq.asyncio

import p2pcoll
from p2pcoll.errors import ProtocolError
from p2pcoll.testing import run_ranks
from p2pcoll.transport import shm
from p2pcoll.wire import WIRE_VERSION

RING = 1 << 16


def _ours() -> set[str]:
    return {n for n in os.listdir(shm.SHM_DIR) if n.startswith(f"p2pcoll-{os.getpid()}-")}


@pytest.fixture
def pair() -> tuple[shm.Outbox, shm.Inbox]:
    out = shm.Outbox(RING, readers=3)
    inbox = shm.Inbox(out.name, me=1)
    yield out, inbox
    inbox.close()
    out.close()


def test_a_piece_round_trips_and_its_space_comes_back(pair: tuple[shm.Outbox, shm.Inbox]) -> None:
    out, inbox = pair
    x = np.arange(1001, dtype=np.float64)  # 8008 bytes
    assert out.put(x, [1]) == (0, [0])
    frame = inbox.take(0, x.nbytes, 0)
    x[:] = -1  # the ring holds a copy
    np.testing.assert_array_equal(np.frombuffer(frame.buffer, np.float64), np.arange(1001.0))
    assert out._tail() == 0
    del frame
    assert out._tail() == 8064 == out.head  # reservations are whole cache lines
    assert out.put(x, [1]) == (8064, [1])  # reader 1's second piece


def test_full_ring_refuses_and_frees_in_order(pair: tuple[shm.Outbox, shm.Inbox]) -> None:
    out, inbox = pair
    piece = np.ones(RING // 4, np.uint8)  # four pieces fill the ring
    placed = [out.put(piece, [1]) for _ in range(4)]
    assert placed == [(i * RING // 4, [i]) for i in range(4)]
    assert out.put(piece, [1]) is None
    frames = [inbox.take(at, piece.nbytes, k[0]) for at, k in placed]
    del frames[2]  # released out of order: nothing before it is free yet
    assert out.put(piece, [1]) is None
    del frames[0]  # piece 0 goes: only its space comes back (piece 1 is still held)
    assert out._tail() == RING // 4
    del frames[0]  # piece 1 goes: the tail moves over 1 and the already released 2
    assert out._tail() == 3 * RING // 4
    assert out.put(piece, [1]) == (RING, [4])  # room again, at the ring's start


def test_a_piece_for_several_readers_is_copied_once_and_freed_by_the_last(
    pair: tuple[shm.Outbox, shm.Inbox],
) -> None:
    out, one = pair
    two = shm.Inbox(out.name, me=2)
    try:
        x = np.arange(5000, dtype=np.int32)
        at, (k1, k2) = out.put(x, [1, 2])
        a, b = one.take(at, x.nbytes, k1), two.take(at, x.nbytes, k2)
        assert bytes(a.buffer) == bytes(b.buffer) == x.tobytes()
        del a
        assert out._tail() == 0  # reader 2 still holds it
        del b
        assert out._tail() == out.head
    finally:
        two.close()


def test_a_piece_that_does_not_fit_before_the_end_starts_the_ring_again(
    pair: tuple[shm.Outbox, shm.Inbox],
) -> None:
    out, inbox = pair
    big = np.full(RING // 2 + 64, 7, np.uint8)
    first = out.put(big, [1])
    del_me = inbox.take(first[0], big.nbytes, 0)
    del del_me
    second, _ = out.put(big, [1])  # does not fit in what is left before the end
    assert second == RING // 2 + 64
    assert shm.placement(second, big.nbytes, RING) == (0, RING + RING // 2 + 64)
    frame = inbox.take(second, big.nbytes, 1)
    assert bytes(frame.buffer) == bytes(big)
    del frame
    assert out._tail() == RING + RING // 2 + 64


def test_a_piece_larger_than_the_ring_is_refused(pair: tuple[shm.Outbox, shm.Inbox]) -> None:
    out, _ = pair
    assert out.put(np.zeros(RING + 1, np.uint8), [1]) is None


@pytest.mark.parametrize(("start", "n", "index"), [(-64, 8, 0), (0, RING + 1, 0), (64, 8, -1)])
def test_bad_offsets_are_protocol_errors(
    pair: tuple[shm.Outbox, shm.Inbox], start: int, n: int, index: int
) -> None:
    _, inbox = pair
    with pytest.raises(ProtocolError, match="outside ring"):
        inbox.take(start, n, index)


def test_a_piece_cannot_be_taken_twice(pair: tuple[shm.Outbox, shm.Inbox]) -> None:
    out, inbox = pair
    at, (k,) = out.put(np.ones(100, np.uint8), [1])
    frame = inbox.take(at, 100, k)
    with pytest.raises(ProtocolError, match="taken already"):
        inbox.take(at, 100, k)
    del frame
    with pytest.raises(ProtocolError, match="taken already"):  # and not after release
        inbox.take(at, 100, k)


def test_only_our_well_formed_segments_are_opened() -> None:
    for name in ("../etc/passwd", "p2pcoll-1-xyz", "other-1-0123456789abcdef"):
        with pytest.raises(ProtocolError, match="not one of ours"):
            shm.Inbox(name, 0)
    with pytest.raises(ProtocolError, match="cannot open"):
        shm.Inbox("p2pcoll-1-0123456789abcdef", 0)
    name = f"p2pcoll-{os.getpid()}-{'d' * 16}"
    path = os.path.join(shm.SHM_DIR, name)
    with open(path, "wb") as f:
        f.write(bytes(2 * shm.PAGE))  # a header of zeros: no readers
    try:
        with pytest.raises(ProtocolError, match="bad header"):
            shm.Inbox(name, 0)
    finally:
        os.unlink(path)
    out = shm.Outbox(RING, readers=2)
    try:
        with pytest.raises(ProtocolError, match="bad header"):
            shm.Inbox(out.name, 2)  # no slot for reader 2
    finally:
        out.close()


def test_the_file_goes_once_the_sender_closed_and_every_reader_mapped() -> None:
    out = shm.Outbox(RING, readers=3)
    out.put(np.ones(10, np.uint8), [1, 2])
    one = shm.Inbox(out.name, 1)
    out.close()  # reader 2 has not mapped it yet: the file must stay
    assert os.path.exists(out.path)
    two = shm.Inbox(out.name, 2)  # the last reader unlinks it
    assert not os.path.exists(out.path)
    one.close()
    two.close()
    early = shm.Outbox(RING, readers=2)
    early.put(np.ones(10, np.uint8), [1])
    reader = shm.Inbox(early.name, 1)
    assert os.path.exists(early.path)  # the sender may still address others
    early.close()
    assert not os.path.exists(early.path)
    reader.close()
    unused = shm.Outbox(RING, readers=2)
    unused.close()
    assert not os.path.exists(unused.path)


def test_sweep_removes_stale_rings_of_dead_creators_only() -> None:
    dead = 4_000_000  # above the default pid_max: no such process
    stale = os.path.join(shm.SHM_DIR, f"p2pcoll-{dead}-{'a' * 16}")
    young = os.path.join(shm.SHM_DIR, f"p2pcoll-{dead}-{'b' * 16}")
    mine = os.path.join(shm.SHM_DIR, f"p2pcoll-{os.getpid()}-{'c' * 16}")
    try:
        for path in (stale, young, mine):
            open(path, "wb").close()
        old = time.time() - 3600
        os.utime(stale, (old, old))
        os.utime(mine, (old, old))
        assert shm.sweep() == 1
        assert not os.path.exists(stale)
        assert os.path.exists(young) and os.path.exists(mine)
    finally:
        for path in (stale, young, mine):
            if os.path.exists(path):
                os.unlink(path)


def test_ring_size_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("P2PCOLL_SHM_BYTES", "100000")
    assert shm.ring_bytes() == 100000 - 100000 % shm.ALIGN
    monkeypatch.setenv("P2PCOLL_SHM_BYTES", "lots")
    with pytest.raises(ValueError, match="P2PCOLL_SHM_BYTES"):
        shm.ring_bytes()
    monkeypatch.setenv("P2PCOLL_SHM_BYTES", "1000")
    with pytest.raises(ValueError, match="at least"):
        shm.ring_bytes()


# --- real groups -------------------------------------------------------------------------

def _allreduce_3mib(expected_shm: str):
    async def fn(g: p2pcoll.Group) -> tuple[np.ndarray, dict[str, int]]:
        x = np.arange(3 << 18, dtype=np.float32) * (g.rank + 1)  # 3 MiB
        out = await g.allreduce(x, strategy="ring")
        out2 = await g.allreduce(x, strategy="recursive_doubling")
        np.testing.assert_array_equal(out, out2)
        return out, g.stats()

    return fn


@pytest.mark.parametrize("transport", ["ipc", "auto"])
async def test_same_host_groups_send_large_pieces_through_shared_memory(transport: str) -> None:
    before = _ours()
    results = await run_ranks(4, _allreduce_3mib("all"), transport=transport)
    want = np.arange(3 << 18, dtype=np.float32) * 10
    for out, stats in results:
        np.testing.assert_array_equal(out, want)
        assert 0 < stats["bytes_sent_shm"] <= stats["bytes_sent"]
    assert _ours() <= before  # nothing left in /dev/shm


async def test_tcp_and_disabled_shm_use_the_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    want = np.arange(3 << 18, dtype=np.float32) * 3
    for out, stats in await run_ranks(2, _allreduce_3mib("none"), transport="tcp"):
        np.testing.assert_array_equal(out, want)
        assert stats["bytes_sent_shm"] == 0 and stats["bytes_sent"] > 0
    monkeypatch.setenv("P2PCOLL_SHM", "0")
    for out, stats in await run_ranks(2, _allreduce_3mib("none"), transport="ipc"):
        np.testing.assert_array_equal(out, want)
        assert stats["bytes_sent_shm"] == 0 and stats["bytes_sent"] > 0


async def test_a_full_ring_falls_back_to_the_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("P2PCOLL_SHM_BYTES", str(1 << 20))  # room for two or three pieces

    async def fn(g: p2pcoll.Group) -> tuple[list[np.ndarray], dict[str, int]]:
        xs = [np.arange(1 << 20, dtype=np.float32) * (g.rank + 1) + i for i in range(4)]
        outs = await asyncio.gather(*(g.allreduce(x) for x in xs))
        bcast = await g.broadcast(xs[0] if g.rank == 1 else None, root=1)
        return [*outs, bcast], g.stats()

    results = await run_ranks(3, fn, transport="ipc")
    base = np.arange(1 << 20, dtype=np.float32)
    for outs, stats in results:
        for i, out in enumerate(outs[:4]):
            np.testing.assert_array_equal(out, base * 6 + 3 * i)
        np.testing.assert_array_equal(outs[4], base * 2)
        assert 0 < stats["bytes_sent_shm"] < stats["bytes_sent"]


async def test_bad_shared_memory_descriptors_are_dropped_and_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ctx = zmq.asyncio.Context.instance()
    out = shm.Outbox(RING, readers=2)
    try:
        async def fn(g: p2pcoll.Group) -> object:
            if g.rank == 0:
                bad = ctx.socket(zmq.DEALER)
                bad.setsockopt(zmq.IDENTITY, b"5")  # a link identity no member uses
                header = {"v": WIRE_VERSION, "k": "data", "g": g.membership.group_id, "r": 5,
                          "q": 999, "seg": 0, "s": 0, "sig": [], "n": [1 << 16]}
                bad.connect(g.endpoint)
                junk = [
                    {**header, "m": "not a list"},
                    {**header, "m": ["p2pcoll-1-zz", [0], [0]]},  # not one of our names
                    {**header, "m": ["p2pcoll-1-0123456789abcdef", [0], [0]]},  # no such file
                    {**header, "m": [out.name, [0], [-1]]},  # a reader index it cannot have
                    {**header, "m": [out.name, [0, 0], [0, 0]]},  # more offsets than pieces
                ]
                for h in junk:
                    await bad.send_multipart([msgpack.packb(h)])
                await asyncio.sleep(0.5)
                bad.close(linger=0)
                dropped = g.stats()["messages_dropped"]
            else:
                await asyncio.sleep(0.5)
                dropped = None
            total = await g.allreduce(np.full(1 << 18, g.rank + 1.0), timeout=10)
            return dropped, total

        results = await run_ranks(2, fn, transport="ipc")
    finally:
        out.close()
    assert results[0][0] == 5
    for _, total in results:
        np.testing.assert_array_equal(total, np.full(1 << 18, 3.0))
    for reason in ("field 'm'", "not one of ours", "cannot open", "outside ring"):
        assert reason in caplog.text


async def test_a_stalled_ring_costs_one_wait_not_one_per_piece(
    pair: tuple[shm.Outbox, shm.Inbox],
) -> None:
    from p2pcoll.transport.mesh import RING_WAIT_S, _put

    out, inbox = pair
    piece = np.ones(RING // 2, np.uint8)
    held = [inbox.take(*_spot(await _put(out, piece, [1]))) for _ in range(2)]  # ring full
    loop = asyncio.get_running_loop()
    t = loop.time()
    assert await _put(out, piece, [1]) is None  # waited for room, in vain
    assert loop.time() - t >= RING_WAIT_S
    assert out.stalled
    t = loop.time()
    assert await _put(out, piece, [1]) is None  # no second wait
    assert loop.time() - t < RING_WAIT_S
    del held[:]
    assert await _put(out, piece, [1]) is not None  # room again: back to normal
    assert not out.stalled


def _spot(placed: tuple[int, list[int]] | None) -> tuple[int, int, int]:
    assert placed is not None
    return placed[0], RING // 2, placed[1][0]
