"""The relay (p2pcoll.relay): its protocol and bookkeeping without sockets, then a relay
on loopback with one target behind it: what passes, what the relay can see, and what it
refuses (garbage, a stranger, a target of another group, a flood), counted, while the
forward it carries goes on. Peers behind NAT in network namespaces: test_relay_nat.py."""

from __future__ import annotations

import asyncio
import os
import tempfile
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
import zmq.asyncio

from p2pcoll.errors import SettingsError
from p2pcoll.relay import Attachment, Entrance, Relay, RelayLimits
from p2pcoll.relay import protocol as rp
from p2pcoll.relay.server import _Connection
from p2pcoll.rendezvous.jobs import Jobs
from p2pcoll.security import JobKey
from p2pcoll.settings import RendezvousLimits, Settings
from p2pcoll.relay import names
from p2pcoll.relay.names import advertised, choosing
from p2pcoll.transport.sockets import SocketFactory
from p2pcoll.wire import WIRE_VERSION

TARGET, TAG = "0" * 31 + "1", "a" * 32

# --- protocol, without sockets --------------------------------------------------------------


@pytest.mark.parametrize("preamble, expected", [
    (rp.register_preamble(TARGET, TAG), rp.Register(TARGET, TAG)),
    (rp.connect_preamble(TARGET, TAG), rp.Connect(TARGET, TAG)),
    (rp.accept_preamble(b"i" * 16), rp.Accept(b"i" * 16)),
])
def test_a_preamble_is_read_whatever_its_pieces(preamble: bytes, expected: object) -> None:
    parser = rp.Preamble()
    results = [parser.feed(preamble[i:i + 1]) for i in range(len(preamble))]
    assert results[:-1] == [None] * (len(preamble) - 1) and results[-1] == expected
    whole = rp.Preamble()
    assert whole.feed(preamble + b"ZMTP") == expected and whole.rest == b"ZMTP"


@pytest.mark.parametrize("garbage", [
    b"GET / HTTP/1.1\r\n", b"\xff" + bytes(8) + b"\x7f", b"P2PR\x03R", b"P2PR\x01X",
    b"P2PR\x01D",
    rp.MAGIC + rp.CONNECT + b"Z" * 64, rp.MAGIC + rp.REGISTER + b"0" * 31 + b"." + b"a" * 32,
])
def test_anything_else_is_garbage(garbage: bytes) -> None:
    with pytest.raises(rp.BadPreamble):
        rp.Preamble().feed(garbage)


def test_targets_route_only_a_member_of_the_targets_group() -> None:
    targets = rp.Targets(most=2)
    control, other = object(), object()
    assert targets.register(TARGET, TAG, control) is None
    assert targets.route(TARGET, TAG) is control
    with pytest.raises(rp.Refused) as refused:
        targets.route(TARGET, "b" * 32)
    assert refused.value.reason == "other-job"
    with pytest.raises(rp.Refused) as refused:
        targets.route("f" * 32, TAG)
    assert refused.value.reason == "unknown"
    targets.register("e" * 32, TAG, other)
    with pytest.raises(rp.Refused):  # full
        targets.register("d" * 32, TAG, other)
    assert targets.register(TARGET, TAG, other) is control  # registered again: replaced
    targets.unregister(TARGET, control)  # no longer its holder: stays
    assert targets.route(TARGET, TAG) is other
    targets.unregister(TARGET, other)
    assert len(targets) == 1


def test_relay_endpoints_and_tags() -> None:
    assert names.parse_endpoint(names.endpoint("h", 5, TARGET)) == ("h", 5, TARGET, "")
    assert names.parse_endpoint(names.endpoint("", 0, TARGET, TAG)) == ("", 0, TARGET, TAG)
    for bad in ("relay://h/x", "tcp://h:1", f"relay://h:99999/{TARGET}"):
        with pytest.raises(ValueError):
            names.parse_endpoint(bad)
    assert names.tag_of("s" * 32) == names.tag_of("s" * 32) != names.tag_of("t" * 32)
    assert len(names.tag_of("s")) == 32 and "s" * 8 not in names.tag_of("s" * 32)


def test_what_a_peer_behind_a_relay_advertises_and_chooses() -> None:
    bound = ["tcp://127.0.0.1:5000", "ipc:///tmp/p.sock"]
    assert advertised(bound, None, TARGET) == [f"relay://:0/{TARGET}", "ipc:///tmp/p.sock"]
    assert advertised(bound, "tcp://relay.example:7000", TARGET)[0] == \
        f"relay://relay.example:7000/{TARGET}"
    first = choosing(lambda host, endpoints: endpoints[0], "198.18.0.1", TARGET)
    other = "e" * 32
    # another peer's relay endpoint on the rendezvous host gets that host
    assert first("h", [f"relay://:4242/{other}"]) == f"relay://198.18.0.1:4242/{other}"
    # this peer's own entry is its relay endpoint, whatever choose would pick
    last = choosing(lambda host, endpoints: endpoints[-1], "198.18.0.1", TARGET)
    assert last("me", [f"relay://:4242/{TARGET}", "ipc:///tmp/p.sock"]) == \
        f"relay://198.18.0.1:4242/{TARGET}"
    assert last("h", ["tcp://198.18.0.2:1", "ipc:///tmp/q.sock"]) == "ipc:///tmp/q.sock"


def _join(endpoints: list[str]) -> list[bytes]:
    return [b"peer", msgpack.packb({
        "v": WIRE_VERSION, "op": "join", "job": "", "world_size": 2, "endpoints": endpoints,
        "host": "h", "pid": 1, "heartbeat": 5.0})]


def test_the_rendezvous_fills_in_its_relay_or_refuses_a_join_that_needs_one() -> None:
    asked = f"relay://:0/{TARGET}"
    none = Jobs(RendezvousLimits())
    [reply] = none.request(_join([asked]), 0.0)
    refusal = msgpack.unpackb(reply.frames[0])
    assert refusal["op"] == "error" and "P2PCOLL_RELAY" in refusal["reason"]
    jobs = Jobs(RendezvousLimits(), relay=lambda: 4242)
    jobs.request(_join([asked, "ipc:///tmp/x"]), 0.0)
    [one, two] = jobs.request([b"other", _join(["tcp://198.18.0.1:5"])[1]], 0.0)
    body = msgpack.unpackb(one.frames[1])
    assert body["endpoints"][0] == [f"relay://:4242/{TARGET}", "ipc:///tmp/x"]


def test_a_peer_the_server_cannot_reach_is_named_by_its_relay() -> None:
    verdicts: dict[bytes, bool | None] = {b"peer": None}
    jobs = Jobs(RendezvousLimits(), relay=lambda: 4242,
                reach=lambda identity, endpoints: verdicts[identity])
    frames = _join(["tcp://198.19.1.2:7000", "ipc:///tmp/y"])
    request = msgpack.unpackb(frames[1])
    checked = msgpack.packb({**request, "check": True, "target": TARGET, "relay": None})
    assert jobs.request([b"peer", checked], 0.0) == []  # held: not known yet
    verdicts[b"peer"] = False
    jobs.request([b"peer", checked], 1.0)
    [one, _] = jobs.request([b"other", _join(["tcp://198.18.0.1:5"])[1]], 1.0)
    body = msgpack.unpackb(one.frames[1])
    assert body["endpoints"][0] == [f"relay://:4242/{TARGET}", "ipc:///tmp/y"]
    bad = msgpack.packb({**request, "check": True, "target": "x"})
    [refusal] = jobs.request([b"third", bad], 2.0)
    assert "malformed" in msgpack.unpackb(refusal.frames[0])["reason"]


def test_settings_of_reachability_and_relay() -> None:
    env = {"P2PCOLL_REACHABLE": "0", "P2PCOLL_RELAY": "tcp://relay.example:7000"}
    settings = Settings.resolve(env)
    assert settings.reachable is False and settings.relay == "tcp://relay.example:7000"
    assert Settings.resolve({}, reachable=False).reachable is False
    with pytest.raises(SettingsError, match="P2PCOLL_RELAY"):
        Settings.resolve({"P2PCOLL_RELAY": "relay.example:7000"})
    with pytest.raises(SettingsError, match="relay="):
        Settings.resolve({}, relay="tcp://h:0")
    with pytest.raises(SettingsError, match="P2PCOLL_REACHABLE"):
        Settings.resolve({"P2PCOLL_REACHABLE": "maybe"})


# --- a relay on loopback --------------------------------------------------------------------


@dataclass
class Behind:
    """A relay, a ROUTER behind it (the target), and a member's entrance to it."""

    relay: Relay
    router: zmq.asyncio.Socket
    attachment: Attachment
    entrance: Entrance
    lost: list[str]
    seen: list[bytes]  # every byte the relay read


def _ipc() -> str:
    return os.path.join(tempfile.gettempdir(), f"p2pcoll-test-{os.urandom(6).hex()}.sock")


@pytest.fixture
async def behind(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
                 ) -> AsyncIterator[Behind]:
    seen: list[bytes] = []
    read = _Connection.data_received

    def record(self: _Connection, data: bytes) -> None:
        seen.append(bytes(data))
        read(self, data)

    monkeypatch.setattr(_Connection, "data_received", record)
    key = getattr(request, "param", None)
    factory = SocketFactory(key=key)
    relay = Relay("127.0.0.1", 0, RelayLimits(max_connections=40, register_s=0.2,
                                               handshake_s=0.5), secured=key is not None)
    port = relay.bind()
    router = factory.mesh_router()
    path = _ipc()
    router.bind(f"ipc://{path}")
    lost: list[str] = []
    attachment = Attachment("127.0.0.1", port, TARGET, TAG, f"ipc://{path}", 5.0, lost.append)
    await attachment.start(5.0)
    entrance = Entrance("127.0.0.1", port, TARGET, TAG, _ipc(), lambda n: None)
    try:
        yield Behind(relay, router, attachment, entrance, lost, seen)
    finally:
        await entrance.aclose()
        await attachment.aclose()
        await relay.aclose()
        router.close(linger=0)
        factory.close()
        Path(path).unlink(missing_ok=True)


async def _exchange(behind: Behind, key: JobKey | None = None, payload: bytes = b"x") -> None:
    factory = SocketFactory(key=key)
    link = factory.mesh_link(b"member")
    link.connect(behind.entrance.endpoint)
    try:
        await link.send_multipart([payload])
        identity, got = await asyncio.wait_for(behind.router.recv_multipart(), 10)
        assert (identity, got) == (b"member", payload)
        await behind.router.send_multipart([b"member", b"back"])
        assert await asyncio.wait_for(link.recv_multipart(), 10) == [b"back"]
    finally:
        link.close(linger=0)
        factory.close()


async def test_a_member_reaches_the_target_through_the_relay(behind: Behind) -> None:
    await _exchange(behind, payload=b"plain payload")
    stats = behind.relay.stats()
    assert stats["forwards"] == 1 and stats["targets"] == 1 and stats["refused"] == {}
    assert stats["bytes_relayed"] > len(b"plain payload")
    assert any(b"plain payload" in chunk for chunk in behind.seen)  # no key: in plain


KEY = JobKey.generate()


@pytest.mark.parametrize("behind", [KEY], indirect=True)
async def test_with_a_job_key_the_relay_sees_only_ciphertext(behind: Behind) -> None:
    secret = b"the secret payload " * 8
    await _exchange(behind, KEY, secret)
    seen = b"".join(behind.seen)
    assert behind.relay.stats()["forwards"] == 1 and b"secret payload" not in seen


async def _refused(port: int, preamble: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(preamble)
        return await asyncio.wait_for(reader.read(), 10)  # until it closes
    finally:
        writer.close()


async def test_garbage_a_stranger_and_another_groups_member_are_refused_and_counted(
        behind: Behind) -> None:
    port = behind.relay.port
    assert await _refused(port, b"GET / HTTP/1.1\r\n\r\n") == b""
    assert await _refused(port, rp.connect_preamble("f" * 32, TAG)) == rp.REFUSED  # stranger
    assert await _refused(port, rp.connect_preamble(TARGET, "b" * 32)) == rp.REFUSED
    assert await _refused(port, rp.accept_preamble(b"n" * 16)) == b""  # no such forward
    assert await _refused(port, b"P2P") == b""  # says too little: timed out
    assert behind.relay.stats()["refused"] == {"garbage": 1, "unknown": 2, "other-job": 1,
                                               "timeout": 1}
    assert behind.relay.stats()["forwards"] == 0
    await _exchange(behind)  # and the target is still served


async def _until(relay: Relay, holds: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """The relay's stats once ``holds`` is true of them (AssertionError with them after
    10 s: the relay never got there)."""
    for _ in range(200):
        stats = relay.stats()
        if holds(stats):
            return stats
        await asyncio.sleep(0.05)
    raise AssertionError(f"the relay never got there: {relay.stats()}")


async def _flood(relay: Relay) -> list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    return [await asyncio.open_connection("127.0.0.1", relay.port)
            for _ in range(60)]  # beyond max_connections (40), silent


async def test_a_flood_of_connections_is_bounded_and_the_forwards_go_on(
        behind: Behind) -> None:
    factory = SocketFactory()
    link = factory.mesh_link(b"member")
    link.connect(behind.entrance.endpoint)
    flood = await _flood(behind.relay)
    try:
        for i in range(20):  # the forward opened amid the flood carries on
            await link.send_multipart([b"%d" % i])
            _, got = await asyncio.wait_for(behind.router.recv_multipart(), 10)
            assert got == b"%d" % i
        assert behind.relay.stats()["connections"] <= 40
        # The silent ones run out of time (handshake_s) and are closed.
        stats = await _until(behind.relay, lambda s: s["connections"] < 10)
        refused = stats["refused"]
        assert refused.get("full", 0) >= 20 and refused.get("timeout", 0) >= 1, refused
    finally:
        for _, writer in flood:
            writer.close()
        link.close(linger=0)
        factory.close()


async def test_a_member_the_full_relay_turned_away_gets_through_once_there_is_room(
        behind: Behind) -> None:
    # The silent ones hold their places until they close: room comes when the test says.
    behind.relay.limits = replace(behind.relay.limits, handshake_s=60)
    flood = await _flood(behind.relay)
    factory = SocketFactory()
    link = factory.mesh_link(b"member")
    try:
        await _until(behind.relay, lambda s: s["refused"].get("full", 0) >= 21)
        link.connect(behind.entrance.endpoint)
        await link.send_multipart([b"through"])
        stats = await _until(behind.relay, lambda s: s["refused"].get("full", 0) >= 22)
        assert stats["connections"] == 40 and stats["forwards"] == 0  # turned away
        for _, writer in flood[:10]:
            writer.close()
        # The entrance closed its side when the relay closed its connection: libzmq
        # connects again at once (not after its handshake timeout, 30 s by default).
        _, got = await asyncio.wait_for(behind.router.recv_multipart(), 10)
        assert got == b"through" and behind.relay.stats()["forwards"] == 1
    finally:
        for _, writer in flood:
            writer.close()
        link.close(linger=0)
        factory.close()


async def test_a_relay_that_stops_is_lost_to_the_target(behind: Behind) -> None:
    await behind.relay.aclose()
    for _ in range(100):
        if behind.lost:
            break
        await asyncio.sleep(0.05)
    assert behind.lost and "relay" in behind.lost[0]
