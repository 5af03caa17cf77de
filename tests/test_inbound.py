"""The one inbound path (p2pcoll.transport.inbound): validate, count, dispatch, drop; on
real wire headers, without a transport."""

from __future__ import annotations

from typing import Any

import pytest

from p2pcoll.errors import ProtocolError
from p2pcoll.transport.base import BytesPiece, Counters, Drops, Piece
from p2pcoll.transport.inbound import Inbound
from p2pcoll.wire import Header, Limits, encode_header

GROUP = "g-inbound"
ME, PEER, SIZE = 0, 1, 3


class Host:
    """A transport as the inbound path sees it."""

    def __init__(self) -> None:
        self.counters = Counters()
        self.drops = Drops(self.counters, lambda: ME)
        self.received: list[tuple[Header, list[bytes]]] = []
        self.delivered_calls: list[tuple[int, str, int]] = []
        self.delivered: Any = None
        self.on_message = self._on_message

    def _on_message(self, header: Header, pieces: list[Piece]) -> None:
        self.received.append((header, [bytes(p.buffer) for p in pieces]))


def data(src: int = PEER, seq: int = 1, payload: bytes = b"12345678") -> tuple[bytes, list[Piece]]:
    header = Header("data", GROUP, src, seq=seq, sig=b"\0" * 8, nbytes=[len(payload)])
    return encode_header(header), [BytesPiece(payload)]


def control(kind: str, src: int = PEER, **meta: Any) -> bytes:
    return encode_header(Header(kind, GROUP, src, meta=meta or None))


@pytest.fixture
def host() -> Host:
    return Host()


@pytest.fixture
def inbound(host: Host) -> Inbound:
    return Inbound(host, Limits(GROUP, ME, SIZE, 1 << 20))


def test_a_data_message_is_counted_and_handed_on(host: Host, inbound: Inbound) -> None:
    seen: list[tuple[int, str, int]] = []
    host.delivered = lambda src, header, n: seen.append((src, header.kind, n))
    head, frames = data()
    assert inbound.accept(PEER, head, frames) is None
    assert [(h.kind, h.src, h.seq, p) for h, p in host.received] == [
        ("data", PEER, 1, [b"12345678"])]
    c = host.counters
    assert (c.messages_received, c.bytes_received, c.messages_dropped) == (1, 8, 0)
    assert seen == [(PEER, "data", 8)]


def test_control_messages_are_handed_on_uncounted(host: Host, inbound: Inbound) -> None:
    inbound.accept(PEER, control("bye"))
    assert [h.kind for h, _ in host.received] == ["bye"]
    assert host.counters.messages_received == 0


@pytest.mark.parametrize(("source", "head", "frames", "reason"), [
    (PEER, None, [], "malformed"),  # no header frame
    (PEER, b"\xc1 not msgpack", [], "malformed"),
    (-1, data()[0], data()[1], "stranger"),  # a link that is no member's
    (ME, data(src=ME)[0], data(src=ME)[1], "stranger"),  # this peer's own rank
    (2, data()[0], data()[1], "mismatch"),  # rank 1's header on rank 2's link
    (PEER, data()[0], [BytesPiece(b"123")], "mismatch"),  # shorter than it says
    (PEER, encode_header(Header("data", "another", PEER, seq=1, sig=b"\0" * 8, nbytes=[8])),
     [BytesPiece(b"12345678")], "group"),
])
def test_what_fails_validation_is_dropped_and_counted_by_reason(
        host: Host, inbound: Inbound, source: int, head: bytes | None,
        frames: list[Piece], reason: str) -> None:
    assert inbound.accept(source, head, frames) is None
    assert host.received == []
    c = host.counters
    assert c.messages_dropped == 1 and c.dropped_by_reason == {reason: 1}
    assert c.messages_received == 0


def test_before_the_group_forms_everything_is_dropped(host: Host) -> None:
    inbound = Inbound(host)
    inbound.accept(PEER, *data())
    assert host.received == [] and host.counters.dropped_by_reason == {"stranger": 1}


def test_a_kept_kind_goes_to_its_handler_only(host: Host, inbound: Inbound) -> None:
    inbound.keep["lane"] = lambda header: header.meta["on"]  # type: ignore[index]
    assert inbound.accept(PEER, control("lane", on=True)) is True
    assert inbound.accept(PEER, control("lane", on=False)) is False
    assert host.received == [] and host.counters.messages_dropped == 0


def test_a_watched_kind_is_seen_then_handed_on(host: Host, inbound: Inbound) -> None:
    seen: list[str] = []
    inbound.watch["bye"] = lambda header: seen.append(header.kind)
    inbound.accept(PEER, control("bye"))
    assert seen == ["bye"] and [h.kind for h, _ in host.received] == ["bye"]


def test_a_watcher_that_refuses_drops_the_message(host: Host, inbound: Inbound) -> None:
    def refuse(header: Header) -> None:
        raise ProtocolError("rank 1 may not announce a board here")

    inbound.watch["bye"] = refuse
    inbound.accept(PEER, control("bye"))
    assert host.received == [] and host.counters.dropped_by_reason == {"malformed": 1}


def test_resolve_gives_the_pieces(host: Host, inbound: Inbound) -> None:
    inbound.resolve = lambda header, frames: [BytesPiece(b"from the ring")]
    inbound.accept(PEER, *data())
    assert host.received[0][1] == [b"from the ring"]


def test_resolve_failing_drops_before_counting(host: Host, inbound: Inbound) -> None:
    def resolve(header: Header, frames: object) -> list[Piece]:
        raise ProtocolError("piece outside the ring")

    inbound.resolve = resolve
    inbound.accept(PEER, *data())
    c = host.counters
    assert host.received == [] and c.messages_received == 0
    assert c.dropped_by_reason == {"malformed": 1}


@pytest.mark.parametrize(("exc", "reason"), [
    (ProtocolError("a second message with that key", reason="duplicate"), "duplicate"),
    (KeyError("a bug"), "error"),
])
def test_a_handler_that_raises_drops_and_the_next_message_goes_on(
        host: Host, inbound: Inbound, exc: Exception, reason: str) -> None:
    calls = []

    def on_message(header: Header, pieces: list[Piece]) -> None:
        calls.append(header.seq)
        if len(calls) == 1:
            raise exc

    host.on_message = on_message
    inbound.accept(PEER, *data(seq=1))
    inbound.accept(PEER, *data(seq=2))
    assert calls == [1, 2]
    c = host.counters
    assert c.dropped_by_reason == {reason: 1} and c.messages_received == 2


def test_a_delivered_hook_that_raises_counts_as_an_error(host: Host, inbound: Inbound) -> None:
    def hook(src: int, header: Header, n: int) -> None:
        raise RuntimeError("hook bug")

    host.delivered = hook
    inbound.accept(PEER, *data())
    assert host.received == [] and host.counters.dropped_by_reason == {"error": 1}


def test_the_hooks_are_read_at_each_message(host: Host, inbound: Inbound) -> None:
    inbound.accept(PEER, *data(seq=1))
    later: list[int] = []
    host.on_message = lambda header, pieces: later.append(header.seq)
    inbound.accept(PEER, *data(seq=2))
    assert [h.seq for h, _ in host.received] == [1] and later == [2]


@pytest.mark.parametrize("table", ["keep", "watch"])
def test_data_cannot_be_kept_or_watched(host: Host, table: str) -> None:
    with pytest.raises(ValueError, match="data messages always go through"):
        Inbound(host, **{table: {"data": lambda header: None}})  # type: ignore[arg-type]
