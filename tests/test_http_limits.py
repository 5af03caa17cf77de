"""The metrics port under attack: a group of two ``p2pcoll peer`` processes, each limited to
1,024 descriptors (as in issue 20's probe), runs allreduces while another process attacks
rank 0's HTTP port with

- 1,100 idle partial requests (the headers never end), from 11 loopback addresses: each one
  is either closed as soon as it is accepted (over the connection caps) or cut at the
  deadline, none stays open, rank 0 never holds more descriptors than its caps allow, the
  collectives go on, and ``/readyz`` answers 200 afterwards;
- a bounded GET flood of ``/metrics``: the collectives go on, the server pauses accepting
  when its rate is spent (counted), and ``/readyz`` answers 200 afterwards.

The peers' job (:func:`count`) prints a progress line after every 50 allreduces and stops,
on every rank after the same one, once the test creates its stop file. The attacker is this
file run as a script (``idle`` or ``flood``), which prints one JSON line of what it saw.
No assertion is about speed: the rates are printed (``-s``) for the notes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import resource
import select
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

TESTS = Path(__file__).resolve().parent
WORLD = 2
FD_LIMIT = 1024  # the attacked peers' RLIMIT_NOFILE, as in the issue's probe
IDLE = 1100  # idle partial requests
SOURCES = [f"127.0.0.{i}" for i in range(2, 13)]  # the attacker's 11 client addresses
TIMEOUT_S = 2.0  # $P2PCOLL_METRICS_TIMEOUT of the attacked peers
MAX_CONNECTIONS, CLIENT_CONNECTIONS, RATE = 64, 8, 20  # the defaults, set explicitly
FD_SLACK = 40  # descriptors rank 0 may open besides the HTTP caps' (zmq, logging, ...)
FLOOD_S = 6.0
WAIT_S = 60  # the longest any one step may take before it counts as a hang
LIMITS = {"P2PCOLL_METRICS_TIMEOUT": str(TIMEOUT_S),
          "P2PCOLL_METRICS_MAX_CONNECTIONS": str(MAX_CONNECTIONS),
          "P2PCOLL_METRICS_CLIENT_CONNECTIONS": str(CLIENT_CONNECTIONS),
          "P2PCOLL_METRICS_RATE": str(RATE)}

pytest.importorskip("aiohttp")


# --- the peers' job -----------------------------------------------------------------------


async def count(group: Any) -> int:
    """Allreduce 1 KiB until $STOP_FILE exists (every rank stops after the same one), at
    most $LIMIT_S seconds; print ``progress N T`` (T: time.time()) every 50."""
    import numpy as np

    stop_file = Path(os.environ["STOP_FILE"])
    give_up = time.monotonic() + float(os.environ.get("LIMIT_S", "120"))
    data = np.ones(256, dtype=np.float32)
    n = 0
    while True:
        flag = stop_file.exists() or time.monotonic() > give_up
        data[0] = float(flag)
        total = await group.allreduce(data, op="max")
        n += 1
        if n % 50 == 0:
            print(f"progress {n} {time.time():.4f}", flush=True)
        if total[0]:
            return 0


# --- the attacked group --------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _limit_fds() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (FD_LIMIT, resource.getrlimit(
        resource.RLIMIT_NOFILE)[1]))


class Peers:
    """The ``p2pcoll peer`` processes, their output read as it comes."""

    def __init__(self, tmp: Path, env: dict[str, str], command: list[str]) -> None:
        url = f"tcp://127.0.0.1:{_free_port()}"
        self.stop_file = tmp / "stop"
        self.ports = [_free_port() for _ in range(WORLD)]
        self.lines: list[list[str]] = [[] for _ in range(WORLD)]
        self.procs: list[subprocess.Popen[str]] = []
        self.readers: list[threading.Thread] = []
        for r in range(WORLD):
            penv = {**os.environ, "P2PCOLL_RENDEZVOUS": url, "WORLD_SIZE": str(WORLD),
                    "RANK": str(r), "STOP_FILE": str(self.stop_file), "LIMIT_S": "150",
                    "P2PCOLL_TRANSPORT": "tcp", **env}
            args = [*command, "peer", "--job", "test_http_limits:count",
                    "--metrics-port", str(self.ports[r]), "--metrics-host", "127.0.0.1"]
            proc = subprocess.Popen(args, cwd=TESTS, env=penv, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    preexec_fn=_limit_fds)
            self.procs.append(proc)
            reader = threading.Thread(target=self._read, args=(proc, self.lines[r]))
            reader.start()
            self.readers.append(reader)

    @staticmethod
    def _read(proc: subprocess.Popen[str], into: list[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            into.append(line)

    def progress(self, rank: int = 0) -> list[tuple[int, float]]:
        """(allreduces done, time.time()) of each progress line so far."""
        out = []
        for line in list(self.lines[rank]):
            m = re.fullmatch(r"progress (\d+) ([\d.]+)\s*", line)
            if m:
                out.append((int(m[1]), float(m[2])))
        return out

    def done(self, rank: int = 0) -> int:
        got = self.progress(rank)
        return got[-1][0] if got else 0

    def wait_running(self) -> None:
        deadline = time.monotonic() + WAIT_S
        while self.done(0) < 100:
            assert time.monotonic() < deadline, self.output()
            assert all(p.poll() is None for p in self.procs), self.output()
            time.sleep(0.1)

    def fds(self, rank: int = 0) -> int:
        return len(os.listdir(f"/proc/{self.procs[rank].pid}/fd"))

    def output(self) -> str:
        return "".join(f"--- rank {r}\n" + "".join(self.lines[r]) for r in range(WORLD))

    def close(self) -> list[int]:
        """Stop the job (every rank after the same allreduce) and reap everything."""
        self.stop_file.touch()
        codes = []
        for p in self.procs:
            try:
                codes.append(p.wait(timeout=WAIT_S))
            except subprocess.TimeoutExpired:
                p.kill()
                codes.append(p.wait())
        for t in self.readers:
            t.join(timeout=10)
        for p in self.procs:
            assert p.stdout is not None
            p.stdout.close()
        return codes


@contextmanager
def peers(tmp: Path, env: dict[str, str] | None = None,
          command: list[str] | None = None) -> Iterator[Peers]:
    group = Peers(tmp, {**LIMITS, **(env or {})},
                  command or [sys.executable, "-m", "p2pcoll"])
    try:
        group.wait_running()
        yield group
    finally:
        codes = group.close()
    assert codes == [0] * WORLD, group.output()


def http_get(port: int, path: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, e.read().decode()


def counted(port: int) -> dict[str, float]:
    """p2pcoll_http_closed_total and p2pcoll_http_paused_total by reason (``closed_timeout``,
    ``paused_rate``, ...), from rank 0's /metrics (retried while it is turned away)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            status, text = http_get(port, "/metrics")
            break
        except OSError:
            assert time.monotonic() < deadline
            time.sleep(0.2)
    assert status == 200
    return {f"{m[1]}_{m[2]}": float(m[3]) for m in re.finditer(
        r'^p2pcoll_http_(closed|paused)_total\{reason="(\w+)"\} (\S+)$', text, re.MULTILINE)}


def rate(progress: list[tuple[int, float]], start: float, end: float) -> float:
    """Allreduces per second between ``start`` and ``end`` (time.time())."""
    inside = [(n, t) for n, t in progress if start <= t <= end]
    if len(inside) < 2:
        return 0.0
    return (inside[-1][0] - inside[0][0]) / (inside[-1][1] - inside[0][1])


def attack(kind: str, port: int, *options: str) -> tuple[subprocess.Popen[str], float]:
    proc = subprocess.Popen([sys.executable, __file__, kind, "--port", str(port), *options],
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    return proc, time.time()


def attack_report(proc: subprocess.Popen[str]) -> dict[str, Any]:
    out, err = proc.communicate(timeout=WAIT_S * 2)
    assert proc.returncode == 0, err
    return dict(json.loads(out.strip().splitlines()[-1]))


def watch(group: Peers, proc: subprocess.Popen[str]) -> int:
    """Rank 0's peak descriptor count while ``proc`` runs (sampled every 20 ms)."""
    peak = 0
    while proc.poll() is None:
        peak = max(peak, group.fds(0))
        time.sleep(0.02)
    return peak


# --- the tests -------------------------------------------------------------------------------


@pytest.mark.processes
def test_idle_partial_requests_are_capped_and_cut_at_the_deadline(tmp_path: Path) -> None:
    # The rate is set out of the way: here the connection caps and the deadline bound it.
    with peers(tmp_path, {"P2PCOLL_METRICS_RATE": "100000"}) as group:
        base_fds = group.fds(0)
        before = group.done(0)
        proc, started = attack("idle", group.ports[0], "--count", str(IDLE),
                               "--hold", str(TIMEOUT_S * 4 + 10))
        peak_fds = watch(group, proc)
        report = attack_report(proc)
        ended = time.time()
        during = [n for n, t in group.progress(0) if started <= t <= ended]
        assert (status := http_get(group.ports[0], "/readyz")[0]) == 200, status
        counts = counted(group.ports[0])
        print(f"\nidle: {report}; fds {base_fds} -> peak {peak_fds}; allreduces during "
              f"the attack: {during[-1] - before if during else 0} "
              f"({rate(group.progress(0), started, ended):.0f}/s); counted {counts}")
    assert report["connected"] == IDLE, report  # the attack really came in
    # Every connection was closed by the peer, none left open, none long after the deadline
    # (generous slack for a busy machine); each one either refused at once, over a cap, or
    # cut at the deadline (the test's own requests are neither).
    assert report["open_at_end"] == 0, report
    assert report["latest_close_s"] < TIMEOUT_S * 4 + 5, report
    assert counts["closed_client_connections"] > 0, counts
    assert counts["closed_max_connections"] > 0 and counts["closed_timeout"] > 0, counts
    assert sum(counts[f"closed_{r}"] for r in ("max_connections", "client_connections",
                                                "timeout")) == IDLE, counts
    # Rank 0 never held more descriptors than its caps allow, and it kept running
    # collectives all along.
    assert peak_fds <= base_fds + MAX_CONNECTIONS + FD_SLACK, (base_fds, peak_fds)
    assert during and during[-1] > before, group.output()


@pytest.mark.processes
def test_a_get_flood_leaves_the_collectives_running(tmp_path: Path) -> None:
    with peers(tmp_path) as group:
        time.sleep(2.0)  # a quiet stretch, for the rate without a flood
        proc, started = attack("flood", group.ports[0], "--seconds", str(FLOOD_S))
        peak_fds = watch(group, proc)
        report = attack_report(proc)
        ended = time.time()
        time.sleep(1.0)
        progress = group.progress(0)
        quiet = rate(progress, started - 2.0, started)
        flooded = rate(progress, started + 0.5, ended)
        during = [n for n, t in progress if started <= t <= ended]
        assert (status := http_get(group.ports[0], "/readyz")[0]) == 200, status
        counts = counted(group.ports[0])
        print(f"\nflood: {report}; allreduces/s {quiet:.0f} quiet, {flooded:.0f} flooded "
              f"({flooded / quiet if quiet else 0:.0%}); peak fds {peak_fds}; "
              f"counted {counts}")
    # The flood reached the server, which answered no more than its rate allows: a burst
    # of RATE, then RATE a second while the flood lasts (and while the connections it had
    # opened by then wait in the queue, at most 5 s), twice that for slack.
    assert 0 < report["answered"] <= 2 * RATE * (1 + FLOOD_S + 5), report
    assert during and during[-1] - during[0] > 0, group.output()
    assert counts["paused_rate"] > 0, counts


async def fetch(port: int, request: bytes) -> tuple[int, bytes, bytes]:
    """Send ``request``, read until the server closes: (status, head, body)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        answer = await asyncio.wait_for(reader.read(), 10)  # to EOF: one answer, then closed
    finally:
        writer.close()
        await writer.wait_closed()
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), head, body


async def test_one_answer_per_connection_rendered_once_for_many(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from p2pcoll.service import Peer
    from p2pcoll.settings import ServiceSettings

    service = ServiceSettings(metrics_port=0, metrics_host="127.0.0.1", metrics_rate=1000.0,
                              metrics_client_connections=64, metrics_cache=60.0)
    async with Peer(service=service) as peer:
        assert peer.metrics_address is not None
        port = peer.metrics_address[1]
        calls = []
        health = peer.health
        monkeypatch.setattr(peer, "health", lambda: calls.append(1) or health())
        ready, alive = (b"GET /%s HTTP/1.1\r\nHost: peer\r\n\r\n" % page
                        for page in (b"readyz", b"healthz"))
        # A pipelined second request on the same connection is not answered: one per
        # connection, then the server closes it.
        answers = await asyncio.gather(*(fetch(port, get * 2)
                                         for get in [ready] * 20 + [alive] * 20))
        assert [(status, body) for status, _, body in answers] == (
            [(503, b'{"state": "starting"}')] * 20 + [(200, b'{"state": "starting"}')] * 20)
        assert all(b"Connection: close" in head for _, head, _ in answers)
        assert len(calls) == 1  # forty requests of both pages, one rendering on the peer's loop
        assert (await fetch(port, b"POST /healthz HTTP/1.1\r\nHost: p\r\n"
                            b"Content-Length: 1000000\r\n\r\n"))[0] == 405
        assert (await fetch(port, b"GET /debug HTTP/1.1\r\nHost: p\r\n\r\n"))[0] == 404
        status, _, body = await fetch(port, b"HEAD /readyz HTTP/1.1\r\nHost: p\r\n\r\n")
        assert (status, body) == (503, b"")
        long_line = b"GET /" + b"x" * 5000 + b" HTTP/1.1\r\nHost: p\r\n\r\n"
        assert (await fetch(port, long_line))[0] == 400
    assert not [t for t in threading.enumerate() if t.name == "p2pcoll-http"]


async def test_on_the_callers_loop_too() -> None:
    """HealthServer(thread=False), the other way the notes measure: the same limits."""
    from p2pcoll.service import Peer
    from p2pcoll.service.http import HealthServer
    from p2pcoll.settings import ServiceSettings

    service = ServiceSettings(metrics_timeout=0.5)
    peer = Peer(service=service)
    server = HealthServer(peer, thread=False)
    await server.start("127.0.0.1", 0)
    try:
        port = server.address[1]
        status, head, _ = await fetch(port, b"GET /readyz HTTP/1.1\r\nHost: p\r\n\r\n")
        assert status == 503 and b"Connection: close" in head
        status, head, _ = await fetch(port, b"GET /healthz HTTP/1.1\r\nHost: p\r\n\r\n")
        assert status == 200 and b"Connection: close" in head
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /metrics HTTP/1.1\r\nHost: p\r\n")  # the headers never end
        assert await asyncio.wait_for(reader.read(), 10) == b""  # cut at the deadline
        writer.close()
        await writer.wait_closed()
        assert server.closed["timeout"] == 1
        status, _, body = await fetch(port, b"GET /metrics HTTP/1.1\r\nHost: p\r\n\r\n")
        assert b'p2pcoll_http_closed_total{reason="timeout"} 1.0' in body
    finally:
        await server.stop()
    assert not [t for t in threading.enumerate() if t.name == "p2pcoll-http"]


@pytest.mark.parametrize(("name", "value"), [
    ("MAX_CONNECTIONS", "0"), ("CLIENT_CONNECTIONS", "many"), ("TIMEOUT", "inf"),
    ("TIMEOUT", "0"), ("RATE", "-5"), ("CACHE", "-1"), ("CACHE", "nan")])
def test_limits_are_settings_checked_where_they_are_read(name: str, value: str) -> None:
    from p2pcoll.errors import SettingsError
    from p2pcoll.settings import ServiceSettings

    with pytest.raises(SettingsError, match=re.escape(f"$P2PCOLL_METRICS_{name}={value!r}")):
        ServiceSettings.resolve({f"P2PCOLL_METRICS_{name}": value})


def test_limits_defaults_and_environment() -> None:
    from p2pcoll.settings import ServiceSettings

    s = ServiceSettings.resolve({})
    assert (s.metrics_max_connections, s.metrics_client_connections, s.metrics_timeout,
            s.metrics_rate, s.metrics_cache) == (64, 8, 5.0, 20.0, 1.0)
    s = ServiceSettings.resolve({"P2PCOLL_METRICS_MAX_CONNECTIONS": "16",
                                 "P2PCOLL_METRICS_TIMEOUT": "0.5", "P2PCOLL_METRICS_CACHE": "0"})
    assert (s.metrics_max_connections, s.metrics_timeout, s.metrics_cache) == (16, 0.5, 0.0)


# --- the attacker (this file as a script) ---------------------------------------------------


def _raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 8192), hard))


def _idle(port: int, count: int, hold: float) -> dict[str, Any]:
    """``count`` connections, each sending a request whose headers never end, opened while
    watching for the server closing the earlier ones; then wait (at most ``hold`` seconds)
    for it to close the rest. Says how long after its connect each one was closed."""
    _raise_fd_limit()
    partial = b"GET /metrics HTTP/1.1\r\nHost: peer\r\nX-Slow: "
    socks: dict[int, tuple[socket.socket, float]] = {}
    closed: list[float] = []
    poller = select.poll()

    def reap(wait_ms: int) -> None:
        for fd, _ in poller.poll(wait_ms):
            s, t0 = socks[fd]
            try:
                data = s.recv(4096)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if data:
                continue  # an answer (a 400, say) before the close
            closed.append(time.monotonic() - t0)
            poller.unregister(fd)
            del socks[fd]
            s.close()

    connect_failed = 0
    for i in range(count):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        # The first 100 from one address (over its cap), the others from all in turn.
        s.bind((SOURCES[0 if i < 100 else i % len(SOURCES)], 0))
        s.settimeout(10)
        try:
            s.connect(("127.0.0.1", port))
            s.sendall(partial)
        except OSError:
            connect_failed += 1
            s.close()
            continue
        s.setblocking(False)
        socks[s.fileno()] = (s, time.monotonic())
        poller.register(s, select.POLLIN | select.POLLHUP | select.POLLERR)
        reap(0)
    end = time.monotonic() + hold
    while socks and time.monotonic() < end:
        reap(200)
    open_at_end = len(socks)
    for s, _ in socks.values():
        s.close()
    return {"connected": len(closed) + open_at_end, "connect_failed": connect_failed,
            "open_at_end": open_at_end,
            "latest_close_s": round(max(closed), 2) if closed else None}


async def _flood(port: int, seconds: float, workers: int) -> dict[str, Any]:
    """``workers`` clients GET /metrics as fast as they can for ``seconds``, each on one
    connection while it stays open, then on a new one."""
    _raise_fd_limit()
    tally: Counter[str] = Counter()
    request = b"GET /metrics HTTP/1.1\r\nHost: peer\r\n\r\n"
    end = time.monotonic() + seconds

    async def client(source: str) -> None:
        while time.monotonic() < end:
            try:
                reader, writer = await asyncio.open_connection(
                    "127.0.0.1", port, local_addr=(source, 0))
            except OSError:
                tally["connect_failed"] += 1
                await asyncio.sleep(0.001)
                continue
            try:
                while time.monotonic() < end:
                    writer.write(request)
                    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
                    status = head.split(b" ", 2)[1].decode()
                    length = re.search(rb"Content-Length: (\d+)", head, re.IGNORECASE)
                    if length:
                        await reader.readexactly(int(length[1]))
                    tally["answered"] += 1
                    tally[f"status_{status}"] += 1
                    if b"connection: close" in head.lower():
                        break
            except (TimeoutError, OSError, asyncio.IncompleteReadError):
                tally["cut"] += 1
            finally:
                writer.close()
                try:
                    await writer.wait_closed()
                except OSError:
                    pass

    await asyncio.gather(*(client(SOURCES[i % len(SOURCES)]) for i in range(workers)))
    return dict(tally)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("kind", choices=("idle", "flood"))
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--count", type=int, default=IDLE)
    parser.add_argument("--hold", type=float, default=30.0)
    parser.add_argument("--seconds", type=float, default=FLOOD_S)
    parser.add_argument("--workers", type=int, default=32)
    args = parser.parse_args()
    if args.kind == "idle":
        result = _idle(args.port, args.count, args.hold)
    else:
        result = asyncio.run(_flood(args.port, args.seconds, args.workers))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
