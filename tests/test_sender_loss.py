"""A lost peer fails every operation that involves it, the sending side included.

A rank that only sends to a peer that dies (a point-to-point send, a broadcast root, the
senders of a gather) used to wait out its whole deadline and then blame nobody, while the
receivers of the same peer failed at once. Here the peers are processes over tcp, over ipc
and over same-host lanes; one is killed (SIGKILL) or stopped (SIGSTOP) while the others
loop the operation, and every survivor must fail with PeerLost naming it within the
heartbeat bound (never the deadline, which is set far beyond it).

"hosts" is the default path between hosts (0.21.0): every peer claims a host of its own
(``P2PCOLL_HOST_ID``), no job key, and the operations are small, so that they go on TCP
lanes read by the event loop; the tests check that they did, through the async API and
the blocking one.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import p2pcoll
from p2pcoll.testing import memory_groups
from p2pcoll.transport.endpoints import free_port
from p2pcoll.transport.memory import MemoryNetwork

from conftest import stop

ROOT = Path(__file__).resolve().parent.parent
PEER = Path(__file__).resolve().parent / "sender_loss_peer.py"

# The environment of each transport: tcp, ipc through the sockets only, and ipc with the
# shared-memory lanes and rings of one host.
TRANSPORTS = {
    "tcp": {"P2PCOLL_TRANSPORT": "tcp"},
    "ipc": {"P2PCOLL_TRANSPORT": "ipc", "P2PCOLL_SHM": "0"},
    "lanes": {"P2PCOLL_TRANSPORT": "ipc", "P2PCOLL_SHM": "1"},
    "hosts": {"P2PCOLL_TRANSPORT": "tcp"},  # and a P2PCOLL_HOST_ID per rank (run_case)
}
SMALL = 8 << 10  # bytes per operation on the hosts path: well under a TCP lane's largest
# scenario -> (world size, the rank that dies, bytes per operation)
SCENARIOS = {
    "send": (2, 1, 1 << 20),  # rank 0 sends to rank 1
    "recv": (2, 0, 1 << 20),  # rank 1 receives from rank 0: the receivers' figure
    "broadcast": (3, 2, 1 << 20),  # root 0 broadcasts to ranks 1 and 2
    "gather": (3, 0, 1 << 20),  # ranks 1 and 2 gather to root 0
    "allreduce": (3, 1, SMALL),  # a stream of small allreduces among 3
}
HEARTBEAT_S = 2.0  # a stopped peer is lost after this (the default is 5 s)
DEADLINE_S = 120.0  # every operation's deadline: far beyond any bound a loss should take


def run_case(
    scenario: str, transport: str, signum: int, *, heartbeat: float = HEARTBEAT_S,
    deadline: float = DEADLINE_S, victim: int | None = None, wait: float = 1.0,
    patience: float | None = None, api: str = "async",
) -> tuple[dict[int, dict[str, Any]], int]:
    """Start the scenario's peers, let them loop for ``wait`` seconds, send ``signum`` to
    the victim (the scenario's unless given), and return each survivor's JSON line, with
    ``elapsed``: seconds from the signal to its failure; and the victim's rank. A survivor
    still running after ``patience`` seconds (default half the deadline) fails the test.
    Over "hosts" every rank has a host id of its own and the operations are SMALL."""
    world, default_victim, size = SCENARIOS[scenario]
    victim = default_victim if victim is None else victim
    hosts = transport == "hosts"
    size = SMALL if hosts else size
    url = f"tcp://127.0.0.1:{free_port()}"
    env = {k: v for k, v in os.environ.items() if k != "P2PCOLL_KEY_FILE"}
    env.update(TRANSPORTS[transport], P2PCOLL_HEARTBEAT_TIMEOUT=str(heartbeat),
               P2PCOLL_TIMEOUT=str(deadline))
    procs = [subprocess.Popen(
        [sys.executable, str(PEER), url, str(rank), str(world), scenario, str(size), api],
        cwd=ROOT, env={**env, "P2PCOLL_HOST_ID": f"host-{rank}"} if hosts else env,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    ) for rank in range(world)]
    stopped = False
    try:
        for rank, proc in enumerate(procs):
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert line.strip() == "ready", f"rank {rank} said {line!r}"
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        time.sleep(wait)
        signalled = time.time()
        os.kill(procs[victim].pid, signum)
        stopped = signum == signal.SIGSTOP
        results = {}
        for rank, proc in enumerate(procs):
            if rank == victim:
                continue
            # Bounded: a survivor that waits out its deadline fails the test here.
            out, _ = proc.communicate(timeout=deadline / 2 if patience is None else patience)
            results[rank] = json.loads(out.strip().splitlines()[-1])
            results[rank]["elapsed"] = results[rank]["failed_at"] - signalled
        return results, victim
    finally:
        if stopped:
            os.kill(procs[victim].pid, signal.SIGCONT)
        for proc in procs:  # only the processes this test started
            stop(proc)


CASES = [
    pytest.param(s, t, sig, id=f"{s}-{t}-{sig.name}")
    for s in ("send", "broadcast", "gather")
    for t in TRANSPORTS if t != "hosts"  # the hosts path has tests of its own, below
    for sig in (signal.SIGKILL, signal.SIGSTOP)
]


@pytest.mark.processes
@pytest.mark.parametrize(("scenario", "transport", "signum"), CASES)
def test_senders_fail_naming_the_lost_peer(scenario: str, transport: str,
                                           signum: signal.Signals) -> None:
    results, victim = run_case(scenario, transport, signum)
    for rank, out in results.items():
        assert out["error"] == "PeerLost", (rank, out)
        assert out["rank"] == victim, (rank, out)
        assert f"rank {victim}" in out["message"], (rank, out)
        # The heartbeat bound and slack for a busy machine, nowhere near the deadline.
        assert out["elapsed"] < HEARTBEAT_S + 20, (rank, out)


# The default path between hosts: small operations on TCP lanes, receivers and senders,
# through the async API and the blocking one.
HOST_CASES = [
    pytest.param(s, api, sig, id=f"{s}-{api}-{sig.name}")
    for s, api, sig in [
        ("send", "async", signal.SIGKILL), ("recv", "async", signal.SIGKILL),
        ("allreduce", "async", signal.SIGKILL), ("broadcast", "async", signal.SIGKILL),
        ("send", "async", signal.SIGSTOP),
        ("send", "blocking", signal.SIGKILL), ("recv", "blocking", signal.SIGKILL),
        ("allreduce", "blocking", signal.SIGKILL),
    ]
]


@pytest.mark.processes
@pytest.mark.parametrize(("scenario", "api", "signum"), HOST_CASES)
def test_peers_on_hosts_of_their_own_fail_naming_the_lost_peer_over_tcp_lanes(
        scenario: str, api: str, signum: signal.Signals) -> None:
    results, victim = run_case(scenario, "hosts", signum, api=api, wait=0.5)
    for rank, out in results.items():
        assert out["warm_lane"] > 0, (rank, out)  # every rank sent on its lanes
        assert out["error"] == "PeerLost", (rank, out)
        assert out["rank"] == victim, (rank, out)
        assert f"rank {victim}" in out["message"], (rank, out)
        # A killed peer's lanes and links close at once; a stopped one is lost after the
        # heartbeat. Slack for a busy machine, nowhere near the deadline. A receiver first
        # takes, in order, what its sender sent before it died: at most the sender's eager
        # window (p2pcoll.engine.credit), 8,000 of these messages, in 0.1-0.2 s here (while
        # each receive scanned the whole backlog, 9-11 s; tests/test_matcher_backlog.py).
        bound = (0.5 if signum == signal.SIGKILL else HEARTBEAT_S) + 5
        assert out["elapsed"] < bound, (rank, out)
    # The scenario's own small messages took the lanes too (a surviving sender's), unless
    # every survivor only receives.
    assert scenario == "recv" or any(
        out["on_lane"] > out["warm_lane"] for out in results.values()), results


# The same over the in-memory transport, whose queues are bounded as a link's: one per
# ordered pair of peers, here of 4 messages.

async def test_in_memory_send_blocked_on_a_full_queue_fails_when_the_receiver_is_cut() -> None:
    net = MemoryNetwork(capacity=4)
    groups = await memory_groups(2, network=net, collective_timeout=DEADLINE_S,
                                 heartbeat_timeout=1)  # the cut peer closes within 1 s
    a, b = groups
    try:
        sent = 0

        async def flood() -> None:
            nonlocal sent
            while True:
                await a.send(np.ones(8), dst=1)
                sent += 1

        net.freeze(b.endpoint)  # as SIGSTOP: nothing reaches b
        sender = asyncio.create_task(flood())
        await asyncio.sleep(0.2)  # 4 messages wait for b, then a waits for room
        assert not sender.done() and sent == 4, sent
        net.cut(b.endpoint)
        with pytest.raises(p2pcoll.PeerLost, match="rank 1") as info:
            await asyncio.wait_for(sender, 10)
        assert info.value.rank == 1
        assert isinstance(a.cause, p2pcoll.PeerLost)  # the group is broken by it
        with pytest.raises(p2pcoll.GroupBroken):
            await a.send(np.ones(8), dst=1)
    finally:
        await asyncio.gather(*(g.close() for g in groups))


async def test_in_memory_broadcast_root_fails_when_a_receiver_is_cut() -> None:
    net = MemoryNetwork(capacity=4)
    groups = await memory_groups(3, network=net, collective_timeout=DEADLINE_S,
                                 heartbeat_timeout=1)  # the cut peer closes within 1 s
    try:
        async def root() -> None:
            while True:
                await groups[0].broadcast(np.ones(8), root=0, strategy="root")

        async def receiver(g: p2pcoll.Group) -> None:
            while True:
                await g.broadcast(None, root=0, strategy="root")

        net.freeze(groups[2].endpoint)  # as SIGSTOP: the root's queue to rank 2 fills
        rank1 = asyncio.create_task(receiver(groups[1]))
        sender = asyncio.create_task(root())
        await asyncio.sleep(0.2)
        assert not sender.done()
        net.cut(groups[2].endpoint)
        for task in (sender, rank1):
            with pytest.raises(p2pcoll.PeerLost) as info:
                await asyncio.wait_for(task, 10)
            assert info.value.rank == 2, info.value
    finally:
        await asyncio.gather(*(g.close() for g in groups))


# A receiver that took its message and closed has not abandoned the send: the send may still
# be waiting for libzmq to let go of its zero-copy frames (reported late, through pyzmq's
# garbage-collector thread) when the goodbye comes. Here that wait is held until the
# receiver has closed and its goodbye has come, as a loaded machine may hold it.

async def test_a_send_whose_receiver_took_it_and_left_succeeds(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from p2pcoll.engine import executor

    real_released = executor._released
    left = asyncio.Event()

    async def late_release(trackers: list[Any]) -> None:
        if trackers:  # the send's zero-copy frames (a receive has none)
            held.append(len(trackers))
            await left.wait()
            await asyncio.sleep(0.5)  # the goodbye is read meanwhile
        await real_released(trackers)

    monkeypatch.setattr(executor, "_released", late_release)
    # 8 MiB: 8 segments of 1 MiB, the first 4 sent zero-copy (the last ones of a pipeline
    # go as copies, so that they need no release).
    data = np.arange(1 << 21, dtype=np.float32)
    held = []

    async def fn(g: p2pcoll.Group) -> str:
        if g.rank == 1:
            got = await g.recv(src=0)
            assert np.array_equal(got, data)
            await g.close()
            left.set()
            return "closed"
        await g.send(data, dst=1)
        assert g.cause is None, g.cause
        return str(g.state)

    assert await p2pcoll.testing.run_ranks(2, fn, transport="tcp",
                                           collective_timeout=DEADLINE_S) == ["degraded", "closed"]
    assert held, "the send had no zero-copy frames to wait for: the test tests nothing"
