"""The root cause travels with the goodbyes it leads to.

On the sparse overlay the news of a lost peer spreads over the fingers in about log2 p hops,
while a survivor that hears of it first and closes at once sends its goodbye straight to its
contacts. A slower survivor may so read "rank X left the group" (X the survivor that
closed) before it hears of the loss itself. A goodbye from a peer whose group had failed
therefore carries the failure (``lost``: the rank it knows lost; ``cause``: what broke its
group), and its readers (and those told of the goodbye over the overlay) take it as news of
that failure first: they fail with the lost rank's PeerLost.

- processes (tests/cause_worker.py), SIGKILL of the victim: every survivor but the closer
  names the victim, never the closer; the closer is a watcher of the victim and the checked
  survivors include its own watchers, which read its goodbye directly while the news of the
  victim reaches them only over a few hops;
- in one process over tcp: a healthy goodbye still reads as "rank X left the group", and a
  goodbye carries no cause then;
- the goodbye's fields are checked where every message is (tests/test_validation_property.py
  has the hostile values).
"""

from __future__ import annotations

import asyncio
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
from p2pcoll.wire import Header, encode_header

WORKER = Path(__file__).with_name("cause_worker.py")


def run_kill_and_close(tmp: Path, n: int, victim: int, closer: int, mode: str,
                       bystanders: tuple[int, ...] = (), transport: str = "tcp",
                       max_links: int | None = None) -> list[dict[str, Any]]:
    """Start ``n`` workers (over ``transport``, under a link budget of ``max_links``),
    SIGKILL ``victim`` once all are in the collective, and return the reports of the
    survivors other than ``closer`` and the ``bystanders``."""
    env = {"P2PCOLL_TRANSPORT": transport}
    if max_links is not None:
        env["P2PCOLL_MAX_LINKS"] = str(max_links)
    job = PeerProcesses(n, lambda r: [sys.executable, str(WORKER), str(tmp), str(victim),
                                      str(closer), mode, *map(str, bystanders)],
                        env=lambda r: env)
    try:
        job.wait_for("ready", list(range(n)), timeout=240)
        time.sleep(0.5)  # the others are in the collective, which waits for the victim
        job.procs[victim].send_signal(signal.SIGKILL)
        job.procs[victim].wait(timeout=30)
        checked = [r for r in range(n) if r not in (victim, closer, *bystanders)]
        after = job.wait_for("after", checked, timeout=120)
        job.wait_for("after", [closer], timeout=60)
        (tmp / "done").touch()
        return after
    finally:
        for proc in job.procs:
            if proc.poll() is None and proc is job.procs[victim]:
                proc.kill()
        job.close()


def check_named(after: list[dict[str, Any]], victim: int, closer: int) -> None:
    links = sorted(r["links"] for r in after)
    print(f"data links open after the failure (the aborts open them): median "
          f"{links[len(links) // 2]}, max {links[-1]}")
    for report in after:
        assert report["error"].startswith("PeerLost"), report
        assert report["rank_named"] == victim, report
        assert f"rank {victim}" in report["error"], report
        assert f"rank {closer} left the group" not in report["error"], report


@pytest.mark.processes
@pytest.mark.parametrize("mode, victim, closer, bystanders", [
    ("idle", 9, 8, (7,)),  # the closer watches the victim: it hears of the loss first
    ("failing", 8, 0, ()),  # the closer hears of it from the others
])
def test_a_survivor_that_closes_at_once_does_not_hide_the_loss(
        tmp_path: Path, mode: str, victim: int, closer: int,
        bystanders: tuple[int, ...]) -> None:
    """16 peers over tcp. The closer has a link to every peer (it gathered and scattered),
    so its goodbye reaches each at once, while the news of the victim needs up to log2 p
    hops over the fingers. It leaves without a collective of its own (``idle``: its group
    is degraded and no abort went out; the victim's other watcher is a bystander, so the
    first aborts come from the peers one hop away) or after its collective failed
    (``failing``: it may have learnt of the loss from another survivor's abort, which it
    does not pass on, and which comes to a slower survivor on a new link, not the
    goodbye's). Before goodbyes carried the cause, most survivors named the closer."""
    after = run_kill_and_close(tmp_path, 16, victim, closer, mode, bystanders)
    check_named(after, victim, closer)


@pytest.mark.scale
@pytest.mark.parametrize("attempt", range(4))
def test_the_loss_is_named_on_every_try_at_twenty_four(tmp_path: Path, attempt: int) -> None:
    """Both modes, other victims, and (the last two tries) under a budget of 4 links a
    peer, which the aborts to every peer keep closing and reopening."""
    n = 24
    victim = (5 + 7 * attempt) % n
    mode = ("idle", "failing")[attempt % 2]
    if mode == "idle":
        closer, bystanders = (victim - 1) % n, ((victim - 2) % n,)
    else:
        closer, bystanders = (victim + n // 2) % n, ()
    after = run_kill_and_close(tmp_path, n, victim, closer, mode, bystanders,
                               max_links=4 if attempt >= 2 else None)
    check_named(after, victim, closer)


async def test_a_healthy_goodbye_reads_as_rank_left() -> None:
    """Rank 1 leaves without any failure: the others' collective names it as having left
    (its goodbye carries no cause, and nobody is reported lost). They stay until all have
    failed, so that rank 1 is the only one to leave meanwhile."""
    failed = 0
    all_failed = asyncio.Event()

    async def fn(g: p2pcoll.Group) -> str:
        nonlocal failed
        if g.rank == 1:
            return "left"
        try:
            await g.allreduce(np.ones(3), timeout=30)
        except p2pcoll.PeerLost as exc:
            assert exc.rank == 1, exc
            gone = g.session.peers.gone()  # nobody else leaves before all have failed
            assert list(gone) == [1] and gone[1].graceful, gone
            failed += 1
            if failed == 3:
                all_failed.set()
            await all_failed.wait()
            return str(exc)
        return "finished"

    results = await run_ranks(4, fn, transport="tcp")
    assert results[1] == "left"
    for text in results[:1] + results[2:]:
        # its goodbye, or a peer's abort that passes it on ("rank 3 failed ...: ...")
        assert text.endswith("rank 1 left the group: it closed it normally"), results


def goodbye(src: int, told: list[int], **report: Any) -> Header:
    return Header("bye", "", src, 1, meta={"told": told, **report})


@pytest.mark.parametrize("cause, error, says", [
    ({"q": 0, "err": ["CollectiveTimeout", "allreduce #0 timed out after 9s on rank 1"]},
     p2pcoll.CollectiveTimeout, "allreduce #0 timed out after 9s on rank 1 (reported by "
                                "rank 1 as it left)"),
    ({"q": 0, "err": ["CollectiveMismatch", "ranks disagree"]},
     p2pcoll.CollectiveMismatch, "ranks disagree (reported by rank 1 as it left)"),
    ({"q": 0, "err": ["PeerLost", "rank 1 lost the connection to rank 0"], "rank": 0},
     p2pcoll.PeerLost, "rank 1 lost the connection to rank 0 (reported by rank 1 as it left)"),
    ({"q": 0, "t": 7, "err": ["NoSuchError", "a transfer failed"]},
     p2pcoll.P2PCollError, "a transfer failed (reported by rank 1 as it left)"),
])
async def test_the_cause_a_goodbye_carries_is_the_error_and_is_passed_on(
        cause: dict[str, Any], error: type[Exception], says: str) -> None:
    """Rank 1's goodbye reaches rank 2 (put on its link here, through the one validation
    point) saying what broke rank 1's group: rank 2's collective fails with that, not with
    "rank 1 left the group"; rank 2 passes the goodbye on to its fingers (ranks 3 and 0)
    with the cause, so rank 3, which hears of the goodbye only from rank 2, fails with the
    same cause."""
    groups = await memory_groups(4, collective_timeout=30, heartbeat_timeout=1)
    try:
        endpoints = groups[0].session.membership.endpoints
        running = [asyncio.create_task(groups[r].allreduce(np.ones(2))) for r in (2, 3)]
        for r in (2, 3):  # both wait in collective #0 for ranks 0 and 1
            await until_waiting(groups[r], 0)
        bye = goodbye(1, [2], cause=cause)
        bye.group = groups[2].session.membership.group_id
        groups[2].session.transport.receive(endpoints[1], [encode_header(bye)])
        for task in running:
            with pytest.raises(error) as caught:
                await asyncio.wait_for(task, 10)
            assert says in str(caught.value), caught.value
            assert "left the group" not in str(caught.value)
            assert type(caught.value) is error
        if "rank" in cause:
            assert caught.value.rank == cause["rank"]  # type: ignore[attr-defined]
        assert groups[2].session.peers.said_goodbye(1)
        assert groups[3].session.peers.said_goodbye(1)
    finally:
        for g in groups:
            await g.close()


async def test_a_goodbye_says_whom_it_knows_lost() -> None:
    """A peer that knows a member lost says so in its goodbye (``lost``), whether or not
    its group broke: a reader that had not heard of the loss records it first (as lost,
    reported by the peer that left), and its next collective names the lost rank."""
    groups = await memory_groups(4, collective_timeout=30, heartbeat_timeout=1)
    try:
        endpoints = groups[0].session.membership.endpoints
        bye = goodbye(1, [2], lost=3)
        bye.group = groups[2].session.membership.group_id
        groups[2].session.transport.receive(endpoints[1], [encode_header(bye)])
        gone = groups[2].session.peers.gone()
        assert list(gone) == [3, 1], gone
        assert not gone[3].graceful and gone[1].graceful
        with pytest.raises(p2pcoll.PeerLost) as caught:
            await groups[2].allreduce(np.ones(2))
        assert caught.value.rank == 3
        assert "rank 1 lost the connection to rank 3" in str(caught.value)
    finally:
        for g in groups:
            await g.close()


async def test_the_goodbye_of_a_broken_group_carries_its_first_failure() -> None:
    """What a peer's goodbye says, from its own state: nothing after a healthy run; after
    its collective failed because rank 3 was lost, the cause (PeerLost naming rank 3, the
    collective's number) and the loss."""
    groups = await memory_groups(4, collective_timeout=30, heartbeat_timeout=1)
    try:
        session = groups[0].session
        assert session._failure_report() == {}
        session.peers.reported_lost(3, by=2)
        with pytest.raises(p2pcoll.PeerLost):
            await groups[0].allreduce(np.ones(2))
        report = session._failure_report()
        assert report["lost"] == 3
        assert report["cause"]["q"] == 0 and report["cause"]["rank"] == 3
        assert report["cause"]["err"][0] == "PeerLost"
        assert "rank 3" in report["cause"]["err"][1]
        assert "t" not in report["cause"]
    finally:
        for g in groups:
            await g.close()


async def test_news_of_a_goodbye_sent_here_too_waits_for_the_goodbye() -> None:
    """Rank 3 hears from rank 0 that rank 1 left after a failure, but rank 1's goodbye went
    to rank 3 too (``told``): rank 3 waits for it (it comes after rank 1's data on their
    link), and takes the cause from it when it comes."""
    groups = await memory_groups(4, collective_timeout=30, heartbeat_timeout=1)
    try:
        endpoints = groups[0].session.membership.endpoints
        group_id = groups[3].session.membership.group_id
        cause = {"q": 0, "err": ["CollectiveMismatch", "ranks disagree"]}
        news = Header("gone", group_id, 0, 1,
                      meta={"rank": 1, "graceful": True, "told": [0, 3], "cause": cause})
        groups[3].session.transport.receive(endpoints[0], [encode_header(news)])
        assert groups[3].state is p2pcoll.GroupState.READY
        assert groups[3].session.peers.gone() == {}
        bye = goodbye(1, [0, 3], cause=cause)
        bye.group = group_id
        groups[3].session.transport.receive(endpoints[1], [encode_header(bye)])
        assert groups[3].session.peers.said_goodbye(1)
        with pytest.raises(p2pcoll.CollectiveMismatch, match="ranks disagree \\(reported by "
                                                             "rank 1 as it left\\)"):
            await groups[3].allreduce(np.ones(2))
    finally:
        for g in groups:
            await g.close()
