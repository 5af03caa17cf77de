"""Aborts spread over the sparse overlay, not over a link to every peer.

A rank whose collective fails tells the peers it has sent anything to (its ``told``) and its
fingers; every peer passes the first abort of an operation on to its own fingers, naming the
rank whose failure it is (see :mod:`p2pcoll.session.failure`). So a failure costs a peer
about log2 p links and messages, not p - 1, and every survivor's error reads as before.

- 16 peers over tcp, each on a host of its own (no lanes), a shape mismatch in a ring
  allreduce: every rank raises CollectiveMismatch naming both shapes, those told by an abort
  name a rank that found the mismatch (not the peer that passed it on), and no rank opened
  more than a few links because of the failure (it opened p - 1 minus its ring links when
  aborts went to every peer);
- 16 peer processes over tcp (64: scale; tests/abort_spread_worker.py), one SIGKILLed while
  the others wait for it in a ring allreduce: every survivor raises the victim's PeerLost,
  again over a few links each;
- in memory: a copy passed on names its origin and reaches the passer's fingers; a copy
  passed on to a peer that the origin told itself waits for the origin's own, which comes
  after the origin's data on their link (a broadcast that gets its data succeeds); a copy to
  a peer the origin never sent anything is taken at once; a peer's own abort coming back is
  ignored.
"""

from __future__ import annotations

import asyncio
import math
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import until_waiting
from peer_processes import PeerProcesses

import p2pcoll
from p2pcoll.testing import memory_groups, run_ranks
from p2pcoll.departures import overlay
from p2pcoll.wire import Header, encode_header

WORKER = Path(__file__).with_name("abort_spread_worker.py")


def few_links(p: int) -> int:
    """The links a failure may open at a peer: its fingers (log2 p), one finger moved past a
    lost rank, and a margin of WATCHED (the overlay's other constant)."""
    return math.ceil(math.log2(p)) + overlay.WATCHED + 1


class Together:
    """Tasks of this process wait for each other at each step."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.arrived: dict[str, int] = {}
        self.events: dict[str, asyncio.Event] = {}

    async def at(self, step: str) -> None:
        event = self.events.setdefault(step, asyncio.Event())
        self.arrived[step] = self.arrived.get(step, 0) + 1
        if self.arrived[step] == self.n:
            event.set()
        await event.wait()


async def test_a_mismatch_among_sixteen_reaches_everyone_over_few_links() -> None:
    n, odd = 16, 5
    together = Together(n)

    async def fn(g: p2pcoll.Group) -> tuple[BaseException | None, int, int]:
        await g.allreduce(np.ones(10, np.float32), strategy="ring")
        before = g.stats()["links_opened"]
        await together.at("warm")  # nobody fails before everyone's ring links are open
        err: BaseException | None = None
        try:
            size = 11 if g.rank == odd else 10
            await g.allreduce(np.ones(size, np.float32), strategy="ring", timeout=30)
        except p2pcoll.P2PCollError as exc:
            err = exc
        await together.at("failed")
        await asyncio.sleep(0.5)  # the copies still being passed on have come
        opened = g.stats()["links_opened"] - before
        await together.at("measured")  # nobody closes (a goodbye opens links) before
        return err, before, opened

    results = await run_ranks(n, fn, transport="tcp", collective_timeout=30,
                              host_ids=[f"h{r}" for r in range(n)])
    opened = [r[2] for r in results]
    print(f"p={n}: links opened by the failure per peer: max {max(opened)}, total "
          f"{sum(opened)}; ring links before it: max {max(r[1] for r in results)} "
          f"(to every peer: {n - 1})")
    finders = {odd - 1, odd, odd + 1}  # the ring neighbours exchange with the odd rank
    for rank, (err, _, _) in enumerate(results):
        assert isinstance(err, p2pcoll.CollectiveMismatch), (rank, repr(err))
        assert "float32[10]" in str(err) and "float32[11]" in str(err), (rank, str(err))
        if "failed collective #1" in str(err):
            origin = int(str(err).split()[1])
            assert origin in finders, (rank, str(err))  # the origin, never a relay
    assert max(opened) <= few_links(n), opened


@pytest.mark.parametrize("n", [pytest.param(16, marks=pytest.mark.processes),
                               pytest.param(64, marks=pytest.mark.scale)])
def test_a_killed_peer_is_named_over_few_links(tmp_path: Path, n: int) -> None:
    victim = 6
    job = PeerProcesses(n, lambda r: [sys.executable, str(WORKER), str(tmp_path), str(victim)],
                        env=lambda r: {"P2PCOLL_TRANSPORT": "tcp",
                                       "P2PCOLL_HOST_ID": f"host-{r}"})
    try:
        ready = job.wait_for("ready", list(range(n)), timeout=300)
        time.sleep(0.5)  # the others are in the collective, which waits for the victim
        job.procs[victim].send_signal(signal.SIGKILL)
        job.procs[victim].wait(timeout=30)
        survivors = [r for r in range(n) if r != victim]
        after = job.wait_for("after", survivors, timeout=120)
        (tmp_path / "done").touch()
    finally:
        job.close()
    before = {r["rank"]: r["opened"] for r in ready}
    opened = [r["opened"] - before[r["rank"]] for r in after]
    print(f"p={n}, SIGKILL of rank {victim}: links opened by the failure per survivor: "
          f"max {max(opened)}, total {sum(opened)}; open after it: max "
          f"{max(r['links'] for r in after)} (to every peer: {n - 1})")
    for report in after:
        assert report["error"].startswith("PeerLost"), report
        assert report["rank_named"] == victim, report
        assert f"rank {victim}" in report["error"], report
    assert max(opened) <= few_links(n), opened


def abort(src: int, number: int, err: list[str], **meta: Any) -> Header:
    return Header("abort", "", src, number, err=err, meta=meta)


async def test_an_abort_passed_on_names_its_origin_and_reaches_the_fingers() -> None:
    """Rank 2 gets rank 0's abort from rank 1 (which passes it on): its collective fails
    naming rank 0, and it passes the abort on to its fingers (ranks 3 and 0, less the
    origin), so rank 3 fails alike; rank 0 ignores its own abort coming back."""
    groups = await memory_groups(4, collective_timeout=30, heartbeat_timeout=1)
    try:
        group_id = groups[0].session.membership.group_id
        endpoints = groups[0].session.membership.endpoints
        running = {r: asyncio.create_task(groups[r].allreduce(np.ones(2))) for r in (0, 2, 3)}
        for r in running:  # all wait in collective #0 for rank 1
            await until_waiting(groups[r], 0)
        copy = abort(1, 0, ["CollectiveMismatch", "shapes differ"], origin=0, told=[])
        copy.group = group_id
        groups[0].session.transport.receive(endpoints[1], [encode_header(copy)])
        groups[2].session.transport.receive(endpoints[1], [encode_header(copy)])
        for r in (2, 3):
            with pytest.raises(p2pcoll.CollectiveMismatch) as caught:
                await asyncio.wait_for(running[r], 10)
            assert str(caught.value) == "rank 0 failed collective #0: shapes differ", r
        await asyncio.sleep(0.1)
        assert not running[0].done()  # its own abort is no news to rank 0
        running[0].cancel()
    finally:
        for g in groups:
            await g.close()


@pytest.mark.parametrize("told", [[2], []])
async def test_a_copy_passed_on_waits_for_the_origins_own_if_it_was_told(told: list[int]
                                                                          ) -> None:
    """Rank 2 waits in a broadcast from root 1 when a copy of rank 1's abort of it comes
    from rank 3, ahead of rank 1's data. If rank 1 sent rank 2 its abort itself
    (``told``), that copy comes after its data on their link: rank 2 waits for it, gets the
    data, its broadcast succeeds, and rank 1's own abort then breaks its group. If not, rank
    1 never sent rank 2 anything before its abort: the copy fails the broadcast at once."""
    groups = await memory_groups(4, collective_timeout=30, heartbeat_timeout=1)
    try:
        group_id = groups[0].session.membership.group_id
        endpoints = groups[0].session.membership.endpoints
        waiting = asyncio.create_task(groups[2].broadcast(np.zeros(3), root=1,
                                                          strategy="root"))
        await asyncio.sleep(0.05)
        copy = abort(3, 0, ["CollectiveMismatch", "root went wrong"], origin=1, told=told)
        copy.group = group_id
        groups[2].session.transport.receive(endpoints[3], [encode_header(copy)])
        await asyncio.sleep(0.1)
        if not told:
            with pytest.raises(p2pcoll.CollectiveMismatch, match="^rank 1 failed collective "
                                                                 "#0: root went wrong$"):
                await asyncio.wait_for(waiting, 10)
            return
        assert not waiting.done()  # the copy waits for rank 1's own abort
        others = [groups[r].broadcast(np.arange(3.0) if r == 1 else np.zeros(3), root=1,
                                      strategy="root") for r in (0, 1, 3)]
        await asyncio.gather(*others)
        assert np.array_equal(await asyncio.wait_for(waiting, 10), np.arange(3.0))
        own = abort(1, 0, ["CollectiveMismatch", "root went wrong"], told=told)
        own.group = group_id
        groups[2].session.transport.receive(endpoints[1], [encode_header(own)])
        with pytest.raises(p2pcoll.GroupBroken, match="rank 1 failed collective #0"):
            await groups[2].barrier(timeout=5)
    finally:
        for g in groups:
            await g.close()
