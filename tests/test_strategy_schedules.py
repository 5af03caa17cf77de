"""Every installed strategy, run by a lockstep simulator: no sockets, so large groups are cheap.

The simulator below follows the executor's rules exactly (see p2pcoll/strategy.py):

- each rank walks the steps that ``p2pcoll.engine.plan.plan`` gives it, in order;
- within a step it posts every Send first (a send never blocks, and its payload is what
  the chunk holds at that moment), then performs the Recv/Reduce ops in list order;
- the k-th message rank a sends to rank b is the k-th one b receives from a.

It reports a deadlock (ranks not finished and nobody can move) and messages nobody received,
then each test checks the collective's contract against numpy and counts the traffic:
bytes and messages per rank, and rounds (the critical path, a non-empty step being one round).
The counts are checked against the textbook formulas of /work/shared/ANCHORS.md, section 3.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from p2pcoll.engine.plan import plan
from p2pcoll.registry import registry
from p2pcoll.strategy import (
    ALL,
    Context,
    Recv,
    Reduce,
    Send,
    Strategy,
)

SIZES = range(1, 17)
NELEMS = (0, 1, 7, 100)  # nothing, less than one element per rank, uneven, even-ish
ROOTED = {"broadcast", "reduce", "gather", "scatter"}
PARTS = {"allgather", "gather", "scatter"}  # one chunk per rank, chunk r = rank r's part


class SimulationError(AssertionError):
    """The schedules deadlock, leave messages behind, or disagree on a message's size."""


@dataclass
class Message:
    chunks: list[np.ndarray]  # copies taken when the send was posted
    stamp: int  # the sender's round when it posted the send
    heard: frozenset[int]  # ranks the sender had heard from, directly or not


@dataclass
class Traffic:
    """What the schedules moved, per rank, and how many rounds the critical path took."""

    bytes_sent: list[int]
    bytes_received: list[int]
    messages_sent: list[int]
    messages_received: list[int]
    steps: list[int]  # length of each rank's schedule
    rounds: int
    heard: list[frozenset[int]] = field(default_factory=list)


def chunk_ids(chunk: Any, nchunks: int) -> Sequence[int]:
    if chunk is ALL:
        return range(nchunks)
    if isinstance(chunk, (range, tuple)):
        return chunk
    return range(chunk, chunk + 1)


def simulate(
    strategy: Strategy,
    size: int,
    data: list[list[np.ndarray]],
    *,
    root: int = 0,
    ufunc: Callable[..., Any] = np.add,
) -> Traffic:
    """Run every rank's schedule over ``data[rank][chunk]`` in place, in lockstep.

    Raises:
        SimulationError: a deadlock, an unreceived message, or a size disagreement.
    """
    nchunks = len(data[0])
    schedules = [plan(strategy, Context(r, size, root), nchunks) for r in range(size)]
    queues: dict[tuple[int, int], deque[Message]] = {}
    step = [0] * size
    posted = [False] * size
    next_recv = [0] * size
    clock = [0] * size
    latest = [0] * size  # the latest stamp among the messages received in the current step
    heard = [frozenset({r}) for r in range(size)]
    t = Traffic([0] * size, [0] * size, [0] * size, [0] * size,
                [len(s) for s in schedules], 0)

    def advance(r: int) -> bool:
        moved = False
        while step[r] < len(schedules[r]):
            ops = schedules[r][step[r]]
            if not posted[r]:
                posted[r] = moved = True
                latest[r] = clock[r]
                for op in ops:
                    if isinstance(op, Send):
                        payload = [data[r][c].copy() for c in chunk_ids(op.chunk, nchunks)]
                        queues.setdefault((r, op.to), deque()).append(
                            Message(payload, clock[r], heard[r]))
                        t.messages_sent[r] += 1
                        t.bytes_sent[r] += sum(a.nbytes for a in payload)
            receives = [op for op in ops if not isinstance(op, Send)]
            while next_recv[r] < len(receives):
                op = receives[next_recv[r]]
                queue = queues.get((op.frm, r))
                if not queue:
                    return moved
                msg = queue.popleft()
                targets = [data[r][c] for c in chunk_ids(op.chunk, nchunks)]
                if [a.size for a in msg.chunks] != [a.size for a in targets]:
                    raise SimulationError(
                        f"{strategy.name}: rank {r} step {step[r]} {op!r} expects chunks of "
                        f"{[a.size for a in targets]} elements, rank {op.frm} sent "
                        f"{[a.size for a in msg.chunks]}"
                    )
                for dst, src in zip(targets, msg.chunks, strict=True):
                    if isinstance(op, Reduce):
                        ufunc(dst, src, out=dst)
                    else:
                        dst[...] = src
                t.messages_received[r] += 1
                t.bytes_received[r] += sum(a.nbytes for a in msg.chunks)
                heard[r] = heard[r] | msg.heard
                latest[r] = max(latest[r], msg.stamp)
                next_recv[r] += 1
                moved = True
            clock[r] = max(clock[r], latest[r]) + (1 if ops else 0)  # an empty step is free
            step[r] += 1
            posted[r] = False
            next_recv[r] = 0
            moved = True
        return moved

    while any([advance(r) for r in range(size)]):
        pass
    stuck = [r for r in range(size) if step[r] < len(schedules[r])]
    if stuck:
        waits = []
        for r in stuck:
            receives = [op for op in schedules[r][step[r]] if not isinstance(op, Send)]
            waits.append(f"rank {r} step {step[r]} waits for {receives[next_recv[r]]!r}")
        raise SimulationError(f"{strategy.name} ({strategy.collective}) on {size} ranks "
                              f"deadlocks: " + "; ".join(waits))
    left = {pair: len(q) for pair, q in queues.items() if q}
    if left:
        raise SimulationError(f"{strategy.name} ({strategy.collective}) on {size} ranks left "
                              f"messages unreceived (src, dst): count = {left}")
    t.rounds = max(clock, default=0)
    t.heard = heard
    return t


# --- the contract of each collective, checked against numpy ------------------------------


def split(array: np.ndarray, nchunks: int) -> list[np.ndarray]:
    return [c.copy() for c in np.array_split(array, nchunks)]


def run_collective(
    strategy: Strategy, size: int, root: int, nelem: int, rng: np.random.Generator,
    dtype: type = np.int64,
) -> tuple[Traffic, list[list[np.ndarray]]]:
    """Simulate ``strategy`` on fresh random data and assert its collective's contract."""
    coll = strategy.collective
    p = size

    def fresh(n: int) -> np.ndarray:
        return rng.integers(-1000, 1000, n).astype(dtype)

    if coll in PARTS:
        nchunks = p
        if coll == "scatter":  # the parts may differ in size; only the root's mean anything
            start = [[fresh(nelem + j) for j in range(p)] for _ in range(p)]
        else:
            start = [[fresh(nelem) for _ in range(p)] for _ in range(p)]
    elif coll == "barrier":
        nchunks = strategy.chunks(p)
        start = [[np.empty(0, dtype) for _ in range(nchunks)] for _ in range(p)]
    elif coll == "alltoall":  # block b = i*p + j, rank i's for rank j; lengths differ
        assert strategy.chunks(p) == p * p, f"alltoall {strategy.name}: chunks({p})"
        start = [[fresh(nelem + b % 3) if b // p == r else np.zeros(nelem + b % 3, dtype)
                  for b in range(p * p)] for r in range(p)]
    else:
        nchunks = strategy.chunks(p)
        assert nchunks >= 1, f"{strategy.name}: chunks({p}) = {nchunks}"
        if coll == "reduce_scatter":
            assert nchunks == p, f"reduce_scatter {strategy.name}: chunks({p}) must be {p}"
        inputs = [fresh(nelem) for _ in range(p)]
        start = [split(x, nchunks) for x in inputs]
    data = [[c.copy() for c in chunks] for chunks in start]
    traffic = simulate(strategy, p, data, root=root)
    where = f"{coll} {strategy.name!r}, p={p}, root={root}, nelem={nelem}"

    def whole(r: int) -> np.ndarray:
        return np.concatenate(data[r]) if data[r] else np.empty(0, dtype)

    if coll == "broadcast":
        for r in range(p):
            np.testing.assert_array_equal(whole(r), inputs[root], err_msg=f"{where}: rank {r}")
    elif coll in ("reduce", "allreduce", "reduce_scatter"):
        expected = np.sum(inputs, axis=0, dtype=dtype)
        if coll == "reduce":
            holders = [root]
        elif coll == "allreduce":
            holders = list(range(p))
        else:
            holders = []
            for r in range(p):
                np.testing.assert_array_equal(
                    data[r][r], np.array_split(expected, p)[r], err_msg=f"{where}: rank {r}")
        for r in holders:
            np.testing.assert_array_equal(whole(r), expected, err_msg=f"{where}: rank {r}")
    elif coll in ("allgather", "gather"):
        for r in [root] if coll == "gather" else range(p):
            for j in range(p):
                np.testing.assert_array_equal(
                    data[r][j], start[j][j], err_msg=f"{where}: rank {r}, part {j}")
    elif coll == "scatter":
        for r in range(p):
            np.testing.assert_array_equal(
                data[r][r], start[root][r], err_msg=f"{where}: rank {r}")
    elif coll == "alltoall":
        for r in range(p):
            for i in range(p):
                np.testing.assert_array_equal(data[r][i * p + r], start[i][i * p + r],
                                              err_msg=f"{where}: rank {r}, block from {i}")
    elif coll == "barrier":
        for r in range(p):
            missing = set(range(p)) - traffic.heard[r]
            assert not missing, f"{where}: rank {r} leaves without hearing from {sorted(missing)}"
    else:
        pytest.fail(f"no contract known for collective {coll!r}")
    return traffic, data


def installed() -> Iterator[Any]:
    for collective, table in registry.entries().items():
        for name, entry in sorted(table.items()):
            yield pytest.param(entry.strategy, id=f"{collective}.{name}")


def roots(collective: str, p: int) -> list[int]:
    return sorted({0, 1, p // 2, p - 1} & set(range(p))) if collective in ROOTED else [0]


@pytest.mark.parametrize("sizes", [
    pytest.param(range(1, 9), id="p1-8"),
    pytest.param(range(9, 17), id="p9-16", marks=pytest.mark.slow),
])
@pytest.mark.parametrize("strategy", list(installed()))
def test_every_installed_strategy_meets_its_contract(strategy: Strategy, sizes: range) -> None:
    rng = np.random.default_rng(1234)
    for p in sizes:
        for root in roots(strategy.collective, p):
            for nelem in NELEMS if strategy.collective != "barrier" else (0,):
                run_collective(strategy, p, root, nelem, rng)


@pytest.mark.parametrize(
    "strategy", [s for s in installed() if s.values[0].collective == "allreduce"]
)
def test_allreduce_results_are_bitwise_identical_on_every_rank(strategy: Strategy) -> None:
    rng = np.random.default_rng(99)
    for p in SIZES:
        inputs = [rng.standard_normal(50).astype(np.float32) for _ in range(p)]
        data = [split(x, strategy.chunks(p)) for x in inputs]
        simulate(strategy, p, data)
        results = [np.concatenate(d) for d in data]
        for r in range(1, p):
            assert results[r].tobytes() == results[0].tobytes(), (
                f"{strategy.name}: rank {r} differs from rank 0 in the last bits (p={p})")
        np.testing.assert_allclose(results[0], np.sum(inputs, axis=0), rtol=1e-4, atol=1e-4)


# --- textbook traffic (ANCHORS.md section 3) ---------------------------------------------

N = 1000  # float32 elements: n = 4000 bytes, as in table C7
NBYTES = 4 * N


def strategy(collective: str, name: str) -> Strategy:
    entry = registry.entries()[collective].get(name)
    if entry is None:
        hint = " (pip install -e examples/custom_strategy)" if name == "direct" else ""
        pytest.fail(f"{collective} strategy {name!r} is not installed{hint}")
    return entry.strategy


def traffic(collective: str, name: str, p: int, root: int = 0, nelem: int = N) -> Traffic:
    rng = np.random.default_rng(p)
    return run_collective(strategy(collective, name), p, root, nelem, rng, np.float32)[0]


def lg(p: int) -> int:
    return math.ceil(math.log2(p)) if p > 1 else 0


@pytest.mark.parametrize("p", SIZES)
def test_binomial_broadcast_counts(p: int) -> None:
    # C1: ceil(lg p) rounds, p-1 messages of the whole data; the root sends ceil(lg p).
    for root in range(p):
        t = traffic("broadcast", "binomial", p, root)
        assert sum(t.messages_sent) == p - 1
        assert t.messages_sent[root] == lg(p)
        assert t.bytes_sent[root] == lg(p) * NBYTES
        assert sum(t.bytes_sent) == (p - 1) * NBYTES
        assert t.messages_received == [0 if r == root else 1 for r in range(p)]
        assert t.rounds == lg(p)


# C7, bytes sent by rank 0..p-1, count = 1000 float32, root 0.
C7_BINOMIAL = {
    2: [4000, 0],
    3: [8000, 0, 0],
    4: [8000, 0, 4000, 0],
    5: [12000, 0, 4000, 0, 0],
    6: [12000, 0, 4000, 0, 4000, 0],
    8: [12000, 0, 4000, 0, 8000, 0, 4000, 0],
}
C7_RECURSIVE_DOUBLING = {
    2: [4000, 4000],
    3: [4000, 8000, 4000],
    4: [8000] * 4,
    5: [4000, 12000, 8000, 8000, 8000],
    6: [4000, 12000, 4000, 12000, 8000, 8000],
    8: [12000] * 8,
}


@pytest.mark.parametrize("p", sorted(C7_BINOMIAL))
def test_binomial_broadcast_matches_table_c7(p: int) -> None:
    assert traffic("broadcast", "binomial", p).bytes_sent == C7_BINOMIAL[p]


@pytest.mark.parametrize("p", SIZES)
def test_ring_allreduce_counts(p: int) -> None:
    # C3: 2(p-1) steps of one message each; 2(p-1)/p·n bytes per rank when p divides the count.
    nelem = 16 * 9 * 5 * 7 * 11 * 13  # divisible by every p in 1..16
    t = traffic("allreduce", "ring", p, nelem=nelem)
    assert t.steps == [2 * (p - 1)] * p
    assert t.rounds == 2 * (p - 1)
    assert t.messages_sent == [2 * (p - 1)] * p
    assert t.bytes_sent == [2 * (p - 1) * 4 * nelem // p] * p
    # Uneven chunks: each phase sends every chunk but one, 2(p-1)·n on the wire in all.
    # (Per-rank numbers depend on the chunking convention, numpy's here, MPICH's in C7.)
    t = traffic("allreduce", "ring", p)
    assert sum(t.bytes_sent) == 2 * (p - 1) * NBYTES
    chunk = [c.nbytes for c in np.array_split(np.empty(N, np.float32), p)]
    for sent in t.bytes_sent:
        assert 2 * (NBYTES - max(chunk)) <= sent <= 2 * (NBYTES - min(chunk))


@pytest.mark.parametrize("p", SIZES)
def test_recursive_doubling_counts_follow_the_fold(p: int) -> None:
    # C4: p' = 2^floor(lg p), r = p - p'. Even ranks below 2r send once (their data in);
    # odd ranks below 2r send lg p' + 1 times (the result back out too); the others lg p'.
    pof2 = 1 << (p.bit_length() - 1)
    extra, lgp = p - pof2, pof2.bit_length() - 1
    expected = [1 if r < 2 * extra and r % 2 == 0 else lgp + 1 if r < 2 * extra else lgp
                for r in range(p)]
    t = traffic("allreduce", "recursive_doubling", p)
    assert t.messages_sent == expected
    assert t.bytes_sent == [m * NBYTES for m in expected]
    assert sum(t.bytes_sent) == pof2 * NBYTES * lgp + 2 * extra * NBYTES
    assert t.rounds == lgp + (2 if extra else 0)
    if p in C7_RECURSIVE_DOUBLING:
        assert t.bytes_sent == C7_RECURSIVE_DOUBLING[p]


@pytest.mark.parametrize("p", SIZES)
def test_flat_strategies_counts(p: int) -> None:
    # C6: the root broadcast sends (p-1)·n from the root and nothing elsewhere, in one round;
    # reduce-then-broadcast moves (p-1)·n in and (p-1)·n out of the hub.
    for root in roots("broadcast", p):
        t = traffic("broadcast", "root", p, root)
        assert t.bytes_sent == [(p - 1) * NBYTES if r == root else 0 for r in range(p)]
        assert t.rounds == (1 if p > 1 else 0)
    t = traffic("allreduce", "reduce_broadcast", p)
    assert t.bytes_sent[0] == t.bytes_received[0] == (p - 1) * NBYTES
    assert t.bytes_sent[1:] == t.bytes_received[1:] == [NBYTES] * (p - 1)


@pytest.mark.parametrize("p", SIZES)
def test_direct_allreduce_counts(p: int) -> None:
    # C6, direct reduce-scatter + allgather: 2 rounds of p-1 messages; rank r sends every
    # chunk but its own, then its own chunk p-1 times: n + (p-2)·c_r, 2(p-1)/p·n if p | n.
    t = traffic("allreduce", "direct", p)
    chunk = [c.nbytes for c in np.array_split(np.empty(N, np.float32), p)]
    assert t.rounds == (2 if p > 1 else 0)
    assert t.messages_sent == [2 * (p - 1)] * p
    assert t.bytes_sent == [NBYTES + (p - 2) * chunk[r] for r in range(p)]
    if N % p == 0:
        assert t.bytes_sent == [2 * (p - 1) * NBYTES // p] * p


@pytest.mark.parametrize("p", SIZES)
def test_other_tree_and_ring_counts(p: int) -> None:
    t = traffic("reduce", "binomial", p, root=p - 1)
    assert sum(t.messages_sent) == p - 1 and t.rounds == lg(p)
    t = traffic("allgather", "ring", p, nelem=10)
    assert t.messages_sent == [p - 1] * p and t.rounds == p - 1
    assert t.bytes_sent == [(p - 1) * 40] * p
    t = traffic("barrier", "dissemination", p)
    assert t.messages_sent == [lg(p)] * p and t.rounds == lg(p)


# --- the simulator catches what it should ------------------------------------------------


class _Bad(Strategy):
    collective = "allreduce"

    def chunks(self, size: int) -> int:
        return size


class RecvFirst(_Bad):
    name = "recv_first"

    def schedule(self, ctx: Context) -> Iterator[Any]:
        other = 1 - ctx.rank
        yield Reduce(other)  # both wait; nobody has sent
        yield Send(other)


class Chatty(_Bad):
    name = "chatty"

    def schedule(self, ctx: Context) -> Iterator[Any]:
        other = 1 - ctx.rank
        yield [Send(other), Reduce(other)]
        yield Send(other)  # nobody receives this one


class WrongSize(_Bad):
    name = "wrong_size"

    def schedule(self, ctx: Context) -> Iterator[Any]:
        other = 1 - ctx.rank
        yield [Send(other, 0), Reduce(other, ALL)]


class Forgetful(_Bad):
    name = "forgetful"

    def schedule(self, ctx: Context) -> Iterator[Any]:
        other = 1 - ctx.rank
        yield [Send(other), Recv(other)]  # overwrites instead of reducing: a wrong sum


def test_simulator_reports_deadlock_unmatched_size_and_wrong_results() -> None:
    rng = np.random.default_rng(0)
    with pytest.raises(SimulationError, match="deadlocks: rank 0 step 0 waits for Reduce"):
        run_collective(RecvFirst(), 2, 0, 10, rng)
    with pytest.raises(SimulationError, match=r"unreceived .*\(0, 1\): 1"):
        run_collective(Chatty(), 2, 0, 10, rng)
    with pytest.raises(SimulationError, match="expects chunks of"):
        run_collective(WrongSize(), 2, 0, 10, rng)
    with pytest.raises(AssertionError, match="rank 0"):
        run_collective(Forgetful(), 2, 0, 10, rng)
