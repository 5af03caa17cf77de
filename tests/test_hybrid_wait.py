"""Hybrid waiting on the board (p2pcoll.engine.waiting): the polling budget learned per peer
stays within its ceiling, shrinks for late partners and grows back for punctual ones; and
real peer processes, one of them stopped (SIGSTOP) and one slow, finish every collective
with the same bits as numpy's fold in rank order."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import finish
from p2pcoll.engine import board_path
from p2pcoll.engine.board_path import MIN_NAP, BoardPath
from p2pcoll.engine.waiting import MARGIN, PROBE, Patience
from p2pcoll.testing import free_port
from p2pcoll.transport.board import COUNT, STAMP, WORDS, Board


def test_the_budget_never_exceeds_the_ceiling() -> None:
    rng = np.random.default_rng(7)
    for ceiling in (0.0, 1e-6, 50e-6, 0.01):
        patience = Patience(ceiling, 4)
        for _ in range(2000):
            # Lateness from "there first" to far beyond any ceiling, in bursts of each.
            patience.learn(int(rng.integers(4)),
                           float(rng.choice([-1.0, 1.0]) * 10 ** rng.uniform(-8, 1)))
            budget = patience.budget(range(4))
            assert 0 <= budget <= ceiling
            assert patience.budget([]) == 0  # nobody to wait for
        if ceiling == 0:
            assert patience.budget(range(4)) == 0  # P2PCOLL_SPIN=0: never polls


def test_a_late_partner_gets_the_margin_and_punctual_ones_the_ceiling() -> None:
    ceiling = 200e-6
    patience = Patience(ceiling, 3)
    assert patience.budget([1, 2]) == ceiling  # unknown peers: poll first, then learn
    for _ in range(40):
        patience.learn(1, 0.05)  # 50 ms late every time: a stopped or computing partner
        patience.learn(2, 10e-6)
    assert patience.usual(1) < 0.5 and patience.usual(2) > 0.99
    assert patience.budget([1]) == MARGIN
    assert patience.budget([2]) == ceiling
    assert patience.budget([1, 2]) == MARGIN  # it waits for the late one anyway
    for _ in range(20):
        patience.learn(1, 0.0)  # back on time (or there first)
    assert patience.usual(1) >= 0.5 and patience.budget([1]) == ceiling  # polled again


def test_a_partner_that_comes_only_as_the_budget_ends_stops_the_polling() -> None:
    # A partner on this rank's own core runs only once this rank stops polling: it
    # comes at the budget's end every time, which is no reason to poll.
    ceiling = 5e-3
    patience = Patience(ceiling, 2)
    for _ in range(40):
        patience.learn(1, patience.budget([1]) + 1e-6)
    assert patience.budget([1]) == MARGIN


def test_early_arrivals_settle_the_policy_and_one_late_arrival_unsettles_it() -> None:
    # While every peer comes early the policy is sure: a wait that finds its partners
    # within the quick poll need not learn (it would change nothing).
    patience = Patience(50e-6, 3)
    assert patience.sure and patience.quick == MARGIN
    patience.learn(1, 1e-3)  # late
    assert not patience.sure and patience.usual(1) == 1 - 1 / 8
    patience.learn(2, 1e-3)
    for _ in range(200):  # early again: both averages settle at exactly 1
        patience.learn(1, 1e-6)
        assert not patience.sure
        patience.learn(2, -1.0)
        if patience.usual(1) == patience.usual(2) == 1.0:
            break
    assert patience.sure and patience.usual(1) == patience.usual(2) == 1.0
    assert patience.budget([1, 2]) == 50e-6
    assert Patience(4e-6, 2).quick == 2e-6  # half a small ceiling: still "early"
    assert Patience(0.0, 2).quick == 0.0


def test_a_late_partner_is_probed_with_the_ceiling_once_in_probe_waits() -> None:
    patience = Patience(50e-6, 2)
    for _ in range(40):
        patience.learn(1, 0.05)
    budgets = [patience.budget([1]) for _ in range(3 * PROBE)]
    assert budgets.count(50e-6) == 3 and budgets.count(MARGIN) == 3 * PROBE - 3


def _two_ranks(rounds: int, wake: float, work: tuple[float, float]) -> tuple[list[float], list[Patience]]:
    """Two ranks of a board allreduce, simulated on the clock the board's stamps give: each
    round a rank publishes, then waits for its partner's publication as BoardPath._wait
    does (a quick poll, a poll for its budget, else a sleep that ends ``wake`` seconds after
    the partner publishes), then works ``work[rank]`` seconds before its next publication.
    Both ranks start out distrusting each other, rank 1 100 us behind. The time of each
    round (from the end of the one before)."""
    ranks = [Patience(50e-6, 2), Patience(50e-6, 2)]
    for rank, patience in enumerate(ranks):
        for _ in range(40):
            patience.learn(1 - rank, 1e-3)
    published, rounds_took, ended = [0.0, 100e-6], [], 100e-6
    for _ in range(rounds):
        done = [0.0, 0.0]
        for rank, patience in enumerate(ranks):
            mine, theirs = published[rank], published[1 - rank]
            late = theirs - mine
            if late <= 0:  # there first: no wait, nothing learned
                done[rank] = mine
                continue
            if late <= patience.quick and patience.sure:
                done[rank] = theirs
                continue
            polled = late <= patience.quick or late <= patience.budget([1 - rank])
            done[rank] = theirs if polled else theirs + wake
            patience.learn(1 - rank, late)
        rounds_took.append(max(done) - ended)
        ended = max(done)
        published = [done[r] + work[r] for r in (0, 1)]
    return rounds_took, ranks


def test_two_ranks_that_both_sleep_get_back_in_step() -> None:
    # A wake-up of 35 us is beyond "early" (half the 50 us ceiling): two ranks that both
    # sleep would each see the other late by a wake-up for ever. A probe that catches the
    # partner puts them back in step, and both poll from then on.
    took, ranks = _two_ranks(400, wake=35e-6, work=(10e-6, 12e-6))
    assert max(took[:20]) > 35e-6  # in the cycle: each round pays a wake-up
    assert max(took[-100:]) <= 12e-6 + 1e-9  # back in step: a round is the slower's work
    assert ranks[0].usual(1) == 1.0  # rank 0, first each round, polls for rank 1 again


class _Core:
    """This rank's core, simulated for a crowded board wait (more peers than cores): the
    host's clock and this rank's own time on the core (ns), each look at them costing
    100 ns of both, and what each yield of the core lets the others do
    (:meth:`others_run`): ``ran`` ns of their work, after which a partner may publish."""

    def __init__(self, board: Board, ran: int, partner: int, publishes_after: int | None) -> None:
        self.wall, self.cpu = 10**12, 10**9
        self.words = board.control()
        self.ran, self.partner, self.publishes_after = ran, partner, publishes_after
        self.yields = 0

    def monotonic_ns(self) -> int:
        self.wall += 100
        self.cpu += 100
        return self.wall

    def thread_time_ns(self) -> int:
        return self.cpu

    def perf_counter(self) -> float:
        return self.wall * 1e-9

    def others_run(self) -> None:  # board_path.yield_core
        self.yields += 1
        self.wall += self.ran + 1000
        self.cpu += 1000  # the system call: this rank's own time
        if self.yields == self.publishes_after:
            self.publish(self.partner)

    def publish(self, q: int) -> None:
        count = self.words[q * WORDS + COUNT] + 1
        self.words[q * WORDS + STAMP] = self.wall
        self.words[q * WORDS + COUNT] = count


@pytest.fixture
def crowded(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """A crowded board wait of rank 0 of 3 over a simulated core: call it with how long the
    others run at each yield and after how many yields rank 1 publishes (None: never; a
    sleep publishes it, so the wait ends); it returns (the path, the core, sleeps)."""
    boards: list[Board] = []

    def make(ran: int, publishes_after: int | None, spin: float = 50e-6):  # type: ignore[no-untyped-def]
        board = Board.create(0, 3, tag=7)
        boards.append(board)
        core = _Core(board, ran, 1, publishes_after)
        core.publish(2)  # rank 2 is always there first
        path = BoardPath(board, None, spin)  # type: ignore[arg-type]  # no sleep needs it
        path.crowded = True
        slept: list[int] = []

        async def sleep(count: int, ranks: object, seq: int) -> None:
            slept.append(count)
            core.wall += 10**6  # a wake-up later, the partner has published
            core.publish(1)
            core.words[2 * WORDS + COUNT] = count  # and rank 2 (its count only)

        monkeypatch.setattr(board_path, "time", core)
        monkeypatch.setattr(board_path, "yield_core", core.others_run)
        monkeypatch.setattr(path, "_sleep", sleep)
        return path, core, slept

    yield make
    for board in boards:
        board.close()


def _wait_for_rank_1(path: BoardPath, core: _Core) -> None:
    count = core.words[2 * WORDS + COUNT]
    asyncio.run(path._wait(count, [1, 2], seq=count))


def test_a_crowded_wait_counts_only_its_own_time_on_the_core(crowded) -> None:  # type: ignore[no-untyped-def]
    # Rank 1 shares rank 0's core and publishes after three of rank 0's yields, each of
    # which runs it 40 us: 120 us on the clock, more than the 50 us ceiling, but rank 0
    # held the core for a few microseconds of it. It finds rank 1 without sleeping, and
    # learns that rank 1 comes early: the budget stays the ceiling, wait after wait.
    path, core, slept = crowded(ran=40_000, publishes_after=3)
    for _ in range(50):
        core.yields = 0
        began = core.wall
        _wait_for_rank_1(path, core)
        assert core.yields == 3 and core.wall - began > 120_000
        assert path._held < 10_000  # its own time: the yields' system calls and the looks
        core.publish(2)
    assert slept == []
    assert path.patience.usual(1) == 1.0 and path.patience.budget([1]) == 50e-6


def test_a_crowded_wait_for_a_stopped_partner_polls_at_most_the_ceiling_then_sleeps(
        crowded) -> None:  # type: ignore[no-untyped-def]
    # Rank 1 is stopped and nothing else wants the core: each yield comes straight back,
    # and the wait polls until it has held the core for its budget, never more than the
    # ceiling (and a look and a yield), then sleeps. It learns rank 1 comes late: the
    # budget falls to the margin, with the ceiling once in PROBE waits.
    path, core, slept = crowded(ran=0, publishes_after=None)
    held = []
    for _ in range(3 * PROBE):
        core.yields = 0
        _wait_for_rank_1(path, core)
        held.append(path._held)
        core.publish(2)
    assert len(slept) == 3 * PROBE
    assert all(h <= 50_000 + 1_500 for h in held)
    assert max(held) >= 50_000  # the first waits polled the ceiling
    assert path.patience.usual(1) < 0.5
    assert sum(h >= 50_000 for h in held[-2 * PROBE:]) == 2  # probes
    assert all(h <= MARGIN * 1e9 + 1_500 for h in held[-2 * PROBE:] if h < 50_000)


def test_a_crowded_wait_that_seldom_gets_the_core_sleeps_after_a_nap_of_polling(
        crowded) -> None:  # type: ignore[no-untyped-def]
    # The host's other work takes the core for 3 ms at every yield: the wait has held the
    # core for microseconds when a sleep's first nap has passed on the clock, and sleeps
    # then (a failure is noticed as soon as by a sleeping wait).
    path, core, slept = crowded(ran=3_000_000, publishes_after=None)
    _wait_for_rank_1(path, core)
    assert slept and core.yields == 1
    assert path._held < 10_000 and path._polled >= MIN_NAP * 1e9


_PEER = textwrap.dedent("""
    import asyncio, hashlib, os, sys, time
    import numpy as np
    import p2pcoll

    ITERS, SLOW, PIN = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "pin"

    async def main():
        if PIN:  # every peer on one core: more peers than cores on any host
            os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        async with p2pcoll.join() as g:
            board = g.session.board
            patience = board.patience
            others = [q for q in range(g.world_size) if q != g.rank]
            most, fewest, digest = 0.0, 1.0, hashlib.sha256()
            for i in range(ITERS):
                x = np.random.default_rng([g.rank, i]).standard_normal(1000)
                if g.rank == SLOW:
                    time.sleep(float(np.random.default_rng(i).uniform(0, 2e-3)))
                if i == ITERS // 4:
                    print("HALFWAY", flush=True)  # the test stops rank 1 about now
                digest.update((await g.allreduce(x.astype(np.float32))).tobytes())
                most = max(most, patience.budget(others), board._held * 1e-9)
                fewest = min(fewest, *(patience.usual(q) for q in others))
            ran = g.stats()["collectives_by_strategy"]["allreduce"]
            print("DONE", digest.hexdigest(), patience.ceiling, most, fewest, ran.get("shm"),
                  board.crowded, flush=True)

    asyncio.run(main())
""")


def _expected(world: int, iters: int) -> str:
    """The digest of every result: the inputs folded in rank order, in float32."""
    digest = hashlib.sha256()
    for i in range(iters):
        parts = [np.random.default_rng([r, i]).standard_normal(1000).astype(np.float32)
                 for r in range(world)]
        total = parts[0] + parts[1]
        for part in parts[2:]:
            total += part
        digest.update(total.tobytes())
    return digest.hexdigest()


@pytest.mark.processes
@pytest.mark.parametrize(("world", "spin", "pin"),
                         [(3, "1000", ""), (5, "50", ""), (2, "0", ""), (3, "50", "pin")])
def test_a_stopped_and_a_slow_partner_end_in_the_same_bits(tmp_path: Path, world: int,
                                                           spin: str, pin: str) -> None:
    """Rank 1 is stopped for a while a quarter of the way in; the last rank sleeps up to
    2 ms before each call. Pinned to one core (and with 5 peers on a host of fewer
    cores), the group has more peers than cores: its waits yield."""
    iters = 300
    script = tmp_path / "peer.py"
    script.write_text(_PEER)
    port = free_port()
    procs = [subprocess.Popen(
        [sys.executable, str(script), str(iters), str(world - 1), pin or "-"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
        env={**os.environ, "P2PCOLL_SPIN": spin, "RANK": str(rank),
             "WORLD_SIZE": str(world), "P2PCOLL_RENDEZVOUS": f"tcp://127.0.0.1:{port}"})
        for rank in range(world)]
    try:
        stopped = procs[1]
        assert stopped.stdout is not None
        assert stopped.stdout.readline() == "HALFWAY\n", stopped.stderr
        stopped.send_signal(signal.SIGSTOP)
        time.sleep(0.3)  # the others wait for it meanwhile (no timing is asserted)
        stopped.send_signal(signal.SIGCONT)
    finally:
        outcomes = finish(procs, timeout=120)
    expected = _expected(world, iters)
    ceiling = int(spin) * 1e-6
    for rank, (code, out) in enumerate(outcomes):
        assert code == 0, (rank, out)
        digest, said_ceiling, most, fewest, on_board, crowded = out.split("DONE ")[1].split()
        assert digest == expected, f"rank {rank}: other bits than numpy's fold"
        assert on_board == str(iters)  # every call ran on the board
        assert float(said_ceiling) == ceiling
        if pin:
            assert crowded == "True"
        # Crowded, a wait polls until it held the core for its budget (and a look and a
        # yield beyond, whose system time a busy host may swell).
        slack = 1e-3 if crowded == "True" else 0.0
        assert 0 <= float(most) <= ceiling + slack
        if rank != 1 and spin != "0":
            assert float(fewest) < 1  # it learned that a partner came late
