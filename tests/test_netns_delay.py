"""The lab's packet delayer (tests/netns_delay.py, nfq_delay.c): a delay TCP can feel.

Two hosts of a lab, the delayer in their switch. Every round trip takes at least twice the
delay (a bound, not a timing: nothing can arrive early), and one TCP stream with a small
receive window moves at most a window per round trip, as over a long cable: the stream
relay the lab used before terminates each connection in the sending host, so its stream ran
at the relay's pace, hundreds of times above that bound.

These need root, ``ip``, a C compiler and ``iptables``; without them they skip, except that
under ``CI=true`` a missing tool fails (CI installs them). A kernel that refuses the queue
skips.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator

import netns
import netns_delay
import pytest

pytestmark = pytest.mark.slow

DELAY = 0.05  # seconds, one way
PORT = 29740
RCVBUF = 64 << 10  # the receiver's SO_RCVBUF in the window test (the kernel doubles it)
SECONDS = 1.0  # the window test's stream

ECHO = f"""
import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, {RCVBUF})
s.bind(("0.0.0.0", {PORT})); s.listen(4); print("ready", flush=True)
c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while d := c.recv(1 << 16):
    if d == b"y":
        c.sendall(d)
"""

CLIENT = f"""
import json, socket, time
s = socket.create_connection(("{netns.address(1)}", {PORT}))
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
rtts = []
for _ in range(10):
    t = time.monotonic(); s.sendall(b"y"); s.recv(1); rtts.append(time.monotonic() - t)
s.setblocking(False)
sent, t = 0, time.monotonic()
while time.monotonic() - t < {SECONDS}:
    try:
        sent += s.send(b"\\0" * (1 << 16))
    except BlockingIOError:
        time.sleep(0.001)
took = time.monotonic() - t
s.close()
print(json.dumps({{"rtts": rtts, "sent": sent, "took": took}}))
"""


@pytest.fixture
def lab() -> Iterator[netns.Lab]:
    """Two hosts with the packet delayer in their switch (DELAY each way)."""
    reason = netns.unavailable() or netns_delay.unavailable()
    if reason is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must run the packet delayer's tests: {reason}")
        pytest.skip(reason)
    made = netns.Lab(2)
    try:
        made.create()
        made.shape("1gbit", burst="1mbit")
        made.delay_packets(DELAY)
    except netns.LabError as exc:
        made.close()
        pytest.skip(f"the packet delayer cannot run here: {exc}")
    try:
        yield made
    finally:
        made.close()


def test_the_delayer_holds_every_packet_and_tcp_feels_it(lab: netns.Lab) -> None:
    assert lab.delayer is not None and lab.delayer.poll() is None
    server = subprocess.Popen(lab.command(1, [sys.executable, "-c", ECHO]),
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        done = subprocess.run(lab.command(0, [sys.executable, "-c", CLIENT]),
                              capture_output=True, text=True, timeout=120, check=True)
        assert server.wait(timeout=60) == 0
    finally:
        server.kill()
        server.wait()
        assert server.stdout is not None
        server.stdout.close()
    report = json.loads(done.stdout)
    # Each round trip crossed the switch twice: never under twice the delay.
    assert min(report["rtts"]) >= 2 * DELAY, report["rtts"]
    # At most a window per round trip (the window is at most the doubled SO_RCVBUF), plus
    # what the sender's buffer took in: the relay lab's stream sent hundreds of MB here.
    window = 2 * RCVBUF
    bound = window * (report["took"] / (2 * DELAY) + 1) + (4 << 20)
    assert 0 < report["sent"] <= bound, (report, bound)
    assert lab.drops() == 0


def test_shape_delays_with_the_delayer_where_the_kernel_has_no_netem() -> None:
    reason = netns.unavailable() or netns_delay.unavailable()
    if reason is not None:
        pytest.skip(reason)
    with netns.Lab(2) as made:
        try:
            how = made.shape("1gbit", delay="5ms")
        except netns.LabError as exc:
            pytest.skip(f"neither netem nor the packet delayer runs here: {exc}")
        assert how in ("netem", "nfqueue")
        assert (made.delayer is not None) == (how == "nfqueue")
        if made.delayer is not None:
            pid = made.delayer.pid
    if how == "nfqueue":  # closed with the lab: gone and reaped
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
