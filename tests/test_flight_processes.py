"""The flight recorder across real processes: a mismatched run and a stopped rank, then
``p2pcoll flight DIR``; a dump on SIGUSR1; the ring's size from the environment."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from p2pcoll.testing import free_port
from tests.peer_processes import PeerProcesses

pytestmark = pytest.mark.processes

WORKER = str(Path(__file__).with_name("flight_worker.py"))


def peers(n: int, mode: str, folder: Path, **env: str) -> PeerProcesses:
    return PeerProcesses(n, lambda r: [sys.executable, WORKER, mode],
                         lambda r: {"P2PCOLL_FLIGHT_DIR": str(folder), **env})


def wait_for_files(folder: Path, ranks: list[int], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not all((folder / f"rank-{r}.json").exists() for r in ranks):
        if time.monotonic() > deadline:
            pytest.fail(f"ranks {ranks} did not all write into {folder}: "
                        f"{sorted(p.name for p in folder.iterdir())}")
        time.sleep(0.05)


def flight(folder: Path) -> str:
    done = subprocess.run([sys.executable, "-m", "p2pcoll", "flight", str(folder)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_mismatched_run_shows_where_the_ranks_differ(tmp_path: Path) -> None:
    job = peers(3, "mismatch", tmp_path, P2PCOLL_TIMEOUT="30")
    try:
        failed = job.wait_for("failed", [0, 1, 2], timeout=90)
    finally:
        job.close()
    assert set(failed) == {"CollectiveMismatch"}
    wait_for_files(tmp_path, [0, 1, 2])
    out = flight(tmp_path)
    assert "first difference: collective #3" in out
    assert "rank 1: broadcast" in out
    assert "rank 0: allreduce 4096 bytes float32 shape [1024] (failed)" in out
    assert "rank 2: allreduce 4096 bytes float32 shape [1024] (failed)" in out
    assert "missing" not in out


def test_a_stopped_rank_is_the_one_everyone_waits_for(tmp_path: Path) -> None:
    job = peers(3, "stop", tmp_path, P2PCOLL_HEARTBEAT_TIMEOUT="1", P2PCOLL_TIMEOUT="60")
    try:
        failed = job.wait_for("failed", [0, 2], timeout=90)
    finally:
        if job.procs[1].poll() is None:
            job.procs[1].kill()  # it is stopped: SIGKILL ends it all the same
        job.close()
    assert failed == ["PeerLost", "PeerLost"]
    wait_for_files(tmp_path, [0, 2])
    out = flight(tmp_path)
    assert "everyone waits for rank 1" in out
    assert "missing: rank 1" in out
    assert "rank 0 in allreduce #3 (failed) waits for rank 1" in out


def test_sigusr1_writes_each_rank_s_record_of_the_ring_s_size(tmp_path: Path) -> None:
    job = peers(2, "usr1", tmp_path, P2PCOLL_FLIGHT_RECORD="2")
    try:
        ready = job.wait_for("ready", [0, 1], timeout=90)
        assert ready == [2, 2]
        for proc in job.procs:
            os.kill(proc.pid, signal.SIGUSR1)
        wait_for_files(tmp_path, [0, 1])
    finally:
        job.close()
    assert [p.returncode for p in job.procs] == [0, 0]
    for r in range(2):
        document = json.loads((tmp_path / f"rank-{r}.json").read_text())
        assert document["reason"] == "SIGUSR1" and document["rank"] == r
        assert [(e["seq"], e["collective"], e["state"]) for e in document["record"]] == [
            (1, "allreduce", "done"), (2, "allreduce", "done")]
    out = flight(tmp_path)
    assert "the ranks agree" in out and "nobody waits" in out


def test_under_torch_the_record_holds_every_op_of_the_backend() -> None:
    pytest.importorskip("torch")
    worker = str(Path(__file__).with_name("flight_torch_worker.py"))
    port = free_port()
    job = PeerProcesses(2, lambda r: [sys.executable, worker],
                        lambda r: {"MASTER_ADDR": "127.0.0.1", "PYTHONWARNINGS": "ignore",
                                   "MASTER_PORT": str(port)})
    try:
        records = job.wait_for("record", [0, 1], timeout=120)
    finally:
        job.close()
    # all_to_all_single is one p2pcoll alltoall: on one host, one board round that agrees
    # on the lengths as it exchanges.
    # Each entry holds the tensors' shapes, as the analysis compares them.
    head = [["allreduce", "done", [[2, 4]]], ["broadcast", "done", [[2, 4]]]]
    assert records[0][:3] == [*head, ["send", "done", [[2, 4]]]]
    assert records[1][:3] == [*head, ["recv", "done", [[2, 4]]]]
    for record in records:
        assert record[-1] == ["barrier", "done", []]
        middle = {c for c, _, _ in record[3:-1]}
        assert middle == {"alltoall"} and all(s == "done" for _, s, _ in record)
        assert [[2], [2]] in [shapes for c, _, shapes in record if c == "alltoall"]
