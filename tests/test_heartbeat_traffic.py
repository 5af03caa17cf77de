"""Heartbeat traffic per peer does not grow with the group, counted on the wire.

benchmarks/mesh_footprint.py ``--heartbeats`` starts a group of peer processes, each on a
host of its own (so every link is TCP on the loopback), in a network namespace of its own
(nobody else's packets on that loopback), lets it sit idle after a barrier and counts the
loopback's packets over the idle window: heartbeats and nothing else. With liveness on the
sparse overlay each peer watches two others whatever the size, so the packets per peer per
second are the same at p = 8 and p = 64 (they grew ninefold when every pair had a probe).
Then one peer is SIGKILLed and every survivor must know of it (``--kill``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "mesh_footprint.py"


def _netns_allowed() -> bool:
    for prefix in (["unshare", "-n"], ["unshare", "-rn"]):
        try:
            done = subprocess.run([*prefix, "true"], check=False, capture_output=True)
        except FileNotFoundError:
            return False
        if done.returncode == 0:
            return True
    return False


@pytest.mark.scale
@pytest.mark.skipif(not _netns_allowed(), reason="needs a network namespace (unshare -n)")
def test_heartbeats_per_peer_stay_flat_from_8_to_64_peers() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("P2PCOLL_")}
    done = subprocess.run(
        [sys.executable, str(BENCH), "--heartbeats", "8", "64", "--idle", "5", "--kill",
         "--nofile", "256"],
        env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {}
    for line in done.stdout.splitlines():
        cells = line.split()
        if cells and cells[0].isdigit():
            assert "failed" not in line, line
            # p, probes, idle s, lo packets, per peer/s, named med s, last s, named
            rows[int(cells[0])] = cells
    assert set(rows) == {8, 64}, done.stdout
    for p, cells in rows.items():
        assert float(cells[1]) == 2, cells  # each peer probes its two ring successors
        assert cells[7] == f"{p - 1}/{p - 1}", cells  # every survivor knew of the kill
    per_peer = {p: float(cells[4]) for p, cells in rows.items()}
    assert per_peer[8] > 0, done.stdout  # the probes do beat
    # The same per peer (a packet or so of slack per peer for the window's edges).
    assert per_peer[64] <= per_peer[8] * 1.1 + 0.5, done.stdout
    print(done.stdout)
