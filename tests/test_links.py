"""Link identities and the order of a sender's successive links (p2pcoll.transport.links),
without sockets: any interleaving of what the links carry is handed on in the order sent."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pcoll.errors import ProtocolError
from p2pcoll.transport import links
from p2pcoll.transport.links import Successions, link_identity, parse_identity

SECRET, NONCE = "s3cret", "00ff00ff00ff00ff"
CLAIMS = {b"%d@%s" % (r, SECRET.encode()): r for r in range(4)}


class Receiver:
    """What the mesh does around Successions: current links by identity, ends handled."""

    def __init__(self) -> None:
        self.got: list[tuple[int, object]] = []
        self.dropped: list[tuple[object, ProtocolError]] = []
        self.ranks: dict[bytes, int] = {}
        self.s: Successions[object] = Successions(
            CLAIMS, release=self.release, drop=lambda who, e: self.dropped.append((who, e)))

    def receive(self, identity: bytes, message: object) -> None:
        rank = self.ranks.get(identity)
        if rank is None:
            rank = self.s.arrive(identity, message)
            if rank is None:
                return
            self.ranks[identity] = rank
        self.take(rank, message)

    def take(self, rank: int, message: object) -> None:
        if message == "end":
            del self.ranks[self.s.current[rank]]
            self.s.end(rank)
        else:
            self.got.append((rank, message))

    def release(self, rank: int, identity: bytes, messages: list[object]) -> None:
        self.ranks[identity] = rank
        for m in messages:
            self.take(rank, m)


def ident(rank: int, gen: int, nonce: str = NONCE) -> bytes:
    return link_identity(rank, SECRET, nonce, gen)


def test_identities_round_trip_and_refuse_other_forms() -> None:
    assert parse_identity(ident(3, 7)) == (b"3@s3cret", NONCE.encode(), 7)
    # a secret may hold '@': the nonce and generation are the last fields
    assert parse_identity(link_identity(1, "a@b", "n", 0)) == (b"1@a@b", b"n", 0)
    for bad in (b"", b"3", b"3@s3cret@nonce", b"3@s@@0", b"3@s@n@x", b"3@s@n@-1",
                b"3@s@n@0~probe", b"3@s@n@" + b"9" * 19):
        assert parse_identity(bad) is None, bad


def test_a_later_link_waits_for_the_end_of_the_one_before() -> None:
    r = Receiver()
    r.receive(ident(1, 0), "a")
    r.receive(ident(1, 1), "c")  # overtakes the tail of link 0
    r.receive(ident(1, 1), "d")
    assert r.got == [(1, "a")]
    r.receive(ident(1, 0), "b")
    r.receive(ident(1, 0), "end")
    assert [m for _, m in r.got] == ["a", "b", "c", "d"]
    assert r.s.later_links == 1 and r.dropped == []


def test_links_three_deep_and_an_empty_tail() -> None:
    r = Receiver()
    r.receive(ident(2, 2), "e")
    r.receive(ident(2, 1), "c")
    r.receive(ident(2, 1), "end")
    r.receive(ident(2, 0), "a")
    assert [m for _, m in r.got] == ["a"]
    r.receive(ident(2, 0), "end")  # releases link 1, whose end releases link 2
    assert [m for _, m in r.got] == ["a", "c", "e"]
    assert r.s.current[2] == ident(2, 2)


def test_strangers_impostors_and_ended_links_are_dropped_by_name() -> None:
    r = Receiver()
    r.receive(b"nobody@x@y@0", "x")
    r.receive(link_identity(9, SECRET, NONCE, 0), "x")  # not a member's rank
    r.receive(ident(1, 0), "a")
    r.receive(ident(1, 1, nonce="ffffffffffffffff"), "x")  # another nonce: an impostor
    r.receive(ident(1, 0), "end")
    r.receive(ident(1, 0), "late")  # on a link that ended
    reasons = [e.reason for _, e in r.dropped]
    assert reasons == ["stranger", "stranger", "impostor", "malformed"], r.dropped
    assert "after that link ended" in str(r.dropped[-1][1])
    assert r.got == [(1, "a")]


def test_what_later_links_may_hold_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(links, "MAX_HELD", 3)
    r = Receiver()
    r.receive(ident(1, 0), "a")
    for i in range(5):
        r.receive(ident(1, 1), i)
    assert [e.reason for _, e in r.dropped] == ["oversize", "oversize"]
    r.receive(ident(1, 0), "end")
    assert [m for _, m in r.got] == ["a", 0, 1, 2]


@st.composite
def interleavings(draw: st.DrawFn) -> tuple[list[list[object]], list[tuple[int, int]]]:
    """A sender's links (each its messages, then 'end' but the last) and an arrival order
    that keeps each link's own order."""
    count = draw(st.integers(1, 5))
    gens = [[f"{g}.{i}" for i in range(draw(st.integers(1, 4)))] for g in range(count)]
    for g in gens[:-1]:
        g.append("end")
    cursors = [0] * count
    order: list[tuple[int, int]] = []
    while any(c < len(g) for c, g in zip(cursors, gens, strict=True)):
        ready = [i for i, g in enumerate(gens) if cursors[i] < len(g)]
        i = draw(st.sampled_from(ready))
        order.append((i, cursors[i]))
        cursors[i] += 1
    return gens, order


@settings(max_examples=300, deadline=None)
@given(interleavings())
def test_any_interleaving_is_handed_on_in_the_order_sent(
        case: tuple[list[list[object]], list[tuple[int, int]]]) -> None:
    gens, order = case
    r = Receiver()
    for g, i in order:
        r.receive(ident(3, g), gens[g][i])
    sent = [m for g in gens for m in g if m != "end"]
    assert [m for _, m in r.got] == sent
    assert r.dropped == []


def test_what_later_links_hold_is_bounded_in_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(links, "MAX_HELD_BYTES", 10)
    got: list[object] = []
    dropped: list[ProtocolError] = []
    s: Successions[str] = Successions(CLAIMS, release=lambda r, i, ms: got.extend(ms),
                                      drop=lambda who, e: dropped.append(e), size=len)
    assert s.arrive(ident(1, 0), "a") == 1
    for m in ("1234", "5678", "90", "x"):  # 4 + 4 + 2 = 10 bytes held, then no more
        assert s.arrive(ident(1, 1), m) is None
    assert [e.reason for e in dropped] == ["oversize"] and "MiB" in str(dropped[0])
    s.end(1)
    assert got == ["1234", "5678", "90"]
