"""A peer lost while a link to it is being opened: named, and nothing hangs.

Eight peer processes (tests/lazy_failure_worker.py), each on a host of its own so that
links stay sparse (a peer links to the two it watches and to its partners), run a ring
allreduce. Then rank 4 is frozen (SIGSTOP) and rank 0, which never had a link to it, sends
to it and waits for its answer: the new link's handshake cannot complete. Rank 4 is then

- killed (SIGKILL) a second later, while that link is still being opened: its watchers'
  probes (ranks 2 and 3) close and the overlay spreads the news; or
- left frozen: only heartbeats can tell, after the heartbeat timeout (here 2 s).

Either way rank 0's receive raises a PeerLost naming rank 4, and every other survivor
holds one too, long before any deadline (60 s).

And a peer that dies as soon as the group has formed, before any data went to it (only
its hello links and its watchers' probes touched it): the survivors' first ring allreduce
raises a PeerLost naming it.
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest
from peer_processes import PeerProcesses

pytestmark = pytest.mark.processes


WORKER = Path(__file__).with_name("lazy_failure_worker.py")
N, VICTIM, OPENER = 8, 4, 0


class Job(PeerProcesses):
    def __init__(self, tmp: Path, *flags: str) -> None:
        self.tmp = tmp
        super().__init__(
            N, lambda r: [sys.executable, str(WORKER), str(tmp), str(VICTIM), str(OPENER),
                          *flags],
            env=lambda r: {"P2PCOLL_HOST_ID": f"host-{r}", "P2PCOLL_HEARTBEAT_TIMEOUT": "2",
                          "P2PCOLL_PROBE": "0"})  # links on demand only: no topology probe

    def close(self) -> None:
        (self.tmp / "go").touch()
        (self.tmp / "done").touch()
        self.procs[VICTIM].kill()  # a stopped one too
        super().close()


@pytest.mark.parametrize("then", ["killed", "frozen"])
def test_a_peer_lost_while_a_link_to_it_is_opening_is_named(tmp_path: Path, then: str) -> None:
    job = Job(tmp_path)
    try:
        ready = job.wait_for("ready", list(range(N)), timeout=240)
        assert all(r["right"] for r in ready), ready
        # Sparse: the opener had no link to the victim, nor the victim to the opener.
        assert VICTIM not in ready[OPENER]["linked"], ready[OPENER]
        assert OPENER not in ready[VICTIM]["linked"], ready[VICTIM]
        job.procs[VICTIM].send_signal(signal.SIGSTOP)
        (tmp_path / "go").touch()
        opening = job.wait_for("opening", [OPENER], timeout=60)[0]
        assert opening["linked"], opening  # the send opened the link
        if then == "killed":
            time.sleep(1.0)  # the link's handshake is still pending: the victim is stopped
            job.procs[VICTIM].send_signal(signal.SIGKILL)
        survivors = [r for r in range(N) if r != VICTIM]
        after = job.wait_for("after", survivors, timeout=90)
        for report in after:
            assert report["error"].startswith("PeerLost"), report
            assert f"rank {VICTIM}" in report["error"], report
        print(*(f"rank {r['rank']}: {r['error']}" for r in after), sep="\n")
    finally:
        job.close()


def test_a_peer_that_dies_before_any_data_went_to_it_is_named(tmp_path: Path) -> None:
    job = Job(tmp_path, "--early")
    try:
        job.wait_for("ready", list(range(N)), timeout=240)
        job.procs[VICTIM].send_signal(signal.SIGKILL)
        job.procs[VICTIM].wait(timeout=30)
        (tmp_path / "go").touch()
        after = job.wait_for("after", [r for r in range(N) if r != VICTIM], timeout=90)
        for report in after:
            assert report["error"].startswith("PeerLost"), report
            assert f"rank {VICTIM}" in report["error"], report
    finally:
        job.close()
