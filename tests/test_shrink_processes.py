"""Group.shrink with real processes: a second rank dies during the shrink
(tests/shrink_death_worker.py). Every survivor gets PeerLost naming it within the
heartbeat (its links find a killed process in a fraction of it), never a hang."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.peer_processes import PeerProcesses

pytestmark = pytest.mark.processes

WORKER = str(Path(__file__).with_name("shrink_death_worker.py"))
# seconds: P2PCOLL_HEARTBEAT_TIMEOUT, also how long the new group waits for hellos: long,
# so that an error within it can only come from the links that found the death.
HEARTBEAT = 6.0
DEADLINE = 60.0  # seconds: the collective timeout, the shrink's own deadline


@pytest.mark.parametrize("when", ["offer", "forming"])
def test_a_second_rank_dying_during_the_shrink_is_named_on_every_survivor(when: str) -> None:
    job = PeerProcesses(4, lambda r: [sys.executable, WORKER, when],
                        lambda r: {"P2PCOLL_HEARTBEAT_TIMEOUT": str(HEARTBEAT),
                                   "P2PCOLL_TIMEOUT": str(DEADLINE)})
    try:
        # A hang guard, well inside the shrink's deadline: the heartbeat finds the loss.
        outcomes = job.wait_for("shrink", [0, 1], timeout=DEADLINE / 2)
    finally:
        job.close()
    assert [p.returncode for p in job.procs[2:]] == [-9, -9]
    for outcome in outcomes:
        assert outcome["error"] == "PeerLost", outcomes
        assert outcome["rank"] == 2 and "rank 2" in outcome["message"], outcomes
        assert outcome["seconds"] < HEARTBEAT, outcomes
