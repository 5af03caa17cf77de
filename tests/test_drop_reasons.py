"""Dropped messages are counted per reason (issue 10): ``Group.stats()`` keeps the total in
``messages_dropped`` and adds ``messages_dropped_by_reason``, and the rate-limited log line
names the reason. The reasons are those of :mod:`p2pcoll.wire.validation`, plus ``error``
for a failure to handle a message (a bug, logged with its traceback)."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import Any

import msgpack
import pytest
import zmq
import zmq.asyncio

import p2pcoll
from conftest import Inject
from p2pcoll.errors import ProtocolError
from p2pcoll.testing import memory_groups, run_ranks
from p2pcoll.transport.base import Counters, Drops
from p2pcoll.wire import REASONS, WIRE_VERSION
from p2pcoll.wire.header import DataHeaders

CAP = 1 << 20  # P2PCOLL_MAX_MESSAGE_BYTES of the test groups


def hostile(gid: str, src: int) -> list[tuple[str, list[bytes]]]:
    """Messages on rank ``src``'s link, each with the reason it must be dropped for."""
    header: dict[str, Any] = {"v": WIRE_VERSION, "k": "data", "g": gid, "r": src, "q": 1000,
                              "seg": 0, "s": 0, "sig": b"\0" * 8, "n": [8]}

    def as_map(**changes: Any) -> bytes:
        return msgpack.packb({**header, **changes})

    def frame(*, group: str = gid, rank: int = src, seq: int = 1000,
              nbytes: tuple[int, ...] = (8,), version: int = WIRE_VERSION) -> bytes:
        raw = DataHeaders(group, rank).frame(seq, 0, 0, b"\0" * 8, list(nbytes))
        return raw[:1] + bytes([version]) + raw[2:]

    half = CAP // 2 + 100  # two such frames are over the cap, each is under libzmq's
    return [
        ("malformed", [b"\xc1 not msgpack"]),
        ("malformed", [msgpack.packb([1, 2, 3])]),
        ("malformed", [as_map(k="exec")]),
        ("malformed", [as_map(), b"12345678"]),  # a data header spelled as a map
        ("malformed", [frame()[:40], b"12345678"]),  # a binary frame cut short
        ("malformed", [msgpack.packb({"v": WIRE_VERSION, "k": "why", "g": gid, "r": src,
                                      "q": 0, "meta": {"state": "waiting"}})]),
        ("malformed", [msgpack.packb({"v": WIRE_VERSION, "k": "waiting", "g": gid, "r": src,
                                      "q": 0, "meta": {"state": "asleep"}})]),
        ("malformed", [msgpack.packb({"v": WIRE_VERSION, "k": "waiting", "g": gid, "r": src,
                                      "q": 0, "meta": {"waiting_on": [7]}})]),  # no such rank
        ("version", [frame(version=99), b"12345678"]),
        ("version", [as_map(v=WIRE_VERSION + 1, future_field=1)]),
        ("group", [frame(group="another-group"), b"12345678"]),
        ("mismatch", [frame(), b"123"]),  # shorter than the header says
        ("mismatch", [frame()]),  # the payload frame is missing
        ("mismatch", [frame(rank=(src + 1) % 2), b"12345678"]),  # another rank than the link's
        ("oversize", [frame(nbytes=(half, half)), bytes(half), bytes(half)]),
        ("duplicate", [frame(seq=1001), b"12345678"]),  # the second time (see below)
    ]


async def _until(predicate: Any, timeout: float) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


async def _link_of_departed(g: p2pcoll.Group, identity: bytes) -> zmq.asyncio.Socket:
    """A socket on ``g`` with the link identity of a member that has closed (read from its
    own transport: the identity holds a nonce of that peer's), once ``g`` reads it (a
    probe, dropped as malformed, shows when it does)."""
    for _ in range(50):
        sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, identity)
        sock.connect(g.endpoint)
        before = g.stats()["messages_dropped"]
        await sock.send(b"\xc1 probe")
        if await _until(lambda: g.stats()["messages_dropped"] > before, 1.0):
            return sock
        sock.close(linger=0)
    raise AssertionError(f"link identity {identity!r} never became free")


async def test_a_live_peer_counts_each_drop_by_its_reason(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, inject: Inject
) -> None:
    """Over tcp: strangers (the ``inject`` fixture's rogue link) and every other reason, on
    the link identity of a member that has left, each counted exactly."""
    monkeypatch.setenv("P2PCOLL_MAX_MESSAGE_BYTES", str(CAP))
    caplog.set_level(logging.DEBUG, logger="p2pcoll.transport")
    counts: dict[str, Any] = {}

    async def fn(g: p2pcoll.Group) -> None:
        if g.rank == 1:
            counts["link"] = g.session.transport.identity  # type: ignore[attr-defined]
            return  # leaves at once; rank 0 is then sent messages on its link identity
        assert g.stats()["messages_dropped_by_reason"] == {}
        assert await _until(lambda: 1 in g.session.peers.gone(), 10)
        sock = await _link_of_departed(g, counts["link"])
        try:
            probes = g.stats()["messages_dropped_by_reason"]
            assert probes == {"malformed": 1}, probes
            messages = hostile(g.membership.group_id, 1)
            messages.append(messages[-1])  # the duplicate itself
            for _, frames in messages:
                await sock.send_multipart(frames)
            total = 1 + len(messages) - 1  # the probe, and all but the first of q=1001
            assert await _until(lambda: g.stats()["messages_dropped"] >= total, 10)
        finally:
            sock.close(linger=0)
        counts["member"] = g.stats()["messages_dropped_by_reason"]
        await inject(g, [[b"\xc1"], [msgpack.packb({"v": WIRE_VERSION})], [b"x", b"y"]])
        await _until(lambda: g.stats()["messages_dropped"] >= total + 3, 10)
        counts["stats"] = g.stats()

    await run_ranks(2, fn, transport="tcp")

    expected = Counter(reason for reason, _ in hostile("", 1)) + Counter(malformed=1)
    assert counts["member"] == dict(expected), counts["member"]
    stats = counts["stats"]
    assert stats["messages_dropped_by_reason"] == dict(expected + Counter(stranger=3)), stats
    assert stats["messages_dropped"] == sum(expected.values()) + 3
    assert set(stats["messages_dropped_by_reason"]) <= set(REASONS)
    # The first drop from each source is a WARNING naming its reason; the rest, within the
    # interval, only DEBUG lines (each naming its reason too).
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
                and r.name == "p2pcoll.transport" and "dropped a message" in r.getMessage()]
    assert any("dropped a message from 1 (malformed): header is not valid msgpack" in w
               for w in warnings), warnings
    assert any("(stranger)" in w for w in warnings), warnings
    debug = Counter(r.args[2] for r in caplog.records  # type: ignore[index]
                    if r.levelno == logging.DEBUG and r.name == "p2pcoll.transport"
                    and r.msg.startswith("rank %d: dropped a message"))
    assert debug == expected + Counter(stranger=3), debug


async def test_the_memory_transport_counts_the_same_way() -> None:
    groups = await memory_groups(2, collective_timeout=10)
    try:
        net = groups[0].session.transport.network  # type: ignore[attr-defined]
        ends = groups[0].membership.endpoints
        messages = [(r, m) for r, m in hostile(groups[0].membership.group_id, 1)
                    if r != "oversize"]  # the memory transport's cap is its own
        messages.append(messages[-1])
        for _, frames in messages:
            net.deliver(ends[1], ends[0], frames, data=False)
        net.deliver("mem://nobody", ends[0], [b"\xc1"], data=False)  # a stranger's
        await asyncio.sleep(0.05)
        expected = Counter(r for r, _ in messages[:-1]) + Counter(stranger=1)
        stats = groups[0].stats()
        assert stats["messages_dropped_by_reason"] == dict(expected), stats
        assert stats["messages_dropped"] == sum(expected.values())
        assert groups[1].stats()["messages_dropped_by_reason"] == {}
    finally:
        for g in groups:
            await g.close()


def test_drops_count_bugs_as_errors_and_report_what_they_held_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="p2pcoll.transport")
    counters = Counters()
    clock = [100.0]
    drops = Drops(counters, lambda: 0, interval=10.0)
    monkey = pytest.MonkeyPatch()
    monkey.setattr("p2pcoll.transport.base.time.monotonic", lambda: clock[0])
    try:
        drops.drop(3, ProtocolError("bad", reason="oversize"))  # WARNING
        drops.drop(3, ProtocolError("bad"))  # quiet: malformed
        drops.drop(3, ProtocolError("bad", reason="oversize"))  # quiet
        drops.drop(3, KeyError("oops"), bug=True)  # quiet: error
        drops.drop(4, ValueError("a bug"))  # another source: ERROR at once
        clock[0] += 11
        drops.drop(3, ProtocolError("late", reason="group"))  # WARNING, with what was held
    finally:
        monkey.undo()
    assert counters.messages_dropped == 6
    assert counters.dropped_by_reason == {"oversize": 2, "malformed": 1, "error": 2,
                                          "group": 1}
    loud = [(r.levelname, r.getMessage()) for r in caplog.records if r.levelno > logging.DEBUG]
    assert loud == [
        ("WARNING", "rank 0: dropped a message from 3 (oversize): bad"),
        ("ERROR", "rank 0: dropped a message from 4 (error)"),
        ("WARNING", "rank 0: dropped a message from 3 (group): late (3 more from there since "
                    "the last report: 1 error, 1 malformed, 1 oversize)"),
    ]
    bug = next(r for r in caplog.records if r.levelno == logging.ERROR)
    assert isinstance(bug.exc_info[1], ValueError)  # type: ignore[index]  # the traceback
