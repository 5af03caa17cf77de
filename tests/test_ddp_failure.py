"""DDP and FSDP2 on the "p2pcoll" backend when a rank dies (issue 20, item 1).

Every world is 3 ranks of ``tests/ddp_failure_worker.py``, started as users start them
without torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; torchrun's agent would
stop the survivors itself), in one of examples/train_ddp.py's modes. Once every rank has
trained a few steps, rank 2 is SIGKILLed (or SIGSTOPped); the survivors must catch the
error, name the lost rank within the heartbeat bound, save a checkpoint and exit 0. In
0.5.0 the DDP survivors died with SIGSEGV in DDP's reducer (the failed future's value was
the exception, from which the reducer took "the first tensor"), and FSDP2 raised
p2pcoll's PeerLost, which is no torch error.

What torch raises is torch's: FSDP2 waits on the Work, which raises a
``torch.distributed.DistBackendError`` that is a ``PeerLost`` too; DDP reads the bucket's
future in C++, which turns any error of a Python backend or a Python hook into a
RuntimeError (the class DistBackendError derives from; Gloo raises a plain RuntimeError
in all four modes) whose message carries "PeerLost: ... rank 2 ...".

A "hosts" world is the default path between hosts: every rank has a host id of its own
(``P2PCOLL_HOST_ID``) and no job key, so that the small buckets of the model go on TCP
lanes (each survivor says how many messages it sent on them).

The worlds run two at a time (a module fixture starts them), so the tests together take
about as long as three worlds.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import stop

from p2pcoll.testing import free_port

pytestmark = pytest.mark.processes

torch = pytest.importorskip("torch")

WORKER = Path(__file__).with_name("ddp_failure_worker.py")
MODES = ["plain", "fp16", "powersgd", "fsdp"]
SIZE = 3
VICTIM = 2
# P2PCOLL_HEARTBEAT_TIMEOUT of the ranks, by signal: a stopped peer is lost after it; a
# killed one at once, whatever it is, so those worlds get a long one that a live rank
# starved of CPU by the other worlds cannot exceed.
HEARTBEAT = {signal.SIGSTOP: 3.0, signal.SIGKILL: 15.0}
WORLDS_AT_ONCE = 2  # 6 torch processes on 2 cores; more starve live ranks
SLACK = 10.0  # what a busy 2-core machine may add to the heartbeat bound
STEPS_BEFORE = 3  # steps every rank trains before the victim is signalled
START_TIMEOUT = 150.0  # seconds for a world to start and train those steps (imports torch)
EXIT_TIMEOUT = 60.0  # seconds for the survivors to checkpoint and exit after the signal


@dataclass
class World:
    """What one world did: exit codes and output per rank, and when the victim was hit."""

    codes: list[int]
    outputs: list[str]
    signalled_at: float
    checkpoints: Path


def run_world(mode: str, sig: signal.Signals, hosts: bool, checkpoints: Path) -> World:
    """Start a world of ``mode``, signal rank VICTIM mid-training, wait for the others;
    ``hosts``: each rank on a host of its own."""
    env = {**{k: v for k, v in os.environ.items() if k != "P2PCOLL_KEY_FILE"}, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": str(SIZE), "P2PCOLL_HEARTBEAT_TIMEOUT": str(HEARTBEAT[sig]),
           "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(WORKER), mode, str(checkpoints)],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r),
                                   **({"P2PCOLL_HOST_ID": f"host-{r}"} if hosts else {})},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(SIZE)]
    lines: list[list[str]] = [[] for _ in range(SIZE)]
    trained = [threading.Event() for _ in range(SIZE)]

    def read(rank: int) -> None:
        stdout = procs[rank].stdout
        assert stdout is not None
        for line in stdout:
            lines[rank].append(line)
            if line.startswith(f"STEP {STEPS_BEFORE}\n"):
                trained[rank].set()

    readers = [threading.Thread(target=read, args=(r,), daemon=True) for r in range(SIZE)]
    for t in readers:
        t.start()
    try:
        deadline = time.monotonic() + START_TIMEOUT
        for event in trained:
            event.wait(max(0.0, deadline - time.monotonic()))
        signalled_at = time.time()
        if all(e.is_set() for e in trained):
            procs[VICTIM].send_signal(sig)
        for p in procs[:VICTIM] + procs[VICTIM + 1:]:
            try:
                p.wait(EXIT_TIMEOUT)
            except subprocess.TimeoutExpired:
                p.kill()  # reported by the test as the exit code -9
                p.wait()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()  # the stopped victim (a SIGKILL ends a stopped process too)
            p.wait()
        for t in readers:
            t.join(10)
        for p in procs:
            stop(p)
    return World([p.returncode for p in procs], ["".join(x) for x in lines], signalled_at,
                 checkpoints)


CASES = [(mode, signal.SIGKILL, False) for mode in MODES] + [
    ("plain", signal.SIGSTOP, False), ("plain", signal.SIGKILL, True)]


Worlds = dict[tuple[str, signal.Signals, bool], Future[World]]


@pytest.fixture(scope="module")
def worlds(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worlds]:
    with ThreadPoolExecutor(WORLDS_AT_ONCE) as pool:
        yield {(mode, sig, hosts): pool.submit(
            run_world, mode, sig, hosts,
            tmp_path_factory.mktemp(f"{mode}-{sig.name}{'-hosts' * hosts}"))
            for mode, sig, hosts in CASES}


def check_survivors(world: World, mode: str, sig: signal.Signals) -> None:
    """The survivors caught the error naming rank VICTIM in time, checkpointed and exited 0."""
    assert world.codes[VICTIM] == -signal.SIGKILL, world.outputs[VICTIM][-3000:]
    for rank in range(SIZE):
        if rank == VICTIM:
            continue
        out = world.outputs[rank]
        assert world.codes[rank] == 0, f"rank {rank} exited {world.codes[rank]}:\n{out[-3000:]}"
        m = re.search(r"^CAUGHT (\S+) (\w+)\[(\S*)\] \| (.*)$", out, re.M)
        assert m, f"rank {rank} caught nothing:\n{out[-3000:]}"
        caught_at, kind, classes, message = float(m.group(1)), m.group(2), \
            m.group(3).split(","), m.group(4)
        if mode == "fsdp":  # FSDP2 waits on the Work: torch's backend error, p2pcoll's too
            assert {"DistBackendError", "PeerLost"} <= set(classes), m.group(0)
            assert f"rank {VICTIM}" in message, m.group(0)
        else:  # DDP: torch's RuntimeError around it, from the reducer or the hook's then()
            assert kind == "RuntimeError", m.group(0)
            assert re.search(rf"PeerLost: .*rank {VICTIM}\b", message), m.group(0)
        delay = caught_at - world.signalled_at
        # A stopped rank is lost after the heartbeat, a killed one after a reconnect's grace.
        bound = (HEARTBEAT[sig] if sig == signal.SIGSTOP else 0.3) + SLACK
        assert delay < bound, f"rank {rank} caught it {delay:.1f}s after {sig.name}"
        assert "SAVED" in out
        saved = torch.load(world.checkpoints / f"rank{rank}.pt", weights_only=True)
        assert saved["step"] >= STEPS_BEFORE
        assert all(bool(torch.isfinite(p).all()) for p in saved["params"])


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", MODES)
def test_survivors_of_a_killed_rank_catch_the_error_and_checkpoint(
        worlds: Worlds, mode: str) -> None:
    world = worlds[(mode, signal.SIGKILL, False)].result(timeout=START_TIMEOUT + EXIT_TIMEOUT + 60)
    check_survivors(world, mode, signal.SIGKILL)


@pytest.mark.timeout(600)
def test_survivors_of_a_stopped_rank_catch_the_error_after_the_heartbeat(
        worlds: Worlds) -> None:
    # A stopped peer keeps its sockets open: only the heartbeat timeout tells it is gone.
    world = worlds[("plain", signal.SIGSTOP, False)].result(timeout=START_TIMEOUT + EXIT_TIMEOUT + 60)
    check_survivors(world, "plain", signal.SIGSTOP)


@pytest.mark.timeout(600)
def test_ranks_on_hosts_of_their_own_catch_the_error_over_tcp_lanes(worlds: Worlds) -> None:
    # The default path between hosts: DDP's small buckets on TCP lanes, read by the loop.
    world = worlds[("plain", signal.SIGKILL, True)].result(
        timeout=START_TIMEOUT + EXIT_TIMEOUT + 60)
    check_survivors(world, "plain", signal.SIGKILL)
    for rank in range(SIZE):
        if rank != VICTIM:
            m = re.search(r"^ON LANE (\d+)$", world.outputs[rank], re.M)
            assert m and int(m.group(1)) > STEPS_BEFORE, world.outputs[rank][-3000:]


def test_errors_reach_torch_as_its_backend_error_and_stay_p2pcolls() -> None:
    import torch.distributed as dist

    from p2pcoll.errors import CollectiveTimeout, PeerLost
    from p2pcoll.integrations.torch.work import backend_error

    lost = PeerLost("rank 0 lost the connection to rank 2", rank=2)
    error = backend_error(lost)
    assert isinstance(error, PeerLost) and isinstance(error, dist.DistBackendError)
    assert (str(error), error.rank, error.__cause__) == (str(lost), 2, lost)
    assert backend_error(error) is error
    assert type(backend_error(PeerLost("again", rank=1))) is type(error)
    late = backend_error(CollectiveTimeout("late", collective="allreduce", waiting_on=[2]))
    assert isinstance(late, CollectiveTimeout) and isinstance(late, dist.DistBackendError)
    assert (late.collective, late.waiting_on) == ("allreduce", [2])
    other = ValueError("not p2pcoll's")
    assert backend_error(other) is other


def test_a_backend_error_survives_pickling() -> None:
    """torchrun's error files, multiprocessing and Ray pickle exceptions: a converted error
    comes back as the same two classes, with its message and attributes."""
    import pickle

    import torch.distributed as dist

    from p2pcoll.errors import PeerLost
    from p2pcoll.integrations.torch.work import backend_error

    error = backend_error(PeerLost("rank 0 lost the connection to rank 2", rank=2))
    again = pickle.loads(pickle.dumps(error))
    assert isinstance(again, PeerLost) and isinstance(again, dist.DistBackendError)
    assert type(again) is type(error)
    assert (str(again), again.rank) == (str(error), 2)
