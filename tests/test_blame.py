"""A CollectiveTimeout names the ranks that really did not arrive (issue 10).

The rank whose deadline passes first knows only whom *it* waits for: in a ring, its
neighbour, which waits further up the chain. So it asks every peer what it waits for and
blames the peers that did not answer (frozen, overloaded, cut off), else the peers that are
waited for and have not started the collective, else whom it waits for itself; every other
rank's error names the same ranks. Over the in-memory transport for every allreduce
strategy, then as four real processes over tcp with one of them stopped by SIGSTOP.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import p2pcoll
from conftest import groups_of
from p2pcoll.testing import free_port
from p2pcoll.transport.memory import Faults, MemoryNetwork

ROOT = Path(__file__).resolve().parents[1]
ALLREDUCE = sorted(p2pcoll.available_strategies()["allreduce"])
SURVIVORS = (0, 1, 3)
ABSENT = 2  # the rank that is frozen, or never calls the collective


async def _timeouts(groups: list[p2pcoll.Group], strategy: str,
                    timeouts: dict[int, float]) -> dict[int, p2pcoll.CollectiveTimeout]:
    """Run an allreduce on the ranks of ``timeouts`` (with those deadlines); each must time out."""

    async def one(g: p2pcoll.Group) -> p2pcoll.CollectiveTimeout:
        with pytest.raises(p2pcoll.CollectiveTimeout) as info:
            await g.allreduce(np.ones(10), strategy=strategy, timeout=timeouts[g.rank])
        return info.value

    errors = await asyncio.gather(*(one(groups[r]) for r in timeouts))
    return dict(zip(timeouts, errors, strict=True))


@pytest.mark.parametrize("strategy", ALLREDUCE)
async def test_a_frozen_rank_is_blamed_by_every_survivor(strategy: str) -> None:
    net = MemoryNetwork(Faults())
    async with groups_of(4, network=net, collective_timeout=10) as groups:
        net.freeze(groups[ABSENT].endpoint)
        errors = await _timeouts(groups, strategy, {r: 0.5 for r in SURVIVORS})
        for rank, err in errors.items():
            assert err.waiting_on == [ABSENT], (rank, str(err))
            assert err.collective == "allreduce" and err.seq == 0
            assert "rank 2 did not answer (frozen, overloaded or cut off)" in str(err), str(err)
            assert groups[rank].state == "broken"
        net.thaw(groups[ABSENT].endpoint)


@pytest.mark.parametrize("strategy", ALLREDUCE)
async def test_a_rank_that_never_calls_is_blamed_as_not_started(strategy: str) -> None:
    async with groups_of(4, collective_timeout=10) as groups:
        start = time.monotonic()
        errors = await _timeouts(groups, strategy, {r: 0.5 for r in SURVIVORS})
        # Every peer answered (rank 2's loop runs; it just has not called): no waiting
        # out the inquiry.
        assert time.monotonic() - start < 5
        for rank, err in errors.items():
            assert err.waiting_on == [ABSENT], (rank, str(err))
            assert "rank 2 has not started it" in str(err), str(err)


async def test_the_message_says_who_waits_for_whom_in_the_ring() -> None:
    """The probe of the issue, in memory: the ring's first rank to time out used to blame its
    neighbour (rank 0: "still waiting for ranks [3]")."""
    net = MemoryNetwork(Faults())
    async with groups_of(4, network=net, collective_timeout=10) as groups:
        net.freeze(groups[ABSENT].endpoint)
        errors = await _timeouts(groups, "ring", {r: 0.5 for r in SURVIVORS})
        assert str(errors[0]) == (
            "allreduce #0 timed out after 0.5s on rank 0: rank 2 did not answer (frozen, "
            "overloaded or cut off); waiting: rank 0 for [3], rank 1 for [0], rank 3 for [2]"
        )
        net.thaw(groups[ABSENT].endpoint)


async def test_the_others_name_the_ranks_the_first_one_blamed() -> None:
    """Rank 0's deadline is far shorter: its abort reaches ranks 1 and 3 long before theirs
    passes, and their errors blame rank 2 too, not whom they wait for (0 and 2)."""
    net = MemoryNetwork(Faults())
    async with groups_of(4, network=net, collective_timeout=10) as groups:
        net.freeze(groups[ABSENT].endpoint)
        start = time.monotonic()
        errors = await _timeouts(groups, "ring", {0: 0.3, 1: 30, 3: 30})
        assert time.monotonic() - start < 10
        for rank, err in errors.items():
            assert err.waiting_on == [ABSENT], (rank, str(err))
            # Found by rank 0 (the others' errors say whose it is) as a silent rank.
            assert (err.origin, err.blame) == (None if rank == 0 else 0, "silent"), rank
        assert str(errors[1]).startswith("rank 0 failed collective #0: allreduce #0 timed out")
        assert "rank 2 did not answer" in str(errors[1])
        assert str(errors[1]).endswith("rank 1 was still waiting for ranks [0]")
        net.thaw(groups[ABSENT].endpoint)


@pytest.mark.parametrize("stagger", [0.0, 0.3])
async def test_lost_messages_blame_what_each_rank_waits_for(stagger: float) -> None:
    """Everyone answers and everyone has started: each rank names whom it waits for, also
    when an earlier rank's abort (which knew no more than its own waits) comes first."""
    async with groups_of(3, faults=Faults(drop=1.0), collective_timeout=10) as groups:
        errors = await _timeouts(groups, "ring", {r: 0.5 + stagger * r for r in range(3)})
        for rank, err in errors.items():
            assert err.waiting_on == [(rank - 1) % 3], (rank, str(err))
            assert "still waiting for ranks" in str(err)


async def test_peers_answer_from_every_state() -> None:
    """The answers behind the blame: finished, waiting (with whom for), not started."""
    async with groups_of(3, collective_timeout=10) as groups:
        await asyncio.gather(*(g.allreduce(np.ones(3)) for g in groups))
        failures = [g._failures for g in groups]
        assert failures[1].status(0) == ("finished", [])
        assert failures[1].status(1) == ("not started", [])
        task = asyncio.ensure_future(groups[1].allreduce(np.ones(3), strategy="ring"))
        await asyncio.sleep(0.05)
        assert failures[1].status(1) == ("waiting", [0])
        await asyncio.gather(*(g.allreduce(np.ones(3), strategy="ring")
                               for g in (groups[0], groups[2])), task)
        assert failures[1].status(1) == ("finished", [])


# --- as processes over tcp ----------------------------------------------------------------

PEER = textwrap.dedent(
    """
    import asyncio, json, sys, time

    import numpy as np
    import p2pcoll

    async def main() -> None:
        url, rank, world = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
        g = await p2pcoll.join(url, world_size=world, rank=rank, timeout=30,
                               collective_timeout=30)
        await g.barrier(timeout=30)  # every link is up (collective #0; the allreduce is #1)
        print("ready", flush=True)
        loop = asyncio.get_running_loop()
        # A thread reads stdin, so the event loop runs meanwhile (and answers peers).
        go = await loop.run_in_executor(None, sys.stdin.readline)
        if go.strip() != "go":  # rank 2 never calls the allreduce (or is frozen)
            await g.close()
            return
        start = time.monotonic()
        try:
            await g.allreduce(np.ones(1000, np.float32), timeout=3)  # $P2PCOLL_ALLREDUCE
            out = {"error": None}
        except p2pcoll.P2PCollError as exc:
            out = {"error": type(exc).__name__, "message": str(exc),
                   "waiting_on": getattr(exc, "waiting_on", None)}
        out["elapsed"] = time.monotonic() - start
        print(json.dumps(out), flush=True)
        await g.close()

    asyncio.run(main())
    """
)


def _run_group(tmp_path: Path, freeze: bool) -> dict[int, dict[str, Any]]:
    """Four peers as processes; rank 2 is stopped with SIGSTOP (``freeze``) or just never
    calls the allreduce. Returns what each survivor's allreduce raised."""
    script = tmp_path / "peer.py"
    script.write_text(PEER)
    url = f"tcp://127.0.0.1:{free_port()}"
    # A stopped peer must not be declared lost by heartbeats first (5 s by default, about
    # what the 3 s deadline and the inquiry take).
    env = {**os.environ, "P2PCOLL_ALLREDUCE": "ring", "P2PCOLL_HEARTBEAT_TIMEOUT": "60"}
    procs = [subprocess.Popen([sys.executable, str(script), url, str(rank), "4"], cwd=ROOT,
                              env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True) for rank in range(4)]
    stopped = False
    try:
        for rank, proc in enumerate(procs):
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert line.strip() == "ready", f"rank {rank} said {line!r}"
        if freeze:
            os.kill(procs[ABSENT].pid, signal.SIGSTOP)
            stopped = True
        for rank in SURVIVORS:
            assert procs[rank].stdin is not None
            procs[rank].stdin.write("go\n")
            procs[rank].stdin.flush()
        results = {}
        for rank in SURVIVORS:
            out, _ = procs[rank].communicate(timeout=60)
            results[rank] = json.loads(out.strip().splitlines()[-1])
        return results
    finally:
        for proc in procs:  # only the processes this test started
            if stopped and proc is procs[ABSENT]:
                os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait()
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    stream.close()


@pytest.mark.processes
@pytest.mark.parametrize("case", ["frozen", "never_calls"])
def test_processes_blame_the_rank_that_did_not_come(tmp_path: Path, case: str) -> None:
    """The issue's probe: 4 processes, rank 2 stopped (or idle), a ring allreduce with
    ``timeout=3``. Every survivor's error names rank 2, none its own neighbour."""
    results = _run_group(tmp_path, freeze=case == "frozen")
    why = "rank 2 did not answer" if case == "frozen" else "rank 2 has not started it"
    for rank, out in results.items():
        assert out["error"] == "CollectiveTimeout", (rank, out)
        assert out["waiting_on"] == [ABSENT], (rank, out)
        assert why in out["message"], (rank, out)
        assert "allreduce #1 timed out after 3s on rank" in out["message"], (rank, out)
        assert out["elapsed"] < 30, (rank, out)  # the deadline and about a second more
