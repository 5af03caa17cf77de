"""``/readyz`` follows the group between collectives: a member that leaves (SIGTERM: its
goodbye), dies (SIGKILL: its links close) or freezes (SIGSTOP: its heartbeats stop) turns
the others' groups ``degraded`` and their ``/readyz`` 503 within the heartbeat bound, while
no collective runs; ``/healthz`` (liveness) stays 200."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from conftest import finish

import p2pcoll
from p2pcoll.service import Peer
from p2pcoll.departures import LINK_LOSS_GRACE
from p2pcoll.testing import free_port

TESTS = Path(__file__).resolve().parent
HEARTBEAT_S = 1.0
# A member is lost at most one heartbeat timeout after it stops answering, plus the
# heartbeat's own period (a fifth of it) and the link-loss grace; the rest is slack for a
# loaded host (two cores, several peers starting).
BOUND_S = HEARTBEAT_S * 1.2 + LINK_LOSS_GRACE + 1.5
POLL_S = 0.1  # well inside the server's rate (metrics_rate, 20 a second)


def get(port: int, page: str) -> tuple[int, dict[str, object]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{page}", timeout=5) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def start(n: int) -> tuple[list[subprocess.Popen[str]], list[int]]:
    """``n`` ``p2pcoll peer`` processes that run one allreduce and then idle."""
    url = f"tcp://127.0.0.1:{free_port()}"
    procs, ports = [], []
    for rank in range(n):
        port = free_port()
        env = {**os.environ, "P2PCOLL_RENDEZVOUS": url, "WORLD_SIZE": str(n),
               "RANK": str(rank), "P2PCOLL_HEARTBEAT_TIMEOUT": str(HEARTBEAT_S)}
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "p2pcoll", "peer", "--job", "readyz_job:hold",
             "--metrics-port", str(port), "--metrics-host", "127.0.0.1"],
            cwd=TESTS, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        ports.append(port)
    return procs, ports


def wait_idle(proc: subprocess.Popen[str]) -> None:
    """Until the peer has run its allreduce and idles (its job prints ``idle``)."""
    assert proc.stdout is not None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        assert line, "the peer exited before it idled"
        if line.strip() == "idle":
            return
    raise AssertionError("the peer did not idle within 60 s")


def until_unready(port: int, limit: float) -> tuple[float, dict[str, object]]:
    """Poll ``/readyz`` until it answers 503; (seconds it took, the report)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        status, report = get(port, "/readyz")
        if status == 503:
            return time.monotonic() - t0, report
        assert (status, report["state"]) == (200, "ready"), report
        time.sleep(POLL_S)
    raise AssertionError(f"/readyz still 200 {limit:g}s after a member went")


@pytest.mark.processes
@pytest.mark.timeout(180)
@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL, signal.SIGSTOP],
                         ids=["SIGTERM", "SIGKILL", "SIGSTOP"])
def test_readyz_turns_503_when_a_member_goes_between_collectives(how: signal.Signals) -> None:
    procs, ports = start(3)
    gone, survivors = procs[2], (0, 1)
    try:
        for proc in procs:
            wait_idle(proc)
        for port in ports:
            assert get(port, "/readyz") == (200, {"state": "ready", "rank": ports.index(port),
                                                  "world_size": 3})
        t0 = time.monotonic()
        gone.send_signal(how)
        took = {}
        for r in survivors:
            _, report = until_unready(ports[r], BOUND_S + 10)
            took[r] = time.monotonic() - t0
            assert report == {"state": "degraded", "rank": r, "world_size": 3, "gone": 1}, \
                report
            # Alive all the same: nothing to restart this peer for.
            assert get(ports[r], "/healthz") == (200, report)
        print(f"\n{how.name}: /readyz 503 after "
              + ", ".join(f"{took[r]:.2f}s (rank {r})" for r in survivors)
              + f"; bound {BOUND_S:.1f}s (heartbeat {HEARTBEAT_S:g}s)")
        assert max(took.values()) < BOUND_S, took
        # The survivors idle on, degraded, until they are stopped.
        for r in survivors:
            procs[r].send_signal(signal.SIGTERM)
        if how == signal.SIGSTOP:
            gone.kill()
    finally:
        results = finish(procs)
    for r in survivors:
        code, text = results[r]
        assert code == 128 + signal.SIGTERM, text


# --- the same, in one process: the group's state ---------------------------------------------


def peers(n: int) -> list[Peer]:
    url = f"tcp://127.0.0.1:{free_port()}"
    return [Peer(metrics_port=0, metrics_host="127.0.0.1", rendezvous=url, world_size=n,
                 rank=r, transport="tcp") for r in range(n)]


async def until_state(peer: Peer, state: str, limit: float = 10) -> None:
    deadline = asyncio.get_running_loop().time() + limit
    while peer.state != state:
        assert asyncio.get_running_loop().time() < deadline, peer.state
        await asyncio.sleep(0.01)


async def test_a_goodbye_degrades_the_group_and_the_next_collective_names_the_leaver() -> None:
    a, b, c = group_of = peers(3)
    async with a, b, c:
        groups = await asyncio.gather(*(p.join() for p in group_of))
        await c.stop("maintenance")  # between collectives
        for p in (a, b):
            await until_state(p, "degraded")
            assert p.health() == (False, {"state": "degraded", "rank": groups.index(p.group),
                                          "world_size": 3, "gone": 1})
        # Transfers between the members still there go on...
        _, received = await asyncio.gather(groups[0].send(np.arange(4.0), dst=1),
                                           groups[1].recv(src=0))
        np.testing.assert_array_equal(received, np.arange(4.0))
        assert a.state == "degraded"
        # ...while a collective fails with the leaver's PeerLost, and breaks the group.
        with pytest.raises(p2pcoll.PeerLost, match="rank 2 left the group") as lost:
            await groups[0].allreduce(np.ones(4))
        assert lost.value.rank == 2
        assert a.state == "broken" and a.health()[1]["cause"] == "PeerLost"
