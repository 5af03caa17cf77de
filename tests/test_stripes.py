"""Striped links (``P2PCOLL_STREAMS``): large messages spread over k TCP connections per
peer pair, handed on once each, in the order sent.

Real peers of one process over loopback tcp (no shared memory: ``transport="tcp"``), with
the striping threshold lowered so that small arrays stripe:

- allreduce with k = 1, 2, 4, plain and with a job key: bit-identical results, k - 1
  stripes opened to the one peer a ring sends to;
- many transfers of mixed sizes (some on the link, some on stripes) from one rank to
  another: every value received once, in the order sent;
- a stripe's connection cut while data flows: the sender names the peer lost (PeerLost),
  nothing hangs;
- the link budget counts stripes: never more connections than ``max_links``;
- bad ``P2PCOLL_STREAMS`` / ``streams=`` values are refused by name;
- the receiver's join (:class:`StripeJoin`), identities and turns, and the sizing of
  ``auto`` and of send buffers, without sockets.
"""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import p2pcoll
import p2pcoll.transport.route as route_module
from p2pcoll.errors import PeerLost, SettingsError
from p2pcoll.security import write_key_file
from p2pcoll.settings import Settings
from p2pcoll.testing import free_port
from p2pcoll.transport.paths import Buffers, Paths, choose_streams, send_buffer
from p2pcoll.transport.stripes import (
    StripeJoin, parse_stripe, stripe_identity, turn, turn_of,
)

PEERS = 3


@pytest.fixture(autouse=True)
def small_stripes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stripe messages of 1 KiB and more, in segments of 16 KiB: small arrays stripe."""
    monkeypatch.setattr(route_module, "STRIPE_BYTES", 1024)
    monkeypatch.setenv("P2PCOLL_SEGMENT_BYTES", "16K")
    monkeypatch.setenv("P2PCOLL_TCP_LANES", "0")  # small messages stripe: not on TCP lanes


def _transport(g: p2pcoll.Group) -> Any:
    return g.session.transport


async def run_ranks(n: int, fn: Any, **kwargs: Any) -> list[Any]:
    """``fn(group)`` on each of ``n`` peers of this loop, each on a host of its own, over
    tcp (rank 0 hosts the rendezvous, with the job key if there is one)."""
    url = f"tcp://127.0.0.1:{free_port()}"

    async def peer(rank: int) -> Any:
        async with p2pcoll.join(url, world_size=n, rank=rank, transport="tcp",
                                host_id=f"host-{rank}", timeout=30, **kwargs) as g:
            return await fn(g)

    return list(await asyncio.gather(*(peer(r) for r in range(n))))


async def _allreduce_with(streams: int, key_file: Path | None) -> list[tuple[Any, int]]:
    rng = np.random.default_rng(7)
    inputs = [rng.standard_normal(50_001).astype(np.float32) for _ in range(PEERS)]

    async def fn(g: p2pcoll.Group) -> tuple[Any, int]:
        out = None
        for _ in range(3):
            out = await g.allreduce(inputs[g.rank], strategy="ring")
        return out, g.stats()["stripes_opened"]

    return await run_ranks(PEERS, fn, streams=streams, key_file=key_file)


@pytest.mark.parametrize("secure", [False, True], ids=["plain", "key"])
async def test_striped_allreduce_is_bit_identical(tmp_path: Path, secure: bool,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("P2PCOLL_PROBE", "0")  # the topology's probe would stripe every link
    key_file = None
    if secure:
        key_file = tmp_path / "job.key"
        write_key_file(key_file)
    reference = None
    for k in (1, 2, 4):
        results = await _allreduce_with(k, key_file)
        for out, stripes in results:
            assert stripes == k - 1  # a ring sends to one peer: k - 1 stripes beside it
            if reference is None:
                reference = out
            assert np.array_equal(out, reference), f"streams={k}"


async def test_many_mixed_transfers_arrive_once_in_order() -> None:
    sizes = [8, 5000, 3, 70_000, 1, 20_000, 256, 9000] * 25  # float32 counts

    async def fn(g: p2pcoll.Group) -> list[int]:
        if g.rank == 0:
            for i, n in enumerate(sizes):
                await g.send(np.full(n, i, np.float32), 1)
        got = []
        if g.rank == 1:
            for n in sizes:
                value = await g.recv(0)
                assert value.shape == (n,) and value[0] == value[-1]
                got.append(int(value[0]))
        await g.barrier()
        return got

    results = await run_ranks(2, fn, streams=4)
    assert results[1] == list(range(len(sizes)))


def _cut(fd: int) -> None:
    """Shut a connection down under libzmq, as a reset on the path would."""
    sock = socket.socket(fileno=os.dup(fd))
    try:
        sock.shutdown(socket.SHUT_RDWR)
    finally:
        sock.close()


async def test_a_cut_stripe_breaks_the_link_and_names_the_peer() -> None:
    x = np.ones(200_000, np.float32)

    async def fn(g: p2pcoll.Group) -> BaseException | None:
        await g.allreduce(x, strategy="ring")  # opens the stripes
        if g.rank == 0:
            route = _transport(g).routes.routes[1]
            stripe = route.stripes[0]
            for _ in range(500):  # its monitor's events come on the loop
                if stripe.fd >= 0 and stripe.handshake_s is not None:
                    break
                await asyncio.sleep(0.01)
            assert stripe.fd >= 0 and stripe.handshake_s is not None
            _cut(stripe.fd)
        try:
            for _ in range(50):
                await g.allreduce(x, strategy="ring", timeout=30)
        except p2pcoll.P2PCollError as exc:
            return exc
        return None

    results = await run_ranks(2, fn, streams=2, heartbeat_timeout=2.0)
    assert isinstance(results[0], PeerLost) and results[0].rank == 1, results[0]
    assert results[1] is not None  # rank 1 is told, not left waiting


def _open(g: p2pcoll.Group) -> int:
    """The connections of this peer's open links, stripes included (not those closed for
    the budget whose peer has not answered their end yet)."""
    return sum(1 + len(r.stripes) for r in _transport(g).routes.routes.values())


async def test_the_link_budget_counts_stripes() -> None:
    """Stripes take only what the budget has left when they open: a ring under a budget of
    4 with streams=8 keeps 4 connections, links and stripes together."""
    x = np.ones(100_000, np.float32)

    async def fn(g: p2pcoll.Group) -> tuple[int, int]:
        held = 0
        for _ in range(3):
            await g.allreduce(x, strategy="ring")
            held = max(held, _open(g))
        return held, int(g.stats()["stripes_opened"])

    results = await run_ranks(PEERS, fn, streams=8, max_links=4)
    for held, stripes in results:
        assert held <= 4
        assert 0 < stripes <= 3


async def test_a_measurement_fed_in_changes_the_width() -> None:
    """``auto`` takes a measured path (as a topology probe would feed it) at the route's
    next large message, wider or narrower, and every result stays right."""
    x = np.arange(60_000, dtype=np.float32)
    expected = x * 2

    async def fn(g: p2pcoll.Group) -> list[int]:
        routes = _transport(g).routes
        peer = 1 - g.rank
        widths = []
        for rtt, bandwidth in ((0.1, 1e9), (0.1, 1.0), (0.1, 1e9)):
            routes.measure(peer, rtt_s=rtt, bandwidth_Bps=bandwidth)
            out = await g.allreduce(x, strategy="ring")
            assert np.array_equal(out, expected)
            widths.append(routes.routes[peer].width)
        return widths

    for widths in await run_ranks(2, fn, streams="auto"):
        assert widths == [4, 1, 4]  # MAX_AUTO_STREAMS for its one peer


async def test_auto_shares_the_hosts_line_between_its_peers() -> None:
    """Under ``auto`` a pair's links share the host's line with its other peers': with two
    remote peers sent to at once each pair takes half of the cap (2 of 4), not 4 each, and
    the result is the one a single connection gives."""
    x = np.arange(60_000, dtype=np.float32)

    async def fn(g: p2pcoll.Group) -> tuple[Any, list[int]]:
        routes = _transport(g).routes
        peers = [p for p in range(g.world_size) if p != g.rank]
        for peer in peers:
            routes.measure(peer, rtt_s=0.1, bandwidth_Bps=1e9)  # 100 MB in flight
        out = await g.allreduce(x + g.rank, strategy="direct")
        return out, sorted(routes.routes[p].width for p in peers)

    results = await run_ranks(PEERS, fn, streams="auto")
    expected = sum(x + r for r in range(PEERS))
    for out, widths in results:
        assert np.array_equal(out, expected)
        assert widths == [2, 2]


@pytest.mark.parametrize("value", ["0", "17", "two", "-1", "1.5"])
def test_bad_streams_variable_is_refused_by_name(value: str) -> None:
    with pytest.raises(SettingsError, match="P2PCOLL_STREAMS"):
        Settings.resolve({"P2PCOLL_STREAMS": value})


@pytest.mark.parametrize("value", [0, 17, "many", True, 2.0])
def test_bad_streams_argument_is_refused_by_name(value: object) -> None:
    with pytest.raises(SettingsError, match="streams="):
        p2pcoll.join("tcp://127.0.0.1:1", world_size=2, streams=value)  # type: ignore[arg-type]


def test_streams_settings() -> None:
    assert Settings.resolve({}).streams == "auto"
    assert Settings.resolve({"P2PCOLL_STREAMS": "AUTO"}).streams == "auto"
    assert Settings.resolve({"P2PCOLL_STREAMS": "3"}).streams == 3
    assert Settings.resolve({"P2PCOLL_STREAMS": "3"}, streams=1).streams == 1


# --- without sockets -------------------------------------------------------------------------

def test_join_hands_on_in_link_order_whatever_arrives_first() -> None:
    out: list[str] = []
    join: StripeJoin[str] = StripeJoin(out.append, len)
    join.on_link("a")
    join.on_stripe(2, "s2-first")  # ahead of its turn: held
    join.on_turn(1)  # its message has not come: what follows waits
    join.on_link("b")
    join.on_turn(2)
    join.on_link("c")
    assert out == ["a"]
    join.on_stripe(1, "s1-first")
    assert out == ["a", "s1-first", "b", "s2-first", "c"]
    join.on_turn(1)
    join.on_stripe(1, "s1-second")
    join.on_link("d")
    assert out[-2:] == ["s1-second", "d"]
    assert join.held_bytes == 0 and not join.queue


def test_join_bounds_what_it_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    import p2pcoll.transport.stripes as stripes

    monkeypatch.setattr(stripes, "MAX_HELD_BYTES", 10)
    join: StripeJoin[str] = StripeJoin(lambda m: None, len)
    assert join.on_stripe(1, "12345678")
    assert not join.on_stripe(1, "123")


def test_identities_and_turns() -> None:
    link = b"2@secret@ab12@3"
    assert parse_stripe(stripe_identity(link, 5)) == (link, 5)
    assert parse_stripe(link) is None
    assert parse_stripe(b"2@s@n@0#0") is None and parse_stripe(b"2@s@n@0#x") is None
    assert turn_of(turn(7)) == 7
    assert turn_of(b"P\x01x") is None and turn_of(b"\x00s") is None


def test_auto_fills_the_bandwidth_delay_product() -> None:
    window = 2 << 20
    assert choose_streams(0.1, 125e6, window_bytes=window) == 4  # 12.5 MB: the cap
    assert choose_streams(0.0002, 125e6, window_bytes=window) == 1
    assert choose_streams(1.0, 125e6, window_bytes=window) == 4  # at most MAX_AUTO_STREAMS
    assert choose_streams(0.0, None, window_bytes=window) == 1
    # Remote peers at once share the host's line: each pair its share of the product and
    # of the cap (4 // 2, 4 // 3), one each at least; the host's connections stay within
    # the cap wherever its peers are fewer than it.
    assert choose_streams(0.1, 125e6, window_bytes=window, sharing=3) == 1
    assert choose_streams(1.0, 125e6, window_bytes=window, sharing=3) == 1
    assert choose_streams(1.0, 125e6, window_bytes=window, sharing=2) == 2
    assert choose_streams(0.05, 125e6, window_bytes=window, sharing=2) == 2
    assert choose_streams(1.0, 125e6, window_bytes=window, sharing=12) == 1
    assert choose_streams(0.01, 125e6, window_bytes=window, sharing=2) == 1
    paths = Paths(Buffers(wmem_max=4 << 20, rmem_max=4 << 20, tcp_wmem_max=4 << 20,
                          tcp_rmem_max=4 << 20))
    assert paths.streams(1) is None  # not measured yet
    paths.handshake(1, 0.2)
    paths.handshake(1, 0.1)  # the smallest handshake's round trip stays
    paths.handshake(1, 0.3)
    assert paths.rtt(1) == 0.1
    paths.measure(2, rtt_s=0.1)  # a measurement replaces, and handshakes no longer count
    paths.handshake(2, 0.01)
    assert paths.rtt(2) == 0.1
    assert paths.streams(1) == 4  # the default bandwidth, 10 Gbit/s: the cap
    paths.measure(1, bandwidth_Bps=125e6)  # a measured bandwidth is taken from now on
    assert paths.streams(1) == 4
    assert paths.streams(1, sharing=2) == 2
    paths.measure(1, bandwidth_Bps=20e6)  # 2 MB in flight: one window (2 MiB) holds it
    assert paths.streams(1) == 1


def test_send_buffers_within_the_system_maxima(caplog: pytest.LogCaptureFixture) -> None:
    roomy = Buffers(wmem_max=64 << 20, tcp_wmem_max=4 << 20)
    # 12.5 MB over 2, each share held in 0.7 of its buffer (SEND_BUFFER_SHARE)
    assert send_buffer(0.1, 125e6, 2, roomy) == (8_928_572, False)
    assert send_buffer(0.001, 125e6, 1, roomy) == (0, False)  # autotuning does it
    tight = Buffers(wmem_max=1 << 20, tcp_wmem_max=4 << 20)
    assert send_buffer(0.1, 125e6, 2, tight) == (0, True)  # a set size would be smaller
    paths = Paths(Buffers(wmem_max=8 << 20, tcp_wmem_max=4 << 20))
    # Of the assumed bandwidth (10 Gbit/s) the need is not known: sized, nothing said.
    paths.measure(4, rtt_s=0.1)
    with caplog.at_level("WARNING", logger="p2pcoll.transport"):
        assert paths.send_buffer(4, 1) == (8 << 20, False)
    assert caplog.text == ""
    paths.measure(3, rtt_s=0.1, bandwidth_Bps=125e6)
    with caplog.at_level("WARNING", logger="p2pcoll.transport"):
        assert paths.send_buffer(3, 1) == (8 << 20, True)
    assert "net.core.wmem_max" in caplog.text
