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

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from p2pcoll.testing import free_port

WORKER = Path(__file__).with_name("lazy_failure_worker.py")
N, VICTIM, OPENER = 8, 4, 0
FOREIGN = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")


class Job:
    def __init__(self, tmp: Path, *flags: str) -> None:
        self.tmp = tmp
        port = free_port()
        base = {k: v for k, v in os.environ.items()
                if k not in FOREIGN and not k.startswith("P2PCOLL_")}
        self.lines: list[list[dict[str, Any]]] = [[] for _ in range(N)]
        self.errors = ["" for _ in range(N)]
        self.procs = [subprocess.Popen(
            [sys.executable, str(WORKER), str(tmp), str(VICTIM), str(OPENER), *flags],
            env=dict(base, P2PCOLL_RENDEZVOUS=f"tcp://127.0.0.1:{port}", WORLD_SIZE=str(N),
                     RANK=str(r), P2PCOLL_HOST_ID=f"host-{r}", P2PCOLL_HEARTBEAT_TIMEOUT="2"),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(N)]
        self.readers = [threading.Thread(target=self._read, args=(r,), daemon=True)
                        for r in range(N)]
        for t in self.readers:
            t.start()

    def _read(self, r: int) -> None:
        proc = self.procs[r]
        assert proc.stdout is not None and proc.stderr is not None
        for line in proc.stdout:
            if line.startswith("{"):
                self.lines[r].append(json.loads(line))
        self.errors[r] = proc.stderr.read()[-2000:]

    def wait_for(self, key: str, ranks: list[int], timeout: float) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = [next((x[key] for x in self.lines[r] if key in x), None) for r in ranks]
            if all(g is not None for g in got):
                return got  # type: ignore[return-value]
            for r, g in zip(ranks, got, strict=True):
                if g is None and self.procs[r].poll() is not None:
                    self.readers[r].join(timeout=10)
                    pytest.fail(f"rank {r} exited before {key!r}: {self.errors[r]}")
            time.sleep(0.05)
        missing = [r for r in ranks if not any(key in x for x in self.lines[r])]
        pytest.fail(f"ranks {missing} did not report {key!r} within {timeout} s")

    def close(self) -> None:
        (self.tmp / "go").touch()
        (self.tmp / "done").touch()
        self.procs[VICTIM].kill()  # a stopped one too
        for proc in self.procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)
        for t in self.readers:
            t.join(timeout=30)
        for proc in self.procs:
            for stream in (proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()


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
