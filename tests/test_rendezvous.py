"""Rendezvous: rank assignment, environment variables, and every way forming a group fails."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import threading
import time

import msgpack
import numpy as np
import pytest
import zmq

import p2pcoll
from p2pcoll.rendezvous import RendezvousServer
from p2pcoll.rendezvous.client import waiting
from p2pcoll.rendezvous.server import hosted_at
from p2pcoll.settings import RANK_VARS, WORLD_SIZE_VARS, Settings
from p2pcoll.testing import free_port
from p2pcoll.wire import WIRE_VERSION
from conftest import stop
from peer_processes import READY, go_on, start_together


def url() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


async def registered(address: str, peers: int) -> None:
    """Until the rendezvous this process hosts at ``address`` holds ``peers`` registrations."""
    port = int(address.rpartition(":")[2])
    while (server := hosted_at(port)) is None or server.stats()["peers"] < peers:
        await asyncio.sleep(0.01)


async def test_ranks_assigned_in_arrival_order_fill_the_gaps() -> None:
    address = url()
    # The first join of a process loads the strategies first (in a thread, ~0.1 s): done
    # before, so that the 50 ms between these arrivals is what orders them.
    p2pcoll.available_strategies()

    async def peer(rank: int | None, delay: float) -> tuple[int, int]:
        await asyncio.sleep(delay)
        async with p2pcoll.join(address, world_size=4, rank=rank, timeout=10) as g:
            await g.barrier(timeout=10)
            return g.rank, g.world_size

    got = await asyncio.gather(peer(None, 0.0), peer(2, 0.05), peer(None, 0.1), peer(None, 0.15))
    ranks = [r for r, _ in got]
    assert sorted(ranks) == [0, 1, 2, 3] and ranks[1] == 2
    assert ranks[0] < ranks[2] < ranks[3], "unranked peers are numbered in arrival order"
    assert {s for _, s in got} == {4}


async def test_peers_may_start_before_the_rendezvous_host() -> None:
    address = url()

    async def peer(rank: int, delay: float) -> float:
        await asyncio.sleep(delay)
        async with p2pcoll.join(address, world_size=3, rank=rank, timeout=10) as g:
            out = await g.allreduce(np.array([rank + 1.0]), timeout=10)
            return float(out[0])

    # Rank 0 hosts the rendezvous; it comes last.
    assert await asyncio.gather(peer(1, 0), peer(2, 0.1), peer(0, 0.8)) == [6.0, 6.0, 6.0]


async def test_timeout_names_arrivals_and_missing_ranks() -> None:
    address = url()
    timeout = 2.0  # both must register before it passes, under load too

    async def peer(rank: int) -> BaseException:
        with pytest.raises(p2pcoll.RendezvousError) as info:
            await p2pcoll.join(address, world_size=4, rank=rank, timeout=timeout)
        return info.value

    start = time.monotonic()
    errors = await asyncio.gather(peer(0), peer(2))
    assert time.monotonic() - start < 10 * timeout  # it does not hang
    for err in errors:
        assert "2 of 4 peers arrived" in str(err)
        assert "missing ranks [1, 3]" in str(err)


async def test_timeout_with_no_rendezvous_host() -> None:
    with pytest.raises(p2pcoll.RendezvousError, match="no answer"):
        await p2pcoll.join(url(), world_size=2, rank=1, timeout=0.5)


OTHER_RANK_1 = """
    import asyncio, sys, time, p2pcoll
    async def main():
        start = time.monotonic()
        try:
            await p2pcoll.join(sys.argv[1], world_size=3, rank=1, timeout=20)
        except p2pcoll.RendezvousError as exc:
            print(f"{time.monotonic() - start:.2f}", exc)
    %s
    asyncio.run(main())
""" % READY


@pytest.mark.processes
async def test_duplicate_rank_fails_both_peers_at_once() -> None:
    """Two processes ask for rank 1 (two in one process are one peer asking again: see
    below)."""
    address = url()

    async def peer() -> tuple[float, BaseException | None]:
        start = time.monotonic()
        try:
            g = await p2pcoll.join(address, world_size=3, rank=1, timeout=20)
        except p2pcoll.RendezvousError as exc:
            return time.monotonic() - start, exc
        await g.close()
        return time.monotonic() - start, None

    async def host() -> None:  # rank 0 hosts the rendezvous: its group cannot form, at once
        with pytest.raises(p2pcoll.RendezvousError, match="requested by two peers.*cannot form"):
            await p2pcoll.join(address, world_size=3, rank=0, timeout=20)

    # The other process first, up to its join (its interpreter's start can take longer
    # than the others' join timeout on a loaded host); it asks once both are registered.
    env = {k: v for k, v in os.environ.items() if not k.startswith("P2PCOLL_")}
    other = subprocess.Popen([sys.executable, "-c", textwrap.dedent(OTHER_RANK_1), address],
                             env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        await asyncio.to_thread(start_together, [other], False)
        joins = asyncio.gather(peer(), host())
        await registered(address, 2)
        go_on([other])
        out, _ = await asyncio.to_thread(other.communicate, timeout=60)
        (t0, e0), _ = await joins
    finally:
        stop(other)
    assert e0 is not None
    assert "rank 1 was requested by two peers" in str(e0)
    assert "rank 1 was requested by two peers" in out, out
    assert float(out.split()[0]) < 5, "duplicate ranks are reported at once, not at the timeout"


async def test_a_peer_that_asks_again_replaces_its_old_registration() -> None:
    """Probe (issue 20 item 5): a join that failed left its registration behind, and the
    same process's next join for that rank failed with "rank 3 was requested by two peers
    (X and X)", a permanent error. A request of the same process (its token) for the
    same rank is the same peer asking again: it replaces the old one, which is told so."""
    server = RendezvousServer("tcp://127.0.0.1:0")
    address = server.bind()

    async def old() -> BaseException:
        with pytest.raises(p2pcoll.RendezvousError) as caught:
            await p2pcoll.join(address, world_size=2, rank=1, timeout=20)
        return caught.value

    async def again() -> int:
        while await waiting(address) < 1:  # the old one is registered
            await asyncio.sleep(0.05)
        async with p2pcoll.join(address, world_size=2, rank=1, timeout=20) as g:
            return int((await g.allreduce(np.array([1]), timeout=10))[0])

    async def host() -> int:
        await asyncio.sleep(1.0)
        async with p2pcoll.join(address, world_size=2, rank=0, timeout=20) as g:
            return int((await g.allreduce(np.array([1]), timeout=10))[0])

    try:
        error, *sums = await asyncio.gather(old(), again(), host())
    finally:
        await server.aclose()
    assert sums == [2, 2]
    assert "replaced this one" in str(error), error
    assert "requested by two peers" not in str(error)


async def test_world_size_disagreement() -> None:
    address = url()

    async def first() -> None:
        g = await p2pcoll.join(address, world_size=2, rank=0, timeout=5)
        await g.close()

    async def second() -> None:
        await registered(address, 1)  # the first one, with its world size
        start = time.monotonic()
        with pytest.raises(p2pcoll.RendezvousError, match="world_size 3 disagrees"):
            await p2pcoll.join(address, world_size=3, rank=1, timeout=20)
        assert time.monotonic() - start < 20 / 2  # at once, not at its timeout

    results = await asyncio.gather(first(), second(), return_exceptions=True)
    assert results[1] is None
    assert isinstance(results[0], p2pcoll.RendezvousError)  # its partner never came


async def test_rank_out_of_range() -> None:
    with pytest.raises(p2pcoll.RendezvousError, match="out of range"):
        await p2pcoll.join(url(), world_size=2, rank=2, timeout=5)
    address = url()

    async def host() -> None:  # world_size known only from the other peer
        with pytest.raises(p2pcoll.RendezvousError):
            await p2pcoll.join(address, world_size=2, rank=0, timeout=3)

    async def stray() -> None:
        await registered(address, 1)  # the host, with its world size
        start = time.monotonic()
        with pytest.raises(p2pcoll.RendezvousError, match="rank 5"):
            await p2pcoll.join(address, rank=5, timeout=20)
        assert time.monotonic() - start < 20 / 2  # at once, not at its timeout

    await asyncio.gather(host(), stray())


async def test_bad_url() -> None:
    with pytest.raises(p2pcoll.RendezvousError, match="tcp://HOST:PORT"):
        await p2pcoll.join("http://example:80", world_size=2)


def test_launcher_variables() -> None:
    env: dict[str, str] = {}

    def read() -> tuple[str | None, int | None, int | None]:
        s = Settings.resolve(env)
        return s.rendezvous, s.world_size, s.rank

    assert read() == (None, None, None)
    env.update(MASTER_ADDR="10.1.2.3", MASTER_PORT="29500")
    assert read()[0] == "tcp://10.1.2.3:29500"
    env["P2PCOLL_RENDEZVOUS"] = "tcp://127.0.0.1:1"
    assert read()[0] == "tcp://127.0.0.1:1"
    env.update(SLURM_NTASKS="6", SLURM_PROCID="3")
    assert read()[1:] == (6, 3)
    # mpirun inside a SLURM allocation: every rank inherits the step's SLURM_PROCID, so
    # Open MPI's own variables win (see p2pcoll.launchers).
    env.update(OMPI_COMM_WORLD_SIZE="5", OMPI_COMM_WORLD_RANK="4")
    assert read()[1:] == (5, 4)
    env.update(WORLD_SIZE="7", RANK="2")
    assert read()[1:] == (7, 2)
    env["RANK"] = "two"
    with pytest.raises(p2pcoll.SettingsError, match="RANK='two'"):
        read()


async def test_join_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    address = url()
    monkeypatch.setenv("P2PCOLL_RENDEZVOUS", address)
    monkeypatch.setenv("WORLD_SIZE", "2")
    for name in ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(name, raising=False)

    async def peer() -> int:
        async with p2pcoll.join(timeout=10) as g:
            return int((await g.allreduce(np.array([1]), timeout=10))[0]) * 10 + g.world_size

    assert await asyncio.gather(peer(), peer()) == [22, 22]


async def test_single_peer_without_rendezvous(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("P2PCOLL_RENDEZVOUS", "MASTER_ADDR", *WORLD_SIZE_VARS, *RANK_VARS):
        monkeypatch.delenv(name, raising=False)
    with pytest.warns(UserWarning, match="group of one"):
        g = await p2pcoll.join()
    try:
        assert (g.rank, g.world_size) == (0, 1)
        np.testing.assert_array_equal(await g.allreduce(np.arange(3)), np.arange(3))
    finally:
        await g.close()
    with pytest.raises(p2pcoll.RendezvousError, match="no rendezvous"):
        await p2pcoll.join(world_size=2)


def _raw_join(**fields: object) -> bytes:
    return msgpack.packb({"v": WIRE_VERSION, "op": "join", "job": "", "rank": 1,
                          "world_size": 2, "endpoints": ["tcp://127.0.0.1:1"], "host": "h",
                          "pid": 1, "heartbeat": 1.0, "order": None, "min": None,
                          "max": None, **fields})


def _replies(sock: object) -> list[dict[str, object]]:
    assert isinstance(sock, zmq.Socket)
    out = []
    while sock.poll(0):
        out.append(msgpack.unpackb(sock.recv_multipart()[-1], raw=False))
    return out


@pytest.mark.slow  # three stalls of 1.6 s by design
async def test_a_live_peer_is_not_lost_when_the_hosts_loop_stalls(
        caplog: pytest.LogCaptureFixture) -> None:
    """Review probe: a registration's expiry was checked against ``now`` while the server
    waited for a request, so after the host's loop stalled longer than the heartbeat the
    watcher could run before the wake-up that reads the peer's re-sent joins, and a live
    peer (re-sending the whole time) was failed as "stopped answering". The stall here
    is a callback due just before the watcher's timer, so the watcher runs before the
    wake-up whatever the machine's load."""
    server = RendezvousServer("tcp://127.0.0.1:0")
    address = server.bind()
    stop, sending, replies = threading.Event(), threading.Event(), []
    sending.set()

    def peers() -> None:  # two peers of a group of three, re-sending their joins as
        # clients do, from outside the stalled loop; a lost one fails the other
        ctx = zmq.Context()
        socks = [ctx.socket(zmq.DEALER) for _ in range(2)]
        try:
            for sock in socks:
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(address)
            while not stop.is_set():
                for rank, sock in enumerate(socks, 1):
                    if sending.is_set():
                        sock.send(_raw_join(token=f"t{rank}", rank=rank, world_size=3))
                    replies.extend(_replies(sock))
                stop.wait(0.1)
        finally:
            for sock in socks:
                sock.close()
            ctx.term()

    thread = threading.Thread(target=peers)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while server.stats()["peers"] < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        loop = asyncio.get_running_loop()

        def stall() -> None:  # the host's loop stalls for longer than the heartbeat (1 s)
            sending.set()
            time.sleep(1.6)

        for _ in range(3):
            sending.clear()  # for less than its re-send period: the server reads it all
            await asyncio.sleep(0.25)
            loop.call_at(loop.time() - 1, stall)  # runs first...
            time.sleep(0.15)  # ...of the timers due then, with the watcher's
            await asyncio.sleep(0.5)
    finally:
        stop.set()
        thread.join(10)
        await server.aclose()
    lost = [r.getMessage() for r in caplog.records if "stopped answering" in r.getMessage()]
    assert not lost, lost
    assert not [r for r in replies if r["op"] == "error"], replies
    assert replies[-1]["op"] == "status" and replies[-1]["arrived"] == 2, replies[-1]


async def test_same_host_and_pid_is_not_the_same_peer() -> None:
    """Review probe: "the same peer asking again" was keyed on (host, pid); two containers
    on the host network both run pid 1, so a real duplicate rank silently replaced the
    first. The process's random token says which process asks: a different token for a
    held rank is a duplicate (both told), the same token replaces its old registration."""
    server = RendezvousServer("tcp://127.0.0.1:0")
    address = server.bind()
    ctx = zmq.Context()
    socks = [ctx.socket(zmq.DEALER) for _ in range(4)]
    try:
        for s in socks:
            s.setsockopt(zmq.LINGER, 0)
            s.connect(address)

        async def exchange(sock: zmq.Socket[bytes], token: str | None
                           ) -> list[dict[str, object]]:
            if token is not None:
                sock.send(_raw_join(token=token, heartbeat=30.0))
            for _ in range(200):
                await asyncio.sleep(0.02)
                if got := _replies(sock):
                    return got
            raise AssertionError("no reply")

        assert (await exchange(socks[0], "a"))[0]["op"] == "status"
        duplicate = await exchange(socks[1], "b")  # same host and pid, another process
        assert "requested by two peers" in str(duplicate[0]["reason"]), duplicate
        assert "requested by two peers" in str((await exchange(socks[0], None))[0])
        assert server.stats()["peers"] == 0
        assert (await exchange(socks[2], "c"))[0]["op"] == "status"
        assert (await exchange(socks[3], "c"))[0]["op"] == "status"  # the same process again
        old = await exchange(socks[2], None)  # its old registration was replaced, and told so
        assert "replaced this one" in str(old[0]["reason"]), old
        assert server.stats()["peers"] == 1
    finally:
        for s in socks:
            s.close()
        ctx.term()
        await server.aclose()


async def test_server_aclose_is_idempotent_and_a_cancelled_one_frees_the_port() -> None:
    server = RendezvousServer("tcp://127.0.0.1:0")
    address = server.bind()
    closing = asyncio.create_task(server.aclose())
    await asyncio.sleep(0)
    closing.cancel()
    await asyncio.gather(closing, return_exceptions=True)
    await server.aclose()
    await server.aclose()
    for _ in range(100):  # the port is let go (libzmq closes in its own thread)
        again = RendezvousServer(address)
        try:
            assert again.bind() == address
            break
        except zmq.ZMQError:
            await again.aclose()
            await asyncio.sleep(0.05)
    else:
        raise AssertionError(f"{address} is still bound")
    await again.aclose()
