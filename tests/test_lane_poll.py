"""A receive polls its peer's TCP lane before it parks (p2pcoll.transport.lane_poll,
p2pcoll.engine.polling): with real peers in two processes, a partner stopped (SIGSTOP)
mid-run and continued costs a parked wait, never a hang, and every result stays exact."""

from __future__ import annotations

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

import p2pcoll
from p2pcoll.engine.polling import MessageWait
from p2pcoll.testing import free_port, run_ranks
from p2pcoll.transport.lane_poll import LanePoll


class _Peer:
    """A peer whose message comes after ``after`` polls (never, if None)."""

    def __init__(self, after: int | None, polled: bool = True) -> None:
        self.after, self.looks, self._polled = after, 0, polled

    def polled(self, peer: int) -> bool:
        return self._polled

    def poll_from(self, peer: int) -> None:
        self.looks += 1

    def came(self) -> bool:
        return self.after is not None and self.looks >= self.after


def test_a_message_that_comes_while_polling_is_found_and_one_that_does_not_parks() -> None:
    peer = _Peer(after=3)
    waits = MessageWait(peer, ceiling=1.0, world_size=2, cores=2)
    assert waits.poll(1, peer.came) == 0 and waits.found == 1
    stopped = _Peer(after=None)
    waits = MessageWait(stopped, ceiling=1e-4, world_size=2, cores=2)
    began = waits.poll(1, stopped.came)
    assert began > 0 and waits.parked == 1 and stopped.looks > 0  # polled, then parked
    waits.parked_until(1, began - 10**9)  # it came a second later: late
    assert waits.patience.usual(1) < 1


def test_no_poll_where_the_transport_cannot_or_the_ceiling_is_zero() -> None:
    peer = _Peer(after=1, polled=False)
    assert MessageWait(peer, ceiling=1.0, world_size=2).poll(1, peer.came) == -1
    assert peer.looks == 0
    never = _Peer(after=None)
    waits = MessageWait(never, ceiling=0.0, world_size=2, cores=2)
    assert waits.poll(1, never.came) > 0 and never.looks >= 1  # the one look, then parks


def test_crowded_waits_yield_and_count_only_their_own_time() -> None:
    never = _Peer(after=None)
    waits = MessageWait(never, ceiling=1e-4, world_size=4, cores=2)
    assert waits.crowded and waits.poll(1, never.came) > 0 and never.looks >= 1


async def test_peers_of_one_process_read_their_lanes_but_never_poll_for_each_other(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks of one process over TCP lanes: the poll before parking reads the lanes, but
    no receive polls for a peer that shares its event loop (it could not send meanwhile)."""
    monkeypatch.setenv("P2PCOLL_TCP_LANES", "1")

    async def fn(g: p2pcoll.Group) -> tuple[int, int, int, bool]:
        x = np.full(1024, g.rank + 1, np.float32)
        for _ in range(20):
            assert np.array_equal(await g.allreduce(x), np.full(1024, 3, np.float32))
        poll, waits = g.session.matcher.poll, g.session.matcher.waits
        assert isinstance(poll, LanePoll) and waits is not None
        return poll.lane_polls, waits.found, waits.parked, poll.polled(1 - g.rank)

    results = await run_ranks(2, fn, host_ids=["host-a", "host-b"])
    assert all(lane_polls > 0 for lane_polls, *_ in results), results
    assert all((found, parked, polled) == (0, 0, False)
               for _, found, parked, polled in results), results


def _report(proc: subprocess.Popen[str], key: str) -> dict[str, Any]:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, f"rank exited before {key!r}"
    report: dict[str, Any] = json.loads(line)[key]
    return report


@pytest.mark.processes
def test_a_stopped_partner_costs_a_parked_wait_and_results_stay_exact() -> None:
    """Rank 1 is stopped (SIGSTOP) while both run 4 KiB allreduces over TCP lanes with a
    generous polling ceiling, then continued: rank 0's receive polled, parked, and both
    finish with every result exact; the poll path read the lanes and found messages."""
    url = f"tcp://127.0.0.1:{free_port()}"
    env = {**os.environ, "P2PCOLL_SHM": "0", "P2PCOLL_TCP_LANES": "1", "P2PCOLL_SPIN": "2000"}
    worker = Path(__file__).with_name("lane_poll_worker.py")
    procs = [subprocess.Popen([sys.executable, str(worker), url, str(r)], env=env,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for r in (0, 1)]
    try:
        for p in procs:
            _report(p, "ready")
        procs[1].send_signal(signal.SIGSTOP)
        time.sleep(0.3)  # rank 0 polls its budget for rank 1, then parks
        procs[1].send_signal(signal.SIGCONT)
        time.sleep(0.1)
        assert procs[0].stdin is not None
        procs[0].stdin.write("stop\n")
        procs[0].stdin.flush()
        after = [_report(p, "after") for p in procs]
        for p in procs:
            p.wait(timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
            p.wait()
            for stream in (p.stdin, p.stdout):
                if stream:
                    stream.close()
    assert [a["wrong"] for a in after] == [0, 0], after
    assert after[0]["calls"] == after[1]["calls"] > 200, after
    for a in after:
        assert a["lane_polls"] > 0 and a["found"] > 0, after  # the poll path read lanes
    assert after[0]["parked"] > 0, after  # the stopped partner: polled, then parked


