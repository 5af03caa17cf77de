"""The rendezvous's rules (:mod:`p2pcoll.rendezvous.jobs`), without sockets: requests in,
replies out, the clock passed in. Each rule of a join and of a group's life, and a property
test over orders of requests."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import p2pcoll
from p2pcoll.rendezvous.admission import Admission
from p2pcoll.rendezvous.jobs import (
    FORMED_TTL,
    JOINED_SHOWN,
    MIN_HEARTBEAT,
    MISSING_SHOWN,
    SETTLE,
    Jobs,
    Reply,
    _Forming,
)
from p2pcoll.settings import RendezvousLimits
from p2pcoll.wire import WIRE_VERSION


def request(op: str = "join", **fields: Any) -> bytes:
    base: dict[str, Any] = {"v": WIRE_VERSION, "op": op, "job": ""}
    if op == "join":
        base.update(rank=None, world_size=None, endpoints=["tcp://127.0.0.1:1"], host="h",
                    pid=1, token=None, heartbeat=5.0, order=None, min=None, max=None)
    packed: bytes = msgpack.packb({**base, **fields})
    return packed


def decode(reply: Reply) -> dict[str, Any]:
    msg: dict[str, Any] = msgpack.unpackb(reply.frames[0], raw=False)
    if len(reply.frames) == 2:
        msg.update(msgpack.unpackb(reply.frames[1], raw=False))
    return msg


class Rendezvous:
    """A :class:`Jobs` and its clock, for tests: ``send`` a request, get the replies by
    client."""

    def __init__(self, **limits: Any) -> None:
        self.jobs = Jobs(RendezvousLimits(**limits))
        self.now = 1000.0
        self.raw: list[Reply] = []

    def send(self, who: str, op: str = "join", **fields: Any) -> dict[str, list[dict[str, Any]]]:
        return self._sorted(self.jobs.request([who.encode(), request(op, **fields)], self.now))

    def join(self, who: str, **fields: Any) -> dict[str, list[dict[str, Any]]]:
        fields.setdefault("token", who)
        fields.setdefault("pid", 100 + sum(map(ord, who)))
        return self.send(who, **fields)

    def tick(self, seconds: float, heard_until: float | None = None
             ) -> dict[str, list[dict[str, Any]]]:
        self.now += seconds
        return self._sorted(self.jobs.tick(self.now, self.now if heard_until is None
                                           else heard_until))

    def _sorted(self, replies: list[Reply]) -> dict[str, list[dict[str, Any]]]:
        self.raw = replies
        out: dict[str, list[dict[str, Any]]] = {}
        for r in replies:
            out.setdefault(r.to.decode(), []).append(decode(r))
        return out


def only(replies: dict[str, list[dict[str, Any]]], who: str) -> dict[str, Any]:
    assert list(replies) == [who] and len(replies[who]) == 1, replies
    return replies[who][0]


# --- a group of fixed size ---------------------------------------------------------------------


def test_a_fixed_group_forms_when_every_rank_is_there() -> None:
    rv = Rendezvous()
    first = only(rv.join("a", rank=1, world_size=3, host="ha"), "a")
    assert first["op"] == "status" and first["arrived"] == 1 and first["world_size"] == 3
    assert first["missing"] == [0, 2] and first["missing_count"] == 2
    assert only(rv.join("b", world_size=3), "b")["missing"] == [2]
    formed = rv.join("c", world_size=3)
    assert sorted(formed) == ["a", "b", "c"]
    rosters = {who: msgs[0] for who, msgs in formed.items()}
    assert {w: r["rank"] for w, r in rosters.items()} == {"a": 1, "b": 0, "c": 2}
    assert len({(r["group"], r["secret"], r["world_size"]) for r in rosters.values()}) == 1
    assert rosters["a"]["hosts"] == ["h", "ha", "h"]
    assert len({id(r.frames[1]) for r in rv.raw}) == 1  # one body for every member
    assert rv.jobs.stats() == {"peers": 0, "jobs": 0, "rosters": 3, "groups_formed": 1,
                               "requests": 3, "dropped": 0, "resends": 0}


def test_unranked_peers_go_by_order_then_arrival() -> None:
    rv = Rendezvous()
    rv.join("late", world_size=4)
    rv.join("second", world_size=4, order=5)
    rv.join("first", world_size=4, order=1)
    formed = rv.join("ranked", world_size=4, rank=0)
    ranks = {who: msgs[0]["rank"] for who, msgs in formed.items()}
    assert ranks == {"ranked": 0, "first": 1, "second": 2, "late": 3}


def test_a_resent_join_is_a_heartbeat_not_a_second_peer() -> None:
    rv = Rendezvous()
    rv.join("a", world_size=2)
    rv.tick(3.0)
    again = only(rv.join("a", world_size=2), "a")
    assert again["op"] == "status" and again["arrived"] == 1
    assert rv.jobs.stats()["peers"] == 1
    assert rv.tick(3.0) == {}  # heard 3 s ago, heartbeat 5 s: alive


def test_a_status_names_the_first_peers_that_joined() -> None:
    rv = Rendezvous()
    rv.join("a", rank=0, world_size=20, host="node-a/boot/1:2/3:4", pid=11)
    status = only(rv.join("b", world_size=20, host="node-b", pid=12), "b")
    assert status["joined"] == [[0, "node-a", 11], [None, "node-b", 12]]
    for i in range(12):
        status = only(rv.join(f"x{i}", world_size=20), f"x{i}")
    assert len(status["joined"]) == JOINED_SHOWN and status["arrived"] == 14
    assert status["missing_count"] == 6
    rv.send("a", "leave")
    assert only(rv.join("b", world_size=20), "b")["joined"][0] == [None, "node-b", 12]


def test_a_peer_that_asks_again_after_forming_gets_its_roster_again() -> None:
    rv = Rendezvous()
    rv.join("a", world_size=2)
    formed = rv.join("b", world_size=2)
    again = only(rv.join("a", world_size=2), "a")
    assert again == formed["a"][0]
    rv.tick(FORMED_TTL + 1)
    assert rv.jobs.stats()["rosters"] == 0
    assert only(rv.join("a", world_size=2), "a")["op"] == "status"  # a new group now


def test_a_formed_job_starts_its_next_group_and_jobs_are_apart() -> None:
    rv = Rendezvous()
    rv.join("a", world_size=2, job="x")
    assert only(rv.join("b", world_size=3, job="y"), "b")["arrived"] == 1
    assert sorted(rv.join("c", world_size=2, job="x")) == ["a", "c"]
    assert only(rv.join("d", world_size=5, job="x"), "d")["world_size"] == 5
    assert rv.jobs.stats()["jobs"] == 2


# --- joins refused ---------------------------------------------------------------------------


def test_two_processes_asking_for_one_rank_are_named_by_host_and_pid() -> None:
    rv = Rendezvous()
    rv.join("a", rank=0, world_size=3, host="node-1/boot/1:2/3:4", pid=4242)
    rv.join("b", rank=1, world_size=3)
    replies = rv.join("c", rank=0, world_size=3, host="node-1", pid=4343)
    reason = ("rank 0 was requested by two peers: node-1 pid 4242 and node-1 pid 4343; give "
              "each process its own rank (rank= or $RANK), or none to have the rendezvous "
              "number them")
    assert replies["a"][0]["reason"] == reason
    assert replies["c"][0]["reason"] == reason
    other = replies["b"][0]  # the group cannot form as asked: the peer waiting is told
    assert other["about"] == "other" and "cannot form as asked" in other["reason"]
    assert "node-1 (pid 4343, asking for rank 0)" in other["reason"]
    assert rv.jobs.stats()["peers"] == 0
    assert "pid 4343" in rv.jobs.refused_joins[-1]


def test_the_same_process_asking_again_replaces_its_registration() -> None:
    rv = Rendezvous()
    rv.join("old", rank=1, world_size=3, token="t", pid=7)
    replies = rv.join("new", rank=1, world_size=3, token="t", pid=7)
    assert "replaced this one" in only({"old": replies["old"]}, "old")["reason"]
    assert replies["new"][0]["op"] == "status"
    assert rv.jobs.stats()["peers"] == 1


@pytest.mark.parametrize(("first", "then", "reason"), [
    ({"world_size": 2}, {"rank": 2, "world_size": 2}, "rank 2 is out of range for world_size 2"),
    ({"world_size": 2}, {"world_size": 3}, "world_size 3 disagrees with world_size 2"),
    ({"min": 2, "max": 4}, {"world_size": 3}, "disagrees with an elastic group"),
    ({"min": 2, "max": 4}, {"min": 2, "max": 5}, "elastic bounds 2..5 disagree"),
    ({"min": 2, "max": 4}, {"min": 2, "max": 4, "rank": 0}, "assigns every rank"),
])
def test_a_join_that_does_not_fit_is_refused(first: dict[str, Any], then: dict[str, Any],
                                             reason: str) -> None:
    rv = Rendezvous()
    rv.join("a", **first)
    replies = rv.join("b", **then)
    assert reason in replies["b"][0]["reason"], replies
    elastic = "min" in first
    if elastic:  # an elastic group goes on without it
        assert "a" not in replies and rv.jobs.stats()["peers"] == 1
    else:  # a fixed one cannot form as asked: its peers are told at once
        assert replies["a"][0]["about"] == "other" and rv.jobs.stats()["peers"] == 0


def test_peers_without_a_size_adopt_the_first_given() -> None:
    rv = Rendezvous()
    rv.join("a", rank=0)
    rv.join("b", rank=3)
    replies = rv.join("c", world_size=3)
    assert replies["b"][0]["reason"] == "rank 3 is out of range for world_size 3"
    assert replies["c"][0]["op"] == "status" and replies["c"][0]["arrived"] == 2
    assert sorted(rv.join("d", world_size=3)) == ["a", "c", "d"]


@pytest.mark.parametrize(("limits", "fields", "reason"), [
    ({"max_world_size": 8}, {"world_size": 9}, "P2PCOLL_RENDEZVOUS_MAX_WORLD_SIZE"),
    ({"max_world_size": 8}, {"rank": 8}, "P2PCOLL_RENDEZVOUS_MAX_WORLD_SIZE"),
    ({"max_heartbeat": 10.0}, {"heartbeat": 11.0}, "P2PCOLL_RENDEZVOUS_MAX_HEARTBEAT"),
    ({"max_peers": 1}, {"world_size": 3}, "P2PCOLL_RENDEZVOUS_MAX_PEERS"),
    ({"max_jobs": 1}, {"job": "other"}, "P2PCOLL_RENDEZVOUS_MAX_JOBS"),
])
def test_a_bound_refuses_the_join_and_fails_nobody_else(
        limits: dict[str, Any], fields: dict[str, Any], reason: str) -> None:
    rv = Rendezvous(**limits)
    rv.join("a", world_size=3)
    replies = rv.join("b", **{"world_size": 3, **fields})
    assert reason in only(replies, "b")["reason"]
    assert rv.jobs.stats()["peers"] == 1  # "a" still waits


@pytest.mark.parametrize(("frames", "error"), [
    ([b"a"], None),
    ([b"a", b"b", b"c"], None),
    ([b"a", b"\xc1"], None),  # not msgpack
    ([b"a", msgpack.packb([1, 2])], None),  # not a map
    ([b"a", msgpack.packb({"v": -1, "op": "join"})], "wire version -1"),
    ([b"a", request(job="x" * 200)], "malformed job id"),
    ([b"a", request(endpoints=[])], "malformed join request"),
    ([b"a", request(host=7)], "malformed join request"),
    ([b"a", request(heartbeat=True)], "malformed join request"),
    ([b"a", request(world_size="2")], "world_size must be an integer"),
    ([b"a", request("shout")], "unknown request 'shout'"),
])
def test_a_malformed_request_is_dropped_or_refused(frames: list[bytes], error: str | None
                                                   ) -> None:
    jobs = Jobs(RendezvousLimits())
    replies = jobs.request(frames, 0.0)
    if error is None:
        assert replies == [] and jobs.dropped == 1
    else:
        assert len(replies) == 1 and error in decode(replies[0])["reason"]
    assert jobs.stats()["peers"] == 0


# --- a peer that leaves or is lost -------------------------------------------------------------


def test_leave_and_waiting() -> None:
    rv = Rendezvous()
    rv.join("a", world_size=3)
    rv.join("b", world_size=3)
    assert only(rv.send("q", "waiting"), "q") == {"op": "waiting", "count": 2}
    assert rv.send("a", "leave") == {}
    assert only(rv.send("q", "waiting"), "q")["count"] == 1
    rv.send("b", "leave")
    assert rv.jobs.stats()["jobs"] == 0
    assert only(rv.send("q", "waiting"), "q")["count"] == 0


def test_a_silent_peer_of_a_fixed_group_fails_the_others() -> None:
    rv = Rendezvous()
    rv.join("a", world_size=3, heartbeat=2.0, host="node-a", pid=77)
    rv.tick(1.5)
    rv.join("b", world_size=3, heartbeat=2.0)
    assert rv.tick(0.4) == {}
    replies = rv.tick(0.2)  # "a" last heard 2.1 s ago
    error = only(replies, "b")
    assert error["permanent"] is False
    assert "the peer on node-a (pid 77) registered and then stopped answering for 2.1s" in (
        error["reason"])
    assert rv.jobs.stats()["peers"] == 0 and rv.jobs.stats()["jobs"] == 0


def test_a_server_behind_its_requests_loses_nobody() -> None:
    rv = Rendezvous()
    rv.join("a", world_size=2, heartbeat=2.0)
    start = rv.now
    assert rv.tick(10.0, heard_until=start + 1.0) == {}  # the re-sends may be unread
    assert rv.jobs.stats()["peers"] == 1
    rv.join("a", world_size=2, heartbeat=2.0)  # they were there
    assert rv.tick(1.0) == {} and rv.jobs.stats()["peers"] == 1


def test_a_heartbeat_below_the_resend_period_is_raised() -> None:
    rv = Rendezvous()
    rv.join("a", world_size=2, heartbeat=0.1)
    rv.join("b", world_size=3, heartbeat=0.1, job="other")
    assert rv.tick(MIN_HEARTBEAT - 0.05) == {}
    assert rv.jobs.stats()["peers"] == 2
    rv.tick(0.1)
    assert rv.jobs.stats()["peers"] == 0


def test_an_elastic_group_goes_on_without_a_lost_peer() -> None:
    rv = Rendezvous()
    rv.join("a", min=2, max=4, heartbeat=1.0)
    rv.tick(0.6)
    rv.join("b", min=2, max=4, heartbeat=1.0)
    rv.join("c", min=2, max=4, heartbeat=1.0)
    assert rv.tick(0.5) == {}  # "a" is lost: nobody told, two remain
    assert rv.jobs.stats()["peers"] == 2
    formed: dict[str, list[dict[str, Any]]] = {}
    while not formed:  # two, the minimum: it forms once nobody new came for SETTLE
        assert rv.now < 1000.6 + SETTLE + 0.5
        rv.join("b", min=2, max=4, heartbeat=1.0)
        rv.join("c", min=2, max=4, heartbeat=1.0)
        formed = rv.tick(0.25)
    assert rv.now >= 1000.6 + SETTLE
    assert sorted(formed) == ["b", "c"] and formed["b"][0]["world_size"] == 2


# --- elastic groups ------------------------------------------------------------------------------


def test_an_elastic_group_forms_once_settled_or_full_and_then_the_next_starts() -> None:
    rv = Rendezvous()
    for who, order in (("a", 3), ("b", None), ("c", 1)):
        assert only(rv.join(who, min=2, max=5, order=order), who)["op"] == "status"
    rv.tick(SETTLE * 0.6)
    rv.join("d", min=2, max=5)  # an arrival: the settling starts again
    for who in "abc":
        rv.join(who, min=2, max=5, order=None)
    assert rv.tick(SETTLE * 0.6) == {}
    formed = rv.tick(SETTLE * 0.6)
    assert {who: m[0]["rank"] for who, m in formed.items()} == {"c": 0, "a": 1, "b": 2, "d": 3}
    assert rv.jobs.stats()["peers"] == 0
    for who in "efgh":  # the next group: it forms at once at its maximum
        assert only(rv.join(who, min=2, max=5), who)["op"] == "status"
    formed = rv.join("i", min=2, max=5)
    assert {who: m[0]["world_size"] for who, m in formed.items()} == dict.fromkeys("efghi", 5)


def test_an_elastic_group_below_its_minimum_does_not_form() -> None:
    rv = Rendezvous()
    rv.join("a", min=3, max=None)
    rv.join("b", min=3, max=None)
    assert rv.tick(SETTLE * 3) == {}
    formed = rv.join("c", min=3, max=None)
    assert formed["c"][0]["op"] == "status"  # enough, but not settled yet
    assert sorted(rv.tick(SETTLE)) == ["a", "b", "c"]


def test_an_elastic_group_forms_once_what_a_join_expects_is_there() -> None:
    """The survivors of a loss expect themselves and the peers counted waiting: the group
    forms as they arrive, not a second later; one expected that does not come leaves the
    others to settle as before."""
    rv = Rendezvous()
    rv.join("new", min=3, max=4)  # a newcomer, waiting
    # the second survivor counted the first among the waiting: one too many
    assert only(rv.join("a", min=3, max=4, order=0, expect=3), "a")["op"] == "status"
    formed = rv.join("b", min=3, max=4, order=1, expect=4)
    assert {who: m[0]["world_size"] for who, m in formed.items()} == dict.fromkeys(
        ["a", "b", "new"], 3)
    # the next group: the expectation was met and is forgotten
    for who in "cde":
        assert only(rv.join(who, min=3, max=5), who)["op"] == "status"
    assert rv.tick(SETTLE * 0.5) == {}
    assert sorted(rv.tick(SETTLE * 0.6)) == ["c", "d", "e"]
    # more expected than come: settled as without it
    rv.join("f", min=2, max=4, expect=3)
    assert only(rv.join("g", min=2, max=4, expect=3), "g")["op"] == "status"
    assert rv.tick(SETTLE * 0.5) == {}
    assert sorted(rv.tick(SETTLE * 0.6)) == ["f", "g"]


def test_a_member_that_learns_of_a_loss_lowers_what_the_forming_group_expects() -> None:
    """Members joining after an admission expect themselves and the newcomer; one of them
    killed on the way never comes. A member that learns of it says so (a ``waiting``
    question with ``expect``), and the group forms at once with those there, where it
    would have waited for the rest of SETTLE."""
    rv = Rendezvous()
    rv.join("new", min=3, max=4)
    assert only(rv.join("a", min=3, max=4, order=0, expect=4), "a")["op"] == "status"
    assert only(rv.join("b", min=3, max=4, order=1, expect=4), "b")["op"] == "status"
    assert rv.tick(SETTLE * 0.5) == {}  # enough for the minimum, but not settled
    told = rv.send("census", "waiting", expect=3)  # rank 2 of the old group was lost
    assert {who: m[0]["op"] for who, m in told.items()} == {
        "census": "waiting", "a": "roster", "b": "roster", "new": "roster"}
    assert told["census"][0]["count"] == 3
    assert [m["rank"] for m in (told["a"][0], told["b"][0], told["new"][0])] == [0, 1, 2]
    # below the minimum, a lowered expectation forms nothing
    rv.join("c", min=3, max=4)
    assert only(rv.send("census", "waiting", expect=1), "census")["count"] == 1
    assert only(rv.send("census2", "waiting", expect="x"), "census2")["op"] == "error"


def test_a_join_that_expects_no_integer_is_refused() -> None:
    rv = Rendezvous()
    assert only(rv.join("a", min=2, max=4, expect="3"), "a")["op"] == "error"
    assert only(rv.join("b", min=2, max=4, expect=0), "b")["op"] == "error"


# --- admission ---------------------------------------------------------------------------------


def test_a_connection_over_its_rate_is_told_once_and_its_resends_never_refused() -> None:
    jobs = Jobs(RendezvousLimits(rate=2.0))
    same = request(world_size=3, token="t")
    for _ in range(2):
        assert decode(jobs.request([b"a", same], 0.0)[0])["op"] == "status"
    for _ in range(50):  # its re-sends, held back and delivered at once
        assert jobs.request([b"a", same], 0.0) == []
    assert jobs.resends == 50 and jobs.dropped == 0
    told = jobs.request([b"a", request("waiting")], 0.0)
    assert "P2PCOLL_RENDEZVOUS_RATE" in decode(told[0])["reason"]
    assert jobs.request([b"a", request("waiting")], 0.0) == []  # told once
    assert jobs.dropped == 2
    assert decode(jobs.request([b"a", request("waiting")], 0.5)[0])["op"] == "waiting"


def test_admission_forgets_the_least_recently_heard_connection() -> None:
    admission = Admission(rate=1.0, kept=2)
    assert admission.admit(b"a", b"x", 0.0) == "handle"
    assert admission.admit(b"a", b"y", 0.0) == "over-told"
    admission.admit(b"b", b"x", 0.0)
    admission.admit(b"c", b"x", 0.0)  # "a" is forgotten: a fresh bucket
    assert admission.admit(b"a", b"y", 0.0) == "handle"


# --- properties ----------------------------------------------------------------------------------


# The machine is shared: slow input generation is its load, not the test's.
SETTINGS = settings(deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(st.integers(1, 40), st.lists(st.integers(0, 60), unique=True, max_size=30),
       st.integers(0, 40))
def test_missing_ranks_are_the_free_ranks_after_the_unranked(
        world: int, requested: list[int], unranked: int) -> None:
    taken = sorted(r for r in requested if r < world)[:world]
    unranked = min(unranked, world - len(taken))
    forming = _Forming("", world_size=world, taken=taken)
    forming.entries = {bytes([i]): None for i in range(len(taken) + unranked)}  # type: ignore
    free = [r for r in range(world) if r not in taken]
    count, shown = forming.missing()
    assert count == world - len(taken) - unranked
    assert shown == free[unranked:][:MISSING_SHOWN]


_ACTIONS = st.lists(st.one_of(
    st.tuples(st.just("join"), st.integers(0, 4)),
    st.tuples(st.just("join"), st.integers(0, 4)),
    st.tuples(st.just("join"), st.integers(0, 4)),
    st.tuples(st.just("leave"), st.integers(0, 4)),
    st.tuples(st.just("tick"), st.floats(0.0, 2.0)),
), min_size=20, max_size=60)
# What each of five peers asks for: mostly its own rank or none, now and then one taken.
_WANTED = st.tuples(*(st.sampled_from([None, i, i]) for i in range(4)),
                    st.sampled_from([None, None, None, 0, 1, 2, 3]))


@settings(SETTINGS, max_examples=100)
@given(_WANTED, _ACTIONS)
def test_any_order_of_requests_forms_each_group_once_and_right(
        wanted: tuple[int | None, ...], actions: list[tuple[str, Any]]) -> None:
    """Five peers of a group of four join, re-send, leave and go silent in any order (each
    asking for a rank or not). What holds after every step: the registrations counted are
    those the peers think they hold; a group forms only with four peers, then with ranks
    0..3 each once, requested ranks honoured, one body naming the members in rank order;
    no peer gets a roster twice but for asking again; a refused peer is told why."""
    rv = Rendezvous(max_world_size=8)
    heartbeat = 4.0
    held: dict[int, float] = {}  # the peers the server should hold: when last heard
    rostered: dict[int, int] = {}  # peer -> its rank, in the group it got
    for action, arg in actions:
        if action == "tick":
            replies = rv.tick(arg)
            lost = {p for p, seen in held.items() if seen + heartbeat <= rv.now}
            if lost:  # the others of the fixed group are failed with them, told so
                assert set(replies) == {f"p{p}" for p in set(held) - lost}, replies
                assert all("stopped answering" in m[0]["reason"] for m in replies.values())
                held.clear()
            else:
                assert replies == {}, replies
        elif action == "leave":
            assert rv.send(f"p{arg}", "leave") == {}
            held.pop(arg, None)
        else:
            peer = arg
            replies = rv.join(f"p{peer}", world_size=4, rank=wanted[peer],
                              heartbeat=heartbeat, endpoints=[f"tcp://e:{peer}"])
            mine = replies[f"p{peer}"]
            assert len(mine) == 1
            if peer in rostered and peer not in held and mine[0]["op"] == "roster":
                assert mine[0]["rank"] == rostered[peer] and list(replies) == [f"p{peer}"]
                continue  # it asked again: its roster again
            if mine[0]["op"] == "error":  # a rank asked for twice: the group cannot form
                assert "requested by two peers" in mine[0]["reason"], mine
                assert set(replies) == {f"p{p}" for p in {*held, peer}}, replies
                held.clear()
            else:
                held[peer] = rv.now
                rosters = {int(w[1:]): m[0] for w, m in replies.items()}
                if mine[0]["op"] == "status":
                    assert list(rosters) == [peer] and mine[0]["arrived"] == len(held)
                else:
                    assert set(rosters) == set(held) and len(rosters) == 4
                    ranks = {p: r["rank"] for p, r in rosters.items()}
                    assert sorted(ranks.values()) == [0, 1, 2, 3]
                    for p, r in ranks.items():
                        assert wanted[p] is None or wanted[p] == r
                        assert rosters[p]["endpoints"][r] == [f"tcp://e:{p}"]
                    rostered.update(ranks)
                    held.clear()
        assert rv.jobs.stats()["peers"] == len(held), (held, rv.jobs.stats())


def _imports(module: str, seen: set[str]) -> set[str]:
    """The modules outside p2pcoll that ``module`` (of p2pcoll) imports at run time,
    following its imports within p2pcoll (not the ``if TYPE_CHECKING:`` ones, nor the
    ``__init__`` of the packages above it)."""
    if module in seen:
        return set()
    seen.add(module)
    root = Path(p2pcoll.__file__).parent.parent
    path = root.joinpath(*module.split("."))
    is_package = path.is_dir()
    tree = ast.parse((path / "__init__.py" if is_package else path.with_suffix(".py"))
                     .read_text())
    package = module if is_package else module.rpartition(".")[0]
    skipped = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
               and ast.unparse(node.test) == "TYPE_CHECKING" for n in ast.walk(node)}
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - node.level + 1]
            target = ".".join(base + ([node.module] if node.module else [])) if node.level \
                else str(node.module)
            names = [target] + [f"{target}.{a.name}" for a in node.names
                                if root.joinpath(*target.split("."), a.name).exists()
                                or root.joinpath(*target.split("."), a.name + ".py").exists()]
        for name in names:
            if name.partition(".")[0] == "p2pcoll":
                found |= _imports(name, seen)
            else:
                found.add(name.partition(".")[0])
    return found


def test_the_rules_import_no_sockets_and_no_event_loop() -> None:
    """jobs.py (and what it imports of p2pcoll) needs no zmq, no socket, no event loop."""
    outside = _imports("p2pcoll.rendezvous.jobs", set())
    assert "zmq" in _imports("p2pcoll.rendezvous.server", set())  # the walk sees them
    assert not outside & {"zmq", "asyncio", "socket", "selectors", "threading"}, outside
