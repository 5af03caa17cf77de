"""Asynchronous DiLoCo under train_elastic with real processes: one peer SIGKILLs itself
mid-round while the previous round's reduction is in flight, a new one joins mid-round; the
log of applied rounds per replica shows each outer step applied exactly once, and the
replicas end bit-identical."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from p2pcoll import training
from p2pcoll.testing import free_port
from peer_processes import READY, start_together

pytestmark = pytest.mark.processes

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID",
                 "SLURM_NTASKS", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")

WORKER = '''
import asyncio, hashlib, json, os, signal, sys
import numpy as np
from p2pcoll import training
from p2pcoll.rendezvous.client import waiting

H, ROUNDS, DIE_AT = 3, int(sys.argv[1]), int(sys.argv[2])
POLL = 0.2  # poll_every: rank 0 asks the rendezvous at most this often who waits


async def main() -> None:
    params = {"w": np.zeros((2, 3)), "b": np.zeros(3)}
    log = []
    arrived = False  # the newcomer waits at the rendezvous

    async def inner(group, r, i):
        nonlocal arrived
        if group.world_size == 2:
            # Fast rounds could finish the job before the newcomer's interpreter reaches
            # the rendezvous (it would then wait there alone): two peers wait for it, then
            # take a round per poll, so each round boundary brings rank 0 a census asked
            # after it arrived.
            while not arrived:
                arrived = await waiting(os.environ["P2PCOLL_RENDEZVOUS"], timeout=30) > 0
                await asyncio.sleep(0.01)
            await asyncio.sleep(POLL / H)
        else:
            await asyncio.sleep(0.01)
        for p in params.values():
            p -= 1.0

    rounds = training.DiLoCoRounds(params, inner, inner_steps=H, outer_lr=0.5,
                                   outer_momentum=0.5, delay=1)

    async def step(group, r, state):
        print(f"round {r}: {group.world_size} peers", flush=True)
        if r == DIE_AT:  # round r - 1's reduction is in flight meanwhile
            os.kill(os.getpid(), signal.SIGKILL)
        return await rounds.step(group, r, state)

    def apply(state, deltas, r):
        rounds.apply(state, deltas, r)
        h = hashlib.blake2b(digest_size=16)
        for name, leaf in training.named_leaves(state):
            h.update(name.encode())
            h.update(np.ascontiguousarray(leaf).tobytes())
        log.append([r, h.hexdigest()])

    result = await training.train_elastic(step, apply, rounds.state, rounds=ROUNDS,
                                          timeout=30.0, poll_every=POLL, delay=1,
                                          settings=rounds.settings)
    print("RESULT " + json.dumps({"log": log, "applied": result.applied,
                                  "joined_at": result.joined_at,
                                  "sizes": [f.world_size for f in result.formations]}),
          flush=True)


%s  # imported: the test lets the peers join together
asyncio.run(main())
''' % READY


def digest(tree: Any) -> str:
    h = hashlib.blake2b(digest_size=16)
    for name, leaf in training.named_leaves(tree):
        h.update(name.encode())
        h.update(np.ascontiguousarray(np.asarray(leaf)).tobytes())
    return h.hexdigest()


def replayed(rounds: int) -> list[str]:
    """The state's digest after each outer step: every pseudo-gradient is H = 3."""
    want = {"b": np.zeros(3), "w": np.zeros((2, 3))}
    velocity = {k: np.zeros_like(v) for k, v in want.items()}
    outer = training.OuterSGD(lr=0.5, momentum=0.5)
    out = []
    for _ in range(rounds):
        outer.apply(list(want.values()), list(velocity.values()),
                    [np.full(3, 3.0), np.full((2, 3), 3.0)])
        out.append(digest({"params": want, "velocity": velocity,
                           "applied": np.array([len(out) + 1], np.int64)}))
    return out


def test_a_killed_peer_and_a_newcomer_under_delay_1_apply_each_outer_step_once(
        tmp_path: Path) -> None:
    rounds, die_at = 24, 3
    script = tmp_path / "async_diloco_worker.py"
    script.write_text(WORKER)
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env.update(P2PCOLL_RENDEZVOUS=f"tcp://127.0.0.1:{free_port()}", PYTHONUNBUFFERED="1",
               P2PCOLL_MIN_WORLD_SIZE="2", P2PCOLL_MAX_WORLD_SIZE="3",
               P2PCOLL_JOIN_TIMEOUT="30")

    def start(die: int) -> subprocess.Popen[str]:
        return subprocess.Popen([sys.executable, str(script), str(rounds), str(die)],
                                env=env, text=True, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    procs = [start(die_at if i == 2 else -1) for i in range(3)]
    try:
        start_together(procs)
        # The newcomer comes once a survivor trains in a group of two.
        assert procs[0].stdout is not None
        lines = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = procs[0].stdout.readline()
            lines.append(line)
            if ": 2 peers" in line or not line:
                break
        assert any(": 2 peers" in line for line in lines), lines
        procs.append(start(-1))
        start_together(procs[3:])
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert procs[2].returncode == -signal.SIGKILL, outs[2]
    reports = []
    for i in (0, 1, 3):
        out, err = outs[i]
        assert procs[i].returncode == 0, err[-3000:]
        reports.append(json.loads(out.splitlines()[-1].removeprefix("RESULT ")))

    want = replayed(rounds)
    for report in reports:  # each applied round's state is the replay's, on every replica
        for r, got in report["log"]:
            assert got == want[r], (r, report)
    first, second, late = reports
    assert first["applied"] == second["applied"] == list(range(rounds))
    assert first["sizes"] == [3, 2, 3] and late["sizes"] == [3]
    assert late["joined_at"] > die_at
    assert late["applied"] == list(range(late["joined_at"], rounds))
