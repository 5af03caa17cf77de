"""The lab's own ceiling for an allreduce's traffic: plain TCP, no p2pcoll, no reduction.

Imported by ``long_link.py --raw PATTERN:K``, which runs one :func:`worker` per host of its
lab: each host sends what one rank of a 4-rank allreduce sends (``2(p-1)/p x size`` bytes)
over ``K`` plain TCP connections (kernel defaults: autotuned buffers, the host's congestion
control) to its ring neighbour (``ring``) or, a third to each, to all its peers
(``direct``), and takes as much from the other side; every pass starts at one agreed wall
clock time on every host (the namespaces share this machine's clock), and a pass's time is
the host's, from the start until it has sent and received everything. The slowest host's
median is what any collective over these cables could reach at best with those connections:
no data dependency, no framing, no Python between the bytes but ``sendall``.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any

PORT = 29900


def _connect(address: str, patience: float = 30.0) -> socket.socket:
    deadline = time.monotonic() + patience
    while True:
        sock = socket.socket()
        try:
            sock.connect((address, PORT))
            return sock
        except OSError:
            sock.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def worker(rank: int, addresses: list[str], streams: int, pattern: str, nbytes: int,
           passes: int, start: float, period: float) -> dict[str, Any]:
    """Run ``passes + 1`` passes (the first warms up) on host ``rank``, pass ``i`` starting
    at wall time ``start + i * period``; returns ``{"times": [...]}`` of the timed ones."""
    world = len(addresses)
    if pattern == "ring":
        outward, inward = [(rank + 1) % world], [(rank - 1) % world]
    else:
        outward = inward = [p for p in range(world) if p != rank]
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((addresses[rank], PORT))
    listener.listen(64)
    taken: list[socket.socket] = []
    acceptor = threading.Thread(target=lambda: taken.extend(
        listener.accept()[0] for _ in range(streams * len(inward))))
    acceptor.start()
    given = [_connect(addresses[p]) for p in outward for _ in range(streams)]
    acceptor.join()
    share = nbytes // len(given)
    data = memoryview(bytearray(share))

    def take(sock: socket.socket) -> None:
        view, left = memoryview(bytearray(1 << 20)), share
        while left:
            n = sock.recv_into(view[:min(left, len(view))])
            if not n:
                raise ConnectionError("a sender closed early")
            left -= n

    times = []
    for i in range(passes + 1):
        while (wait := start + i * period - time.time()) > 0:
            time.sleep(min(wait, 0.01))
        began = time.time()
        threads = ([threading.Thread(target=s.sendall, args=(data,)) for s in given]
                   + [threading.Thread(target=take, args=(s,)) for s in taken])
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if i:
            times.append(time.time() - began)
    for sock in (*given, *taken, listener):
        sock.close()
    return {"times": times}


def main(argv: list[str]) -> int:
    rank, streams, nbytes, passes = (int(a) for a in argv[:4])
    pattern, addresses = argv[4], argv[5].split(",")
    start, period = float(argv[6]), float(argv[7])
    print(json.dumps(worker(rank, addresses, streams, pattern, nbytes, passes, start,
                            period)), flush=True)
    return 0
