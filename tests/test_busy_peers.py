"""A peer that is alive but busy is not declared lost; one that is gone still is.

Real processes over tcp with a heartbeat timeout of HEARTBEAT_S: a peer whose event loop is
held by synchronous work for twice the heartbeat timeout (a pure-Python loop that keeps the
GIL, or a blocking sleep) keeps its probes up (libzmq answers heartbeats on its own thread)
and every collective completes bit for bit; a busy peer whose neighbour leaves while it is
held names the leaver, not itself (it once declared itself lost: "stopped for 2.6 s"). The
kills and long stops of tests/test_sender_loss.py are the other half: those peers are still
named within their bounds. The decisions themselves are tested without processes in
tests/test_suspects.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from p2pcoll.transport.endpoints import free_port

from conftest import stop

ROOT = Path(__file__).resolve().parent.parent
PEER = Path(__file__).resolve().parent / "busy_peer.py"
HEARTBEAT_S = 1.0
HOLD_S = 2 * HEARTBEAT_S  # each hold: twice the heartbeat timeout
WORLD = 4
PATIENCE_S = 120.0  # a peer still running after this fails the test (it would be a hang)


def run(busy: str, kind: str, rounds: int, leaver: int | None = None) -> list[dict[str, Any]]:
    """Run every peer to its end; each one's JSON line, by rank."""
    url = f"tcp://127.0.0.1:{free_port()}"
    env = {k: v for k, v in os.environ.items() if k != "P2PCOLL_KEY_FILE"}
    env.update(P2PCOLL_TRANSPORT="tcp", P2PCOLL_HEARTBEAT_TIMEOUT=str(HEARTBEAT_S),
               P2PCOLL_TIMEOUT="60")
    argv = [str(rounds), busy, str(HOLD_S), kind] + ([] if leaver is None else [str(leaver)])
    procs = [subprocess.Popen(
        [sys.executable, str(PEER), url, str(rank), str(WORLD), *argv],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    ) for rank in range(WORLD)]
    try:
        outs = []
        for rank, proc in enumerate(procs):
            out, err = proc.communicate(timeout=PATIENCE_S)
            assert proc.returncode == 0, (rank, err[-2000:])
            outs.append(json.loads(out.strip().splitlines()[-1]) | {"log": err})
        return outs
    finally:
        for proc in procs:  # only the processes this test started
            stop(proc)


@pytest.mark.processes
@pytest.mark.parametrize(("busy", "kind"), [("1", "spin"), ("0,1,2,3", "sleep")])
def test_a_peer_whose_loop_is_held_past_the_heartbeat_is_not_lost(busy: str, kind: str) -> None:
    outs = run(busy, kind, rounds=3)
    for rank, out in enumerate(outs):
        assert out.get("error") is None, (rank, out)
        assert out["done"] == 3, (rank, out)  # each one checked bit for bit by the peer
        assert "declared it lost" not in out["log"], (rank, out["log"])


@pytest.mark.processes
def test_a_held_peer_whose_neighbour_leaves_meanwhile_names_the_leaver() -> None:
    # Rank 2 watches 3; 3 leaves while 2's loop is held, so 2 resumes to its probe of 3
    # down (and the goodbye, in either order) right after a gap of twice the heartbeat.
    outs = run("2", "spin", rounds=3, leaver=3)
    assert outs[3].get("error") is None and outs[3]["done"] == 1
    for rank in (0, 1, 2):
        out = outs[rank]
        assert out["error"] == "PeerLost" and out["rank"] == 3, (rank, out)
        assert "rank 3 left the group" in out["message"], (rank, out)
        assert "declared it lost" not in out["log"], (rank, out["log"])
