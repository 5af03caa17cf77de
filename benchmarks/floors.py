"""What the raw stack costs on this machine, beneath p2pcoll: the floors of a small collective.

    python benchmarks/floors.py                        # 4 KiB, 2000 round trips each
    python benchmarks/floors.py --size 64K --iterations 500

Not a test: it prints a table. Two processes (forked) ping-pong ``--size`` bytes; each
figure is one way, half the median round trip, with the p10-p90 range:

- ``pyzmq blocking``: a PAIR socket each way over ipc, blocking calls, no event loop;
- ``pyzmq asyncio``: the same through ``zmq.asyncio`` (one event loop per process);
- ``lane``: a p2pcoll lane each way (:mod:`p2pcoll.transport.lane`, the shared-memory ring
  a message between peers of one host takes), the reader polling ``read()``, no wake-up;
- ``board``: one slot each on a p2pcoll board (:mod:`p2pcoll.transport.board`): write the
  payload into the slot, publish the count, poll the peer's count and read its slot; a
  round trip is what a two-rank board allreduce exchanges.

In one process: ``numpy copy`` and ``numpy add`` of ``--size`` bytes of float32
(``np.copyto``, ``np.add(a, b, out=a)``), per call. ``benchmarks/profile_small.py``
measures p2pcoll's layers on top of these.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

import numpy as np
import zmq
import zmq.asyncio

from p2pcoll.transport import board as boards
from p2pcoll.transport import lane

Trip = Callable[[], None]  # one round trip, from the pinging side


def pingpong(setup: Callable[[Connection, bool], tuple[Trip, Trip, Callable[[], None]]],
             n: int) -> list[float]:
    """Round-trip seconds of ``n`` ping-pongs between this process and a forked one.

    ``setup(conn, pinger)`` returns (ping, pong, close): ``ping`` one round trip on the
    pinging side, ``pong`` one answer on the other; ``conn`` swaps names between the two.
    """
    parent, child = mp.Pipe()
    proc = mp.get_context("fork").Process(target=_ponger, args=(setup, child, n))
    proc.start()
    ping, _, close = setup(parent, True)
    times = []
    for _ in range(n):
        t = time.perf_counter()
        ping()
        times.append(time.perf_counter() - t)
    close()
    proc.join(60)
    return times


def _ponger(setup: Callable[[Connection, bool], tuple[Trip, Trip, Callable[[], None]]],
            conn: Connection, n: int) -> None:
    _, pong, close = setup(conn, False)
    for _ in range(n):
        pong()
    close()
    os._exit(0)


def zmq_blocking(size: int) -> Callable[[Connection, bool], tuple[Trip, Trip, Callable[[], None]]]:
    def setup(conn: Connection, pinger: bool) -> tuple[Trip, Trip, Callable[[], None]]:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.PAIR)
        if pinger:
            sock.bind("ipc:///tmp/p2pcoll-floor-%d" % os.getpid())
            conn.send(sock.getsockopt_string(zmq.LAST_ENDPOINT))
        else:
            sock.connect(conn.recv())
        payload = bytes(size)

        def ping() -> None:
            sock.send(payload)
            sock.recv(copy=False)

        def pong() -> None:
            sock.send(sock.recv(copy=False), copy=False)

        def close() -> None:
            sock.close(linger=1000)
            ctx.term()
        return ping, pong, close
    return setup


def zmq_asyncio(size: int, n: int) -> list[float]:
    """The pyzmq asyncio ping-pong: both sides run their loop for the whole exchange."""
    endpoint = "ipc:///tmp/p2pcoll-floor-async-%d" % os.getpid()

    async def side(pinger: bool) -> list[float]:
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.PAIR)
        sock.bind(endpoint) if pinger else sock.connect(endpoint)
        payload, times = bytes(size), []
        for _ in range(n):
            if pinger:
                t = time.perf_counter()
                await sock.send(payload)
                await sock.recv(copy=False)
                times.append(time.perf_counter() - t)
            else:
                await sock.send(await sock.recv(copy=False), copy=False)
        sock.close(linger=1000)
        ctx.term()
        return times

    def ponger() -> None:
        asyncio.run(side(False))
        os._exit(0)

    proc = mp.get_context("fork").Process(target=ponger)
    proc.start()
    times = asyncio.run(side(True))
    proc.join(60)
    return times


def lane_pair(size: int) -> Callable[[Connection, bool], tuple[Trip, Trip, Callable[[], None]]]:
    tag = 7

    def setup(conn: Connection, pinger: bool) -> tuple[Trip, Trip, Callable[[], None]]:
        me, peer = (0, 1) if pinger else (1, 0)
        out = lane.LaneOut(me, peer, tag)
        conn.send(out.name)
        into = lane.LaneIn(conn.recv(), me, peer, tag)
        while not out.mapped:
            time.sleep(1e-4)
        frames = [b"h" * 80, bytes(size)]  # a header's worth, then the payload

        def receive() -> None:
            while into.read() is None:
                pass
            into.release()

        def ping() -> None:
            out.write(frames)
            receive()

        def pong() -> None:
            receive()
            out.write(frames)

        def close() -> None:
            conn.send("done")
            conn.recv()  # both sides finished reading before either unmaps
            out.close()
            into.close()
        return ping, pong, close
    return setup


def board_pair(size: int) -> Callable[[Connection, bool], tuple[Trip, Trip, Callable[[], None]]]:
    tag = 11
    words = boards.WORDS

    def setup(conn: Connection, pinger: bool) -> tuple[Trip, Trip, Callable[[], None]]:
        if pinger:
            board = boards.Board.create(0, 2, tag, slot_bytes=max(size, 8))
            conn.send(board.name)
            conn.recv()
            board.unlink_when_all_attached()
        else:
            board = boards.Board.attach(conn.recv(), 1, 2, tag)
            conn.send("attached")
        me, peer = board.rank, 1 - board.rank
        control = board.control()
        payload = np.ones(size // 4, np.float32)
        into = np.empty_like(payload)
        count = [0]

        def publish() -> None:  # collective number count[0]: its parity's slot, then the count
            slot = board.data[me][count[0] % 2].view(np.float32)[:payload.size]
            np.copyto(slot, payload)
            control[me * words + boards.COUNT] = count[0]

        def poll() -> None:  # until the peer has published count[0], then read its slot
            while control[peer * words + boards.COUNT] < count[0]:
                pass
            np.copyto(into, board.data[peer][count[0] % 2].view(np.float32)[:payload.size])

        def ping() -> None:
            count[0] += 1
            publish()
            poll()

        def pong() -> None:
            count[0] += 1
            poll()
            publish()

        def close() -> None:
            conn.send("done")
            conn.recv()
            board.close()
        return ping, pong, close
    return setup


def per_call(fn: Callable[[], object], n: int) -> list[float]:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times


def row(name: str, times: list[float], halve: bool) -> str:
    q = np.quantile(np.array(times) * 1e6 / (2 if halve else 1), [0.5, 0.1, 0.9])
    return f"| {name} | {q[0]:.1f} | {q[1]:.1f}-{q[2]:.1f} |"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="4K", help="payload bytes (K, M suffixes; 4K)")
    parser.add_argument("--iterations", type=int, default=2000, help="round trips per floor")
    args = parser.parse_args(argv)
    units = {"K": 1 << 10, "M": 1 << 20}
    text = args.size.upper()
    size = int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)
    if size <= 0 or size % 4 or args.iterations < 1:
        parser.error("--size must be a positive multiple of 4 bytes, --iterations >= 1")
    n = args.iterations
    a, b = np.ones(size // 4, np.float32), np.ones(size // 4, np.float32)
    print(f"floors: {size} bytes, {n} round trips each; one way = half the round trip\n")
    print("| floor | us (median) | p10-p90 us |\n|---|---|---|")
    print(row("pyzmq blocking, PAIR over ipc, one way", pingpong(zmq_blocking(size), n), True))
    print(row("pyzmq asyncio, PAIR over ipc, one way", zmq_asyncio(size, n), True))
    print(row("p2pcoll lane, polled, one way", pingpong(lane_pair(size), n), True))
    print(row("p2pcoll board, publish + poll round trip", pingpong(board_pair(size), n),
              False))
    print(row("numpy copy (np.copyto)", per_call(lambda: np.copyto(a, b), n), False))
    print(row("numpy add (out=)", per_call(lambda: np.add(a, b, out=a), n), False))


if __name__ == "__main__":
    main()
