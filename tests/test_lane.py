"""Shared-memory lanes (:mod:`p2pcoll.transport.lane`): records and their checks, the wake-up
pipe, and real groups over ipc whose messages go on lanes, switch between lane and socket
(tiny lanes) and still arrive in the order sent, and a corrupt lane that names its sender."""

from __future__ import annotations

import asyncio
import os
import struct
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import p2pcoll
from p2pcoll.errors import ProtocolError
from p2pcoll.testing import run_ranks
from p2pcoll.transport import lane

TAG = 0x1234


def _pair(size: int = 1024) -> tuple[lane.LaneOut, lane.LaneIn]:
    out = lane.LaneOut(0, 1, TAG, size)
    return out, lane.LaneIn(out.name, 1, 0, TAG)


def _read_all(inbound: lane.LaneIn) -> list[list[bytes]]:
    got = []
    while (record := inbound.read()) is not None:
        first, rest = record
        got.append([bytes(first), *rest])
        first.release()
        inbound.release()
    return got


def test_records_round_trip_across_many_wraps() -> None:
    out, inbound = _pair(1024)
    try:
        assert out.mapped and not os.path.exists(out.path)  # its one reader unlinked it
        for i in range(200):
            payload = np.full(i % 90, i, np.uint8)
            assert out.write([b"h%d" % i, payload, b""])
            assert _read_all(inbound) == [[b"h%d" % i, payload.tobytes(), b""]]
        for i in range(5):  # several waiting at once
            assert out.write([b"x" * i])
        assert _read_all(inbound) == [[b"x" * i] for i in range(5)]
        assert inbound.read() is None
    finally:
        inbound.close()
        out.close()


def test_a_full_lane_refuses_and_keeps_room_for_a_marker() -> None:
    out, inbound = _pair(1024)
    try:
        assert not out.fits_now([bytes(600)]) and not out.write([bytes(600)])  # > half the ring
        written = 0
        while out.write([bytes(100)], spare=64):
            written += 1
        assert written >= 7 and out.room() >= 64
        assert out.write([bytes(40)])  # the marker's room: 8 + 4 + 40 bytes -> 56
        assert len(_read_all(inbound)) == written + 1
        assert out.room() == 1024 and out.write([bytes(100)], spare=64)  # all free again
    finally:
        inbound.close()
        out.close()


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=600), st.integers(0, 3000), st.integers(0, 1023))
def test_any_bytes_in_a_lane_give_records_inside_it_or_a_protocol_error(
    garbage: bytes, head: int, start: int,
) -> None:
    """A lane's reader trusts nothing its sender wrote: whatever the ring holds and its
    head says, it returns records that lie inside the ring, or breaks with ProtocolError."""
    out, inbound = _pair(1024)
    try:
        start -= start % 8
        data = out._data
        data[start:start + len(garbage)] = garbage[:1024 - start]
        inbound.tail = start  # as if the earlier records had been read
        out._words[lane.HEAD] = start + head
        for _ in range(300):
            try:
                record = inbound.read()
            except ProtocolError as exc:
                assert "corrupt" in str(exc) and inbound.broken
                assert inbound.read() is None  # broken for good
                break
            if record is None:
                break
            first, rest = record
            assert len(first) + sum(map(len, rest)) <= 1024
            first.release()
        else:
            pytest.fail("the reader went on for ever")
    finally:
        inbound.close()
        out.close()


@pytest.mark.parametrize(("me", "creator", "tag", "message"), [
    (2, 0, TAG, "not rank 0's lane to rank 2"),
    (1, 3, TAG, "not rank 3's lane to rank 1"),
    (1, 0, TAG + 1, "not rank 0's lane to rank 1"),
])
def test_a_lane_of_another_pair_or_group_is_refused(me: int, creator: int, tag: int,
                                                     message: str) -> None:
    out = lane.LaneOut(0, 1, TAG, 1024)
    try:
        with pytest.raises(ProtocolError, match=message):
            lane.LaneIn(out.name, me, creator, tag)
        assert not out.mapped and os.path.exists(out.path)
    finally:
        out.close()
    assert not os.path.exists(out.path)


@pytest.mark.parametrize(("name", "message"), [
    ("../etc/passwd", "not one of ours"),
    ("p2pcoll-1-0123456789abcdef", "cannot map lane"),
])
def test_names_that_are_no_lane(name: str, message: str) -> None:
    with pytest.raises(ProtocolError, match=message):
        lane.LaneIn(name, 1, 0, TAG)


def test_wake_up_pipe() -> None:
    wakeup = lane.Wakeup()
    waker = lane.Waker(wakeup.name)
    try:
        for _ in range(70_000):  # more than a pipe holds: a full pipe is no error
            waker.wake()
        wakeup.clear()
        with pytest.raises(BlockingIOError):
            os.read(wakeup.fd, 1)
        waker.wake()
        assert os.read(wakeup.fd, 10) == b"\0"
    finally:
        waker.close()
        wakeup.close()
    pid, fd, ino = wakeup.name.split(":")
    reader, writer = os.pipe()
    try:
        for bad, message in [("x:1:2", "not pid:fd:inode"),
                             (f"{os.getpid()}:{writer}:{int(ino) + 10**9}", "not that peer's"),
                             (f"{os.getpid()}:999999:1", "cannot open")]:
            with pytest.raises(ProtocolError, match=message):
                lane.Waker(bad)
    finally:
        os.close(reader)
        os.close(writer)


def _counters(g: p2pcoll.Group) -> Any:
    return g.session.transport.counters


async def test_small_messages_take_the_lanes() -> None:
    async def fn(g: p2pcoll.Group) -> tuple[int, int, int]:
        x = np.full(1024, g.rank + 1, np.float32)
        # Strategies asked for by name: small collectives would otherwise go on the board.
        for _ in range(10):
            assert np.array_equal(await g.allreduce(x, strategy="ring"),
                                  np.full(1024, 6, np.float32))
        assert np.array_equal(await g.broadcast(x, root=1, strategy="binomial"),
                              np.full(1024, 2, np.float32))
        c = _counters(g)
        return c.messages_sent, c.messages_sent_lane, g.stats()["messages_dropped"]

    results = await run_ranks(3, fn, transport="ipc")
    for sent, on_lane, dropped in results:
        # All but the first messages of each link (sent before its receiver mapped it).
        assert dropped == 0 and on_lane >= sent - 2 and on_lane > 0, results


async def test_no_lanes_without_shared_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("P2PCOLL_SHM", "0")

    async def fn(g: p2pcoll.Group) -> int:
        await g.allreduce(np.ones(16, np.float32))
        assert g.session.transport._lanes is None
        return int(_counters(g).messages_sent_lane)

    assert await run_ranks(2, fn, transport="ipc") == [0, 0]


async def test_order_holds_while_messages_switch_between_lane_and_socket(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Lanes of 2 KiB: a message above 1 KiB goes over the socket and the next small one
    back on the lane, with markers in between; point-to-point messages of one tag,
    collectives of mixed sizes, and a rank that closes right after its last send all
    arrive in the order sent, with every result right."""
    monkeypatch.setattr(lane, "LANE_BYTES", 2048)
    sizes = [1, 300, 5, 20_000, 2, 250, 4000, 3, 100, 60_000, 7]

    async def fn(g: p2pcoll.Group) -> tuple[int, int]:
        for round_ in range(3):
            for n in sizes:
                x = np.arange(n, dtype=np.float32) + g.rank
                want = 3 * np.arange(n, dtype=np.float32) + 3
                assert np.array_equal(await g.allreduce(x, strategy="ring"), want), (round_, n)
            if g.rank == 0:
                for i, n in enumerate(sizes):
                    await g.send(np.full(n, i, np.int64), dst=1, tag=7)
            elif g.rank == 1:
                for i, n in enumerate(sizes):
                    got = await g.recv(src=0, tag=7)
                    assert got.shape == (n,) and (got == i).all(), (i, got[:3])
        c = _counters(g)
        return c.messages_sent, c.messages_sent_lane

    results = await run_ranks(3, fn, transport="ipc")
    for sent, on_lane in results:
        assert 0 < on_lane < sent, results  # both ways were taken


async def test_a_corrupt_lane_names_its_sender() -> None:
    """A record that does not add up (written here straight into rank 0's lane to rank 1)
    is dropped and counted, the lane is read no more, and rank 1 loses rank 0 by name
    instead of waiting out its deadline."""

    async def fn(g: p2pcoll.Group) -> Any:
        x = np.ones(256, np.float32)
        for _ in range(3):
            await g.allreduce(x)
        if g.rank == 0:
            lanes = g.session.transport._lanes
            out = lanes.ready(1)
            assert out is not None
            pos = out.head % out.size
            struct.pack_into("<II", out._data, pos, 8, 0)  # a record of no frames
            out.head += 8
            out._words[lane.HEAD] = out.head
            lanes.wake(1)
            await asyncio.sleep(1)
            return None
        if g.rank == 1:
            started = asyncio.get_running_loop().time()
            with pytest.raises(p2pcoll.PeerLost, match="rank 0") as info:
                for _ in range(100):
                    await g.allreduce(x, timeout=30)
                    await asyncio.sleep(0.02)
            elapsed = asyncio.get_running_loop().time() - started
            dropped = g.stats()["messages_dropped_by_reason"]
            return str(info.value), elapsed, dropped
        return None

    results = await run_ranks(2, fn, transport="ipc", return_exceptions=True)
    message, elapsed, dropped = results[1]
    assert dropped == {"malformed": 1} and elapsed < 10, results


def _from(header: bytes, rank: int) -> bool:
    """Whether ``header`` is a binary data frame or a msgpack map that names ``rank`` as
    its source."""
    import msgpack

    from p2pcoll.wire.header import DATA_MAGIC

    if header[:1] == bytes([DATA_MAGIC]) and len(header) >= 16:
        return int.from_bytes(header[12:16], "little") == rank
    try:
        d = msgpack.unpackb(header, strict_map_key=False)
    except Exception:
        return False
    return isinstance(d, dict) and d.get("r") == rank


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def test_a_peer_survives_hostile_records_on_its_lanes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The live fuzz run of the lane path: rank 0 puts 10,000 hostile messages (random
    bytes, random msgpack, valid headers mutated or from another source) on its lane to
    rank 1 as records that add up. Rank 1 drops and counts every one, its memory stays
    put, and the collectives after it are exact."""
    import random

    from test_live_fuzz import _collectives, hostile_messages

    monkeypatch.setenv("P2PCOLL_MAX_MESSAGE_BYTES", str(1 << 20))
    shared: dict[str, Any] = {}
    done = asyncio.Event()

    async def fn(g: p2pcoll.Group) -> None:
        await _collectives(g)  # the lanes are up and current
        if g.rank == 1:
            shared["group"] = g
            shared["rss"] = _rss_bytes()
            await done.wait()
        else:
            mesh = g.session.transport
            rng = random.Random(11)
            # Not those that claim to come from rank 0 itself: on its own lane such a
            # message is rank 0's (a member can always send nonsense in its own name).
            messages = [m for m in hostile_messages(rng, g.membership.group_id, 14_000)
                        if sum(map(len, m)) < 64 << 10 and not _from(m[0], 0)][:10_000]
            while "group" not in shared:
                await asyncio.sleep(0.01)
            other = shared["group"]
            for frames in messages:
                while not mesh._lane_put(mesh._link(1), frames):  # full: let rank 1 read
                    await asyncio.sleep(0.001)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 30
            while other.stats()["messages_dropped"] < len(messages) and loop.time() < deadline:
                await asyncio.sleep(0.05)
            shared["sent"] = len(messages)
            shared["dropped"] = other.stats()["messages_dropped"]
            shared["growth"] = _rss_bytes() - shared["rss"]
            done.set()
        await _collectives(g)
        await _collectives(g)
        shared[f"lane_{g.rank}"] = _counters(g).messages_sent_lane

    await run_ranks(2, fn, transport="ipc")
    assert shared["dropped"] == shared["sent"] == 10_000, shared
    assert shared["growth"] < 32 << 20, shared  # 10,000 messages of up to 64 KiB went by
    assert shared["lane_0"] > 0 and shared["lane_1"] > 0
