"""torch.distributed.shrink_group on "p2pcoll", with real processes.

DDP loses a rank (SIGKILL, or SIGSTOP: found after the heartbeat) and the survivors go on
training with examples/torch_shrink.py, with SHRINK_DEFAULT and SHRINK_ABORT; the shrunk
group gives the bits of a group formed fresh by the survivors; torch's errors for bad
ranks; an operation in flight on the old group ends with either flag
(tests/shrink_worker.py); a second rank dying during the shrink is named on every survivor;
``abort()`` returns without waiting for a frozen peer.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import stop

from p2pcoll.testing import free_port

pytestmark = pytest.mark.slow  # torch worlds: minutes on a 2-core machine

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "torch_shrink.py"
WORKER = Path(__file__).with_name("shrink_worker.py")
WORLD_TIMEOUT = 240.0  # seconds for a world of torch processes on a busy 2-core machine


def environment(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("P2PCOLL_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return {**env, **extra}


def run_world(size: int, *args: str, heartbeat: float = 5.0, wait: int | None = None
              ) -> list[str]:
    """Run ``size`` ranks of the worker; their output lines, once all have ended (or,
    with ``wait``, once rank ``wait`` has: the others are then killed)."""
    env = environment(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                      WORLD_SIZE=str(size), P2PCOLL_HEARTBEAT_TIMEOUT=str(heartbeat))
    procs = [subprocess.Popen([sys.executable, str(WORKER), *args],
                              env={**env, "RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(size)]
    try:
        waited = procs if wait is None else [procs[wait]]
        outs = [p.communicate(timeout=WORLD_TIMEOUT)[0] for p in waited]
    finally:
        for p in procs:
            stop(p)
    return [line for out in outs for line in out.splitlines()]


@pytest.mark.parametrize("sig", ["KILL", "STOP"])
@pytest.mark.parametrize("flag", ["default", "abort"])
def test_ddp_trains_on_after_losing_a_rank(sig: str, flag: str) -> None:
    steps, kill_at = 8, 3
    args = ["--world", "3", "--victim", "2", "--kill-at", str(kill_at), "--steps", str(steps),
            "--signal", sig] + (["--abort"] if flag == "abort" else [])
    done = subprocess.run([sys.executable, str(EXAMPLE), *args], capture_output=True,
                          text=True, timeout=WORLD_TIMEOUT,
                          env=environment(P2PCOLL_HEARTBEAT_TIMEOUT="3"))
    out = done.stdout
    assert done.returncode == 0, out + done.stderr[-3000:]
    # The survivors name the lost rank, shrink around it, and agree on the weights.
    assert len(re.findall(r"shrank without ranks \[2\] in \d+ ms: now rank [01] of 2",
                          out)) == 2, out
    digests = re.findall(r"rank (\d): DONE parameters (\w+)", out)
    assert sorted(r for r, _ in digests) == ["0", "1"], out
    assert len({d for _, d in digests}) == 1, out
    # The loss curve goes on: every step once, those from the loss on in the world of 2.
    curve = [(int(s), float(loss), int(w)) for s, loss, w in
             re.findall(r"step +(\d+) +loss ([\d.]+) +world (\d)", out)]
    assert [s for s, _, _ in curve] == list(range(steps)), out
    assert all(w == (3 if s < kill_at else 2) for s, _, w in curve), out
    assert curve[-1][1] < curve[0][1]


def test_a_shrunk_group_gives_the_bits_of_a_fresh_one_and_bad_ranks_are_refused() -> None:
    lines = run_world(4, "identical")
    assert lines.count("BAD ok") == 4, lines
    fresh = sorted(line.split()[1] for line in lines if line.startswith("FRESH"))
    shrunk = sorted(line.split()[1] for line in lines if line.startswith("SHRUNK"))
    assert len(fresh) == 3 and len(set(fresh)) == 3, lines  # one digest per survivor
    assert shrunk == fresh, lines


@pytest.mark.parametrize("flag", ["default", "abort"])
def test_an_operation_in_flight_on_the_old_group_ends(flag: str) -> None:
    lines = run_world(3, "inflight", flag)
    assert "EXCLUDED RuntimeError" in lines, lines
    assert any(line.startswith("LEFT ") for line in lines), lines
    ended = [line for line in lines if line.startswith("INFLIGHT")]
    assert len(ended) == 1, lines
    if flag == "abort":  # ended before the shrink
        assert "GroupBroken aborted: rank 0 shrinks the group without ranks [2]" in ended[0]
    else:  # ended when torch destroys the old group: here, or at rank 1 first
        assert ended[0].split()[1] in ("GroupBroken", "PeerLost"), lines
    assert lines.count("SUM 3 SIZE 2") == 2, lines


def test_abort_returns_at_once_with_an_operation_in_flight_and_a_frozen_peer() -> None:
    # The heartbeat is long: a close that waited for the frozen peer would take it.
    lines = run_world(2, "abort", heartbeat=120.0, wait=0)
    ended = [line.split() for line in lines if line.startswith("ABORT")]
    assert len(ended) == 1 and ended[0][2] == "GroupBroken", lines
    assert float(ended[0][1]) < 60.0, lines


@pytest.mark.parametrize("when", ["offer", "forming"])
def test_a_second_rank_dying_during_shrink_group_is_named_on_every_survivor(when: str
                                                                             ) -> None:
    # Long, and the new group's hello wait too: an error within it comes from the links
    # that found the death (in a fraction of a second), not from a wait running out.
    heartbeat = 6.0
    lines = run_world(4, "second", when, heartbeat=heartbeat)
    ended = [line.split(maxsplit=4) for line in lines if line.startswith("SECOND")]
    assert len(ended) == 2, lines  # ranks 0 and 1
    for _, error, rank, seconds, message in ended:
        assert (error, rank) == ("PeerLost", "2") and "rank 2" in message, lines
        assert float(seconds) < heartbeat, lines
