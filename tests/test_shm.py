"""Shared-memory rings between peers of one host: placement, flow control, validation,
clean-up, and real groups that use them (and fall back to the socket when they are full)."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest

import p2pcoll
from conftest import ROGUE_RANK, Inject
from p2pcoll.errors import ProtocolError
from p2pcoll.testing import run_ranks
from p2pcoll.transport import shm
from p2pcoll.wire import WIRE_VERSION

RING = 1 << 16
TAG = shm.group_tag("test-group")


def _ours() -> set[str]:
    return {n for n in os.listdir(shm.SHM_DIR) if n.startswith(f"p2pcoll-{os.getpid()}-")}


@pytest.fixture
def pair() -> tuple[shm.Outbox, shm.Inbox]:
    out = shm.Outbox(RING, readers=3, creator=0, tag=TAG)
    out.announce({1, 2})
    inbox = shm.Inbox(out.name, me=1, creator=0, tag=TAG)
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
    assert out.put(x, [1]) == (8064, [1])  # reservations are whole cache lines
    assert out._tail() == 0
    del frame
    assert out._tail() == 8064
    assert out._header.released[1] == 1


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
    two = shm.Inbox(out.name, me=2, creator=0, tag=TAG)
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
    q = RING // 4
    a = inbox.take(*_spot(out.put(np.ones(q, np.uint8), [1]), q))
    b = inbox.take(*_spot(out.put(np.ones(2 * q, np.uint8), [1]), 2 * q))
    d = inbox.take(*_spot(out.put(np.ones(64, np.uint8), [1]), 64))  # held: keeps the tail
    del a, b
    assert out._tail() == 3 * q
    big = np.full(2 * q, 7, np.uint8)
    start, (k,) = out.put(big, [1])  # does not fit in what is left before the end
    assert start == 3 * q + 64
    assert shm.placement(start, big.nbytes, RING) == (0, RING + 2 * q)
    frame = inbox.take(start, big.nbytes, k)
    assert bytes(frame.buffer) == bytes(big)
    del d, frame
    assert out._tail() == out.head == 2 * RING  # all free: the next piece starts the ring


def test_when_all_is_free_any_piece_up_to_the_ring_fits(pair: tuple[shm.Outbox, shm.Inbox]) -> None:
    out, inbox = pair
    f = inbox.take(*_spot(out.put(np.ones(3 * RING // 8, np.uint8), [1]), 3 * RING // 8))
    del f
    big = np.ones(5 * RING // 8, np.uint8)  # more than what is left before the end
    assert out.put(big, [1]) is not None


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


def test_only_the_announcing_ranks_ring_of_this_group_is_mapped() -> None:
    for name in ("../etc/passwd", "p2pcoll-1-xyz", "other-1-0123456789abcdef",
                 "p2pcoll-99999999999-0123456789abcdef"):
        with pytest.raises(ProtocolError, match="not one of ours"):
            shm.Inbox(name, 0, 1, TAG)
    with pytest.raises(ProtocolError, match="cannot map"):
        shm.Inbox("p2pcoll-1-0123456789abcdef", 0, 1, TAG)
    name = f"p2pcoll-{os.getpid()}-{'d' * 16}"
    path = os.path.join(shm.SHM_DIR, name)
    with open(path, "wb") as f:
        f.write(bytes(2 * shm.PAGE))  # a header of zeros: no readers
    try:
        with pytest.raises(ProtocolError, match="not rank 1's ring"):
            shm.Inbox(name, 0, 1, TAG)
    finally:
        os.unlink(path)
    out = shm.Outbox(RING, readers=2, creator=1, tag=TAG)
    try:
        for me, creator, tag in ((2, 1, TAG), (0, 0, TAG), (0, 1, shm.group_tag("other"))):
            with pytest.raises(ProtocolError, match="not rank"):
                shm.Inbox(out.name, me, creator, tag)
        assert not out.ready(0)
        shm.Inbox(out.name, 0, 1, TAG).close()
        assert out.ready(0)
    finally:
        out.close()


def test_the_file_goes_once_every_peer_mapped_it_or_the_sender_closes() -> None:
    out = shm.Outbox(RING, readers=3, creator=0, tag=TAG)
    out.announce({1, 2})
    one = shm.Inbox(out.name, 1, 0, TAG)
    out.unlink_when_all_mapped()
    assert os.path.exists(out.path)  # rank 2 has not mapped it yet
    two = shm.Inbox(out.name, 2, 0, TAG)  # the last to map it unlinks it
    assert not os.path.exists(out.path)
    out.unlink_when_all_mapped()  # nothing left to do
    x = np.arange(10, dtype=np.uint8)  # both still read through their mappings
    frames = [box.take(*_spot(out.put(x, [1, 2]), 10, i)) for i, box in enumerate((one, two))]
    assert [bytes(f.buffer) for f in frames] == [x.tobytes()] * 2
    del frames
    one.close()
    two.close()
    out.close()
    lonely = shm.Outbox(RING, readers=2, creator=0, tag=TAG)
    lonely.close()
    assert not os.path.exists(lonely.path)


def test_sweep_removes_the_rings_of_dead_creators_at_once(tmp_path: Path) -> None:
    # In a directory of its own: any group that forms on the host meanwhile sweeps /dev/shm.
    dead = 1 << 22  # pids stay below pid_max, which is at most 2**22: no such process
    stale = tmp_path / f"p2pcoll-{dead}-{'a' * 16}"
    young = tmp_path / f"p2pcoll-{dead}-{'b' * 16}"  # just written: goes all the same
    mine = tmp_path / f"p2pcoll-{os.getpid()}-{'c' * 16}"
    for path in (stale, young, mine):
        path.touch()
    old = time.time() - 3600
    os.utime(stale, (old, old))
    os.utime(mine, (old, old))
    assert shm.sweep(str(tmp_path)) == 2
    assert not stale.exists() and not young.exists()
    assert mine.exists()


def test_ring_size_from_the_environment() -> None:
    from p2pcoll.settings import Settings

    assert Settings.resolve({"P2PCOLL_SHM_BYTES": "100000"}).shm_bytes == 100000
    assert Settings.resolve({"P2PCOLL_SHM_BYTES": "1M"}).shm_bytes == 1 << 20
    with pytest.raises(ValueError, match="P2PCOLL_SHM_BYTES='lots'"):
        Settings.resolve({"P2PCOLL_SHM_BYTES": "lots"})
    with pytest.raises(ValueError, match=">= 64K"):
        Settings.resolve({"P2PCOLL_SHM_BYTES": "1000"})


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
        # A peer maps a ring when the announcing hello arrives, which on a loaded machine can
        # be after the first sends were made: one barrier first, so the rings are in use.
        await g.barrier(timeout=10)
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
        assert stats["bytes_sent_shm"] <= stats["bytes_sent"]
    # Across the group some pieces went through the rings and some, finding them full, over
    # the socket. Per rank either can be all: rank 0 of 3 only sends whole 1 MiB segments
    # (Rabenseifner's fold), which fit a 1 MiB ring only while it is empty.
    shm = sum(stats["bytes_sent_shm"] for _, stats in results)
    assert 0 < shm < sum(stats["bytes_sent"] for _, stats in results)


async def test_bad_shared_memory_descriptors_are_dropped_and_counted(
    caplog: pytest.LogCaptureFixture, inject: Inject
) -> None:
    caplog.set_level(logging.DEBUG, logger="p2pcoll.transport")
    out = shm.Outbox(RING, readers=2, creator=ROGUE_RANK, tag=TAG)
    try:
        async def fn(g: p2pcoll.Group) -> object:
            if g.rank == 0:
                header = {"v": WIRE_VERSION, "k": "data", "g": g.membership.group_id,
                          "r": ROGUE_RANK, "q": 999, "seg": 0, "s": 0, "sig": b"\0" * 8,
                          "n": [1 << 16]}
                dropped = await inject(g, [[msgpack.packb(h)] for h in (
                    {**header, "m": "not a list"},
                    {**header, "m": ["p2pcoll-1-zz", [0], [0]]},  # not one of our names
                    {**header, "m": ["p2pcoll-1-0123456789abcdef", [0], [0]]},  # no such file
                    {**header, "m": [out.name, [0], [-1]]},  # a reader index it cannot have
                    {**header, "m": [out.name, [0, 0], [0, 0]]},  # more offsets than pieces
                )])
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
    for reason in ("is not a member of this group",):  # a stranger's ring is never looked up
        assert reason in caplog.text


async def test_a_stalled_ring_costs_one_wait_not_one_per_piece(
    pair: tuple[shm.Outbox, shm.Inbox],
) -> None:
    from p2pcoll.transport.zmq_mesh import RING_WAIT_S, _put

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


def _spot(
    placed: tuple[int, list[int]] | None, n: int = RING // 2, reader: int = 0
) -> tuple[int, int, int]:
    assert placed is not None
    return placed[0], n, placed[1][reader]


async def test_a_peer_that_cannot_map_a_ring_gets_the_socket(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Another /dev/shm, another user, or shared memory off on that peer: it does not map
    the rings announced to it, and the others send it everything over the socket."""
    real = shm.SharedRings.accept

    def refuse_on_rank_1(self: shm.SharedRings, peer: int, name: str) -> None:
        if self.rank == 1:
            raise ProtocolError("cannot map (simulated)")
        real(self, peer, name)

    monkeypatch.setattr(shm.SharedRings, "accept", refuse_on_rank_1)

    async def fn(g: p2pcoll.Group) -> tuple[np.ndarray, np.ndarray, dict[str, int]]:
        x = np.arange(1 << 20, dtype=np.float32) * (g.rank + 1)
        total = await g.allreduce(x, strategy="ring")
        sent = await g.broadcast(x if g.rank == 0 else None, root=0, strategy="root")
        return total, sent, g.stats()

    results = await run_ranks(3, fn, transport="ipc")
    base = np.arange(1 << 20, dtype=np.float32)
    for total, sent, _ in results:
        np.testing.assert_array_equal(total, base * 6)
        np.testing.assert_array_equal(sent, base)
    # rank 0 sends to 1 over the socket and to 2 through the ring
    assert 0 < results[0][2]["bytes_sent_shm"] < results[0][2]["bytes_sent"]
