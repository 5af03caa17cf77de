"""Peers on hosts of their own: a network namespace each, joined by a switch (tests/netns.py).

Four peers, each started with ``ip netns exec`` on its own host of the lab (198.18.0.R+1),
meet at the rendezvous hosted by rank 0 at ``tcp://198.18.0.1:PORT`` and run allreduce
(every built-in strategy), broadcast and allgather with the job key on. Nobody sets
``P2PCOLL_HOST``: each peer must bind and advertise the address that routes to the
rendezvous host (each host has a second one, on another subnet, that does not), or the
others could not reach it. With ``P2PCOLL_HOST`` set to the second address, that one is
advertised instead.

The hosts share this machine's file system, hostname and boot id, so to p2pcoll they are
one host, which is true: ipc sockets (file system paths) and shared memory reach across
network namespaces. To cross the network these tests set ``P2PCOLL_TRANSPORT=tcp``, and
check that each host's cable carried at least what its peer sent; one test runs ``auto``
to show that it works too, over ipc and shared memory.

Last, a cable is pulled mid-run (``ip link set eth0 down`` in one host): the others get
``PeerLost`` naming that rank within the heartbeat bound, and every process exits.

These need root and ``ip`` (iproute2); without them they skip, except that under ``CI=true``
a missing ``ip`` fails (CI installs iproute2). Run as a script, this file is the peer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import netns
import pytest

pytestmark = pytest.mark.slow

WORLD = 4
PORT = 29500  # every lab is new: nothing else listens in its namespaces
RENDEZVOUS = f"tcp://{netns.address(0)}:{PORT}"
STRATEGIES = ("ring", "recursive_doubling", "reduce_broadcast", "rabenseifner")
COUNT = 1 << 18  # float32 elements: 1 MiB, pieces large enough for shared memory under auto
HEARTBEAT = 2.0  # seconds (P2PCOLL_HEARTBEAT_TIMEOUT) in the cut test
VICTIM = 2
WAIT = 60.0  # seconds any one wait of the driver may take before the test fails
# Variables of the environment that would tell a peer something other than the test does.
FOREIGN = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")
FOREIGN_PREFIXES = ("P2PCOLL_", "SLURM_", "OMPI_", "PMIX_", "TORCHELASTIC_")


# --- the peer (this file run as a script on a host of the lab) ------------------------------

def _say(**event: Any) -> None:
    print(json.dumps(event), flush=True)


async def collectives() -> None:
    """Join, run every collective under test once, report the results and the roster."""
    import numpy as np

    import p2pcoll

    async with p2pcoll.join() as g:
        r, p = g.rank, g.world_size
        x = np.arange(COUNT, dtype=np.float32) + r
        want = p * np.arange(COUNT, dtype=np.float32) + p * (p - 1) / 2
        allreduce = {s: bool(np.array_equal(await g.allreduce(x, strategy=s), want))
                     for s in STRATEGIES}
        root = p - 1  # not the rendezvous host
        mine = np.arange(COUNT, dtype=np.float64) * 3 if r == root else np.zeros(COUNT)
        got = await g.broadcast(mine, root=root)
        broadcast = bool(np.array_equal(got, np.arange(COUNT, dtype=np.float64) * 3))
        parts = await g.allgather(np.full(5, r, np.int64))
        allgather = [a.tolist() for a in parts] == [[q] * 5 for q in range(p)]
        stats = g.stats()
        _say(event="done", rank=r, endpoint=g.endpoint, endpoints=list(g.membership.endpoints),
             allreduce=allreduce, broadcast=broadcast, allgather=allgather,
             bytes_sent=stats["bytes_sent"], bytes_sent_shm=stats["bytes_sent_shm"],
             secured=g.settings.key is not None)


async def loop() -> None:
    """Join, then allreduce back to back until one fails; report the error, and close the
    group once told to (a line on stdin): a survivor that left at once would be a peer lost
    in its turn, which its peers might see before the first loss."""
    import numpy as np

    import p2pcoll

    g = await p2pcoll.join()
    rank = g.rank  # a closed group has no rank any more
    x = np.ones(COUNT, np.float32)
    rounds = 0
    try:
        while True:
            await g.allreduce(x)
            rounds += 1
            if rounds == 3:
                _say(event="running", rank=rank)
    except p2pcoll.P2PCollError as exc:
        _say(event="raised", t=time.monotonic(), rank=rank, type=type(exc).__name__,
             message=str(exc), rank_attr=getattr(exc, "rank", None), rounds=rounds)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    await g.close()
    _say(event="closed", t=time.monotonic(), rank=rank)


# --- the driver ------------------------------------------------------------------------------

class Peer:
    """One peer process on one host of the lab, its JSON lines read as they come."""

    def __init__(self, proc: asyncio.subprocess.Process, rank: int) -> None:
        self.proc, self.rank = proc, rank
        self.events: list[dict[str, Any]] = []
        self.stderr = b""
        self._changed = asyncio.Event()
        self._tasks = [asyncio.create_task(self._read()), asyncio.create_task(self._errors())]

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        while line := await self.proc.stdout.readline():
            with contextlib.suppress(ValueError):
                self.events.append(json.loads(line))
            self._changed.set()
        self._changed.set()

    async def _errors(self) -> None:
        assert self.proc.stderr is not None
        self.stderr = await self.proc.stderr.read()

    def tell(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line.encode() + b"\n")

    def find(self, event: str) -> dict[str, Any] | None:
        return next((e for e in self.events if e.get("event") == event), None)

    async def wait_for(self, event: str, timeout: float = WAIT) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while (found := self.find(event)) is None:
            left = deadline - time.monotonic()
            if self._tasks[0].done() or left <= 0:
                await asyncio.wait(self._tasks, timeout=1)
                why = "exited" if self._tasks[0].done() else f"said nothing for {timeout:g}s"
                raise AssertionError(
                    f"rank {self.rank} {why} before {event!r}; events {self.events}; stderr:\n"
                    f"{self.stderr.decode(errors='replace')[-3000:]}")
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), left)
        return found

    async def kill(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
        await self.proc.wait()
        await asyncio.wait(self._tasks, timeout=5)


def _environment(rank: int, key: Path, transport: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in FOREIGN and not k.startswith(FOREIGN_PREFIXES)}
    env.update(P2PCOLL_RENDEZVOUS=RENDEZVOUS, WORLD_SIZE=str(WORLD), RANK=str(rank),
               P2PCOLL_TRANSPORT=transport, P2PCOLL_KEY_FILE=str(key),
               P2PCOLL_JOIN_TIMEOUT="30", **extra)
    return env


@contextlib.asynccontextmanager
async def peers(lab: netns.Lab, mode: str, key: Path, transport: str = "tcp",
                env: dict[int, dict[str, str]] | None = None) -> AsyncIterator[list[Peer]]:
    """A peer on every host of ``lab`` running ``mode``; all killed on the way out."""
    started: list[Peer] = []
    try:
        for r in range(WORLD):
            argv = lab.command(r, [sys.executable, __file__, mode])
            proc = await asyncio.create_subprocess_exec(
                *argv, env=_environment(r, key, transport, **(env or {}).get(r, {})),
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, cwd=Path(__file__).parent)
            started.append(Peer(proc, r))
        yield started
    finally:
        for peer in started:
            await peer.kill()


def _require_namespaces() -> None:
    """Skip where no namespace can be made; under CI a missing ``ip`` is a failure."""
    reason = netns.unavailable()
    if reason is not None:
        if os.environ.get("CI") == "true" and shutil.which("ip") is None:
            pytest.fail(f"CI must run the network namespace tests: {reason}")
        pytest.skip(reason)


@pytest.fixture
def lab() -> Iterator[netns.Lab]:
    """A fresh lab of WORLD hosts, removed after the test whatever happened."""
    _require_namespaces()
    made = netns.Lab(WORLD)
    try:
        made.create()
    except netns.LabError as exc:
        made.close()
        pytest.skip(f"network namespaces cannot be made here: {exc}")
    try:
        yield made
    finally:
        made.close()


@pytest.fixture
def key(tmp_path: Path) -> Path:
    """A job key made with ``p2pcoll keygen``: every socket of these groups is secured."""
    path = tmp_path / "job.key"
    subprocess.run([sys.executable, "-m", "p2pcoll", "keygen", str(path)], check=True,
                   capture_output=True, timeout=60)
    return path


def _check_done(done: list[dict[str, Any]]) -> None:
    for report in done:
        assert report["allreduce"] == dict.fromkeys(STRATEGIES, True), report
        assert report["broadcast"] and report["allgather"] and report["secured"], report


async def test_peers_on_their_own_hosts_advertise_the_routing_interface(
        lab: netns.Lab, key: Path) -> None:
    for r in range(WORLD):  # a second address each, on a subnet the rendezvous is not on
        lab.add_address(r, subnet=1)
    before = [lab.counters(r) for r in range(WORLD)]
    async with peers(lab, "collectives", key) as group:
        done = [await p.wait_for("done") for p in group]
    _check_done(done)
    addresses = [netns.address(r) for r in range(WORLD)]
    for r, report in enumerate(done):
        assert report["rank"] == r
        host, _, port = report["endpoint"].removeprefix("tcp://").rpartition(":")
        assert host == addresses[r] and port.isdigit(), report["endpoint"]
        assert [e.removeprefix("tcp://").rpartition(":")[0] for e in report["endpoints"]] \
            == addresses, report["endpoints"]
        assert report["bytes_sent_shm"] == 0
    for r, report in enumerate(done):
        sent = lab.counters(r)[0] - before[r][0]
        assert sent >= report["bytes_sent"] > 2 * COUNT * 4, (r, sent, report)


async def test_p2pcoll_host_overrides_the_advertised_address(lab: netns.Lab, key: Path) -> None:
    # A second address on every host, on a subnet of its own; the rendezvous stays on the
    # first, so without the override every peer would advertise its 198.18.0.x.
    chosen = {r: {"P2PCOLL_HOST": lab.add_address(r, subnet=1)} for r in range(WORLD)}
    async with peers(lab, "collectives", key, env=chosen) as group:
        done = [await p.wait_for("done") for p in group]
    _check_done(done)
    for report in done:
        assert [e.removeprefix("tcp://").rpartition(":")[0] for e in report["endpoints"]] \
            == [netns.address(r, subnet=1) for r in range(WORLD)], report["endpoints"]


async def test_auto_treats_the_namespaces_as_one_host(lab: netns.Lab, key: Path) -> None:
    async with peers(lab, "collectives", key, transport="auto") as group:
        done = [await p.wait_for("done") for p in group]
    _check_done(done)
    for r, report in enumerate(done):
        assert report["endpoint"].startswith(f"tcp://{netns.address(r)}:")
        others = [e for q, e in enumerate(report["endpoints"]) if q != r]
        assert all(e.startswith("ipc://") for e in others), report["endpoints"]
        assert report["bytes_sent_shm"] > 0, report


async def test_a_cut_cable_is_a_peer_lost_naming_it(lab: netns.Lab, key: Path) -> None:
    hb = {r: {"P2PCOLL_HEARTBEAT_TIMEOUT": f"{HEARTBEAT:g}"} for r in range(WORLD)}
    async with peers(lab, "loop", key, env=hb) as group:
        for p in group:
            await p.wait_for("running")
        lab.cut(VICTIM)
        cut_at = time.monotonic()
        bound = HEARTBEAT * 1.2 + 0.3 + 3.0  # probe timeout, its interval, grace, a loaded box
        survivors = [p for p in group if p.rank != VICTIM]
        raised = [await p.wait_for("raised", timeout=bound + 5) for p in survivors]
        for event in raised:
            assert event["type"] == "PeerLost", event
            assert f"rank {VICTIM}" in event["message"], event
            assert event["t"] - cut_at < bound, (event["t"] - cut_at, event)
        assert all(e["rank_attr"] == VICTIM for e in raised), raised
        # The peer cut off finds itself alone, and nobody hangs: told to, every peer closes
        # its group and exits at once.
        alone = await group[VICTIM].wait_for("raised", timeout=bound + 5)
        assert alone["type"] == "PeerLost", alone
        for p in group:
            p.tell("close")
        for p in group:
            await p.wait_for("closed", timeout=10)
            assert await asyncio.wait_for(p.proc.wait(), 10) == 0


def test_a_lab_leaves_nothing_behind() -> None:
    _require_namespaces()
    # A lab whose maker died without closing it: the next lab's sweep removes it.
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    orphan = f"{netns.PREFIX}{dead}-0-sw"
    subprocess.run(["ip", "netns", "add", orphan], check=True, capture_output=True)
    try:
        with netns.Lab(2) as lab:
            listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                                    check=True).stdout
            assert orphan not in listed
            assert all(name in listed for name in (lab.switch, *lab.names))
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                                check=True).stdout
        assert not any(name in listed for name in (lab.switch, *lab.names)), listed
    finally:
        subprocess.run(["ip", "netns", "delete", orphan], capture_output=True, check=False)


if __name__ == "__main__":
    asyncio.run({"collectives": collectives, "loop": loop}[sys.argv[1]]())
