"""The departures state machine as a pure object: several instances wired together by a
tiny message router (no sockets, no event loop, a clock passed in), each scenario in
milliseconds, and a property test over random orders of events."""

from __future__ import annotations

import logging
import math
import random
from collections import Counter
from collections.abc import Collection, Hashable
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2pcoll.departures import (
    CHECK_WAIT,
    KILLED_WAIT,
    LINK_LOSS_GRACE,
    Aborted,
    Action,
    DeclaredLost,
    Degrade,
    Departures,
    Fail,
    Forget,
    Post,
    Unwatch,
    Watch,
    overlay,
)
from p2pcoll.errors import KILLED, UNRESPONSIVE
from p2pcoll.wire import Header

GROUP = "g"

Ops = dict[Hashable, tuple[Collection[int] | None, int | None]]  # op -> (needs, seq)


def machine(rank: int, size: int, ops: Ops, stall: float | None = None) -> Departures:
    """A peer's machine that reads ``ops`` as what runs (as the session's failure model
    is read)."""
    return Departures(rank, size, GROUP, stall=stall,
                      running=lambda: [(op, n, s) for op, (n, s) in ops.items()])


@dataclass
class Message:
    src: int
    dst: int
    header: Header
    via: str
    hops: int  # how many messages led to this one, from a first-hand observation


@dataclass
class Net:
    """Peers' Departures wired together: what they post is queued, delivered in the order a
    test chooses; what they watch is followed (a killed peer's watchers lose their probe)."""

    size: int
    stall: float | None = None
    now: float = 0.0
    peers: dict[int, Departures] = field(default_factory=dict)
    killed: set[int] = field(default_factory=set)
    closed: set[int] = field(default_factory=set)
    queue: list[Message] = field(default_factory=list)
    links: dict[int, set[int]] = field(default_factory=dict)  # who posted to whom on links
    watching: dict[int, set[int]] = field(default_factory=dict)
    fails: Counter[tuple[int, Hashable]] = field(default_factory=Counter)
    aborted: Counter[tuple[int, int, int]] = field(default_factory=Counter)  # (at, origin, op)
    declared: dict[int, DeclaredLost] = field(default_factory=dict)
    ops: dict[int, Ops] = field(default_factory=dict)  # what runs at each peer
    degraded: set[int] = field(default_factory=set)
    forgotten: dict[int, set[int]] = field(default_factory=dict)
    graceful: dict[tuple[int, int], bool] = field(default_factory=dict)  # (at, gone) -> said bye
    learned: dict[tuple[int, int], int] = field(default_factory=dict)  # (at, gone) -> hops
    sent: Counter[int] = field(default_factory=Counter)  # messages posted by each peer
    violations: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        for r in range(self.size):
            self.ops[r] = {}
            self.peers[r] = machine(r, self.size, self.ops[r], stall=self.stall)
            self.links[r], self.watching[r], self.forgotten[r] = set(), set(), set()
        for r in range(self.size):
            self.apply(r, self.peers[r].start(self.now), 0)

    # -- carrying out actions --------------------------------------------------------

    def apply(self, at: int, actions: list[Action], hops: int) -> None:
        me = self.peers[at]
        for action in actions:
            if isinstance(action, Post):
                if action.via != "answer" and action.dst in me.gone():
                    self.violations.append(f"rank {at} posted {action.header.kind} to "
                                           f"rank {action.dst}, known gone")
                if action.via == "link":
                    self.links[at].add(action.dst)
                self.sent[at] += 1
                self.queue.append(Message(at, action.dst, action.header, action.via, hops + 1))
            elif isinstance(action, Watch):
                self.watching[at].add(action.peer)
                if action.peer in self.killed or action.peer in self.closed:
                    # a late probe to a port that is gone cannot connect
                    self.apply(at, me.probe_lost(action.peer, self.now), 0)
            elif isinstance(action, Unwatch):
                self.watching[at].discard(action.peer)
            elif isinstance(action, Forget):
                self.forgotten[at].add(action.peer)
                self.graceful[(at, action.peer)] = action.graceful
            elif isinstance(action, Fail):
                self.fails[(at, action.op)] += 1
            elif isinstance(action, Aborted):
                self.aborted[(at, action.origin, action.header.seq)] += 1
            elif isinstance(action, DeclaredLost):
                self.declared[at] = action
            elif isinstance(action, Degrade):
                self.degraded.add(at)
        for gone in me.gone():
            self.learned.setdefault((at, gone), hops)

    # -- events --------------------------------------------------------------------------

    def start(self, r: int, op: Hashable, needs: Collection[int] | None,
              seq: int | None = None) -> list[Action]:
        """``r`` starts ``op`` (it runs from now on); returns what the machine said."""
        self.ops[r][op] = (needs, seq)
        actions = self.peers[r].starting(op, needs, seq)
        self.apply(r, actions, 0)
        return actions

    def end(self, r: int, op: Hashable) -> None:
        del self.ops[r][op]

    def live(self, r: int) -> bool:
        return r not in self.killed and r not in self.closed

    def kill(self, r: int) -> None:
        """``r`` dies: its watchers' probes go down at once; what was sent to it is lost."""
        self.killed.add(r)
        self.queue = [m for m in self.queue if m.dst != r]
        for w in range(self.size):
            if self.live(w) and r in self.watching[w]:
                self.apply(w, self.peers[w].probe_lost(r, self.now), 0)

    def close(self, r: int, seq: int = 0) -> None:
        """``r`` says goodbye (its port closes later: see :meth:`finish_close`)."""
        senders = {s for s in range(self.size) if r in self.links[s] and self.live(s)}
        self.apply(r, self.peers[r].close(seq, self.links[r], senders), 0)

    def finish_close(self, r: int) -> None:
        self.peers[r].closed()
        self.closed.add(r)
        self.queue = [m for m in self.queue if m.dst != r]
        for w in range(self.size):
            if self.live(w) and r in self.watching[w]:
                self.apply(w, self.peers[w].probe_lost(r, self.now), 0)

    def classify(self, r: int) -> None:
        """``r`` finds out what became of each peer it suspects, as the session asks its
        address: nothing listens there once it was killed or closed."""
        for q in range(self.size):
            if self.peers[r].suspects(q):
                how = KILLED if not self.live(q) else UNRESPONSIVE
                self.apply(r, self.peers[r].classified(q, how, self.now), 0)

    def deliver(self, index: int = 0) -> None:
        m = self.queue.pop(index)
        self.now += 0.001
        if not self.live(m.dst):
            return
        self.apply(m.dst, self.peers[m.dst].received(m.header, self.now), m.hops)

    def tick(self, dt: float) -> None:
        self.now += dt
        for r in range(self.size):
            if self.live(r):
                self.apply(r, self.peers[r].tick(self.now), 0)

    def settle(self) -> None:
        """Deliver everything, let every grace period pass, close what is closing: when
        every farewell has come, or else (a farewell from a peer that died unnoticed) once
        nothing else happens, as the drain deadline would."""
        for _ in range(100):
            while self.queue:
                self.deliver()
            self.tick(LINK_LOSS_GRACE + 0.01)
            closing = [r for r in self.closing() if not self.peers[r].unanswered()]
            if not self.queue and not closing:
                closing = self.closing()
                if not closing:
                    return
            for r in closing:
                self.finish_close(r)
        raise AssertionError("the peers never settled")

    def closing(self) -> list[int]:
        return [r for r in range(self.size) if self.live(r) and self.peers[r].told]

    def survivors(self) -> list[int]:
        return [r for r in range(self.size) if self.live(r)]


def watched_by(net: Net, q: int) -> set[int]:
    return {w for w in net.survivors() if q in net.peers[w].watched}


# -- scenarios ---------------------------------------------------------------------------


def test_a_run_of_consecutive_losses_is_found_one_after_another() -> None:
    net = Net(8)
    for r in (2, 3, 4):
        net.kill(r)
    net.settle()
    for r in net.survivors():
        assert set(net.peers[r].gone()) == {2, 3, 4}
        assert all(not d.graceful for d in net.peers[r].gone().values())
        assert net.peers[r].watched == overlay.watched(r, 8, gone={2, 3, 4})
        assert net.watching[r] == set(net.peers[r].watched)  # the probes follow
        assert r in net.degraded and net.forgotten[r] == {2, 3, 4}
    # 1 watched 2 and 3, then 4 (a late probe that could not connect), now 5 and 6
    assert net.peers[1].watched == [5, 6]
    for q in net.survivors():
        assert len(watched_by(net, q)) == 2
    assert not net.violations


def test_a_goodbye_under_a_link_budget() -> None:
    # Rank 5 keeps a link to 6 only (the others were closed for the budget and drained);
    # rank 2 has a link to 5. Its watchers (4, 3) are told over their probes.
    net = Net(8)
    net.links[5] = {6}
    net.links[2] = {5}
    net.close(5, seq=3)
    byes = {(m.dst, m.via) for m in net.queue if m.header.kind == "bye"}
    assert byes == {(6, "link"), (4, "probe"), (3, "probe"), (2, "answer")}
    assert net.peers[5].told == {6, 4, 3}
    assert net.peers[5].unanswered() == {6, 4, 3}
    net.settle()
    assert 5 in net.closed and not net.peers[5].unanswered()
    for r in net.survivors():
        gone = net.peers[r].gone()
        assert set(gone) == {5} and gone[5].graceful and gone[5].started == 3
        assert net.graceful[(r, 5)]  # it removed its own files: nobody sweeps them
        assert str(gone[5].error) == "rank 5 left the group: it closed it normally"
        assert gone[5].error.how == "closed"
    assert not net.violations


def test_an_abort_travels_over_the_fingers() -> None:
    net = Net(16)
    abort = Header("abort", GROUP, 0, 7, err=["CollectiveTimeout", "too slow"], meta={})
    net.apply(0, net.peers[0].failed(abort, unread={3}), 0)
    direct = sorted(m.dst for m in net.queue)
    assert direct == [1, 2, 3, 4, 8]  # its unread peer, then its fingers (3 skipped)
    net.settle()
    for r in range(1, 16):
        assert net.aborted[(r, 0, 7)] == 1, r
    assert net.aborted[(0, 0, 7)] == 0
    assert max(net.sent.values()) <= math.ceil(math.log2(16)) + 1
    assert not net.violations


def test_a_peer_that_closes_while_others_still_read() -> None:
    net = Net(4)
    assert net.start(0, "allreduce#4", needs=range(4), seq=4) == []
    assert net.start(0, "send", needs={1}) == []
    net.close(1, seq=5)  # rank 1 started 5 collectives (0..4): #4 goes on
    net.settle()
    assert net.fails[(0, "allreduce#4")] == 0 and net.fails[(0, "send")] == 0
    [fail] = net.start(0, "allreduce#5", needs=range(4), seq=5)
    assert isinstance(fail, Fail) and fail.error.rank == 1
    [fail] = net.start(0, "send again", needs={1})
    assert isinstance(fail, Fail)
    assert net.fails[(0, "allreduce#5")] == 1 and net.fails[(0, "send again")] == 1
    net.end(0, "allreduce#4")
    net.end(0, "send")


def test_a_collective_that_needs_every_member_fails_on_any_loss() -> None:
    # needs=None: every member (what the failure model gives for a collective: no set of
    # p ranks built per call), including one lost before it started.
    net = Net(4)
    assert net.start(0, "allreduce#0", needs=None, seq=0) == []
    net.kill(2)
    net.settle()
    assert net.fails[(0, "allreduce#0")] == 1
    # Killed: every survivor forgets it as not graceful (its files are swept on its host).
    assert {r: net.graceful[(r, 2)] for r in (0, 1, 3)} == {0: False, 1: False, 3: False}
    [fail] = net.start(0, "allreduce#1", needs=None, seq=1)
    assert isinstance(fail, Fail) and fail.error.rank == 2
    assert net.start(0, "recv", needs=()) == []  # a receive needs nobody


def test_nothing_is_asked_of_a_caller_while_every_member_is_there() -> None:
    # The failure model skips starting() until the first Degrade: nothing fails an
    # operation as it starts before a peer has gone, and what runs is read only then.
    reads: list[int] = []

    def running() -> list[tuple[Hashable, None, int]]:
        reads.append(1)
        return [("op", None, 0)]

    p = Departures(0, 4, GROUP, running=running)
    assert p.starting("op", needs=None, seq=0) == []
    assert p.tick(1.0) == [] and reads == []
    actions = p.probe_lost(1, 1.0) + p.tick(2.0)
    assert reads == [1]
    assert [type(a) for a in actions if isinstance(a, (Fail, Degrade))] == [Fail, Degrade]


def test_the_news_of_a_goodbye_goes_out_before_its_farewell() -> None:
    # The farewell lets the leaver close its port: its untold watchers should hear first.
    p = Departures(1, 8, GROUP)
    actions = p.received(Header("bye", GROUP, 2, 0, meta={"told": [1]}), 0.0)
    posts = [a for a in actions if isinstance(a, Post)]
    assert (posts[-1].header.kind, posts[-1].via, posts[-1].dst) == ("farewell", "answer", 2)
    assert {a.header.kind for a in posts[:-1]} == {"gone"}
    assert {a.dst for a in posts[:-1]} == set(overlay.fingers(1, 8, gone={2}))


def test_a_goodbye_that_crosses_a_loss_is_a_goodbye() -> None:
    net = Net(4)
    net.close(2, seq=1)
    # rank 2's port closes under its watcher 1's probe before 1 reads the goodbye
    net.apply(1, net.peers[1].probe_lost(2, net.now), 0)
    while net.queue:
        net.deliver()
    net.settle()
    assert net.peers[1].said_goodbye(2)
    for r in net.survivors():
        assert str(net.peers[r].lost(2)) == "rank 2 left the group: it closed it normally"


def test_a_goodbye_after_the_grace_finds_the_peer_lost_and_is_still_answered() -> None:
    net = Net(4)
    net.apply(1, net.peers[1].probe_lost(2, net.now), 0)
    net.tick(LINK_LOSS_GRACE + 0.01)
    assert net.peers[1].lost(2) is not None and not net.peers[1].said_goodbye(2)
    bye = Header("bye", GROUP, 2, 1, meta={"told": [1]})
    actions = net.peers[1].received(bye, net.now)
    assert [(type(a), getattr(a, "via", None)) for a in actions] == [(Post, "answer")]
    assert not net.peers[1].said_goodbye(2)


def test_a_frozen_peer_that_resumes_is_told_it_was_declared_lost() -> None:
    net = Net(6, stall=5.3)
    p3 = net.peers[3]
    net.start(3, "allreduce#0", needs=range(6), seq=0)
    net.killed.add(3)  # frozen: reads nothing, and its watchers' probes time out
    for w in (1, 2):
        net.apply(w, net.peers[w].probe_lost(3, net.now), 0)
    for _ in range(20):  # the others go on (and tick), 3 does not
        net.now += 0.5
        for r in net.survivors():
            net.apply(r, net.peers[r].tick(net.now), 0)
        while net.queue:
            net.deliver()
    assert all(net.peers[r].lost(3) for r in net.survivors())
    net.killed.discard(3)  # resumes: its own probes time out at once
    net.now += 0.01
    net.apply(3, p3.probe_lost(4, net.now), 0)
    net.apply(3, p3.probe_lost(5, net.now), 0)
    net.tick(1.0)
    assert net.declared[3].error.rank == 3
    assert net.fails[(3, "allreduce#0")] == 1
    assert p3.lost(4) is None and p3.lost(5) is None  # its neighbours are not blamed
    # no news of them: only the question to its watchers whether they declared it lost
    assert {(m.dst, m.header.meta["rank"]) for m in net.queue if m.src == 3} <= {(1, 3), (2, 3)}


def test_news_from_a_peer_declared_lost_is_answered_not_believed() -> None:
    net = Net(6)  # no stall clock: the resumed peer learns it from the others
    for w in (1, 2):
        net.apply(w, net.peers[w].probe_lost(3, net.now), 0)
    net.settle()
    net.apply(3, net.peers[3].probe_lost(4, net.now), 0)
    net.tick(LINK_LOSS_GRACE + 0.01)  # 3 calls 4 lost and tells its fingers
    net.settle()
    assert all(net.peers[r].lost(4) is None for r in net.survivors() if r != 3)
    assert net.declared[3].by != 3 and net.declared[3].error.rank == 3


def test_news_passed_to_a_finger_that_went_goes_on_from_its_replacement() -> None:
    # Rank 5 finds 0 and then 1 lost in one tick: the news of 0 went to its finger 1 (gone
    # too), so it goes to 2, which replaces it. Rank 4 is leaving and passes on nothing.
    net = Net(6)
    net.kill(1)
    net.kill(0)
    net.close(4, seq=6)
    net.settle()
    for r in net.survivors():
        assert set(net.peers[r].gone()) == {0, 1, 4}, r
    assert not net.violations


@pytest.mark.parametrize(("how", "says"), [
    ("killed", "ended without a word: its process was killed or crashed hard"),
    ("unresponsive", "stopped answering: its process is there but silent past the "
                     "heartbeat timeout"),
    ("", "is gone without closing the group: its process was killed or crashed, or it "
         "stopped answering"),
])
def test_a_loss_says_how_its_peer_went_and_its_news_carries_that(how: str, says: str) -> None:
    net = Net(6)
    net.killed.add(3)  # its other watcher's probe stays up: that one learns from the news
    # rank 2 (a watcher of 3) finds out what became of it before the grace is over
    net.apply(2, net.peers[2].link_closed(3, net.now, checking=True), 0)
    net.apply(2, net.peers[2].classified(3, how, net.now + 0.01), 0)
    net.settle()
    for r in net.survivors():
        err = net.peers[r].lost(3)
        assert err is not None and err.how == how and err.rank == 3
        assert str(err).startswith(f"rank 3 {says}"), str(err)
    assert not net.violations


def test_a_loss_waits_for_how_its_peer_went_but_not_forever() -> None:
    p = machine(0, 4, {"op": (range(4), 0)})
    assert p.link_closed(1, 0.0, checking=True) == []
    assert p.tick(LINK_LOSS_GRACE + 0.01) == [] and p.suspects(1)  # still finding out
    assert p.deadline() == pytest.approx(LINK_LOSS_GRACE + CHECK_WAIT)
    fails = [a for a in p.tick(LINK_LOSS_GRACE + CHECK_WAIT) if isinstance(a, Fail)]
    assert [f.error.how for f in fails] == [""] and p.lost(1) is fails[0].error
    # found out in time, after the grace: lost at once, saying so
    q = Departures(0, 4, GROUP)
    q.link_closed(1, 0.0, checking=True)
    q.tick(LINK_LOSS_GRACE + 0.01)
    assert q.classified(1, "killed", LINK_LOSS_GRACE + 0.02)
    err = q.lost(1)
    assert err is not None and err.how == "killed"


def test_a_suspect_found_killed_is_lost_without_waiting_out_the_grace() -> None:
    p = machine(0, 4, {"op": (range(4), 0)})
    p.link_closed(1, 0.0, checking=True)
    p.link_closed(2, 0.0, checking=True)
    assert p.classified(1, KILLED, 0.01) == []  # its goodbye may still be being read
    p.classified(2, UNRESPONSIVE, 0.01)
    assert p.deadline() == pytest.approx(0.01 + KILLED_WAIT)
    assert KILLED_WAIT < LINK_LOSS_GRACE
    fails = [a for a in p.tick(0.01 + KILLED_WAIT) if isinstance(a, Fail)]
    assert [f.error.rank for f in fails] == [1] and p.suspects(2)  # 2 has its grace
    assert p.lost(2) is None and p.tick(LINK_LOSS_GRACE) and p.lost(2) is not None
    # found killed late: the grace is over already, and it is lost at once
    q = Departures(0, 4, GROUP)
    q.link_closed(1, 0.0, checking=True)
    assert q.classified(1, KILLED, LINK_LOSS_GRACE + 0.01) and q.lost(1) is not None


def test_a_goodbye_read_after_the_port_was_found_closed_wins() -> None:
    p = Departures(0, 4, GROUP)
    p.link_closed(1, 0.0, checking=True)
    p.classified(1, KILLED, 0.01)
    p.received(Header("bye", GROUP, 1, 0, meta={"told": [0]}), 0.01 + KILLED_WAIT / 2)
    p.tick(1.0)
    assert p.said_goodbye(1)


def test_a_goodbye_after_a_link_closed_wins_over_how_it_was_found() -> None:
    p = Departures(0, 4, GROUP)
    p.link_closed(1, 0.0, checking=True)
    p.classified(1, "killed", 0.1)
    p.received(Header("bye", GROUP, 1, 0, meta={"told": [0]}), 0.2)
    p.tick(1.0)
    err = p.lost(1)
    assert p.said_goodbye(1) and err is not None and err.how == "closed"


def test_a_leaving_peer_logs_no_loss(caplog: pytest.LogCaptureFixture) -> None:
    net = Net(4)
    net.close(0)
    net.close(1)
    net.apply(0, net.peers[0].probe_lost(1, net.now), 0)
    net.tick(LINK_LOSS_GRACE + 0.01)
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


@pytest.mark.parametrize("seed", range(8))
def test_a_group_that_closes_around_a_peer_warns_it_of_nothing(
        seed: int, caplog: pytest.LogCaptureFixture) -> None:
    """Issue 35: 64 ranks that closed normally logged "rank 55: lost the connection to
    rank 14": a closing peer passes on no news, so a peer still there that watches, late,
    one whose watchers had both closed finds its port closed and its goodbye unheard."""
    rng = random.Random(seed)
    net = Net(16)
    for r in rng.sample(range(1, 16), 15):
        net.close(r, seq=1)
        for _ in range(rng.randint(0, 5)):
            if net.queue:
                net.deliver(rng.randrange(len(net.queue)))
        for c in net.closing():
            if not net.peers[c].unanswered() and rng.random() < 0.5:
                net.finish_close(c)
    net.settle()
    assert set(net.peers[0].gone()) == set(range(1, 16))
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_loss_before_any_goodbye_is_warned_of(caplog: pytest.LogCaptureFixture) -> None:
    net = Net(4)
    net.kill(2)
    net.settle()
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert "rank 1: lost the connection to rank 2" in warned, warned


def test_an_operation_fails_once_whatever_else_goes() -> None:
    ops: Ops = {"op": (range(8), 0)}
    p = machine(0, 8, ops)
    first = p.probe_lost(1, 0.0) + p.tick(1.0)
    second = p.probe_lost(2, 1.0) + p.tick(2.0)
    assert next(a for a in first if isinstance(a, Fail)).error.rank == 1
    assert not [a for a in second if isinstance(a, Fail)]
    # once it has ended, it is forgotten: an operation started since fails on its own
    del ops["op"]
    ops["next"] = (range(8), 1)
    third = p.probe_lost(3, 2.0) + p.tick(3.0)
    assert [a.op for a in third if isinstance(a, Fail)] == ["next"]


def test_a_rank_outside_the_group_is_refused() -> None:
    with pytest.raises(ValueError, match="not a rank"):
        Departures(4, 4, GROUP)


# -- the property test ---------------------------------------------------------------------


@st.composite
def runs(draw: st.DrawFn) -> tuple[int, list[tuple[str, int]], random.Random]:
    size = draw(st.integers(2, 12))
    ranks = st.integers(0, size - 1)
    events = draw(st.lists(st.tuples(st.sampled_from(["kill", "close", "abort", "deliver",
                                                      "tick", "link", "classify",
                                                      "finish"]), ranks),
                           max_size=40))
    order = draw(st.randoms(use_true_random=False))  # which message goes next, and such
    return size, events, order


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(runs())
def test_invariants_over_random_orders_of_events(
        run: tuple[int, list[tuple[str, int]], random.Random]) -> None:
    size, events, order = run
    quiet = logging.getLogger("p2pcoll")
    level, quiet.level = quiet.level, logging.ERROR  # thousands of losses: not logged
    try:
        check_invariants(size, events, order)
    finally:
        quiet.level = level


def check_invariants(size: int, events: list[tuple[str, int]], order: random.Random) -> None:
    net = Net(size)
    # every peer runs a collective (#5) and a send to its successor
    for r in range(size):
        net.start(r, ("c", 5), needs=range(size), seq=5)
        net.start(r, ("s", (r + 1) % size), needs={(r + 1) % size})
    closed_seq: dict[int, int] = {}
    for n, (kind, r) in enumerate(events):
        if kind == "kill" and net.live(r) and len(net.survivors()) > 1:
            net.kill(r)
        elif kind == "close" and net.live(r) and not net.peers[r].told:
            closed_seq[r] = order.randrange(8)  # before or after collective #5
            net.close(r, closed_seq[r])
        elif kind == "abort" and net.live(r):
            abort = Header("abort", GROUP, r, 100 + n, err=["CollectiveMismatch", "no"])
            net.apply(r, net.peers[r].failed(abort, net.links[r]), 0)
        elif kind == "link" and net.live(r):
            dst = order.randrange(size)
            if dst != r and net.peers[r].lost(dst) is None:
                net.links[r].add(dst)
        elif kind == "deliver" and net.queue:
            net.deliver(order.randrange(len(net.queue)))
        elif kind == "tick":
            net.tick(LINK_LOSS_GRACE / 2)
        elif kind == "classify" and net.live(r):
            net.classify(r)
        elif kind == "finish" and r in net.closing() and not net.peers[r].unanswered():
            net.finish_close(r)  # every farewell came: its port closes
    net.settle()

    assert not net.violations  # no message to a peer known gone
    assert not net.declared  # nobody stalled
    survivors = net.survivors()
    departed = net.killed | net.closed
    bound = math.ceil(math.log2(size)) + len(departed) + 1
    for r in survivors:
        me = net.peers[r]
        # every departure known to every survivor, within the bound
        assert set(me.gone()) == departed, (r, me.gone(), departed)
        for q in departed:
            assert net.learned[(r, q)] <= bound
            # lost, unless it said goodbye (which a watcher may miss: its probe went first)
            assert q in closed_seq or not me.gone()[q].graceful
            # a goodbye this peer was sent is never taken for a loss, even once the port
            # is found closed (the leaver closed after it, as its farewells came or not);
            # a leaver killed after its goodbye may be lost before the goodbye is read
            if q in closed_seq and q not in net.killed and r in net.peers[q].told:
                assert me.gone()[q].graceful, (r, q)
        # every live peer watched (and the probes follow what it watches)
        assert me.watched == overlay.watched(r, size, gone=departed)
        assert net.watching[r] == set(me.watched)
        # no operation failed twice, or never: exactly those a peer abandoned (a goodbye
        # after collective #5 started leaves it running, and a running send too)
        ops: list[tuple[Hashable, set[int], int | None]] = [
            (("c", 5), set(range(size)) - {r}, 5),
            (("s", (r + 1) % size), {(r + 1) % size} - {r}, None)]
        for op, needs, seq in ops:
            gone = me.gone()
            expect = any(not gone[q].graceful or (seq is not None and gone[q].started <= seq)
                         for q in needs & departed)
            assert net.fails[(r, op)] == int(expect), (r, op, net.fails[(r, op)])
    for q in survivors:
        assert len(watched_by(net, q)) == min(overlay.WATCHED, len(survivors) - 1)
    # each abort taken at most once by each peer
    assert all(n == 1 for n in net.aborted.values())
