"""What becomes of a peer whose link or probe went down, without processes: the verdict
over every combination of what its check found, what went down, this peer's own gap and the
time (p2pcoll.departures.suspects), and the departures machine wired to it (busy peers kept,
a held peer's neighbour that leaves or dies named, a stopped peer told it is the lost one).
The same with real processes: tests/test_busy_peers.py."""

from __future__ import annotations

import itertools

import pytest

from p2pcoll.departures import (
    ALIVE,
    CHECK_WAIT,
    LINK_LOSS_GRACE,
    DeclaredLost,
    Departures,
    Unwatch,
    Watch,
)
from p2pcoll.departures.suspects import Suspect, dropped, verdict
from p2pcoll.errors import KILLED, UNRESPONSIVE
from p2pcoll.wire import Header

from test_departures import GROUP, Net

STALL = 5.0
STOPPED_PAST = STALL * 1.25 + CHECK_WAIT  # as Departures(stall=STALL) has it
DUE = 10.0
HOWS = (None, "", KILLED, UNRESPONSIVE, ALIVE)
GAPS = (None, STALL + 0.5, STOPPED_PAST + 0.5)  # none, short (ambiguous), long
TIMES = (DUE - 0.2, DUE + 0.1, DUE + CHECK_WAIT + 0.1)


@pytest.mark.parametrize(("how", "probe_only", "gap", "late", "now"),
                         list(itertools.product(HOWS, (True, False), GAPS, (True, False),
                                                TIMES)))
def test_the_verdict_over_every_case(how: str | None, probe_only: bool, gap: float | None,
                                     late: bool, now: float) -> None:
    got = verdict(Suspect(DUE, how, probe_only, gap, late), now, STOPPED_PAST)
    if how == ALIVE and probe_only and gap is not None and gap > STOPPED_PAST:
        assert got == "self"  # this peer's own long stop lost it
    elif how == ALIVE and probe_only and late:
        assert got == "kept"  # its process answers and this peer ran late: kept at once
    elif now < DUE or (how is None and now < DUE + CHECK_WAIT):
        assert got == "wait"  # a goodbye may still come, or the check's answer
    elif how in (KILLED, UNRESPONSIVE):
        assert got == "lost"  # gone, even right after this peer was busy
    else:  # not found out, or a live peer closed its data link
        assert got == ("self" if gap is not None else "lost")


def test_a_stopped_peer_is_lost_only_past_the_watchers_probe_and_check() -> None:
    p = Departures(0, 4, GROUP, stall=STALL)
    assert p.stopped_past == STOPPED_PAST
    assert p.deadline() is None
    p.start(0.0)
    assert p.deadline() == STALL / 4  # ticks often enough that a gap measures a stop


# -- the machine ------------------------------------------------------------------------------


def test_a_watched_peer_whose_process_answers_is_kept_if_this_one_ran_late() -> None:
    # Both starved (a crowded host): the watcher's ticks came late, and its probe's timer
    # may have run out before it read the answer; the peer answers: kept.
    net = Net(6, stall=STALL)
    p1 = net.peers[1]
    net.now += 0.6 * STALL  # no event meanwhile: late (its ticks are due every STALL / 4)
    net.apply(1, p1.probe_lost(2, net.now, checking=True), 0)
    actions = p1.classified(2, ALIVE, net.now + 0.1)
    assert actions == [Unwatch(2), Watch(2, late=True)]
    net.tick(LINK_LOSS_GRACE + CHECK_WAIT)
    assert p1.lost(2) is None and not p1.suspects(2) and not net.queue  # no news
    # the same peer killed later is still found
    net.apply(1, p1.probe_lost(2, net.now, checking=True), 0)
    net.apply(1, p1.classified(2, KILLED, net.now), 0)
    net.tick(LINK_LOSS_GRACE)
    assert p1.lost(2) is not None and p1.lost(2).how == KILLED


@pytest.mark.parametrize("how", [KILLED, UNRESPONSIVE, ALIVE, ""])
def test_a_suspect_whose_data_link_went_down_is_lost_whatever_its_check(how: str) -> None:
    # what it sent on that link is lost: a peer that answers is no better
    p = Departures(1, 6, GROUP)
    p.start(0.0)
    p.probe_lost(2, 0.0, checking=True)
    p.link_closed(2, 0.01)
    p.classified(2, how, 0.1)
    p.tick(LINK_LOSS_GRACE + 0.01)
    err = p.lost(2)
    assert err is not None and err.how == (how if how in (KILLED, UNRESPONSIVE) else "")


def held(net: Net, r: int, seconds: float) -> None:
    """``r``'s loop is held for ``seconds`` (its probes stay up); the others go on."""
    end = net.now + seconds
    while net.now < end:
        net.now += 0.5
        for q in net.survivors():
            if q != r:
                net.apply(q, net.peers[q].tick(net.now), 0)
        while net.queue and net.queue[0].dst != r:
            net.deliver()


def test_a_held_peer_whose_neighbour_left_meanwhile_takes_the_goodbye() -> None:
    net = Net(6, stall=STALL)
    p2 = net.peers[2]
    net.start(2, "allreduce#3", needs=None, seq=3)
    net.close(3, seq=4)  # 3 leaves (having started #0..#3) while 2's loop is held
    held(net, 2, 2 * STALL)
    net.now += 0.01
    # 2 resumes: its probe of 3 went down (the port closed) before it reads the goodbye
    net.apply(2, p2.probe_lost(3, net.now, checking=True), 0)
    net.apply(2, p2.classified(3, KILLED, net.now + 0.01), 0)
    net.settle()
    assert 2 not in net.declared
    assert p2.said_goodbye(3)
    assert net.fails[(2, "allreduce#3")] == 0  # 3 had started #3: it took part


@pytest.mark.parametrize("how", [KILLED, UNRESPONSIVE])
def test_a_held_peer_whose_neighbour_died_meanwhile_names_it(how: str) -> None:
    net = Net(6, stall=STALL)
    p2 = net.peers[2]
    net.start(2, "allreduce#0", needs=None, seq=0)
    net.kill(3)  # its other watcher (1) finds it; 2 is held
    held(net, 2, 2 * STALL)
    net.now += 0.01
    net.apply(2, p2.probe_lost(3, net.now, checking=True), 0)
    net.apply(2, p2.classified(3, how, net.now + 0.01), 0)
    net.settle()
    assert 2 not in net.declared
    err = p2.lost(3)
    assert err is not None and err.rank == 3
    assert net.fails[(2, "allreduce#0")] == 1


@pytest.mark.parametrize(("stopped", "found_silent"), [
    (STALL + 1.0, False),  # starved just past the heartbeat: its watchers found it alive
    (STALL + 1.0, True),  # stopped as long, but its watchers' checks found it silent
    (3 * STALL, True),  # past their probe and check together: surely found silent
])
def test_a_peer_stopped_past_the_heartbeat_finds_its_neighbours_alive(
        stopped: float, found_silent: bool) -> None:
    # Its own probes' timers ran out as it resumed; its neighbours answer, and are never
    # blamed. After a stop longer than its watchers' probe and check together it is the
    # lost one at once; after a shorter one it keeps its neighbours and asks its watchers,
    # which answer only if they declared it lost.
    net = Net(6, stall=STALL)
    p3 = net.peers[3]
    net.start(3, "allreduce#0", needs=None, seq=0)
    net.killed.add(3)  # stopped: reads nothing
    net.now += STALL
    if found_silent:
        for w in (1, 2):
            net.apply(w, net.peers[w].probe_lost(3, net.now, checking=True), 0)
            net.apply(w, net.peers[w].classified(3, UNRESPONSIVE, net.now + 0.1), 0)
        net.tick(LINK_LOSS_GRACE)
        while net.queue:
            net.deliver()
        assert all(net.peers[r].lost(3) for r in (0, 1, 2, 4, 5))
    net.now += stopped - STALL - (LINK_LOSS_GRACE + 0.01 if found_silent else 0)
    net.killed.discard(3)  # resumes
    for q in (4, 5):
        net.apply(3, p3.probe_lost(q, net.now, checking=True), 0)
    for q in (4, 5):
        net.apply(3, p3.classified(q, ALIVE, net.now + 0.05), 0)
    net.settle()
    assert (3 in net.declared) == found_silent
    assert p3.lost(4) is None and p3.lost(5) is None
    for r in (0, 1, 2, 4, 5):
        assert (net.peers[r].lost(3) is not None) == found_silent  # the ask changes nothing
    if found_silent:
        assert isinstance(net.declared[3], DeclaredLost) and net.declared[3].error.rank == 3
        assert net.fails[(3, "allreduce#0")] == 1
        if stopped > STOPPED_PAST:  # its own clock said so; else a watcher answered
            assert f"was stopped for {stopped:.1f} s" in str(net.declared[3].error)
        else:
            assert net.declared[3].by in (1, 2)
    else:
        assert net.fails[(3, "allreduce#0")] == 0
        assert net.sent[3] == 2  # it asked its two watchers, once
        assert sum(net.sent.values()) == 2  # and nothing answered


def test_a_peer_that_cannot_check_and_resumes_to_a_loss_is_the_lost_one() -> None:
    # No check (an endpoint that cannot be asked): a loss right after its own gap is its
    # own, as before the checks; after its grace, so that a goodbye still wins.
    net = Net(6, stall=STALL)
    p3 = net.peers[3]
    net.now += 2 * STALL
    net.apply(3, p3.probe_lost(4, net.now), 0)
    assert 3 not in net.declared  # not at once: the grace first
    bye = Header("bye", GROUP, 5, 0, meta={"told": [3]})
    net.apply(3, p3.probe_lost(5, net.now), 0)
    net.apply(3, p3.received(bye, net.now + 0.01), 0)
    assert p3.said_goodbye(5)
    net.tick(LINK_LOSS_GRACE + 0.01)
    assert net.declared[3].error.rank == 3 and p3.lost(4) is None


def test_a_stopped_peer_whose_neighbours_left_meanwhile_is_told_it_was_the_lost_one() -> None:
    # Stopped just past the heartbeat (a gap too short to be sure), its watchers declared it
    # lost and its neighbours closed (they said no goodbye to a peer they had lost): it
    # resumes to its probes down on ports that are gone, asks its watchers, and their
    # answer comes within the grace, before it would name a neighbour.
    net = Net(6, stall=STALL)
    p3 = net.peers[3]
    net.start(3, "allreduce#0", needs=None, seq=0)
    net.killed.add(3)
    net.now += STALL
    for w in (1, 2):
        net.apply(w, net.peers[w].probe_lost(3, net.now, checking=True), 0)
        net.apply(w, net.peers[w].classified(3, UNRESPONSIVE, net.now + 0.1), 0)
    net.tick(LINK_LOSS_GRACE)
    while net.queue:
        net.deliver()
    net.now += 1.0
    net.killed.discard(3)
    net.killed |= {4, 5}  # gone, as far as 3 can tell: nothing listens there any more
    for q in (4, 5):
        net.apply(3, p3.probe_lost(q, net.now, checking=True), 0)
        net.apply(3, p3.classified(q, KILLED, net.now + 0.05), 0)
    net.now += 0.1
    net.deliver()  # the question reaches watcher 1 or 2, which answers
    while net.queue:
        net.deliver()
    assert net.declared[3].by in (1, 2) and net.declared[3].error.rank == 3
    assert p3.lost(4) is None and p3.lost(5) is None
    assert net.fails[(3, "allreduce#0")] == 1


def test_a_stopped_peer_whose_group_closed_meanwhile_is_the_lost_one() -> None:
    # As above, but its watchers have closed too: nobody answers. Every peer it watches is
    # found gone right after its gap: it was dropped (two neighbours seldom die at once
    # while one is held), not they.
    net = Net(6, stall=STALL)
    p3 = net.peers[3]
    net.start(3, "allreduce#0", needs=None, seq=0)
    net.now += STALL + 1.0
    net.killed |= {0, 1, 2, 4, 5}
    for q in (4, 5):
        net.apply(3, p3.probe_lost(q, net.now, checking=True), 0)
        net.apply(3, p3.classified(q, KILLED, net.now + 0.05), 0)
    net.tick(LINK_LOSS_GRACE + 0.1)
    assert net.declared[3].error.rank == 3 and "was stopped for" in str(net.declared[3].error)
    assert p3.lost(4) is None and p3.lost(5) is None
    assert net.fails[(3, "allreduce#0")] == 1


def test_dropped_needs_every_watched_peer_found_gone_after_a_gap() -> None:
    gone, alive = Suspect(1.0, KILLED, True, 6.0), Suspect(1.0, ALIVE, True, 6.0)
    assert dropped([4, 5], {4: gone, 5: gone})
    assert not dropped([4, 5], {4: gone})  # 5 is fine: 4 died while this peer was held
    assert not dropped([4, 5], {4: gone, 5: alive})
    assert not dropped([4, 5], {4: gone, 5: Suspect(1.0, None, True, 6.0)})  # still asked
    assert not dropped([4, 5], {4: Suspect(1.0, KILLED, True, None)} | {5: gone})  # no gap
    assert not dropped([], {})


def test_a_peer_that_answers_after_missing_its_heartbeats_is_lost_if_this_one_ran_on() -> None:
    # Nothing says this watcher was starved: the peer missed its heartbeats (stopped for a
    # moment, or its connections reset) and what it sent meanwhile may be lost with them.
    p = Departures(1, 6, GROUP, stall=STALL)
    p.start(0.0)
    p.tick(STALL / 4)
    p.probe_lost(2, STALL / 4 + 0.1, checking=True)
    assert p.classified(2, ALIVE, STALL / 4 + 0.2) == []
    p.tick(STALL / 4 + LINK_LOSS_GRACE + 0.2)
    err = p.lost(2)
    assert err is not None and err.how == UNRESPONSIVE
