"""The heal from every survivor over real sockets: a source SIGKILLed mid-transfer. The
others and the receiver get the group's error, the receiver's state is untouched and its
progress kept; in the group the survivors form next it fetches only the rest, and ends
bit-identical with them."""

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

pytestmark = pytest.mark.processes

ROOT = Path(__file__).resolve().parents[1]

PEER = r'''
import asyncio, hashlib, json, os, sys, time
import numpy as np
import p2pcoll
from p2pcoll import training
from p2pcoll.training.heal import HealProgress, StripedHeal

first, second, rank, marker = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
VICTIM, RECEIVER = 1, 3


def state(seed):
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal(300_000).astype(np.float32), "b": rng.standard_normal(999)}


def digest(tree):
    return hashlib.sha256(b"".join(np.ascontiguousarray(a).tobytes()
                                   for _, a in training.named_leaves(tree))).hexdigest()


class Stalling(StripedHeal):
    """The victim sends one range, says so, and waits for its SIGKILL."""

    async def send_range(self, group, dst, index, pieces):
        if group.rank == VICTIM and os.path.exists(marker):
            while True:
                time.sleep(1)  # holds the loop: killed here, mid-transfer
        await super().send_range(group, dst, index, pieces)
        if group.rank == VICTIM:
            open(marker, "w").close()


async def main():
    tree = state(5 if rank == RECEIVER else 0)
    progress = HealProgress()
    out = {"rank": rank, "before": digest(tree)}
    async with p2pcoll.join(first, world_size=4, rank=rank, timeout=30,
                            collective_timeout=30) as g:
        try:
            await Stalling(chunk_bytes=64 << 10).run(g, tree, [0, 1, 2], progress)
            out["first"] = "finished"
        except p2pcoll.P2PCollError as exc:
            out["first"] = f"{type(exc).__name__}: {exc}"
            out["lost"] = getattr(exc, "rank", None)
    out["after_first"] = digest(tree)
    out["verified"] = len(progress.held)
    new_rank = {0: 0, 2: 1, 3: 2}[rank]
    async with p2pcoll.join(second, world_size=3, rank=new_rank, timeout=30,
                            collective_timeout=30) as g:
        report = await training.heal(g, tree, [0, 1], progress=progress, chunk_bytes=64 << 10)
        await training.check_replicas(g, tree)
    out.update(final=digest(tree), ranges=report.ranges, received=report.received,
               resumed=report.resumed)
    print(json.dumps(out), flush=True)


asyncio.run(main())
'''


def test_a_source_killed_mid_transfer_is_replaced_by_the_others(tmp_path: Path) -> None:
    script = tmp_path / "peer.py"
    script.write_text(PEER)
    marker = tmp_path / "victim-sent-one"
    first = f"tcp://127.0.0.1:{free_port()}"
    second = f"tcp://127.0.0.1:{free_port()}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("P2PCOLL_")}
    env["PYTHONPATH"] = str(ROOT)
    procs = [subprocess.Popen([sys.executable, str(script), first, second, str(r), str(marker)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for r in range(4)]
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():  # the victim has sent a range, and stalls on the next
            assert time.monotonic() < deadline, "the victim never sent a range"
            assert procs[1].poll() is None, procs[1].communicate()
            time.sleep(0.05)
        procs[1].send_signal(signal.SIGKILL)
        results = {}
        for r in (0, 2, 3):
            out, err = procs[r].communicate(timeout=90)
            assert procs[r].returncode == 0, err[-3000:]
            results[r] = json.loads(out.strip().splitlines()[-1])
        procs[1].communicate(timeout=10)
        assert procs[1].returncode == -signal.SIGKILL
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()  # reaps it and closes its pipes
    receiver = results[3]
    for r in (0, 2, 3):
        assert results[r]["first"].startswith(("PeerLost", "GroupBroken")), results[r]
    assert receiver["lost"] == 1, receiver
    assert receiver["after_first"] == receiver["before"]  # nothing applied from the cut heal
    assert 0 < receiver["verified"] < receiver["ranges"]
    assert receiver["resumed"] == receiver["verified"]
    assert receiver["received"] == receiver["ranges"] - receiver["verified"]
    assert receiver["final"] == results[0]["final"] == results[2]["final"]
    assert results[0]["final"] == results[0]["before"]  # the sources' state, unchanged
