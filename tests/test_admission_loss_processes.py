"""A member killed while its group admits a newcomer (real processes, train_elastic with
``delay=1``): the others and the newcomer form the next group at once, without it.

Four peers form a group; one SIGKILLs itself in round 2 and the three others shrink. Once a
newcomer waits at the rendezvous, rank 0 decides to admit it, and a second member SIGKILLs
itself the moment it learns the decision (before it reaches the rendezvous). The survivors
joined expecting 3 + 1 peers; the old group tells them of the loss, they tell the
rendezvous to expect one fewer, and the group of three forms. The rendezvous here waits 60
seconds of quiet before it forms a group that is short of what was expected (SETTLE, a
second in the library), longer than the join timeout: without the lowered expectation the
join times out and the survivors fail; with it, every outer step is applied once and the
replicas are bit-identical.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from p2pcoll.testing import free_port
from peer_processes import READY, start_together
from test_async_diloco_processes import LAUNCHER_VARS, replayed

pytestmark = pytest.mark.processes

SERVER = '''
import runpy, sys
import p2pcoll.rendezvous.jobs as jobs
jobs.SETTLE = 60.0  # a group short of what was expected forms only after a minute of quiet
sys.argv = ["p2pcoll", "rendezvous", "--host", "127.0.0.1", "--port", sys.argv[1]]
runpy.run_module("p2pcoll", run_name="__main__")
'''

WORKER = '''
import asyncio, hashlib, json, logging, os, signal, sys, time
import numpy as np
from p2pcoll import training
from p2pcoll.rendezvous.client import waiting

H, ROUNDS, ROLE = 3, int(sys.argv[1]), sys.argv[2]
POLL = 0.2


class DieOnAdmission(logging.Handler):
    """The victim: killed the moment it learns that its group admits a newcomer."""

    def emit(self, record):
        if "peers wait to join" in record.getMessage():
            # what this peer sent of the round is on its way (ZeroMQ's I/O thread): the
            # others complete the round, as it did, and only the admission is cut
            time.sleep(0.3)
            os.kill(os.getpid(), signal.SIGKILL)


logging.basicConfig(level=logging.INFO, format="%(message)s")
if ROLE == "victim":
    logging.getLogger("p2pcoll.training").addHandler(DieOnAdmission())


async def main() -> None:
    params = {"w": np.zeros((2, 3)), "b": np.zeros(3)}
    log = []
    arrived = False

    async def inner(group, r, i):
        nonlocal arrived
        if ROLE != "newcomer" and group.world_size == 3 and not arrived:
            # the three wait for the newcomer: rank 0's census then finds it
            while not arrived:
                arrived = await waiting(os.environ["P2PCOLL_RENDEZVOUS"], timeout=30) > 0
                await asyncio.sleep(0.01)
        await asyncio.sleep(0.01)
        for p in params.values():
            p -= 1.0

    rounds = training.DiLoCoRounds(params, inner, inner_steps=H, outer_lr=0.5,
                                   outer_momentum=0.5, delay=1)

    async def step(group, r, state):
        print(f"round {r}: {group.world_size} peers", flush=True)
        if ROLE == "first" and r == 2:
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
                                          timeout=20.0, poll_every=POLL, delay=1,
                                          settings=rounds.settings)
    print("RESULT " + json.dumps({"log": log, "applied": result.applied,
                                  "joined_at": result.joined_at,
                                  "sizes": [f.world_size for f in result.formations]}),
          flush=True)


READY
asyncio.run(main())
'''.replace("READY", READY)


def test_a_member_killed_during_an_admission_is_left_out_at_once(tmp_path: Path) -> None:
    rounds = 16
    script = tmp_path / "admission_worker.py"
    script.write_text(WORKER)
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCHER_VARS and not k.startswith("P2PCOLL_")}
    port = free_port()
    env.update(P2PCOLL_RENDEZVOUS=f"tcp://127.0.0.1:{port}", PYTHONUNBUFFERED="1",
               P2PCOLL_MIN_WORLD_SIZE="2", P2PCOLL_MAX_WORLD_SIZE="4",
               P2PCOLL_JOIN_TIMEOUT="20")
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(port)], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def start(role: str) -> subprocess.Popen[str]:
        return subprocess.Popen([sys.executable, str(script), str(rounds), role],
                                env=env, text=True, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    procs: list[subprocess.Popen[str]] = []
    try:
        assert server.stdout is not None
        assert "serving" in server.stdout.readline()
        procs = [start(role) for role in ("member", "member", "victim", "first")]
        start_together(procs)
        assert procs[0].stdout is not None
        lines = []
        while not any(": 3 peers" in line for line in lines):
            line = procs[0].stdout.readline()
            assert line, lines
            lines.append(line)
        procs.append(start("newcomer"))
        start_together(procs[4:])
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in [*procs, server]:
            if p.poll() is None:
                p.kill()
            p.communicate()
    assert procs[3].returncode == -signal.SIGKILL, outs[3][1][-3000:]
    assert procs[2].returncode == -signal.SIGKILL, outs[2][1][-3000:]
    reports = []
    for i in (0, 1, 4):
        out, err = outs[i]
        assert procs[i].returncode == 0, err[-3000:]
        reports.append(json.loads(out.splitlines()[-1].removeprefix("RESULT ")))
    # the survivors learnt of the loss from the old group and said so to the rendezvous
    assert any("was lost on the way; the next group expects 3" in outs[i][1] for i in (0, 1))
    want = replayed(rounds)
    for report in reports:  # each applied round's state is the replay's, on every replica
        for r, got in report["log"]:
            assert got == want[r], (r, report)
    first, second, late = reports
    assert first["applied"] == second["applied"] == list(range(rounds))
    assert first["sizes"] == [4, 3, 3] and late["sizes"] == [3]
    assert late["applied"] == list(range(late["joined_at"], rounds))
