"""A dial between two peers behind relays (relay protocol version 2): its messages and
bookkeeping without sockets, then a relay on loopback with both sides played by hand
(what the relay tells each, and what it does with their verdicts), and an entrance and an
attachment that dial through it. Behind real NATs in network namespaces:
test_relay_punch.py."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import socket
import tempfile
from collections import Counter
from collections.abc import AsyncIterator

import pytest

from p2pcoll.relay import Attachment, Entrance, Relay, RelayLimits
from p2pcoll.relay import protocol as rp
from p2pcoll.relay import punch, server
from p2pcoll.transport.base import Counters
from p2pcoll.transport.relayed import tally
from p2pcoll.transport.sockets import SocketFactory

TARGET, TAG, SENDER = "0" * 31 + "1", "a" * 32, "5" * 32

# --- messages and state, without sockets -----------------------------------------------


@pytest.mark.parametrize("preamble, expected", [
    (rp.dial_preamble(TARGET, TAG, 4242, SENDER), rp.Dial(TARGET, TAG, 4242, SENDER)),
    (rp.dial_preamble(TARGET, TAG, 1), rp.Dial(TARGET, TAG, 1, rp.NOBODY)),
    (rp.answer_preamble(b"i" * 16, 65535), rp.Answer(b"i" * 16, 65535)),
    (rp.register2_preamble(TARGET, TAG), rp.Register(TARGET, TAG, 2)),
    (rp.MAGIC2 + rp.CONNECT + TARGET.encode() + TAG.encode(), rp.Connect(TARGET, TAG)),
])
def test_version_2_preambles_are_read_whatever_their_pieces(preamble: bytes,
                                                             expected: object) -> None:
    parser = rp.Preamble()
    results = [parser.feed(preamble[i:i + 1]) for i in range(len(preamble))]
    assert results[:-1] == [None] * (len(preamble) - 1) and results[-1] == expected
    whole = rp.Preamble()
    assert whole.feed(preamble + b"Y") == expected and whole.rest == b"Y"


@pytest.mark.parametrize("garbage", [
    rp.MAGIC + rp.DIAL + b"0" * 64,  # a dial is version 2's
    rp.MAGIC + rp.ANSWER + b"i" * 18,
    rp.MAGIC2 + rp.DIAL + TARGET.encode() + TAG.encode() + b"\x00\x01" + b"Z" * 32,
    rp.MAGIC2 + b"X",
])
def test_a_malformed_dial_is_garbage(garbage: bytes) -> None:
    with pytest.raises(rp.BadPreamble):
        rp.Preamble().feed(garbage)


def test_a_hole_round_trips_and_a_bad_one_is_refused() -> None:
    hole = rp.Hole("198.18.0.102", 40001, b"m" * 16, b"t" * 16, 0.005, 2.0)
    packed = hole.pack()
    assert packed[:1] == rp.HOLE and len(packed) == 1 + rp.HOLE_BYTES
    assert rp.Hole.unpack(packed[1:]) == hole
    with pytest.raises(rp.BadPreamble):
        rp.Hole.unpack(packed[1:-1])
    for zero in (rp.Hole("1.2.3.4", 0, hole.mine, hole.theirs, 0.005, 2.0),
                 rp.Hole("1.2.3.4", 5, hole.mine, hole.theirs, 0.0, 2.0),
                 rp.Hole("1.2.3.4", 5, hole.mine, hole.theirs, 0.005, 0.0)):
        with pytest.raises(rp.BadPreamble):
            rp.Hole.unpack(zero.pack()[1:])


A, B = ("198.18.0.102", 40001), ("198.18.0.103", 40002)


@pytest.mark.parametrize("bound, seen, other_bound, other_seen, why", [
    (40001, A, 40002, B, None),
    (40009, A, 40002, B, "port changed by a NAT"),  # --random-fully, this side
    (40001, A, 40009, B, "port changed by a NAT"),  # the other side
    (40001, A, 40002, (A[0], 40002), "one address"),  # one NAT: no hairpin
    (40001, ("127.0.0.1", 40001), 40002, ("127.0.0.1", 40002), None),  # loopback
    (40001, ("::1", 40001), 40002, B, "not IPv4"),
    (40001, A, 40002, ("fe80::1", 40002), "not IPv4"),
])
def test_which_sides_may_try(bound: int, seen: rp.Address, other_bound: int,
                             other_seen: rp.Address, why: str | None) -> None:
    assert rp.punchable(bound, seen, other_bound, other_seen) == why


@pytest.mark.parametrize("first, second", list(itertools.product(range(2), repeat=2)))
@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
def test_verdicts_decide_once_both_are_in(first: int, second: int,
                                          order: tuple[int, int]) -> None:
    said = [(rp.DIRECT, rp.FAILED)[first], (rp.DIRECT, rp.FAILED)[second]]
    verdicts = rp.Verdicts()
    assert verdicts.say(order[0], said[order[0]]) is None
    outcome = verdicts.say(order[1], said[order[1]])
    assert outcome == {(0, 0): "direct", (1, 1): "relayed"}.get((first, second), "mixed")
    with pytest.raises(rp.BadPreamble):  # a side says it once
        verdicts.say(0, rp.DIRECT)


def test_a_verdict_that_is_none_is_garbage() -> None:
    with pytest.raises(rp.BadPreamble):
        rp.Verdicts().say(1, b"K")


# --- a relay on loopback, both sides by hand ---------------------------------------------

Stream = tuple[asyncio.StreamReader, asyncio.StreamWriter]
_writers: list[asyncio.StreamWriter] = []  # every connection a test opens: closed after it


async def _open(relay: Relay, sock: socket.socket | None = None) -> Stream:
    if sock is None:
        reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
    else:
        reader, writer = await asyncio.open_connection(sock=sock)
    _writers.append(writer)
    return reader, writer


@pytest.fixture
async def relay() -> AsyncIterator[Relay]:
    server = Relay("127.0.0.1", 0, RelayLimits(register_s=0.2, handshake_s=0.5, punch_s=0.5),
                   secured=True)
    server.bind()
    try:
        yield server
    finally:
        await server.aclose()
        for writer in _writers:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
        _writers.clear()


async def _control(relay: Relay, preamble: bytes) -> Stream:
    reader, writer = await _open(relay)
    writer.write(preamble)
    assert await asyncio.wait_for(reader.readexactly(1), 5) == rp.OK
    return reader, writer


async def _word(reader: asyncio.StreamReader) -> bytes:
    """The next word on a control connection that is not a PING."""
    while (kind := await asyncio.wait_for(reader.readexactly(1), 5)) == rp.PING:
        pass
    return kind


async def _bound(relay: Relay) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, int]:
    sock = await punch.open_bound("127.0.0.1", relay.port, 5)
    port = sock.getsockname()[1]
    reader, writer = await _open(relay, sock)
    return reader, writer, port


async def _holes(relay: Relay, claim: int = 0) -> tuple[Stream, Stream, bytes]:
    """A v2 target registered, a member's dial and the target's answer: both sides'
    streams, and the member's first word (``claim``: a port the member says it bound
    instead of its own)."""
    control = await _control(relay, rp.register2_preamble(TARGET, TAG))
    m_reader, m_writer, m_port = await _bound(relay)
    m_writer.write(rp.dial_preamble(TARGET, TAG, claim or m_port, SENDER))
    assert await _word(control[0]) == rp.PUNCH
    body = await control[0].readexactly(rp.PUNCH_BYTES)
    assert body[rp.ID_BYTES:] == SENDER.encode()  # the target learns who dials
    t_reader, t_writer, t_port = await _bound(relay)
    t_writer.write(rp.answer_preamble(body[:rp.ID_BYTES], t_port))
    first = await asyncio.wait_for(m_reader.readexactly(1), 5)
    if first == rp.HOLE:
        mine = rp.Hole.unpack(await m_reader.readexactly(rp.HOLE_BYTES))
        assert await t_reader.readexactly(1) == rp.HOLE
        theirs = rp.Hole.unpack(await t_reader.readexactly(rp.HOLE_BYTES))
        # each is told where the other's bound port is, and the other's nonce
        assert (mine.host, mine.port) == ("127.0.0.1", t_port)
        assert (theirs.host, theirs.port) == ("127.0.0.1", m_port)
        assert mine.mine == theirs.theirs != mine.theirs == theirs.mine
        assert mine.interval_s != theirs.interval_s and mine.deadline_s == 0.5
    return (m_reader, m_writer), (t_reader, t_writer), first


async def _closed(reader: asyncio.StreamReader) -> bool:
    return await asyncio.wait_for(reader.read(), 5) == b""


async def test_both_failed_the_relay_forwards_between_their_connections(relay: Relay) -> None:
    (m_reader, m_writer), (t_reader, t_writer), first = await _holes(relay)
    assert first == rp.HOLE
    m_writer.write(rp.FAILED)
    t_writer.write(rp.FAILED)
    assert await m_reader.readexactly(1) == rp.OK and await t_reader.readexactly(1) == rp.OK
    m_writer.write(b"zmtp from the member")
    t_writer.write(b"zmtp from the target")
    assert await t_reader.readexactly(20) == b"zmtp from the member"
    assert await m_reader.readexactly(20) == b"zmtp from the target"
    stats = relay.stats()
    assert stats["dials"] == {"relayed": 1} and stats["forwards"] == 1
    assert stats["refused"] == {}


@pytest.mark.parametrize("member, target, outcome", [
    (rp.DIRECT, rp.DIRECT, "direct"), (rp.DIRECT, rp.FAILED, "mixed"),
    (rp.FAILED, rp.DIRECT, "mixed")])
async def test_a_side_that_went_direct_ends_both_relay_connections(
        relay: Relay, member: bytes, target: bytes, outcome: str) -> None:
    (m_reader, m_writer), (t_reader, t_writer), _ = await _holes(relay)
    m_writer.write(member)
    t_writer.write(target)
    assert await _closed(m_reader) and await _closed(t_reader)
    assert relay.stats()["dials"] == {outcome: 1} and relay.stats()["forwards"] == 0


async def test_a_garbled_or_missing_verdict_is_refused_and_counted(relay: Relay) -> None:
    (m_reader, m_writer), (t_reader, _), _ = await _holes(relay)
    m_writer.write(b"??")
    assert await _closed(m_reader) and await _closed(t_reader)
    (m_reader, _), (t_reader, _), _ = await _holes(relay)  # silent: punch_s + handshake_s
    assert await _closed(m_reader) and await _closed(t_reader)
    assert relay.stats()["refused"] == {"garbage": 1, "timeout": 1}
    assert relay.stats()["dials"] == {}


async def test_a_side_whose_port_the_nat_changed_is_forwarded_without_a_try(
        relay: Relay) -> None:
    (m_reader, m_writer), (t_reader, t_writer), first = await _holes(relay, claim=1)
    assert first == rp.OK and await t_reader.readexactly(1) == rp.OK
    m_writer.write(b"ping")
    assert await t_reader.readexactly(4) == b"ping"
    assert relay.stats()["dials"] == {"not punchable": 1}


async def test_a_dial_to_a_version_1_target_is_a_connect(relay: Relay) -> None:
    control = await _control(relay, rp.register_preamble(TARGET, TAG))
    m_reader, m_writer, m_port = await _bound(relay)
    m_writer.write(rp.dial_preamble(TARGET, TAG, m_port))
    assert await _word(control[0]) == rp.OPEN  # never a PUNCH, which it would not know
    conn = await control[0].readexactly(rp.ID_BYTES)
    _, t_writer = await _open(relay)
    t_writer.write(rp.accept_preamble(conn))
    assert await m_reader.readexactly(1) == rp.OK
    assert relay.stats()["dials"] == {"plain": 1}


async def test_a_dial_from_outside_the_targets_job_learns_nothing(relay: Relay) -> None:
    control = await _control(relay, rp.register2_preamble(TARGET, TAG))
    for target, tag in ((TARGET, "b" * 32), ("f" * 32, TAG)):
        reader, writer, port = await _bound(relay)
        writer.write(rp.dial_preamble(target, tag, port))
        assert await asyncio.wait_for(reader.read(), 5) == rp.REFUSED  # and no address
    # an answer for no dial, and an answer to a connect's OPEN, are strangers'
    _, _, port = await _bound(relay)
    reader, writer, port = await _bound(relay)
    writer.write(rp.answer_preamble(b"n" * 16, port))
    assert await _closed(reader)
    assert relay.stats()["refused"] == {"other-job": 1, "unknown": 2}
    assert not control[0].at_eof() and relay.stats()["dials"] == {}


# --- an entrance and an attachment that dial ---------------------------------------------


def _ipc() -> str:
    return os.path.join(tempfile.gettempdir(), f"p2pcoll-test-{os.urandom(6).hex()}.sock")


async def test_an_entrance_dials_an_attachment_and_the_link_works(relay: Relay) -> None:
    """On loopback an attempt meets the other's only within microseconds: it goes direct
    or falls back, and either way the link carries what it is given, and both sides
    report the path they took."""
    factory = SocketFactory()
    router = factory.mesh_router()
    path = _ipc()
    router.bind(f"ipc://{path}")
    seen_target: list[tuple[str, str, int]] = []
    seen_member: list[tuple[str, int]] = []
    attachment = Attachment("127.0.0.1", relay.port, TARGET, TAG, f"ipc://{path}", 5.0,
                            lambda why: None, seen=lambda *a: seen_target.append(a))
    await attachment.start(5.0)
    entrance = Entrance("127.0.0.1", relay.port, TARGET, TAG, _ipc(), lambda n: None,
                        dial_from=SENDER, seen=lambda *a: seen_member.append(a), dial_s=0.3)
    link = factory.mesh_link(b"member")
    try:
        link.connect(entrance.endpoint)
        await link.send_multipart([b"hello"])
        identity, got = await asyncio.wait_for(router.recv_multipart(), 10)
        assert (identity, got) == (b"member", b"hello")
        await router.send_multipart([b"member", b"back"])
        assert await asyncio.wait_for(link.recv_multipart(), 10) == [b"back"]
        [(way, opened)] = seen_member
        assert opened == 1 and way in ("direct", "relayed") and seen_target == [(SENDER, way, 1)]
        assert relay.stats()["dials"] == {way: 1}
        assert entrance.dial_from == (SENDER if way == "direct" else None)
    finally:
        link.close(linger=0)
        await entrance.aclose()
        await attachment.aclose()
        router.close(linger=0)
        factory.close()
        os.unlink(path)


async def test_with_a_relay_of_version_1_a_peer_registers_and_connects_as_before(
        relay: Relay, monkeypatch: pytest.MonkeyPatch) -> None:
    """A standalone relay of p2pcoll 0.18 closes version 2's preambles as garbage: the
    attachment registers with version 1, the entrance connects instead of dialling."""

    class Version1(rp.Preamble):
        def feed(self, data: bytes) -> rp.Request | None:
            if (self._buf + data).startswith(rp.MAGIC2[:5]):
                raise rp.BadPreamble("version 2")
            return super().feed(data)

    monkeypatch.setattr(server, "Preamble", Version1)
    factory = SocketFactory()
    router = factory.mesh_router()
    path = _ipc()
    router.bind(f"ipc://{path}")
    attachment = Attachment("127.0.0.1", relay.port, TARGET, TAG, f"ipc://{path}", 5.0,
                            lambda why: None)
    await attachment.start(5.0)
    entrance = Entrance("127.0.0.1", relay.port, TARGET, TAG, _ipc(), lambda n: None,
                        dial_from=SENDER)
    link = factory.mesh_link(b"member")
    try:
        link.connect(entrance.endpoint)
        await link.send_multipart([b"hello"])
        assert (await asyncio.wait_for(router.recv_multipart(), 10))[1] == b"hello"
        assert entrance.dial_from is None and relay.stats()["forwards"] == 1
        assert relay.stats()["refused"] == {"garbage": 2}  # the registration, the dial
    finally:
        link.close(linger=0)
        await entrance.aclose()
        await attachment.aclose()
        router.close(linger=0)
        factory.close()
        os.unlink(path)


def test_a_peer_is_direct_while_every_dialled_connection_to_it_is() -> None:
    counters = Counters()
    open_: dict[int, Counter[str]] = {1: Counter(), 2: Counter()}
    tally(open_, counters, 1, "direct", 1)  # the link to rank 1
    tally(open_, counters, 2, "relayed", 1)  # the link to rank 2 fell back
    tally(open_, counters, None, "direct", 1)  # from someone unnamed: not counted
    tally(open_, counters, 7, "direct", 1)  # nor from a rank behind no relay
    assert counters.punched == {1} and (counters.direct_punched, counters.punch_failed) == (1, 1)
    tally(open_, counters, 1, "plain", 1)  # rank 1's probe, forwarded without a try
    assert counters.punched == frozenset()
    tally(open_, counters, 1, "plain", -1)
    tally(open_, counters, 2, "relayed", -1)
    tally(open_, counters, 2, "direct", 1)  # rank 2's link again, direct this time
    assert counters.punched == {1, 2} and counters.direct_punched == 2
    tally(open_, counters, 1, "direct", -1)  # closed: nothing open, nothing direct
    assert counters.punched == {2}
