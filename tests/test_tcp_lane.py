"""TCP lanes (p2pcoll.transport.tcp_lane): the record codec and the tokens without sockets,
then real peers over real sockets: small messages take the lanes, order holds across lane
and link, a lane that carries garbage or breaks names its sender lost, and a stranger on
the lane port is closed and counted."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import p2pcoll
from p2pcoll.errors import ProtocolError
from p2pcoll.security import write_key_file
from p2pcoll.testing import free_port, run_ranks
from p2pcoll.transport import tcp_lane, tcp_lane_ends
from p2pcoll.transport.tcp_records import END, RecordReader, Tokens, encode_record

HOSTS = ["host-a", "host-b", "host-c"]  # peers that reach each other over tcp only


@pytest.fixture(autouse=True)
def tcp_lanes(monkeypatch: pytest.MonkeyPatch) -> None:
    """TCP lanes on (the default; set here so that the environment cannot turn them off)."""
    monkeypatch.setenv("P2PCOLL_TCP_LANES", "1")


def _wire(frames: list[bytes]) -> bytes:
    return b"".join(bytes(p) for p in encode_record(frames))


def _frames(reader: RecordReader) -> list[list[bytes]]:
    out = []
    while (record := reader.take()) is not None:
        out.append([bytes(record[0]), *record[1]])
    return out


# The codec and the tokens (no sockets).

@given(st.lists(st.lists(st.binary(max_size=300), min_size=1, max_size=5), max_size=20),
       st.integers(1, 97))
@settings(max_examples=60, deadline=None)
def test_records_round_trip_whatever_the_pieces_they_arrive_in(
        messages: list[list[bytes]], chunk: int) -> None:
    data = b"".join(_wire(m) for m in messages)
    reader = RecordReader()
    for at in range(0, len(data), chunk):
        reader.feed(data[at:at + chunk])
    assert _frames(reader) == messages
    assert not reader.partial and reader.held == 0


@pytest.mark.parametrize(("record", "what"), [
    (struct.pack("<II", 16, 0) + bytes(8), "0 frames"),
    (struct.pack("<III", 12, 1, 5), "frames of 5 bytes in a record of 12"),
    (struct.pack("<III", 20, 1, 4) + bytes(8), "frames of 4 bytes in a record of 20"),
    (struct.pack("<II", 1 << 30, 1), "record of 1073741824 bytes"),
    (struct.pack("<II", 8, 5000), "5000 frames"),
])
def test_records_that_do_not_add_up_are_refused(record: bytes, what: str) -> None:
    reader = RecordReader()
    good = _wire([b"before"])
    with pytest.raises(ProtocolError, match=what):
        reader.feed(good + record)
    assert _frames(reader) == [[b"before"]]  # what came whole before is kept, no more


@given(st.binary(max_size=200))
@settings(max_examples=200, deadline=None)
def test_any_bytes_give_whole_records_or_a_protocol_error(data: bytes) -> None:
    reader = RecordReader(largest=1 << 10)
    try:
        reader.feed(data)
    except ProtocolError:
        return
    for frames in _frames(reader):
        assert frames and sum(map(len, frames)) <= len(data)


def test_the_end_record_ends_the_lane() -> None:
    reader = RecordReader()
    reader.feed(_wire([b"last"]) + END)
    assert reader.ended and _frames(reader) == [[b"last"]]
    with pytest.raises(ProtocolError, match="after the end"):
        reader.feed(_wire([b"more"]))


def test_a_token_is_redeemed_once_and_only_by_its_bytes() -> None:
    tokens = Tokens()
    one, two = tokens.issue(1), tokens.issue(2)
    assert tokens.redeem(bytes(16)) is None
    assert tokens.redeem(one[:-1] + bytes([one[-1] ^ 1])) is None
    assert tokens.redeem(two) == 2 and tokens.redeem(two) is None
    tokens.revoke(1)
    assert tokens.redeem(one) is None


@pytest.mark.parametrize("kind", ["bytes", "array"])
async def test_a_sender_keeps_what_the_kernel_does_not_take_and_room_for_a_marker(
        monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    monkeypatch.setattr(tcp_lane_ends, "PENDING_BYTES", 64 << 10)
    near, far = socket.socketpair()
    near.setblocking(False)
    near.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    broken: list[int] = []
    out = tcp_lane.TcpLaneOut(near, 1, lambda peer, why: broken.append(peer))
    try:
        piece = bytes(range(256)) * 16  # 4 KiB
        # A message's frames as the transport writes them: a header's bytes, and the
        # data as an array of wider items (kept, in part, by its bytes).
        frames: list[Any] = [piece] if kind == "bytes" else [
            b"head", np.frombuffer(piece, np.float32)]
        sent = 0
        while out.fits_now(frames, spare=100):
            assert out.write(frames, spare=100)
            sent += 1
        assert out.pending > 0 and not out.write(frames, spare=100)
        assert out.write([b"marker"])  # the room kept for it
        reader = RecordReader()
        far.setblocking(False)
        got: list[list[bytes]] = []
        while len(got) < sent + 1:
            try:
                reader.feed(far.recv(1 << 16))
            except BlockingIOError:
                await asyncio.sleep(0.001)  # the loop writes what was kept
            got.extend(_frames(reader))
        whole = [piece] if kind == "bytes" else [b"head", piece]
        assert got == [whole] * sent + [[b"marker"]] and not broken
    finally:
        out.close()
        far.close()


async def test_a_receivers_poll_reads_what_waits_and_nothing_else_and_sees_the_end() -> None:
    near, far = socket.socketpair()
    far.setblocking(False)
    arrived: list[int] = []
    broken: list[str] = []
    into = tcp_lane_ends.TcpLaneIn(far, 3, arrived.append,
                                   lambda peer, why: broken.append(why.reason))
    try:
        into.poll()  # nothing waits: nothing read, nothing told
        assert arrived == [] and broken == [] and into.read() is None
        near.sendall(_wire([b"head", b"piece"]) + _wire([b"next"]))
        into.poll()  # read at once, without a turn of the loop
        assert arrived == [3]
        assert _frames(into.reader) == [[b"head", b"piece"], [b"next"]]
        near.sendall(_wire([b"cut"])[:6])
        near.close()  # mid-record: the polls read the part, then the end, and tell it
        into.poll()
        into.poll()
        assert broken == ["malformed"] and into.closed
        into.poll()  # closed: a no-op
        assert broken == ["malformed"]
    finally:
        into.close()
        near.close()


# Real peers over real sockets (in this process: peers on "different hosts" over tcp).

def _counters(g: p2pcoll.Group) -> Any:
    return g.session.transport.counters


async def test_small_messages_take_the_tcp_lanes_and_large_ones_the_link() -> None:
    async def fn(g: p2pcoll.Group) -> tuple[int, int, int]:
        x = np.full(1024, g.rank + 1, np.float32)
        for _ in range(10):
            assert np.array_equal(await g.allreduce(x, strategy="ring"),
                                  np.full(1024, 6, np.float32))
        big = np.arange(200_000, dtype=np.float32)
        assert np.array_equal(await g.allreduce(big, strategy="ring"), 3 * big)
        c = _counters(g)
        return c.messages_sent, c.messages_sent_lane, g.stats()["messages_dropped"]

    results = await run_ranks(3, fn, host_ids=HOSTS)
    for sent, on_lane, dropped in results:
        # All but a link's first messages (before its receiver connected) and the large.
        assert dropped == 0 and sent - 8 <= on_lane < sent, results


async def test_tcp_lanes_are_on_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("P2PCOLL_TCP_LANES")

    async def fn(g: p2pcoll.Group) -> int:
        for _ in range(20):  # the first messages go before the lane is connected
            await g.allreduce(np.ones(16, np.float32))
        assert g.session.transport._local.far is not None
        return int(_counters(g).messages_sent_lane)

    assert all(on_lane > 0 for on_lane in await run_ranks(2, fn, host_ids=HOSTS[:2]))


@pytest.mark.parametrize("why", ["setting", "key"])
async def test_no_tcp_lanes_when_turned_off_or_with_a_job_key(
        why: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    kwargs: dict[str, Any] = {}
    if why == "setting":
        monkeypatch.setenv("P2PCOLL_TCP_LANES", "0")
    else:
        kwargs["key_file"] = tmp_path / "job.key"
        write_key_file(kwargs["key_file"])

    async def fn(g: p2pcoll.Group) -> int:
        for _ in range(3):
            await g.allreduce(np.ones(16, np.float32))
        assert g.session.transport._local.far is None
        return int(_counters(g).messages_sent_lane)

    if why != "key":
        assert await run_ranks(2, fn, host_ids=HOSTS[:2]) == [0, 0]
        return
    url = f"tcp://127.0.0.1:{free_port()}"  # rank 0 hosts the rendezvous, with the key

    async def peer(rank: int) -> int:
        async with p2pcoll.join(url, world_size=2, rank=rank, host_id=HOSTS[rank],
                                timeout=30, **kwargs) as g:
            return await fn(g)

    assert await asyncio.gather(peer(0), peer(1)) == [0, 0]


async def test_order_holds_while_messages_switch_between_tcp_lane_and_link(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Records up to 2 KiB: a larger message goes over the link and the next small one
    back on the lane, with markers in between; point-to-point messages of one tag and
    collectives of mixed sizes all arrive in the order sent, bit-identical."""
    monkeypatch.setattr(tcp_lane, "LARGEST", 2048)
    sizes = [1, 300, 5, 20_000, 2, 250, 4000, 3, 100, 60_000, 7, 0]
    rng = np.random.default_rng(3)
    inputs = {n: [rng.standard_normal(n).astype(np.float32) for _ in range(3)] for n in sizes}

    async def fn(g: p2pcoll.Group) -> tuple[int, int]:
        for round_ in range(3):
            for n in sizes:
                want = inputs[n][0] + inputs[n][1] + inputs[n][2]  # the ring's order, below
                got = await g.allreduce(inputs[n][g.rank], strategy="ring")
                assert np.allclose(got, want, atol=1e-5), (round_, n)
                again = await g.allreduce(inputs[n][g.rank], strategy="ring")
                assert np.array_equal(got, again), (round_, n)  # bit-identical
            if g.rank == 0:
                for i, n in enumerate(sizes):
                    await g.send(np.full(n, i, np.int64), dst=1, tag=7)
            elif g.rank == 1:
                for i, n in enumerate(sizes):
                    got = await g.recv(src=0, tag=7)
                    assert got.shape == (n,) and (got == i).all(), (i, got[:3])
        c = _counters(g)
        return c.messages_sent, c.messages_sent_lane

    results = await run_ranks(3, fn, host_ids=HOSTS)
    for sent, on_lane in results:
        assert 0 < on_lane < sent, results  # both ways were taken


async def _lose_rank_0(act: Any) -> tuple[str, float, dict[str, int]]:
    """Rank 0 does ``act`` to its lane to rank 1 after three allreduces; rank 1 keeps
    calling until it loses rank 0: the error, how long it took, what it dropped."""

    async def fn(g: p2pcoll.Group) -> Any:
        x = np.ones(256, np.float32)
        for _ in range(3):
            await g.allreduce(x)
        if g.rank == 0:
            far = g.session.transport._local.far
            out = far.ready(1)
            assert out is not None
            act(out)
            await asyncio.sleep(1)
            return None
        started = asyncio.get_running_loop().time()
        with pytest.raises(p2pcoll.PeerLost, match="rank 0") as info:
            for _ in range(100):
                await g.allreduce(x, timeout=30)
                await asyncio.sleep(0.02)
        elapsed = asyncio.get_running_loop().time() - started
        return str(info.value), elapsed, g.stats()["messages_dropped_by_reason"]

    results = await run_ranks(2, fn, host_ids=HOSTS[:2], return_exceptions=True)
    assert isinstance(results[1], tuple), results
    return results[1]


async def test_garbage_on_a_tcp_lane_is_dropped_and_names_its_sender() -> None:
    def garbage(out: tcp_lane.TcpLaneOut) -> None:
        out.sock.send(struct.pack("<II", 12, 0) + b"junk")  # a record of no frames

    message, elapsed, dropped = await _lose_rank_0(garbage)
    assert dropped == {"malformed": 1} and elapsed < 10, (message, dropped)


@pytest.mark.parametrize("cut", ["mid-record", "between records"])
async def test_a_tcp_lane_cut_names_its_sender_lost(cut: str) -> None:
    """The lane ends without its END (a network cut, a killed peer's kernel closing it):
    its sender is lost at once, not after its deadline; a record cut short is dropped."""
    def end(out: tcp_lane.TcpLaneOut) -> None:
        if cut == "mid-record":
            out.sock.send(_wire([b"x" * 100])[:50])
        out.sock.shutdown(socket.SHUT_WR)

    message, elapsed, dropped = await _lose_rank_0(end)
    assert elapsed < 10, message
    assert dropped == ({"malformed": 1} if cut == "mid-record" else {}), dropped


@pytest.mark.parametrize("present", [b"", b"P2PL" + bytes(16), b"GET / HTTP/1.1\r\n\r\n"])
async def test_a_stranger_on_the_lane_port_is_closed_and_counted(
        present: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tcp_lane, "HANDSHAKE_S", 0.3)

    async def fn(g: p2pcoll.Group) -> tuple[int, bytes]:
        x = np.ones(256, np.float32)
        await g.allreduce(x)
        answer = b"?"
        if g.rank == 0:
            port = g.session.transport._local.far.port
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(present)
            answer = await asyncio.wait_for(reader.read(), 5)  # closed on us: b""
            writer.close()
        await g.barrier()
        for _ in range(3):
            assert np.array_equal(await g.allreduce(x), 2 * x)
        return g.stats()["links_refused"], answer

    results = await run_ranks(2, fn, host_ids=HOSTS[:2])
    assert results[0] == (1, b""), results


@pytest.mark.processes
def test_a_killed_peer_is_named_lost_on_the_tcp_lane_path() -> None:
    """Two processes over tcp with shared memory off, their small messages on TCP lanes:
    rank 0 is SIGKILLed while rank 1 runs allreduces; rank 1 names rank 0 lost, well
    before its 60 s deadline."""
    url = f"tcp://127.0.0.1:{free_port()}"
    env = {**os.environ, "P2PCOLL_SHM": "0", "P2PCOLL_TCP_LANES": "1"}
    worker = Path(__file__).with_name("tcp_lane_worker.py")
    procs = [subprocess.Popen([sys.executable, str(worker), url, str(r)], env=env,
                              stdout=subprocess.PIPE, text=True) for r in (0, 1)]
    try:
        ready = [json.loads(p.stdout.readline())["ready"] for p in procs if p.stdout]
        assert all(r["on_lane"] > 0 for r in ready), ready
        procs[0].kill()
        out, _ = procs[1].communicate(timeout=90)
        after = json.loads(out.strip().splitlines()[-1])["after"]
    finally:
        for p in procs:
            p.kill()
            p.wait()
            if p.stdout:
                p.stdout.close()
    assert after["error"].startswith("PeerLost") and after["rank_named"] == 0, after
    assert after["seconds"] < 30, after
