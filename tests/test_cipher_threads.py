"""CurveZMQ's cipher spread over libzmq's I/O threads (see p2pcoll.transport.sockets).

- with a job key, each link and stripe sends from the I/O thread its place names, and the
  ROUTER accepts on the least loaded; plain sockets all stay on the first thread;
- the threads a context runs are those it started with, whatever its setting says later;
- ``streams=auto`` stripes an encrypted tcp route for its cipher only where the host has
  cores to spare for it, and an encrypted group striped so delivers bit-identical results;
  a plain one on one host stays unstriped.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq
import zmq.asyncio

import p2pcoll
import p2pcoll.transport.route as route_module
from p2pcoll.security import JobKey, write_key_file
from p2pcoll.testing import free_port
from p2pcoll.transport.paths import cipher_streams
from p2pcoll.transport.sockets import SocketFactory, io_threads


def _affinity(sock: zmq.asyncio.Socket) -> int:
    value = sock.getsockopt(zmq.AFFINITY)
    assert isinstance(value, int)
    return value


def test_encrypted_connections_take_the_threads_in_turn_and_plain_ones_the_first() -> None:
    context = zmq.asyncio.Context(io_threads=3)
    secure = SocketFactory(context, key=JobKey.generate())
    plain = SocketFactory(context)
    made: list[zmq.asyncio.Socket] = []
    try:
        assert (secure.cipher_threads, plain.cipher_threads) == (3, 1)
        links = [secure.mesh_link(b"r%d" % i, place=i) for i in range(5)]
        made += links
        assert [_affinity(s) for s in links] == [1, 2, 4, 1, 2]  # thread place % 3
        made.append(router := secure.mesh_router())
        assert _affinity(router) == 0  # any thread: the least loaded
        others = [secure.mesh_probe(b"p"), secure.rendezvous_client(b"c"),
                  secure.rendezvous_server(), plain.mesh_router(),
                  *(plain.mesh_link(b"q%d" % i, place=i) for i in range(3))]
        made += others
        assert [_affinity(s) for s in others] == [1] * len(others)  # the first thread
    finally:
        for sock in made:
            sock.close(linger=0)
        secure.close()
        context.destroy(linger=0)


def test_the_threads_a_context_runs_are_those_it_started_with() -> None:
    started = zmq.Context(io_threads=1)
    started.socket(zmq.PAIR).close()  # libzmq starts its threads with the first socket
    started.set(zmq.IO_THREADS, 4)  # read back as 4, but one thread runs
    fresh = zmq.Context(io_threads=3)
    try:
        assert started.get(zmq.IO_THREADS) == 4
        assert io_threads(started) == 1
        assert io_threads(fresh) == 3
        assert SocketFactory(started, key=JobKey.generate()).cipher_threads == 1
    finally:
        started.destroy(linger=0)
        fresh.destroy(linger=0)


def test_cipher_streams_share_the_cores_among_a_hosts_peers() -> None:
    assert cipher_streams(4, 16, 2) == 4  # one per thread
    assert cipher_streams(4, 4, 2) == 2  # two cores each
    assert cipher_streams(4, 2, 2) == 1  # a core each: nothing to spread over
    assert cipher_streams(1, 64, 1) == 1  # one thread
    assert cipher_streams(4, 64, 0) == 4


async def _one_host(key_file: Path | None, inputs: list[Any]) -> list[tuple[Any, int, int]]:
    """A ring allreduce of ``inputs`` between two peers of one host over tcp, three times:
    per rank the result, its stripes and the width auto chose for its cipher."""
    url = f"tcp://127.0.0.1:{free_port()}"

    async def peer(rank: int) -> tuple[Any, int, int]:
        async with p2pcoll.join(url, world_size=2, rank=rank, transport="tcp",
                                host_id="one-host", timeout=30, streams="auto",
                                key_file=key_file) as g:
            out = None
            for _ in range(3):
                out = await g.allreduce(inputs[rank], strategy="ring")
            sockets = g.session.transport.sockets
            return (out, int(g.stats()["stripes_opened"]),
                    cipher_streams(sockets.cipher_threads, 64, 2))

    return list(await asyncio.gather(peer(0), peer(1)))


@pytest.mark.parametrize("secure", [False, True], ids=["plain", "key"])
async def test_auto_stripes_an_encrypted_route_for_its_cipher(
        tmp_path: Path, secure: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a host with cores to spare (64 here), auto stripes an encrypted route to a peer
    of the same host over tcp, one stripe per further I/O thread, and the results are the
    same bits; a plain route stays one connection."""
    monkeypatch.setattr(route_module, "cores", lambda: 64)
    monkeypatch.setattr(route_module, "STRIPE_BYTES", 1024)
    monkeypatch.setenv("P2PCOLL_SEGMENT_BYTES", "16K")
    monkeypatch.setenv("P2PCOLL_PROBE", "0")
    monkeypatch.setenv("P2PCOLL_SHM", "0")
    key_file = None
    if secure:
        key_file = tmp_path / "job.key"
        write_key_file(key_file)
    rng = np.random.default_rng(11)
    inputs = [rng.standard_normal(40_003).astype(np.float32) for _ in range(2)]
    expected = inputs[0] + inputs[1]
    for out, stripes, width in await _one_host(key_file, inputs):
        assert np.array_equal(out, expected)
        assert stripes == (width - 1 if secure else 0)
