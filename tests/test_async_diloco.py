"""Asynchronous DiLoCo (``DiLoCo(..., delay=1)``) over real peers: the one-step-delayed
outer update of p2pcoll.training.delayed, bit for bit against a numpy reference; replicas
identical after every outer step; bad and disagreeing settings; a loss while the delayed
reduction is in flight ends it with the group's error, retrieved."""

from __future__ import annotations

import asyncio
import contextvars
import gc
import hashlib
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

import p2pcoll
from p2pcoll import training
from p2pcoll.testing import memory_groups, run_ranks
from p2pcoll.training.compressors import CHUNK, TopK2Bit
from conftest import newcomer_arrives
from losses import assert_survivors_failed, cut_off_and_close
from peer_processes import port_held

TIMEOUT = 10.0


def digest(tree: Any) -> str:
    h = hashlib.blake2b(digest_size=16)
    for name, leaf in training.named_leaves(tree):
        h.update(name.encode())
        h.update(np.ascontiguousarray(np.asarray(leaf)).tobytes())
    return h.hexdigest()


def dyadic_grads(rank: int, step: int) -> dict[str, np.ndarray]:
    """Small integers: with 4 ranks every sum and average below is exact in float64."""
    rng = np.random.default_rng(10 * step + rank)
    return {"w": rng.integers(-8, 8, (4, 3)).astype(np.float64),
            "b": rng.integers(-8, 8, 3).astype(np.float64)}


def reference(n: int, h: int, steps: int, lr: float, outer: training.OuterSGD
              ) -> list[dict[str, np.ndarray]]:
    """The rule of p2pcoll.training.delayed, in numpy: the anchor after each outer step."""
    anchor = {"w": np.zeros((4, 3)), "b": np.ones(3)}
    velocity = {k: np.zeros_like(v) for k, v in anchor.items()}
    local = [{k: v.copy() for k, v in anchor.items()} for _ in range(n)]
    origin = [{k: v.copy() for k, v in anchor.items()} for _ in range(n)]
    pending: dict[str, np.ndarray] | None = None
    states = []
    for t in range(steps):
        for r in range(n):
            for k, g in dyadic_grads(r, t).items():
                local[r][k] -= lr * g
        if (t + 1) % h:
            continue
        deltas = [{k: origin[r][k] - local[r][k] for k in anchor} for r in range(n)]
        fresh = {k: sum(d[k] for d in deltas) / n for k in anchor}
        if pending is not None:
            keys = list(anchor)
            outer.apply([anchor[k] for k in keys], [velocity[k] for k in keys],
                        [pending[k] for k in keys])
            states.append({k: v.copy() for k, v in anchor.items()})
        pending = fresh
        local = [{k: anchor[k] - deltas[r][k] for k in anchor} for r in range(n)]
        origin = [{k: v.copy() for k, v in mine.items()} for mine in local]
    assert pending is not None
    keys = list(anchor)
    outer.apply([anchor[k] for k in keys], [velocity[k] for k in keys],
                [pending[k] for k in keys])
    states.append({k: v.copy() for k, v in anchor.items()})
    return states


@pytest.mark.parametrize("codec", [None, "int8", "topk2bit"])
async def test_delay_1_applies_each_round_one_round_late_and_keeps_replicas_equal(
        codec: str | None) -> None:
    n, h, rounds, lr = 4, 3, 5, 0.5
    outer = training.OuterSGD(lr=0.5, momentum=0.5)

    async def fn(g: p2pcoll.Group) -> list[tuple[str, str]]:
        params = {"w": np.zeros((4, 3)), "b": np.ones(3)}
        diloco = training.DiLoCo(g, params, inner_steps=h, outer_lr=0.5, outer_momentum=0.5,
                                 delay=1, timeout=TIMEOUT,
                                 **({"compressor": codec, "density": 0.2}
                                    if codec == "topk2bit" else {"codec": codec}))
        applied: list[tuple[str, str]] = []
        for t in range(h * rounds):
            for k, grad in dyadic_grads(g.rank, t).items():
                params[k] -= lr * grad
            if await diloco.after_inner_step():
                state = diloco.global_state()
                applied.append((digest(state["params"]), digest(state)))
        assert diloco.outer_steps == rounds - 1  # the last round's is still in flight
        assert await diloco.flush() == 1
        state = diloco.global_state()
        applied.append((digest(state["params"]), digest(state)))
        assert diloco.outer_steps == rounds
        assert digest(params) == digest(diloco.global_state()["params"])  # all applied
        return applied

    results = await run_ranks(n, fn, collective_timeout=TIMEOUT)
    assert all(r == results[0] for r in results)  # bit-identical after every outer step
    assert len(set(results[0])) == rounds
    if codec is None:  # dyadic values over 4 ranks: the reference is exact
        want = reference(n, h, h * rounds, lr, outer)
        assert [x[0] for x in results[0]] == [digest(s) for s in want]


class Recording(TopK2Bit):
    """topk2bit that keeps, per exchange, its inputs, the accumulator before and after,
    and the average it returned."""

    def __init__(self) -> None:
        super().__init__(0.05)
        self.log: list[dict[str, list[np.ndarray]]] = []

    async def average(self, group: p2pcoll.Group, deltas: Sequence[np.ndarray],
                      residuals: Sequence[np.ndarray] | None, **kw: Any) -> list[np.ndarray]:
        assert residuals is not None
        before = [r.copy() for r in residuals]
        given = [d.copy() for d in deltas]
        out = await super().average(group, deltas, residuals, **kw)
        self.log.append({"delta": given, "before": before,
                         "after": [r.copy() for r in residuals], "out": out})
        return out


async def test_delay_1_with_topk2bit_measures_from_the_rounds_start_and_chains_the_residual(
) -> None:
    """Asynchronous DiLoCo with error feedback, against the rule of training.delayed bit for
    bit: each round's pseudo-gradient is the worker's own progress from where the round
    started (the anchor minus its previous own progress), its exchange starts from the
    accumulator the previous exchange left (never skipped, never taken twice), each
    average is applied once, one round late, and the next round starts from the new anchor
    minus the worker's own progress."""
    n, h, rounds, size = 3, 4, 5, 3 * CHUNK
    groups = await memory_groups(n, collective_timeout=TIMEOUT)
    try:
        x0 = np.random.default_rng(0).standard_normal(size).astype(np.float32)
        params = [{"w": x0.copy()} for _ in range(n)]
        compressors = [Recording() for _ in range(n)]
        dilocos = [training.DiLoCo(g, p, inner_steps=h, compressor=c, delay=1,
                                   timeout=TIMEOUT)
                   for g, p, c in zip(groups, params, compressors, strict=True)]
        starts: list[list[np.ndarray]] = [[x0.copy()] for _ in range(n)]
        ends: list[list[np.ndarray]] = [[] for _ in range(n)]
        rng = np.random.default_rng(1)
        for t in range(1, h * rounds + 1):
            for r in range(n):  # each worker pulled towards its own target
                params[r]["w"] -= (np.float32(0.1) * (params[r]["w"] - np.float32(r))
                                   + rng.standard_normal(size).astype(np.float32) / 100)
                if t % h == 0:
                    ends[r].append(params[r]["w"].copy())
            await asyncio.gather(*(d.after_inner_step() for d in dilocos))
            if t % h == 0:
                for r in range(n):
                    starts[r].append(params[r]["w"].copy())
        assert [await d.flush() for d in dilocos] == [1] * n

        outer = training.OuterSGD()
        for r in range(n):
            log = compressors[r].log
            assert len(log) == rounds
            anchor, velocity = [x0.copy()], [np.zeros_like(x0)]
            for k, got in enumerate(log):
                own = starts[r][k] - ends[r][k]
                np.testing.assert_array_equal(got["delta"][0], own)
                held = log[k - 1]["after"][0] if k else np.zeros_like(x0)
                np.testing.assert_array_equal(got["before"][0], held)
                if k:
                    outer.apply(anchor, velocity, log[k - 1]["out"])
                if k < rounds - 1:
                    np.testing.assert_array_equal(starts[r][k + 1], anchor[0] - own)
            outer.apply(anchor, velocity, log[-1]["out"])
            np.testing.assert_array_equal(dilocos[r].anchor[0], anchor[0])
            np.testing.assert_array_equal(params[r]["w"], anchor[0])
            assert np.abs(log[-1]["after"][0]).max() > 0  # something was held back
        assert len({d.anchor[0].tobytes() for d in dilocos}) == 1
    finally:
        for g in groups:
            await g.close()


async def test_delay_1_reduces_in_the_background_and_applies_at_the_next_rounds_end(
) -> None:
    """Round 0's reduction finishes while nobody calls after_inner_step (as during round
    1's inner steps); it is applied only at round 1's end."""
    h = 4

    async def fn(g: p2pcoll.Group) -> None:
        params = {"w": np.zeros(8)}
        diloco = training.DiLoCo(g, params, inner_steps=h, delay=1, timeout=TIMEOUT)
        for t in range(1, 2 * h + 1):
            params["w"] -= 1.0
            applied = await diloco.after_inner_step()
            assert applied == (t == 2 * h)
            if t == h:
                _, reduction = diloco._in_flight[0]
                await asyncio.wait([reduction])  # no after_inner_step meanwhile
                assert reduction.result()[0].tolist() == [float(h)] * 8
                assert diloco.outer_steps == 0
        assert diloco.outer_steps == 1
        await diloco.flush()

    await run_ranks(2, fn, collective_timeout=TIMEOUT)


class Threads(training.OuterSGD):
    """The paper's outer optimizer, noting which thread took each step and when."""

    def apply(self, params: Sequence[np.ndarray], velocity: Sequence[np.ndarray],
              delta: Sequence[np.ndarray]) -> None:
        seen.append(threading.current_thread() is threading.main_thread())
        super().apply(params, velocity, delta)


seen: list[bool] = []  # Threads.apply's: on the loop's thread


async def test_delay_1_takes_the_outer_step_in_a_thread_before_the_rounds_end() -> None:
    """The outer step of the round in flight is taken off the loop as soon as its reduction
    lands (the next round's inner steps need not wait for it at the round's end), on copies:
    the global state changes only at the round's end, the same bits on every rank."""
    h, rounds = 3, 4
    seen.clear()

    async def fn(g: p2pcoll.Group) -> list[str]:
        params = {"w": np.zeros((4, 3)), "b": np.ones(3)}
        diloco = training.DiLoCo(g, params, inner_steps=h, delay=1, codec="int8",
                                 timeout=TIMEOUT)
        diloco.outer = Threads()
        digests = []
        for t in range(h * rounds):
            for k, grad in dyadic_grads(g.rank, t).items():
                params[k] -= 0.5 * grad
            before = digest(diloco.global_state())
            steps = len(seen)
            if (t + 1) % h == 0 and t + 1 > h:  # the previous round's step is ready by now
                _, reduction = diloco._in_flight[0]
                await asyncio.wait([reduction])
                for _ in range(100):  # its thread's step, a loop turn or a few away
                    if len(seen) > steps:
                        break
                    await asyncio.sleep(0.01)
                assert len(seen) > steps  # taken before the round ends...
                assert digest(diloco.global_state()) == before  # ...on copies
            if await diloco.after_inner_step():
                digests.append(digest(diloco.global_state()))
        await diloco.flush()
        digests.append(digest(diloco.global_state()))
        assert digest(params) == digest(diloco.global_state()["params"])
        return digests

    results = await run_ranks(4, fn, collective_timeout=TIMEOUT)
    assert all(r == results[0] for r in results) and len(set(results[0])) == rounds
    assert len(seen) == 4 * rounds and not any(seen)  # every step off the loop's thread


class Slow(training.OuterSGD):
    """An outer step that takes a while (in its thread)."""

    def stepped(self, params: Sequence[np.ndarray], velocity: Sequence[np.ndarray],
                delta: Sequence[np.ndarray]) -> tuple[list[np.ndarray], list[np.ndarray]]:
        time.sleep(0.5)
        return super().stepped(params, velocity, delta)


async def test_delay_1_cancelled_while_the_outer_step_is_taken_leaves_nothing_running(
) -> None:
    """A round's end cancelled while it waits for the outer step taken aside: the round is
    not applied, and every exchange in flight is ended (none left running)."""
    h = 2

    async def fn(g: p2pcoll.Group) -> None:
        params = {"w": np.zeros(8)}
        diloco = training.DiLoCo(g, params, inner_steps=h, delay=1, timeout=TIMEOUT)
        diloco.outer = Slow()
        for _ in range(h):
            params["w"] -= 1.0
            await diloco.after_inner_step()
        _, reduction = diloco._in_flight[0]
        await asyncio.wait([reduction])
        for _ in range(h - 1):
            params["w"] -= 1.0
            await diloco.after_inner_step()
        params["w"] -= 1.0
        end = asyncio.ensure_future(diloco.after_inner_step())
        await asyncio.sleep(0.1)  # waiting for the slow outer step
        end.cancel()
        with pytest.raises(asyncio.CancelledError):
            await end
        assert diloco.outer_steps == 0 and not diloco._in_flight
        assert reduction.done() and (diloco._last is None or diloco._last.done())

    await run_ranks(2, fn, collective_timeout=TIMEOUT)


@pytest.mark.parametrize("kwargs, match", [
    ({"delay": 2}, "delay must be 0 or 1, got 2"),
    ({"delay": -1}, "delay must be 0 or 1, got -1"),
    ({"delay": True}, "delay must be 0 or 1, got True"),
    ({"delay": "1"}, "delay must be 0 or 1, got '1'"),
    ({"delay": 1, "fragments": 2}, "fragments=2"),
    ({"delay": 1, "overlap": 2}, "overlap=2"),
])
async def test_bad_delays_are_refused_at_construction(kwargs: dict[str, Any], match: str
                                                       ) -> None:
    async def fn(g: p2pcoll.Group) -> None:
        with pytest.raises(ValueError, match=match):
            training.DiLoCo(g, {"w": np.ones((4, 2))}, inner_steps=4, **kwargs)

    await run_ranks(1, fn)


async def test_ranks_that_disagree_on_delay_are_told_before_anything_moves() -> None:
    async def fn(g: p2pcoll.Group) -> Exception | None:
        params = {"w": np.ones(3)}
        diloco = training.DiLoCo(g, params, inner_steps=2, delay=g.rank, timeout=TIMEOUT)
        before = digest(diloco.global_state())
        try:
            for _ in range(6):
                params["w"] -= 1.0
                await diloco.after_inner_step()
        except p2pcoll.CollectiveMismatch as exc:
            assert digest(diloco.global_state()) == before
            return exc
        return None

    for exc in await run_ranks(2, fn, collective_timeout=TIMEOUT):
        assert isinstance(exc, p2pcoll.CollectiveMismatch)
        assert "delay is 0 on rank 0 but 1 on rank 1" in str(exc), str(exc)


async def test_a_loss_during_the_delayed_reduction_ends_it_with_the_groups_error() -> None:
    """Rank 3 vanishes while round 1's reduction is in flight: each survivor's next
    after_inner_step raises the group's error, and nothing reaches the loop as a task
    exception never retrieved, the victim's included (it never awaits its own again)."""
    loop = asyncio.get_running_loop()
    unretrieved: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _, context: unretrieved.append(context))
    groups = await memory_groups(4, heartbeat_timeout=1.0)

    async def rank(group: p2pcoll.Group) -> BaseException | None:
        params = {"w": np.zeros((4, 3))}
        diloco = training.DiLoCo(group, params, inner_steps=4, delay=1, timeout=TIMEOUT)
        try:
            for step in range(1, 41):
                params["w"] -= 0.5
                if group.rank == 3 and step == 4:  # its round-0 reduction just started
                    await diloco.after_inner_step()
                    await cut_off_and_close(group)
                    return None  # leaves, never awaiting the reduction in flight
                await diloco.after_inner_step()
        except p2pcoll.P2PCollError as exc:
            return exc
        return None

    try:
        errors = await asyncio.gather(*(rank(g) for g in groups))
        assert_survivors_failed(groups[:3], errors[:3])
    finally:
        for group in groups:
            await group.close()
    del errors, groups, group
    for _ in range(3):
        gc.collect()
        await asyncio.sleep(0)
    assert not unretrieved, [str(c.get("exception")) for c in unretrieved]


# --- under train_elastic: churn with delay=1 ------------------------------------------------------


class ElasticJob:
    """Peers of one elastic asynchronous-DiLoCo job as tasks. Each inner step takes every
    parameter down by exactly 1, so every pseudo-gradient is H whatever the world size and
    the start: the final state tells how many outer steps were applied, and a newcomer's
    zeros counted in an average would show (they would pull it below H)."""

    H = 3
    POLL = 0.2  # poll_every: rank 0 asks the rendezvous at most this often who waits

    def __init__(self, rounds: int, codec: str | None = None,
                 reformed: asyncio.Event | None = None, newcomer: bool = True) -> None:
        from p2pcoll.testing import free_port

        self.url = f"tcp://127.0.0.1:{free_port()}"
        self.rounds, self.codec = rounds, codec
        # Set: the survivors' step that runs across the loss waits for it to be set.
        self.reformed = reformed
        self.ahead = asyncio.Event()  # both survivors started that step
        self.starting = 0
        self.stuck = asyncio.Event()     # the victim is in an inner step, never to return
        self.smaller = asyncio.Event()   # the survivors took outer steps without it
        self.arrived = asyncio.Event()   # the newcomer waits at the rendezvous
        self.newcomer = newcomer  # the test starts one once the survivors are smaller
        self.digests: dict[int, list[str]] = {}  # round -> state digests as applied

    def start(self, die_at: int | None = None, newcomer: bool = False) -> asyncio.Task[Any]:
        return asyncio.create_task(self.peer(die_at, newcomer))

    async def hosted(self) -> None:
        """Until a peer holds the rendezvous' port: every peer of an elastic job tries to
        host, and the one that binds first does."""
        while not port_held(int(self.url.rsplit(":", 1)[1])):
            await asyncio.sleep(0.01)

    async def peer(self, die_at: int | None, newcomer: bool) -> Any:
        params = {"w": np.full((2, 3), 9.0 if newcomer else 0.0), "b": np.zeros(3)}

        async def inner(group: p2pcoll.Group, r: int, i: int) -> None:
            if r == die_at and i == 1:
                self.stuck.set()
                await asyncio.sleep(3600)  # until cancelled, while the others wait for it
            if self.reformed is not None and r == 5 and group.world_size == 3 and i == 0:
                self.starting += 1  # (round 5: victim dies in round 4 below)
                if self.starting == 2:
                    self.ahead.set()
                await self.reformed.wait()
            held = _ADMITTING.get()
            if held is not None and i == 0:  # a step started once the group chose to admit
                await held.wait()
            if group.world_size < 3 and r >= (die_at or 0) + 3:
                self.smaller.set()
            if self.newcomer and self.smaller.is_set() and group.world_size < 3:
                # Fast rounds could finish the job before the newcomer reaches the
                # rendezvous (it would then wait there alone): two peers wait for it, then
                # take a round per poll, so that each round boundary brings rank 0 a census
                # asked after it arrived.
                await self.arrived.wait()
                await asyncio.sleep(self.POLL / self.H)
            else:
                await asyncio.sleep(0.002)
            for p in params.values():
                p -= 1.0

        rounds = training.DiLoCoRounds(params, inner, inner_steps=self.H, outer_lr=0.5,
                                       outer_momentum=0.5, delay=1)

        def apply(state: Any, deltas: dict[str, Any], r: int) -> None:
            rounds.apply(state, deltas, r)
            self.digests.setdefault(r, []).append(digest(state))

        result = await training.train_elastic(
            rounds.step, apply, rounds.state, rounds=self.rounds, min_world_size=2,
            max_world_size=3, rendezvous=self.url, timeout=20.0, poll_every=self.POLL,
            codec=self.codec, delay=rounds.delay, settings=rounds.settings)
        rounds.finish()
        return result, rounds


def replayed(rounds: int, h: int) -> dict[str, Any]:
    want = {"b": np.zeros(3), "w": np.zeros((2, 3))}
    velocity = {k: np.zeros_like(v) for k, v in want.items()}
    outer = training.OuterSGD(lr=0.5, momentum=0.5)
    for _ in range(rounds):
        outer.apply(list(want.values()), list(velocity.values()),
                    [np.full(3, float(h)), np.full((2, 3), float(h))])
    return {"params": want, "velocity": velocity, "applied": np.array([rounds], np.int64)}


@pytest.mark.parametrize("codec", [None, "int8"])
async def test_elastic_delay_1_applies_each_outer_step_once_through_a_loss_and_a_join(
        codec: str | None) -> None:
    job = ElasticJob(rounds=20, codec=codec)
    survivors = [job.start()]  # the first hosts the rendezvous (which must outlive the loss)
    await job.hosted()
    victim = job.start(die_at=4)
    survivors.append(job.start())
    await job.stuck.wait()
    victim.cancel()  # it closes its group while round 3's reduction may be in flight
    with pytest.raises(asyncio.CancelledError):
        await victim
    await job.smaller.wait()
    newcomer = job.start(newcomer=True)  # joins mid-round: a reduction is in flight
    await newcomer_arrives(job.url, job.arrived)
    results = await asyncio.gather(*survivors, newcomer)

    want = digest(replayed(job.rounds, job.H))
    for _, rounds in results:
        assert digest(rounds.state) == want  # every outer step once, the holders' average
    for r, digests in job.digests.items():
        assert len(set(digests)) == 1, f"round {r}: replicas differ"
    (first, _), (second, _), (late, _) = results
    # The log of applied rounds per replica: each round at most once, in order. A survivor
    # applied every round itself but one the loss caught before it applied it (the other
    # had): that one came with the other's state at the next formation (see
    # ElasticResult.applied). The newcomer applied every round from the one it joined in.
    for result in (first, second):
        log = result.applied
        assert log == sorted(set(log)), log
        for r in set(range(job.rounds)) - set(log):
            assert any(f.received and f.round > r for f in result.formations), (r, log)
    assert sorted({*first.applied, *second.applied}) == list(range(job.rounds))
    assert late.applied == list(range(late.joined_at, job.rounds))
    assert late.joined_at > 4 and late.formations[0].received
    assert [f.world_size for f in first.formations] == [3, 2, 3]
    # The survivors formed their group of 2 among themselves (the rendezvous' host is one
    # of them); the newcomer came through the rendezvous.
    assert [f.shrunk for f in first.formations] == [False, True, False]


_ADMITTING: contextvars.ContextVar[asyncio.Event | None] = contextvars.ContextVar(
    "_ADMITTING", default=None)


class _Admissions(logging.Handler):
    """In the task of a peer that logs an admission, a fresh event that its next formation
    sets: the steps that task starts from then on wait for it (their context's copy)."""

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "peers wait to join" in message:
            _ADMITTING.set(asyncio.Event())
        elif "from round" in message and (event := _ADMITTING.get()) is not None:
            event.set()


class _Formed(logging.Handler):
    """Sets ``event`` once ``count`` ranks logged a formation of a group of ``size``."""

    def __init__(self, size: int, count: int, event: asyncio.Event) -> None:
        super().__init__()
        self.size, self.left, self.event = size, count, event

    def emit(self, record: logging.LogRecord) -> None:
        if f"of {self.size} from round" in record.getMessage():
            self.left -= 1
            if self.left == 0:
                self.event.set()


async def test_elastic_delay_1_a_step_running_across_a_loss_overlaps_the_new_groups_reduction(
        ) -> None:
    # The survivors' step of round 5 started in the group of 3, alongside round 4's
    # reduction, which the loss breaks (the victim dies once both survivors started it:
    # round 3 was reduced); it finishes only once both survivors formed their group of 2:
    # the formation does not wait for it (round 4's reduction again, in the new group,
    # overlaps it, as reductions overlap the next step), and it still counts.
    reformed = asyncio.Event()
    handler = _Formed(2, 2, reformed)
    logger = logging.getLogger("p2pcoll.training")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        job = ElasticJob(rounds=10, reformed=reformed, newcomer=False)
        survivors = [job.start()]
        await job.hosted()
        victim = job.start(die_at=4)
        survivors.append(job.start())
        await job.stuck.wait()
        await job.ahead.wait()
        victim.cancel()
        with pytest.raises(asyncio.CancelledError):
            await victim
        async with asyncio.timeout(60):  # a formation that waits for the step never ends
            results = await asyncio.gather(*survivors)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    want = digest(replayed(job.rounds, job.H))
    for result, rounds in results:
        assert digest(rounds.state) == want  # every outer step once, round 5's step kept
        assert result.redone == 0
        assert [f.world_size for f in result.formations] == [3, 2]
    for r, digests in job.digests.items():
        assert len(set(digests)) == 1, f"round {r}: replicas differ"


async def test_elastic_delay_1_a_step_running_across_an_admission_overlaps_the_new_groups_reduction(
        ) -> None:
    # A survivor's step started when its group chose to admit the newcomer finishes only
    # once that survivor is in the new group: the formation does not wait for the step.
    handler = _Admissions()
    logger = logging.getLogger("p2pcoll.training")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        job = ElasticJob(rounds=16)
        survivors = [job.start()]
        await job.hosted()
        victim = job.start(die_at=4)
        survivors.append(job.start())
        await job.stuck.wait()
        victim.cancel()
        with pytest.raises(asyncio.CancelledError):
            await victim
        await job.smaller.wait()
        newcomer = job.start(newcomer=True)
        async with asyncio.timeout(60):  # a formation that waits for the step never ends
            await newcomer_arrives(job.url, job.arrived)
            results = await asyncio.gather(*survivors, newcomer)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    want = digest(replayed(job.rounds, job.H))
    for _, rounds in results:
        assert digest(rounds.state) == want
    for r, digests in job.digests.items():
        assert len(set(digests)) == 1, f"round {r}: replicas differ"
    (first, _), _, (late, _) = results
    assert [f.world_size for f in first.formations][-1] == 3  # the newcomer got in
    assert late.applied == list(range(late.joined_at, job.rounds))


async def test_elastic_ranks_that_disagree_on_delay_are_told_before_the_state_moves() -> None:
    from p2pcoll.testing import free_port

    url = f"tcp://127.0.0.1:{free_port()}"

    async def peer(delay: int) -> Any:
        params = {"w": np.zeros(3)}
        rounds = training.DiLoCoRounds(params, lambda g, r, i: None, inner_steps=2,
                                       delay=delay)
        return await training.train_elastic(rounds.step, rounds.apply, rounds.state,
                                            rounds=2, min_world_size=2, max_world_size=2,
                                            rendezvous=url, timeout=10, delay=delay,
                                            settings=rounds.settings)

    errors = await asyncio.gather(peer(0), peer(1), return_exceptions=True)
    for exc in errors:
        assert isinstance(exc, p2pcoll.CollectiveMismatch), exc
        assert ("delay is 0 on rank 0 but 1 on rank 1" in str(exc)
                or "delay is 1 on rank 0 but 0 on rank 1" in str(exc)), str(exc)


async def test_elastic_bad_delays_are_refused() -> None:
    with pytest.raises(ValueError, match="delay must be 0 or 1, got 2"):
        training.DiLoCoRounds({"w": np.zeros(3)}, lambda g, r, i: None, inner_steps=2,
                              delay=2)
    with pytest.raises(ValueError, match="delay must be 0 or 1, got 3"):
        await training.train_elastic(lambda g, r, s: {}, lambda s, g, r: None,
                                     {"w": np.zeros(3)}, rounds=1, min_world_size=1,
                                     rendezvous="tcp://127.0.0.1:1", delay=3)


async def test_diloco_rounds_with_delay_1_follows_the_same_rule_as_diloco() -> None:
    """The same inner steps (which depend on where they start) under DiLoCo(delay=1) and
    under DiLoCoRounds(delay=1) with train_elastic end in the same global state."""
    from p2pcoll.testing import free_port

    h, n_rounds = 2, 5

    def inner_step(params: dict[str, np.ndarray], rank: int) -> None:
        for p in params.values():
            p *= 0.5
            p -= rank + 1

    async def with_diloco(g: p2pcoll.Group) -> dict[str, Any]:
        params = {"w": np.full(3, 8.0)}
        diloco = training.DiLoCo(g, params, inner_steps=h, outer_lr=0.5, outer_momentum=0.5,
                                 delay=1, timeout=TIMEOUT)
        for _ in range(h * n_rounds):
            inner_step(params, g.rank)
            await diloco.after_inner_step()
        await diloco.flush()
        return {k: {n: a.copy() for n, a in v.items()} for k, v in
                diloco.global_state().items()}

    url = f"tcp://127.0.0.1:{free_port()}"

    async def with_rounds() -> dict[str, Any]:
        params = {"w": np.full(3, 8.0)}
        rounds = training.DiLoCoRounds(
            params, lambda g, r, i: inner_step(params, g.rank), inner_steps=h,
            outer_lr=0.5, outer_momentum=0.5, delay=1)
        await training.train_elastic(rounds.step, rounds.apply, rounds.state,
                                     rounds=n_rounds, min_world_size=2, max_world_size=2,
                                     rendezvous=url, timeout=10, delay=1,
                                     settings=rounds.settings)
        return rounds.state

    want = (await run_ranks(2, with_diloco, collective_timeout=TIMEOUT))[0]
    got = await asyncio.gather(with_rounds(), with_rounds())
    for state in got:
        assert int(state["applied"][0]) == n_rounds
        for key in ("params", "velocity"):
            np.testing.assert_allclose(state[key]["w"], want[key]["w"], rtol=1e-12)


async def test_elastic_delay_1_starts_the_next_rounds_step_before_the_rounds_reduction(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """At each round boundary the step of round r + 1 begins (its inner steps handed on)
    before round r's reduction issues anything: the compute does not wait for the
    reduction's first slice (the agreement, the buckets)."""
    from p2pcoll.testing import free_port
    from p2pcoll.training import elastic_delayed

    log: contextvars.ContextVar[list[tuple[str, int]]] = contextvars.ContextVar("log")
    reduce_round = elastic_delayed.reduce_round

    async def recorded(group: p2pcoll.Group, grads: Any, **kwargs: Any) -> Any:
        log.get().append(("reduce", kwargs["r"]))  # the peer's task's context
        return await reduce_round(group, grads, **kwargs)

    monkeypatch.setattr(elastic_delayed, "reduce_round", recorded)
    url = f"tcp://127.0.0.1:{free_port()}"
    n_rounds = 5

    async def peer() -> list[tuple[str, int]]:
        mine: list[tuple[str, int]] = []
        log.set(mine)
        params = {"w": np.zeros(3)}
        rounds = training.DiLoCoRounds(params, lambda g, r, i: None, inner_steps=2,
                                       delay=1)

        async def step(group: p2pcoll.Group, r: int, state: Any) -> dict[str, np.ndarray]:
            mine.append(("step", r))
            return await rounds.step(group, r, state)

        await training.train_elastic(step, rounds.apply, rounds.state, rounds=n_rounds,
                                     min_world_size=2, max_world_size=2, rendezvous=url,
                                     timeout=10, delay=1, settings=rounds.settings)
        return mine

    for events in await asyncio.gather(peer(), peer()):
        for r in range(n_rounds - 1):
            assert events.index(("step", r + 1)) < events.index(("reduce", r)), events
