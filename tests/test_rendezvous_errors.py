"""Rendezvous errors in the user's terms (issue 35): a host that says who it waits for and
what sets the wait, something else on the rendezvous port named within seconds, "no job
key" whatever the load, and a rank asked for twice named by host and pid. One process,
real sockets on loopback."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgpack
import pytest
import zmq

import p2pcoll
from p2pcoll.rendezvous import RendezvousServer, client
from p2pcoll.rendezvous.client import rendezvous
from p2pcoll.rendezvous.probe import greeting, probe, read_greeting
from p2pcoll.security import JobKey, write_key_file
from p2pcoll.testing import free_port
from p2pcoll.transport.sockets import SocketFactory
from p2pcoll.wire import WIRE_VERSION

OLD_WAIT = 30.0  # the join timeout these errors used to wait out


def first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0]


def first(host: str, endpoints: list[str]) -> str:
    return endpoints[0]


async def join(url: str, *, rank: int | None = 1, world_size: int = 2,
               timeout: float = OLD_WAIT, host_id: str = "node-a",
               sockets: SocketFactory | None = None) -> p2pcoll.types.Membership:
    return await rendezvous(url, endpoints=["tcp://127.0.0.1:1"], world_size=world_size,
                            rank=rank, timeout=timeout, host_id=host_id, choose=first,
                            sockets=sockets)


# --- the host says who it waits for ------------------------------------------------------------


async def test_a_waiting_host_says_who_it_waits_for_and_what_sets_the_wait(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """``P2PCOLL_TIMEOUT=5`` (the collectives' deadline, taken for the join's) used to leave
    the host silent for the whole join timeout."""
    monkeypatch.setattr(client, "WAIT_REPORT", 0.5)
    monkeypatch.setenv("P2PCOLL_TIMEOUT", "5")
    url = f"tcp://127.0.0.1:{free_port()}"
    with (caplog.at_level("WARNING", logger="p2pcoll.rendezvous"),
          pytest.raises(p2pcoll.RendezvousError, match="timed out") as info):
        await p2pcoll.join(url, world_size=3, rank=0, timeout=2.5)
    assert first_line(info.value).endswith(
        "(the join timeout: P2PCOLL_JOIN_TIMEOUT, or join(timeout=))"), info.value
    reports = [r.getMessage() for r in caplog.records if "still waiting" in r.getMessage()]
    assert len(reports) >= 2, [r.getMessage() for r in caplog.records]  # again and again
    line = reports[-1].splitlines()[0]
    assert line.startswith(f"still waiting at the rendezvous {url} after "), line
    assert "1 of 3 peers arrived; missing ranks [1, 2]" in line, line
    assert f"joined: rank 0 ({socket.gethostname()}, pid {os.getpid()})" in line, line
    assert "s in all for the group to form: the join timeout (P2PCOLL_JOIN_TIMEOUT" in line
    assert "P2PCOLL_JOIN_TIMEOUT" in line, line
    assert "P2PCOLL_TIMEOUT is the deadline of each collective" in line, line


# --- something else on the rendezvous port ---------------------------------------------------


@pytest.fixture
def other_service() -> Iterator[Callable[[bytes, bool], int]]:
    """A TCP server of another protocol: it sends ``answer`` (when the client has spoken,
    or at once for a banner) and keeps the connection open."""
    stop = threading.Event()
    listeners: list[socket.socket] = []
    held: list[socket.socket] = []

    def start(answer: bytes, banner: bool) -> int:
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        listener.settimeout(0.05)
        listeners.append(listener)

        def serve() -> None:
            while not stop.is_set():
                try:
                    conn, _ = listener.accept()
                except OSError:
                    continue
                held.append(conn)
                conn.settimeout(5.0)
                try:
                    if not banner:
                        conn.recv(1024)
                    conn.sendall(answer)
                except OSError:
                    pass

        threading.Thread(target=serve, daemon=True).start()
        return int(listener.getsockname()[1])

    yield start
    stop.set()
    for s in listeners + held:
        s.close()


@pytest.mark.parametrize("keyed", [False, True], ids=["plain", "with a job key"])
@pytest.mark.parametrize(("answer", "banner", "quoted"), [
    (b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n", False,
     "'HTTP/1.1 400 Bad Request'"),
    (b"SSH-2.0-OpenSSH_9.6\r\n", True, "'SSH-2.0-OpenSSH_9.6'"),
], ids=["http", "ssh"])
async def test_something_else_on_the_port_is_named_within_seconds(
        other_service: Callable[[bytes, bool], int], answer: bytes, banner: bool,
        quoted: str, keyed: bool, tmp_path: Path) -> None:
    """It used to warn after 5 s and wait out the whole join timeout (30 s); a peer with
    a job key was not told in 30 s either."""
    port = other_service(answer, banner)
    url = f"tcp://127.0.0.1:{port}"
    key_file = tmp_path / "job.key" if keyed else None
    if key_file is not None:
        write_key_file(key_file)
    start = time.monotonic()
    with pytest.raises(p2pcoll.RendezvousError) as info:
        await p2pcoll.join(url, world_size=2, rank=1, timeout=OLD_WAIT, key_file=key_file)
    took = time.monotonic() - start
    line = first_line(info.value)
    assert line.startswith(f"{url} is not a p2pcoll rendezvous: what answers there sent "
                           f"{quoted}"), line
    assert info.value.permanent
    assert took < OLD_WAIT / 2, took  # within seconds (5 on a quiet machine), not 30


@pytest.mark.parametrize("then_close", [False, True], ids=["slow", "closed"])
async def test_a_greeting_cut_short_by_a_long_round_trip_is_not_another_protocol(
        then_close: bool) -> None:
    """ZeroMQ sends its greeting's signature at once and the rest once the client's part
    came: over a round trip longer than the probe's wait only the start arrives. That
    start used to be judged "not a ZeroMQ greeting" (a permanent error: a rendezvous
    across a satellite link was refused); it proves nothing either way."""
    start, answered = greeting("NULL")[:11], asyncio.Event()
    served: list[asyncio.Task[None]] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        served.append(asyncio.current_task())  # type: ignore[arg-type]
        try:
            writer.write(start)
            await writer.drain()
            if not then_close:
                await answered.wait()  # the rest "still on its way"
        finally:
            writer.close()
            await writer.wait_closed()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        answer = await probe("127.0.0.1", port, "NULL", 0.5)
        answered.set()
        await asyncio.gather(*served)
    assert answer.kind == ("closed" if then_close else "silent"), answer
    assert read_greeting(start) is None  # the start of a greeting: wait for the rest
    assert read_greeting(b"HTTP/1.1 400").kind == "other"  # never the start of one


# --- a peer without the job key --------------------------------------------------------------


NO_KEY = "this peer has no job key: the rendezvous is secured"


async def test_a_peer_without_the_key_is_told_so() -> None:
    server = RendezvousServer("tcp://127.0.0.1:0", SocketFactory(key=JobKey.generate()))
    url = server.bind()
    try:
        with pytest.raises(p2pcoll.RendezvousError) as info:
            await join(url)
    finally:
        await server.aclose()
    assert NO_KEY in first_line(info.value), info.value
    assert info.value.permanent


async def test_no_job_key_is_said_even_when_every_handshake_is_cut() -> None:
    """Under load, a secured rendezvous could close a keyless client's connection before
    its own greeting (which names its mechanism) got out: the client saw only cut
    handshakes and, after CUTS_PERSIST, said "not a p2pcoll rendezvous". Here that is what
    happens every time: this server cuts every ZeroMQ handshake after its signature, as a
    loaded CURVE server may, and answers only a client that sends its signature and
    version at once (the probe) with a CURVE greeting."""
    stop = threading.Event()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    listener.settimeout(0.05)

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                continue
            with conn:
                conn.settimeout(2.0)
                try:
                    time.sleep(0.05)  # the probe's 11 bytes arrive together
                    if len(conn.recv(64)) < 11:  # libzmq waits for the signature: cut
                        continue
                    conn.sendall(greeting("CURVE"))
                    conn.recv(64)
                except OSError:
                    pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    url = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
    try:
        with pytest.raises(p2pcoll.RendezvousError) as info:
            await join(url)
    finally:
        stop.set()
        thread.join(10)
        listener.close()
    assert NO_KEY in first_line(info.value), info.value


# --- a rank asked for twice ------------------------------------------------------------------


async def test_two_processes_asking_for_one_rank_are_named_by_host_and_pid() -> None:
    """They were "rank 0 was requested by two peers (node-a and node-a)". The second
    process here is a raw client (another pid and process token)."""
    server = RendezvousServer("tcp://127.0.0.1:0")
    url = server.bind()
    ctx = zmq.Context()
    other = ctx.socket(zmq.DEALER)
    other.setsockopt(zmq.LINGER, 0)
    try:
        waiting = asyncio.create_task(join(url, rank=0, world_size=3,
                                           host_id="node-a/boot/1:2/3:4"))
        while server.stats()["peers"] < 1:
            await asyncio.sleep(0.02)
        other.connect(url)
        other.send(msgpack.packb({
            "v": WIRE_VERSION, "op": "join", "job": "", "rank": 0, "world_size": 3,
            "endpoints": ["tcp://127.0.0.1:2"], "host": "node-a/boot/1:2/3:4", "pid": 99999,
            "token": "another process", "heartbeat": 5.0, "order": None, "min": None,
            "max": None}))
        with pytest.raises(p2pcoll.RendezvousError) as first:
            await waiting
        assert other.poll(10_000)
        second = msgpack.unpackb(other.recv(), raw=False)
    finally:
        other.close()
        ctx.term()
        await server.aclose()
    both = (f"rank 0 was requested by two peers: node-a pid {os.getpid()} and node-a pid "
            f"99999; give each process its own rank (rank= or $RANK), or none to have the "
            f"rendezvous number them")
    assert first_line(first.value) == f"rendezvous at {url} rejected this peer: {both}"
    assert second == {"op": "error", "reason": both}
