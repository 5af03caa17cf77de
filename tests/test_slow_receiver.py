"""A slow receiver costs its senders no unbounded memory, and the collectives still come out
exact once it wakes: a small run of benchmarks/slow_receiver.py (three peers as processes
on this host; rank 2 stalls while ranks 0 and 1 push allreduces), over tcp, over ipc without
shared memory, and with it.

The bounds are generous on purpose; no timing is asserted. What the benchmark measured on
a 2-core machine as a sender's peak RSS growth, with 3 allreduces of 16 MiB: during the
stall at most 11 MiB (16 MiB with the 3 started at once); over the whole run, warm-up
included, at most 29 MiB, or 62 MiB with shared memory, whose rings count in RSS once mapped
(16 MiB each: a peer maps its own and its 2 peers'). A sender that kept what it sends until
the receiver woke would grow by the tensor per collective.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.processes

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "slow_receiver.py"
MIB = 16  # the tensor
RING_MIB = 16  # the default ring size ($P2PCOLL_SHM_BYTES)
STALL_BOUND_MIB = 3 * MIB  # a sender's growth from "go" on


def _run(tmp_path: Path, *args: str) -> dict[str, list[float] | bool | dict[str, str]]:
    out = tmp_path / "rows.json"
    done = subprocess.run(
        [sys.executable, str(BENCH), "--mib", str(MIB), "--count", "3", "--stall", "2",
         "--strategies", "auto", "--json", str(out), *args],
        capture_output=True, text=True, timeout=110,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    (row,) = json.loads(out.read_text())
    return row


def _whole_bound(config: str) -> int:
    """A sender's growth over the whole run: 6 tensors, and the rings it maps."""
    return 6 * MIB + (3 * RING_MIB if config == "shm" else 0)


@pytest.mark.parametrize("config", ["tcp", "ipc", "shm"])
def test_senders_to_a_blocked_receiver_stay_bounded(tmp_path: Path, config: str) -> None:
    """Rank 2 blocks its event loop (time.sleep) while the others run 3 allreduces in a row."""
    row = _run(tmp_path, "--configs", config, "--modes", "block")
    assert row["exact"] and not row["errors"], row
    whole, stall = row["growth_mib"], row["stall_growth_mib"]
    assert isinstance(whole, list) and isinstance(stall, list)
    assert max(whole[:2]) < _whole_bound(config), row
    assert max(stall[:2]) < STALL_BOUND_MIB, row
    if config == "shm":
        assert sum(row["bytes_sent_shm"]) > 0, row  # type: ignore[arg-type]


def test_senders_of_collectives_started_at_once_stay_bounded(tmp_path: Path) -> None:
    """Rank 2 sleeps (its loop reads and buffers) while the others start 3 allreduces at
    once, so each has all of them in flight."""
    row = _run(tmp_path, "--configs", "tcp", "--modes", "sleep", "--together")
    assert row["exact"] and not row["errors"], row
    whole, stall = row["growth_mib"], row["stall_growth_mib"]
    assert isinstance(whole, list) and isinstance(stall, list)
    assert max(whole[:2]) < _whole_bound("tcp"), row
    assert max(stall[:2]) < STALL_BOUND_MIB, row
