"""Eager credits, the pure ledgers (p2pcoll.engine.credit): the rule, the batching, and a
model of two ranks that checks, over random programs, windows and message orders, that
collectives never deadlock on credit and that a receiver holds at most a window (and the
operation in hand) of a sender's messages."""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pcoll.engine.credit import MESSAGE_COST, Receipts, SendLedger
from p2pcoll.types import OpKey

W = 10_000


def test_an_operation_larger_than_the_window_goes_whole() -> None:
    ledger = SendLedger(W)
    for _ in range(5):
        assert ledger.may_send(OpKey(0), 1)
        ledger.sent(OpKey(0), [1], 3 * W)
    assert ledger.outstanding(1) == 5 * (3 * W + MESSAGE_COST)
    assert not ledger.may_send(OpKey(1), 1)  # a later collective waits
    assert ledger.may_send(OpKey(1), 2)  # another peer does not


def test_a_collective_waits_only_for_earlier_ones() -> None:
    ledger = SendLedger(W)
    ledger.sent(OpKey(3), [1], 2 * W)
    assert ledger.may_send(OpKey(2), 1) and ledger.may_send(OpKey(3), 1)
    assert not ledger.may_send(OpKey(4), 1)
    ledger.credit(1, floor=3, p2p_credited=0)  # collective 3 not finished there yet
    assert not ledger.may_send(OpKey(4), 1)
    ledger.credit(1, floor=4, p2p_credited=0)
    assert ledger.may_send(OpKey(4), 1) and ledger.outstanding(1) == 0


def test_reports_out_of_order_or_twice_count_once() -> None:
    ledger = SendLedger(W)
    for seq in range(4):
        ledger.sent(OpKey(seq), [1], W)
    ledger.credit(1, floor=3, p2p_credited=0)
    ledger.credit(1, floor=1, p2p_credited=0)  # an older report, late
    assert ledger.outstanding(1) == W + MESSAGE_COST
    ledger.sent(OpKey(2), [1], W)  # a record the report overtook: already credited
    assert ledger.outstanding(1) == W + MESSAGE_COST


def test_a_transfer_waits_for_what_was_sent_before_it_started() -> None:
    ledger = SendLedger(W)
    t0, t1 = OpKey.transfer(0, 1, 0, 0), OpKey.transfer(0, 1, 5, 0)
    ledger.begin(t0, 1)
    for _ in range(4):  # its own messages never wait
        assert ledger.may_send(t0, 1)
        ledger.sent(t0, [1], W)
    ledger.begin(t1, 1)
    assert not ledger.may_send(t1, 1)
    assert ledger.may_send(OpKey(0), 1)  # collectives keep their own account
    ledger.credit(1, floor=0, p2p_credited=4 * (W + MESSAGE_COST))
    assert ledger.may_send(t1, 1)
    ledger.end(t0, 1)
    ledger.end(t1, 1)


def test_empty_messages_count_too() -> None:
    ledger = SendLedger(W)
    for _ in range(W // MESSAGE_COST + 1):
        ledger.sent(OpKey(0), [1], 0)
    assert not ledger.may_send(OpKey(1), 1)


def test_a_gone_peer_is_forgotten_on_both_sides() -> None:
    ledger, receipts = SendLedger(W), Receipts(W)
    ledger.sent(OpKey(0), [1], 3 * W)
    receipts.arrived(OpKey(0), 1, 3 * W)
    receipts.arrived(OpKey.transfer(1, 0, 0, 0), 1, 5)
    ledger.forget(1)
    receipts.forget(1)
    assert ledger.outstanding(1) == 0 and ledger.may_send(OpKey(9), 1)
    assert receipts.held(1) == 0 and receipts.collective_finished(1) == []


def test_the_receiver_reports_once_per_half_window() -> None:
    receipts = Receipts(W)
    reports = 0
    for seq in range(100):
        receipts.arrived(OpKey(seq), 1, 1000)
        for src in receipts.collective_finished(seq + 1):
            assert src == 1
            floor, _ = receipts.report(src)
            assert floor == seq + 1
            reports += 1
    per_report = -(-(W // 2) // (1000 + MESSAGE_COST))  # collectives a report covers
    assert reports == 100 // per_report


def test_transfers_are_credited_when_finished_or_dropped() -> None:
    receipts = Receipts(W)
    t = OpKey.transfer(1, 0, 0, 0)
    receipts.arrived(t, 1, W)
    assert receipts.held(1) == W + MESSAGE_COST
    assert receipts.transfer_finished(t) == [1]
    assert receipts.report(1) == (0, W + MESSAGE_COST)
    assert receipts.held(1) == 0
    assert receipts.dropped(t, 1, 10) == []  # under half a window
    assert receipts.dropped(OpKey(0), 1, W) == []  # a collective's: the watermark's
    assert receipts.report(1) == (0, W + 2 * MESSAGE_COST + 10)


def test_a_receiver_without_a_window_reports_when_asked() -> None:
    receipts = Receipts(0)
    receipts.arrived(OpKey(0), 1, 100)
    assert receipts.collective_finished(1) == []  # it never reports unasked
    assert receipts.ask(1, 400)  # something finished since: report now
    assert receipts.report(1) == (1, 0)
    receipts.arrived(OpKey(1), 1, 100)
    assert receipts.collective_finished(2) == [1]  # by half the asker's window now


def test_collectives_finishing_out_of_order_wait_for_the_watermark() -> None:
    receipts = Receipts(W)
    for seq in range(3):
        receipts.arrived(OpKey(seq), 2, W)
    assert receipts.collective_finished(0) == []
    assert receipts.collective_finished(3) == [2]
    assert receipts.report(2) == (3, 0)
    assert receipts.held(2) == 0


_ledger_events = st.lists(st.one_of(
    st.tuples(st.just("sent"), st.integers(0, 6), st.integers(0, 3), st.integers(0, 3 * W),
              st.booleans()),
    st.tuples(st.just("credit"), st.integers(0, 3), st.integers(0, 8),
              st.integers(0, 20 * W)),
    st.tuples(st.just("forget"), st.integers(0, 3)),
), max_size=40)


@given(events=_ledger_events)
@settings(max_examples=200, deadline=None)
def test_the_ledgers_total_is_every_peers_outstanding_summed(
        events: list[tuple[Any, ...]]) -> None:
    # The executor lets every message go while the total is within the window: that holds
    # only if no peer's outstanding is ever above the total, whatever comes: reports out of
    # order, twice, ahead of the sender's own count of a send (crediting more than it has
    # counted: a peer's outstanding below zero for a while), peers forgotten.
    ledger = SendLedger(W)
    for event in events:
        if event[0] == "sent":
            _, n, peer, nbytes, transfer = event
            op = OpKey.transfer(0, peer, 5, n) if transfer else OpKey(n)
            ledger.sent(op, [peer], nbytes)
        elif event[0] == "credit":
            _, peer, floor, credited = event
            ledger.credit(peer, floor=floor, p2p_credited=credited)
        else:
            ledger.forget(event[1])
        outstanding = [ledger.outstanding(peer) for peer in range(4)]
        assert ledger.total == sum(max(o, 0) for o in outstanding)
        assert all(o <= ledger.total for o in outstanding)
        if ledger.total <= W:
            assert all(ledger.may_send(OpKey(9), peer) for peer in range(4))


def test_bad_windows_are_refused() -> None:
    with pytest.raises(ValueError, match="window"):
        SendLedger(0)
    with pytest.raises(ValueError, match="window"):
        Receipts(-1)


# -- A model of two ranks running collectives and transfers over a network that delivers in
# any order. Each rank walks its program one step at a time as the executor does (a send
# waits while the ledger says no, a receive until its message came); an operation finishes
# when its steps are done, and the receiver's side reports as it says.


@dataclass
class Rank:
    me: int
    window: int  # the ledger's (> 0)
    receipts_window: int
    program: list[tuple[OpKey, list[tuple[str, int]]]]  # (op, [("send", n) | ("recv", i)])
    ledger: SendLedger = field(init=False)
    receipts: Receipts = field(init=False)
    op_index: int = 0
    step: int = 0
    arrived: set[tuple[OpKey, int]] = field(default_factory=set)
    asked: bool = False
    held_peak: int = 0
    watermark: int = 0

    def __post_init__(self) -> None:
        self.ledger = SendLedger(self.window)
        self.receipts = Receipts(self.receipts_window)

    @property
    def done(self) -> bool:
        return self.op_index == len(self.program)


def _run(ranks: list[Rank], rng: random.Random) -> int:
    """Run the model to the end; returns the steps taken. Fails on a deadlock."""
    net: deque[tuple[int, str, object]] = deque()  # (to, kind, payload) in flight
    counts = {0: 0, 1: 0}  # messages of the current op sent, per rank
    steps = 0
    while not all(r.done for r in ranks) or net:
        steps += 1
        moves = []
        for r in ranks:
            if r.done:
                continue
            op, todo = r.program[r.op_index]
            kind, n = todo[r.step]
            peer = 1 - r.me
            if op.tag is not None and op.src == r.me and r.step == 0:
                r.ledger.begin(op, peer)  # as the executor does when a transfer starts
            if kind == "send":
                if r.ledger.may_send(op, peer):
                    moves.append(("send", r))
                elif not r.asked:
                    moves.append(("ask", r))
            elif (op, n) in r.arrived:
                moves.append(("recv", r))
        if net:
            moves.append(("deliver", None))
        assert moves, "deadlock: " + repr([(r.op_index, r.step) for r in ranks])
        what, r = rng.choice(moves)
        if what == "deliver":
            to, kind, payload = net.popleft() if rng.random() < 0.5 else net.pop()
            dest = ranks[to]
            if kind == "data":
                op, index, nbytes = payload  # type: ignore[misc]
                dest.receipts.arrived(op, 1 - to, nbytes)
                dest.arrived.add((op, index))
                dest.held_peak = max(dest.held_peak, dest.receipts.held(1 - to))
            elif kind == "report":
                floor, credited = payload  # type: ignore[misc]
                dest.ledger.credit(1 - to, floor, credited)
                dest.asked = False
            else:  # ask
                if dest.receipts.ask(1 - to, payload):  # type: ignore[arg-type]
                    net.append((1 - to, "report", dest.receipts.report(1 - to)))
            continue
        assert r is not None
        op, todo = r.program[r.op_index]
        peer = 1 - r.me
        if what == "ask":
            r.asked = True
            net.append((peer, "ask", r.window))
            continue
        if what == "send":
            nbytes = todo[r.step][1]
            net.append((peer, "data", (op, counts[r.me], nbytes)))
            counts[r.me] += 1
            r.ledger.sent(op, [peer], nbytes)
        else:
            r.arrived.discard((op, todo[r.step][1]))
        r.step += 1
        if r.step == len(todo):  # the operation finished here
            counts[r.me] = 0
            if op.tag is None:
                r.watermark = op.number + 1
                due = r.receipts.collective_finished(r.watermark)
            else:
                r.ledger.end(op, peer)
                due = r.receipts.transfer_finished(op) if op.src == peer else []
            for src in due:
                net.append((src, "report", r.receipts.report(src)))
            r.op_index += 1
            r.step = 0
    return steps


def _collective(sends: list[list[int]], rng: random.Random) -> list[list[tuple[str, int]]]:
    """Each rank's steps in one collective: its sends (sizes) and receives of the other's,
    in order per direction as on a link, in an order that completes when sends never wait
    (as every strategy's does): both follow one global order of the messages, then each
    rank moves some receives later (a send never waits for a receive, unbounded)."""
    order = [0] * len(sends[0]) + [1] * len(sends[1])
    rng.shuffle(order)
    out = []
    for me in (0, 1):
        sizes, steps, received = iter(sends[me]), [], 0
        for sender in order:
            if sender == me:
                steps.append(("send", next(sizes)))
            else:
                steps.append(("recv", received))
                received += 1
        for _ in range(len(steps)):  # receives drift later
            i = rng.randrange(len(steps) - 1) if len(steps) > 1 else 0
            if steps[i:i + 2] and steps[i][0] == "recv" and i + 1 < len(steps) \
                    and steps[i + 1][0] == "send":
                steps[i], steps[i + 1] = steps[i + 1], steps[i]
        out.append(steps)
    return out


sizes = st.lists(st.integers(0, 3 * W), min_size=0, max_size=6)


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(st.tuples(sizes, sizes), min_size=1, max_size=12),
       windows=st.tuples(st.sampled_from([1, 500, W, 4 * W]),
                         st.sampled_from([1, 500, W, 4 * W])),
       receipts_zero=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_collectives_never_deadlock_and_hold_at_most_the_window(
        ops: list[tuple[list[int], list[int]]], windows: tuple[int, int], receipts_zero: bool,
        seed: int) -> None:
    rng = random.Random(seed)
    programs: list[list[tuple[OpKey, list[tuple[str, int]]]]] = [[], []]
    ops = [(a, b) if a or b else ([0], b) for a, b in ops]
    for seq, (a, b) in enumerate(ops):
        steps = _collective([a, b], rng)
        for me in (0, 1):
            # A rank with nothing to do in a collective finishes it at once.
            programs[me].append((OpKey(seq), steps[me] or [("recv", -1)]))
    ranks = [Rank(me, windows[me], 0 if receipts_zero else windows[me], programs[me])
             for me in (0, 1)]
    for r in ranks:  # the empty steps: a receive that has always come
        r.arrived.update((op, -1) for op, _ in r.program)
    _run(ranks, rng)
    biggest = max(sum(n + MESSAGE_COST for n in side) for pair in ops for side in pair)
    for me in (0, 1):
        # What the other sent in earlier collectives (at most its window when its last
        # message went), and the collective that message was of.
        assert ranks[me].held_peak <= windows[1 - me] + biggest


@settings(max_examples=300, deadline=None)
@given(transfers=st.lists(st.lists(st.integers(0, 3 * W), min_size=1, max_size=4),
                          min_size=1, max_size=12),
       window=st.sampled_from([1, 500, W, 4 * W]), receipts_zero=st.booleans(),
       seed=st.integers(0, 2**32 - 1))
def test_a_stream_of_transfers_never_deadlocks_and_holds_at_most_the_window(
        transfers: list[list[int]], window: int, receipts_zero: bool, seed: int) -> None:
    """Rank 0 sends transfers (each one or more messages) that rank 1 receives in order."""
    rng = random.Random(seed)
    send_prog = [(OpKey.transfer(0, 1, 0, k), [("send", n) for n in t])
                 for k, t in enumerate(transfers)]
    recv_prog = [(OpKey.transfer(0, 1, 0, k), [("recv", i) for i in range(len(t))])
                 for k, t in enumerate(transfers)]
    ranks = [Rank(0, window, 0 if receipts_zero else window, send_prog),
             Rank(1, window, 0 if receipts_zero else window, recv_prog)]
    _run(ranks, rng)
    biggest = max(sum(n + MESSAGE_COST for n in t) for t in transfers)
    assert ranks[1].held_peak <= window + biggest
