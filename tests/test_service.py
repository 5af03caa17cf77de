"""A peer as a service: the Peer object in an asyncio application, ``p2pcoll peer``, its
HTTP /healthz and /metrics, and a prompt, visible exit on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

import p2pcoll
from conftest import finish
from peer_processes import port_held
from p2pcoll.errors import GroupBroken, PeerLost, ServiceStopped, SettingsError
from p2pcoll.service import Peer, exit_code, load_job
from p2pcoll.testing import free_port

pytest.importorskip("aiohttp")  # the service extra; the dev extra installs it
aiohttp = pytest.importorskip("aiohttp")

TESTS = Path(__file__).resolve().parent
PINNED = ("p2pcoll_collectives_total", "p2pcoll_collective_seconds",
          "p2pcoll_bytes_sent_total", "p2pcoll_bytes_received_total",
          "p2pcoll_messages_dropped_total", "p2pcoll_errors_total", "p2pcoll_world_size",
          "p2pcoll_rank")


async def get(peer: Peer, path: str) -> tuple[int, str]:
    assert peer.metrics_address is not None
    _, port = peer.metrics_address
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://127.0.0.1:{port}{path}") as response:
            return response.status, await response.text()


def samples(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value}."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def peers(n: int, **options: object) -> list[Peer]:
    url = f"tcp://127.0.0.1:{free_port()}"
    return [Peer(metrics_port=0, metrics_host="127.0.0.1", rendezvous=url, world_size=n,
                 rank=r, transport="tcp", **options) for r in range(n)]


# --- the Peer object -------------------------------------------------------------------


async def test_lifecycle_health_and_metrics_from_the_groups_counters() -> None:
    threads = set(threading.enumerate())
    group_of = peers(2)
    for p in group_of:
        await p.start()
    # Alive (/healthz) from the start; ready (/readyz) once the group has formed.
    status, body = await get(group_of[0], "/readyz")
    assert (status, json.loads(body)["state"]) == (503, "starting")
    status, body = await get(group_of[0], "/healthz")
    assert (status, json.loads(body)["state"]) == (200, "starting")

    groups = await asyncio.gather(*(p.join() for p in group_of))
    for page in ("/readyz", "/healthz"):
        status, body = await get(group_of[1], page)
        report = json.loads(body)
        assert status == 200, page
        # Counts and states only: no group id, endpoint or secret (see Peer.health).
        assert report == {"state": "ready", "rank": 1, "world_size": 2}

    async def job(g: p2pcoll.Group) -> int:
        for _ in range(5):
            await g.allreduce(np.ones(1000, dtype=np.float32), strategy="ring")
        await g.broadcast(np.arange(10.0), root=0)
        return g.rank

    assert await asyncio.gather(*(p.run(job) for p in group_of)) == [0, 1]

    status, text = await get(group_of[0], "/metrics")
    assert status == 200
    for name in PINNED:
        assert re.search(rf"^# TYPE ({name}|{name.removesuffix('_total')}) ", text, re.MULTILINE), name
    got, stats = samples(text), groups[0].stats()
    assert got['p2pcoll_collectives_total{collective="allreduce",strategy="ring"}'] == 5
    broadcasts = stats["collectives_by_strategy"]["broadcast"]
    assert sum(v for k, v in got.items() if k.startswith(
        'p2pcoll_collectives_total{collective="broadcast"')) == sum(broadcasts.values()) == 1
    assert got['p2pcoll_collective_seconds_count{collective="allreduce"}'] == 5
    assert got['p2pcoll_collective_seconds_bucket{collective="allreduce",le="+Inf"}'] == 5
    assert got['p2pcoll_collective_seconds_sum{collective="allreduce"}'] == pytest.approx(
        stats["collective_seconds"]["allreduce"]["sum"])
    assert got["p2pcoll_bytes_sent_total"] == stats["bytes_sent"] > 0
    assert got["p2pcoll_bytes_received_total"] == stats["bytes_received"] > 0
    assert (got["p2pcoll_world_size"], got["p2pcoll_rank"]) == (2, 0)
    assert got['p2pcoll_state{state="ready"}'] == 1

    await asyncio.gather(*(p.stop() for p in group_of))
    assert [p.state for p in group_of] == ["closed", "closed"]
    assert all(p.metrics_address is None for p in group_of)
    # Nothing outlives the peers: no thread (but the event loop's own executor, which
    # name lookups use and asyncio.run shuts down), no task but this test's own.
    def extra() -> set[threading.Thread]:
        return {t for t in set(threading.enumerate()) - threads
                if not t.name.startswith("asyncio_")}

    for _ in range(50):
        if not extra():
            break
        await asyncio.sleep(0.05)
    assert not extra()
    assert asyncio.all_tasks() == {asyncio.current_task()}


async def test_a_broken_group_is_unhealthy_with_its_cause_and_counts_the_error() -> None:
    a, b = peers(2)
    async with a, b:
        await asyncio.gather(a.join(), b.join())

        async def late(g: p2pcoll.Group) -> None:
            await g.allreduce(np.ones(4), timeout=0.5)  # rank 1 never calls it

        with pytest.raises(p2pcoll.CollectiveTimeout):
            await a.run(late)
        status, body = await get(a, "/readyz")
        report = json.loads(body)
        assert status == 503 and report["state"] == "broken"
        assert report["cause"] == "CollectiveTimeout"  # the type: a message may name endpoints
        assert (await get(a, "/healthz")) == (200, body)  # alive all the same
        got = samples((await get(a, "/metrics"))[1])
        assert got['p2pcoll_errors_total{type="CollectiveTimeout"}'] == 1
        assert got['p2pcoll_state{state="broken"}'] == 1


async def test_a_failed_join_is_closed_with_its_cause_and_counted() -> None:
    (a,) = peers(2)[:1]  # a group of two that nobody else joins
    a.join_options["timeout"] = 0.5
    async with a:
        with pytest.raises(p2pcoll.RendezvousError):
            await a.join()
        status, body = await get(a, "/readyz")
        assert status == 503
        assert json.loads(body)["cause"] == "RendezvousError"  # not its URL
        got = samples((await get(a, "/metrics"))[1])
        assert got['p2pcoll_errors_total{type="RendezvousError"}'] == 1


async def test_stop_while_a_job_runs_is_seen_by_the_peers_as_peer_lost_at_once() -> None:
    group_of = peers(3)
    async with group_of[0], group_of[1], group_of[2]:
        await asyncio.gather(*(p.join() for p in group_of))
        started = asyncio.Event()

        async def job(g: p2pcoll.Group) -> None:
            while True:
                await g.allreduce(np.ones(10_000, dtype=np.float32))
                started.set()

        runs = [asyncio.ensure_future(p.run(job)) for p in group_of]
        await started.wait()
        t0 = time.monotonic()
        await group_of[1].stop("maintenance")
        with pytest.raises(ServiceStopped, match="maintenance"):
            await runs[1]
        for r in (0, 2):
            with pytest.raises(PeerLost) as lost:
                await runs[r]
            # Named: "left the group during collective #N (maintenance)" when it left in
            # the middle of one, "left the group" when between two.
            assert lost.value.rank == 1
            assert "rank 1 left the group" in str(lost.value)
        # At once, not at a deadline or the heartbeat timeout (5 s): a loose bound.
        assert time.monotonic() - t0 < 4
        assert group_of[1].state == "closed"
        assert group_of[0].state == "broken"


async def test_stop_during_join_is_prompt() -> None:
    (a,) = peers(2)[:1]
    async with a:
        joining = asyncio.ensure_future(a.join())
        await asyncio.sleep(0.3)
        await a.stop("SIGTERM")
        with pytest.raises(ServiceStopped):
            await joining
        assert a.state == "closed"
        with pytest.raises(ServiceStopped):
            await a.join()


async def test_run_needs_a_joined_group() -> None:
    (a,) = peers(1)
    async with a:
        with pytest.raises(GroupBroken, match="join"):
            await a.run(lambda g: asyncio.sleep(0))


def test_service_settings_are_checked() -> None:
    with pytest.raises(SettingsError, match=r"P2PCOLL_METRICS_PORT='99999'"):
        p2pcoll.settings.ServiceSettings.resolve({"P2PCOLL_METRICS_PORT": "99999"})
    with pytest.raises(SettingsError, match=r"P2PCOLL_LOG_LEVEL='loud'.*DEBUG, INFO"):
        p2pcoll.settings.ServiceSettings.resolve({"P2PCOLL_LOG_LEVEL": "loud"})
    with pytest.raises(SettingsError, match="metrics_port=-1"):
        Peer(metrics_port=-1)
    s = p2pcoll.settings.ServiceSettings.resolve({"P2PCOLL_METRICS_PORT": "9100",
                                                  "P2PCOLL_LOG_LEVEL": "debug"})
    assert (s.metrics_port, s.metrics_host, s.log_level) == (9100, "0.0.0.0", "DEBUG")


def test_exit_codes() -> None:
    assert [exit_code(v) for v in (None, True, False, 0, 3, 256 + 7, "done")] == \
        [0, 0, 1, 0, 3, 7, 0]


@pytest.mark.parametrize(("spec", "message"), [
    ("service_jobs", "is not MODULE:FUNCTION"),
    ("no_such_module:job", "cannot import 'no_such_module'"),
    ("service_jobs:missing", "has no 'missing'"),
    ("service_jobs:sync_job", "not an async function"),
    ("service_jobs:NOT_ASYNC", "is a int, not an async function"),
])
def test_bad_job_specs(spec: str, message: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(TESTS)
    with pytest.raises(SettingsError, match=re.escape(message)):
        load_job(spec)


# --- p2pcoll peer ----------------------------------------------------------------------


def start_peers(n: int, job: str, *, extra_env: dict[str, str] | None = None,
                metrics: bool = False) -> tuple[list[subprocess.Popen[str]], list[int]]:
    url = f"tcp://127.0.0.1:{free_port()}"
    procs, ports = [], []
    for r in range(n):
        port = free_port()
        env = {**os.environ, "P2PCOLL_RENDEZVOUS": url, "WORLD_SIZE": str(n), "RANK": str(r),
               **(extra_env or {})}
        args = [sys.executable, "-m", "p2pcoll", "peer", "--job", job]
        if metrics:
            args += ["--metrics-port", str(port), "--metrics-host", "127.0.0.1"]
        procs.append(subprocess.Popen(args, cwd=TESTS, env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        ports.append(port)
    return procs, ports


@pytest.mark.processes
def test_peer_command_runs_the_job_and_exits_with_its_code() -> None:
    procs, _ = start_peers(3, "service_jobs:sum_ranks", extra_env={"EXIT_CODE": "3"})
    results = finish(procs)
    for rank, (code, text) in enumerate(results):
        assert code == 3, text
        assert "total 3" in text
        # One line per event, each naming rank and group.
        joined = [line for line in text.splitlines() if "joined" in line]
        assert len(joined) == 1 and f"rank={rank} group=" in joined[0], text
        assert re.search(rf"rank={rank} group=\w+ p2pcoll.service: service_jobs:sum_ranks "
                         rf"finished: 3 \(exit 3\)", text), text


@pytest.mark.processes
def test_sigterm_aborts_the_collective_and_the_peers_name_the_leaver() -> None:
    procs, ports = start_peers(3, "service_jobs:forever", metrics=True)
    try:
        leaver = procs[1]
        assert leaver.stdout is not None
        line = ""
        deadline = time.monotonic() + 60
        while "running" not in line and time.monotonic() < deadline:
            line = leaver.stdout.readline()
            assert line, "the peer exited before it ran a collective"
        with urllib.request.urlopen(f"http://127.0.0.1:{ports[1]}/healthz", timeout=5) as r:
            assert r.status == 200 and json.load(r)["state"] == "ready"
        t0 = time.monotonic()
        leaver.send_signal(signal.SIGTERM)
        leaver.wait(timeout=10)
        took = time.monotonic() - t0
    finally:
        results = finish(procs)
    code, text = results[1]
    assert code == 128 + signal.SIGTERM, text
    assert took < 10
    assert "stopping: SIGTERM" in text
    for r in (0, 2):
        code, text = results[r]
        assert code == 1, text
        assert re.search(r"failed: PeerLost: (rank \d failed collective #\d+: )?rank 1 left "
                         r"the group", text), text


@pytest.mark.processes
def test_sigterm_while_joining_exits_promptly() -> None:
    port = free_port()
    procs, _ = start_peers(1, "service_jobs:forever", extra_env={
        "WORLD_SIZE": "2", "P2PCOLL_RENDEZVOUS": f"tcp://127.0.0.1:{port}"})
    proc = procs[0]
    deadline = time.monotonic() + 60
    # Joining once it hosts the rendezvous (rank 0); the second peer never comes. (A fixed
    # sleep sent the signal while a loaded host still imported p2pcoll.)
    while not port_held(port) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert port_held(port), "the peer never hosted the rendezvous"
    proc.send_signal(signal.SIGINT)
    (code, text), = finish(procs, timeout=10)
    assert code == 128 + signal.SIGINT, text
    assert "Traceback" not in text


@pytest.mark.processes
def test_a_job_that_raises_exits_1_with_its_traceback() -> None:
    procs, _ = start_peers(1, "service_jobs:fails")
    (code, text), = finish(procs)
    assert code == 1
    assert "service_jobs:fails raised" in text and "RuntimeError: the job's own bug" in text


@pytest.mark.processes
@pytest.mark.parametrize(("args", "env", "message"), [
    (["--job", "service_jobs"], {}, "is not MODULE:FUNCTION"),
    (["--job", "service_jobs:sync_job"], {}, "not an async function"),
    (["--job", "service_jobs:forever"], {"P2PCOLL_METRICS_PORT": "http"},
     "$P2PCOLL_METRICS_PORT='http' is not allowed"),
    (["--job", "service_jobs:forever"], {"P2PCOLL_LOG_LEVEL": "chatty"},
     "$P2PCOLL_LOG_LEVEL='chatty' is not allowed"),
    (["--job", "service_jobs:forever"], {"WORLD_SIZE": "two"},
     "$WORLD_SIZE='two' is not allowed"),
])
def test_peer_command_refuses_bad_input_before_joining(
        args: list[str], env: dict[str, str], message: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "p2pcoll", "peer", *args], check=False, cwd=TESTS,
                          env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
