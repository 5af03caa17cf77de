"""DiLoCo with sparse 2-bit pseudo-gradients (``compressor="topk2bit"``) over real peers
(memory groups): replicas stay bit-identical, the accumulator keeps exactly what was not
sent, the sparse and dense ways of summing agree, bytes drop by thousands, and bad
arguments or ranks that disagree are told what is wrong before anything moves."""

from __future__ import annotations

import asyncio
import gc
import hashlib
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import pytest

import p2pcoll
from p2pcoll import training
from p2pcoll.testing import memory_groups
from p2pcoll.training.compressors import CHUNK, TopK2Bit
from p2pcoll.training.sparse_codes import LEVELS
from losses import assert_survivors_failed, cut_off_and_close

TIMEOUT = 10.0
T = TypeVar("T")


async def on_groups(n: int, fn: Callable[[p2pcoll.Group], Awaitable[T]]) -> list[T]:
    groups = await memory_groups(n)
    try:
        return list(await asyncio.gather(*(fn(g) for g in groups)))
    finally:
        for g in groups:
            await g.close()


def model(seed: int = 0) -> dict[str, np.ndarray]:
    """Tensors of one chunk, of a chunk and a tail, and of a few elements."""
    rng = np.random.default_rng(seed)
    return {"big": rng.standard_normal((100, 50)).astype(np.float32),   # 4096 + 904
            "small": rng.standard_normal((16, 24)).astype(np.float32),
            "bias": rng.standard_normal(7).astype(np.float32)}


def digest(arrays: Sequence[np.ndarray]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def local_steps(params: dict[str, np.ndarray], rank: int, step: int) -> None:
    """One inner step of rank's own: a pull towards a rank-specific target, plus noise."""
    rng = np.random.default_rng([rank, step])
    for v in params.values():
        v -= (0.05 * (v - rank) + 0.01 * rng.standard_normal(v.shape)).astype(v.dtype)


# --- identical replicas -----------------------------------------------------------------------


@pytest.mark.parametrize("n, fragments, overlap", [(2, 1, 0), (3, 1, 0), (4, 2, 1)])
async def test_replicas_stay_bit_identical_under_topk2bit(n: int, fragments: int,
                                                          overlap: int) -> None:
    start = digest(model().values())

    async def rank(group: p2pcoll.Group) -> tuple[str, int]:
        params = model()
        diloco = training.DiLoCo(group, params, inner_steps=4, compressor="topk2bit",
                                 density=0.015, fragments=fragments, overlap=overlap,
                                 timeout=TIMEOUT)
        for step in range(1, 17):
            local_steps(params, group.rank, step)
            await diloco.after_inner_step()
        await diloco.flush()
        leaves = [a for _, a in training.named_leaves(diloco.global_state())]
        return digest(leaves), diloco.outer_steps

    results = await on_groups(n, rank)
    assert len({d for d, _ in results}) == 1, "every replica holds the same global state"
    assert results[0][0] != start and results[0][1] == 4 * fragments


# --- what is sent and what is kept -------------------------------------------------------------


async def exchange(n: int, compressor: TopK2Bit, deltas: list[list[np.ndarray]],
                   residuals: list[list[np.ndarray]]) -> list[list[np.ndarray]]:
    """One exchange of rank r's ``deltas[r]`` with its ``residuals[r]`` (updated in place)."""
    async def rank(group: p2pcoll.Group) -> list[np.ndarray]:
        r = group.rank
        return await compressor.average(group, deltas[r], residuals[r],
                                        names=[str(i) for i in range(len(deltas[r]))],
                                        round_no=1, nonfinite="raise", strategy=None,
                                        timeout=TIMEOUT)
    return await on_groups(n, rank)


def inputs(n: int, shapes: Sequence[tuple[int, ...]], seed: int
           ) -> tuple[list[list[np.ndarray]], list[list[np.ndarray]]]:
    rng = np.random.default_rng(seed)
    deltas = [[rng.standard_normal(s).astype(np.float32) for s in shapes] for _ in range(n)]
    residuals = [[(0.1 * rng.standard_normal(s)).astype(np.float32) for s in shapes]
                 for _ in range(n)]
    return deltas, residuals


@pytest.mark.parametrize("density, decay", [(0.015, 1.0), (0.2, 0.95), (0.9, 0.5)])
async def test_the_accumulator_keeps_exactly_what_was_not_sent(density: float,
                                                               decay: float) -> None:
    """Per rank: the accumulator is a = delta + decay * residual; where nothing was sent the
    new residual is a bit for bit; k entries per chunk were sent, each a code +-m or
    +-(m + 1) times the chunk's step s, where (s, m) follow from the largest over the ranks
    of the mean and standard deviation of what they selected (the same on every rank); the
    kept value is a - q s rounded once; and the average is the sum of what was sent, / p.
    (0.9: the dense way.)"""
    n, shapes = 3, [(CHUNK + 904,), (5, 7), (1,)]
    compressor = TopK2Bit(density, decay=decay)
    deltas, residuals = inputs(n, shapes, seed=1)
    before = [[d + np.float32(decay) * e if decay != 1 else d + e
               for d, e in zip(ds, es, strict=True)]
              for ds, es in zip(deltas, residuals, strict=True)]
    averaged = await exchange(n, compressor, deltas, residuals)

    for out in averaged[1:]:
        assert digest(out) == digest(averaged[0])
    for t, shape in enumerate(shapes):
        size = int(np.prod(shape))
        exact = [np.zeros(size) for _ in range(n)]  # code times step, exactly
        for lo in range(0, size, CHUNK):
            hi = min(size, lo + CHUNK)
            k = compressor.k_of(hi - lo)
            chosen: list[np.ndarray] = []
            stats = np.zeros(2, np.float32)
            for r in range(n):
                a = before[r][t].reshape(-1)[lo:hi]
                kept = residuals[r][t].reshape(-1)[lo:hi]
                where = np.flatnonzero(a != kept)
                assert where.size == k
                unsent = np.ones(hi - lo, bool)
                unsent[where] = False
                np.testing.assert_array_equal(kept[unsent], a[unsent])
                # the k largest magnitudes were sent
                assert np.abs(a[where]).min() >= np.abs(a[unsent]).max(initial=0)
                chosen.append(where)
                mags = np.abs(a[where]).astype(np.float64)
                stats = np.maximum(stats, [mags.mean(), mags.std()]).astype(np.float32)
            mu, sigma = stats.astype(np.float64)
            low = LEVELS if sigma == 0 else int(np.clip(np.rint(mu / (2 * sigma) - 0.5), 1,
                                                        LEVELS))
            step = mu / (low + 0.5)
            for r, where in enumerate(chosen):
                a = before[r][t].reshape(-1)[lo:hi][where].astype(np.float64)
                kept = residuals[r][t].reshape(-1)[lo:hi][where]
                codes = np.sign(a) * np.clip(np.rint(np.abs(a) / step), low, low + 1)
                assert set(np.abs(codes).tolist()) <= {low, low + 1}
                np.testing.assert_array_equal(kept, (a - codes * step).astype(np.float32))
                exact[r][lo:hi][where] = codes * step
        total = np.sum(exact, axis=0)
        np.testing.assert_allclose(averaged[0][t].reshape(-1).astype(np.float64) * n, total,
                                   rtol=1e-6, atol=0)


async def test_the_levels_straddle_the_selected_values_rather_than_round_them_to_one() -> None:
    """Selected magnitudes that sit close together (the largest of each chunk do: on
    slow_training.py's pseudo-gradients 5-95 % of them within 0.5-0.9 of the chunk's
    largest) are sent with both levels, most within 10 %; the rule before (levels s and
    2 s, s half the largest) put its boundary, 0.75, among them and sent them 17 % off (the
    median) and up to 33 %."""
    n, size = 2, CHUNK
    rng = np.random.default_rng(5)
    big = rng.permutation(size) < size // 2  # half of the chunk: the ones selected
    deltas = [[(rng.choice([-1, 1], size) * np.where(big, rng.uniform(0.6, 1.0, size),
                                                      rng.uniform(0, 0.1, size))
                ).astype(np.float32)] for _ in range(n)]
    residuals = [[np.zeros(size, np.float32)] for _ in range(n)]
    a = [d[0].copy() for d in deltas]
    await exchange(n, TopK2Bit(0.5), deltas, residuals)
    for r in range(n):
        where = np.flatnonzero(residuals[r][0] != a[r])
        assert np.array_equal(where, np.flatnonzero(big))
        sent = a[r][where].astype(np.float64) - residuals[r][0][where]
        relative = np.abs(sent - a[r][where]) / np.abs(a[r][where])
        assert np.median(relative) < 0.08 and relative.max() < 0.16
        assert 0.3 < np.mean(np.abs(sent) > 0.8) < 0.7  # both levels, each for about half


async def test_error_feedback_sends_over_rounds_what_one_round_held_back() -> None:
    """A constant pseudo-gradient: what was sent over R exchanges plus what is still held
    equals R times the input (the accumulator loses nothing), and most of it got through."""
    n, rounds, shape = 2, 40, (CHUNK,)
    compressor = TopK2Bit(0.05, decay=1.0)  # keeps all it held
    rng = np.random.default_rng(7)
    deltas = [[rng.standard_normal(shape).astype(np.float32)] for _ in range(n)]
    residuals = [[np.zeros(shape, np.float32)] for _ in range(n)]
    got = np.zeros(shape)
    for _ in range(rounds):
        got += (await exchange(n, compressor, deltas, residuals))[0][0]
    want = sum(d[0].astype(np.float64) for d in deltas) / n * rounds
    held = sum(r[0].astype(np.float64) for r in residuals) / n
    np.testing.assert_allclose(got + held, want, rtol=0, atol=1e-3 * rounds)
    assert np.abs(held).max() < 0.25 * np.abs(want).max()


async def test_the_sparse_and_the_dense_sums_give_the_same_bits() -> None:
    class SparseAlways(TopK2Bit):
        def dense(self, sizes: Sequence[int], world_size: int) -> bool:
            return False

    n, shapes, density = 2, [(CHUNK + 10,), (3,)], 0.9
    assert TopK2Bit(density).dense([CHUNK + 10, 3], n), "this density sums densely"
    deltas, residuals = inputs(n, shapes, seed=3)
    dense_res = [[e.copy() for e in es] for es in residuals]
    dense = await exchange(n, TopK2Bit(density), deltas, dense_res)
    sparse = await exchange(n, SparseAlways(density), deltas, residuals)
    assert digest(dense[0]) == digest(sparse[0]) == digest(sparse[1])
    for mine, theirs in zip(dense_res, residuals, strict=True):
        assert digest(mine) == digest(theirs)


# --- bytes -------------------------------------------------------------------------------------


async def test_bytes_are_thousands_of_times_fewer_than_per_step_fp32() -> None:
    """density 1.5 %, H = 50: each rank hands ~0.035 bytes per element per exchange."""
    async def rank(group: p2pcoll.Group) -> training.DiLoCo:
        params = {"w": np.zeros((16, CHUNK), np.float32)}
        diloco = training.DiLoCo(group, params, inner_steps=50, compressor="topk2bit",
                                 density=0.015, timeout=TIMEOUT)
        for step in range(1, 101):
            local_steps(params, group.rank, step)
            await diloco.after_inner_step()
        return diloco

    for diloco in await on_groups(4, rank):
        selected = 16 * 62  # ceil(0.015 * 4096) of each chunk
        per_exchange = 16 * 8 + 3 * selected // 2 + selected // 4  # statistics, indices, codes
        assert diloco.traffic.rounds == 2
        assert diloco.traffic.sent_bytes == 2 * per_exchange
        assert diloco.traffic.ratio >= 3000


# --- bad input and disagreement ----------------------------------------------------------------


@pytest.mark.parametrize("decay", [-0.1, 1.5, float("nan"), "0.9", True])
def test_a_bad_decay_is_refused_naming_it(decay: Any) -> None:
    with pytest.raises(ValueError, match="decay"):
        TopK2Bit(0.015, decay=decay)


@pytest.mark.parametrize("kwargs, match", [
    ({"compressor": "topk2bit", "density": 0}, "density"),
    ({"compressor": "topk2bit", "density": 1.5}, "density"),
    ({"compressor": "topk2bit", "density": -0.1}, "density"),
    ({"compressor": "topk2bit", "density": float("nan")}, "density"),
    ({"compressor": "topk2bit", "density": "0.1"}, "density"),
    ({"compressor": "topk2bit", "density": True}, "density"),
    ({"compressor": "topk3bit"}, "compressor"),
    ({"compressor": 2}, "compressor"),
    ({"density": 0.1}, "density"),
    ({"compressor": "topk2bit", "codec": "int8"}, "compressor"),
])
async def test_bad_arguments_are_refused_when_diloco_is_made(kwargs: dict[str, Any],
                                                             match: str) -> None:
    async def rank(group: p2pcoll.Group) -> None:
        with pytest.raises(ValueError, match=match):
            training.DiLoCo(group, model(), inner_steps=4, **kwargs)
    await on_groups(1, rank)


@pytest.mark.parametrize("settings, words", [
    ([{"compressor": "topk2bit", "density": 0.015}, {"compressor": "topk2bit",
                                                      "density": 0.03}],
     "density is 0.015 on rank 0 but 0.03 on rank 1"),
    ([{}, {"compressor": "topk2bit"}], "compressor is None on rank 0 but 'topk2bit' on rank 1"),
    ([{"compressor": TopK2Bit(0.015, decay=0.9)}, {"compressor": "topk2bit"}],
     "compressor_decay is 0.9 on rank 0 but 0.95 on rank 1"),
])
async def test_ranks_that_disagree_are_told_before_anything_moves(
        settings: list[dict[str, Any]], words: str) -> None:
    start = model()

    async def rank(group: p2pcoll.Group) -> None:
        params = model()
        diloco = training.DiLoCo(group, params, inner_steps=2, timeout=TIMEOUT,
                                 **settings[group.rank])
        local_steps(params, group.rank, 1)
        await diloco.after_inner_step()
        local_steps(params, group.rank, 2)
        with pytest.raises(p2pcoll.CollectiveMismatch, match=words):
            await diloco.after_inner_step()
        for name, anchor in zip(sorted(start), diloco.anchor, strict=True):
            np.testing.assert_array_equal(anchor, start[name])  # nothing applied
        if diloco.residuals is not None:
            assert not any(r.any() for r in diloco.residuals)  # nothing kept either
        # and the group is still usable
        got = await group.allreduce(np.ones(3), timeout=TIMEOUT)
        np.testing.assert_array_equal(got, np.full(3, 2.0))

    await on_groups(2, rank)


async def test_nan_in_a_pseudo_gradient_is_reported_by_name_and_not_applied() -> None:
    async def rank(group: p2pcoll.Group) -> None:
        params = model()
        diloco = training.DiLoCo(group, params, inner_steps=1, compressor="topk2bit",
                                 timeout=TIMEOUT)
        if group.rank == 1:
            params["small"][3, 4] = np.nan
        with pytest.raises(training.NonFiniteGradients, match="'small'"):
            await diloco.after_inner_step()
        for name, anchor in zip(sorted(params), diloco.anchor, strict=True):
            np.testing.assert_array_equal(anchor, model()[name])  # nothing applied
        assert diloco.residuals is not None
        assert not any(r.any() for r in diloco.residuals)  # nothing kept either

    await on_groups(2, rank)


# --- off the event loop ---------------------------------------------------------------------

# Digests of the average and of every rank's residuals after one exchange of the fixed inputs
# below (decay 1), as topk2bit computed them on the event loop's thread (with the levels of
# 0.22, which changed the bits, not where they are computed): moving the work to a worker
# thread changed no bit. (n, density, residuals kept, seed, average, residuals)
SHAPES = [(2 * CHUNK + 904,), (5, 7), (1,), (3, CHUNK)]
AS_ON_THE_LOOP = [
    (3, 0.015, True, 11, "b8f25cc783cf8781b8211ed52abcab4c", "5b937863276493447e7244bbefdeaab3"),
    (3, 0.9, True, 12, "0f13260f2b9797b69c1b843dda1733d2", "ab307ebba56dfebe2ae3c96ea89b36ec"),
    (1, 0.015, True, 13, "907952981754b5ef91926997af496e39", "00536ac1517736ea5e5ad7fec7f5db0a"),
    (2, 0.05, False, 14, "3befc648581ae3007b84c0268162c137", None),
    (4, 0.3, True, 15, "21b930bf6c55afd84a3592ec6ee1d41f", "5be75bd1a33b96dd7b903d69ac085f6f"),
]


@pytest.mark.parametrize("n, density, keep, seed, average, kept", AS_ON_THE_LOOP)
async def test_the_results_are_the_bits_topk2bit_gave_when_it_computed_on_the_loop(
        n: int, density: float, keep: bool, seed: int, average: str, kept: str | None) -> None:
    """The sparse way (0.015, 0.05), the dense way (0.9; 0.3 at p = 4), one rank, and no
    residuals."""
    deltas, residuals = inputs(n, SHAPES, seed)
    compressor = TopK2Bit(density, decay=1.0)
    assert compressor.dense([int(np.prod(s)) for s in SHAPES], n) == (density >= 0.3)

    async def rank(group: p2pcoll.Group) -> list[np.ndarray]:
        r = group.rank
        return await compressor.average(group, deltas[r], residuals[r] if keep else None,
                                        names=[str(i) for i in range(len(SHAPES))],
                                        round_no=1, nonfinite="raise", strategy=None,
                                        timeout=TIMEOUT)

    outs = await on_groups(n, rank)
    assert {digest(o) for o in outs} == {average}
    assert (digest([e for es in residuals for e in es]) if keep else None) == kept


class Held(TopK2Bit):
    """topk2bit that records the thread each of its stages runs on; ``stage``'s waits for
    ``go`` (a threading.Event: set from the loop), after saying so in ``arrived``."""

    def __init__(self, stage: str, go: threading.Event) -> None:
        super().__init__(0.015)
        self.stage, self.go = stage, go
        self.threads: dict[str, int] = {}
        self.arrived = threading.Event()
        self.released: bool | None = None

    def _held(self, stage: str) -> None:
        self.threads[stage] = threading.get_ident()
        if stage == self.stage:
            self.arrived.set()
            self.released = self.go.wait(TIMEOUT)  # False: nothing set it in time

    def _select(self, *args: Any) -> Any:
        self._held("select")
        return super()._select(*args)

    def _encode(self, *args: Any) -> Any:
        self._held("encode")
        return super()._encode(*args)

    def _decode(self, *args: Any) -> Any:
        self._held("decode")
        return super()._decode(*args)


async def arrival(event: threading.Event) -> None:
    while not event.is_set():  # the loop turns meanwhile, which is what is shown
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("stage", ["select", "encode", "decode"])
async def test_topk2bit_computes_on_a_worker_thread_while_the_loop_serves(stage: str) -> None:
    """While each rank's stage waits on its thread, the loop goes on (it is what releases
    the stage), and a collective on another group of the same loop completes meanwhile."""
    go = threading.Event()
    compressors = [Held(stage, go) for _ in range(2)]
    deltas, residuals = inputs(2, SHAPES, seed=21)
    others = await memory_groups(2)

    async def rank(group: p2pcoll.Group) -> list[np.ndarray]:
        r = group.rank
        return await compressors[r].average(group, deltas[r], residuals[r],
                                            names=[str(i) for i in range(len(SHAPES))],
                                            round_no=1, nonfinite="raise", strategy=None,
                                            timeout=TIMEOUT)

    async def meanwhile() -> list[np.ndarray]:
        for c in compressors:
            await arrival(c.arrived)
        sums = await asyncio.gather(*(g.allreduce(np.ones(3), timeout=TIMEOUT) for g in others))
        go.set()
        return sums

    try:
        outs, sums = await asyncio.gather(on_groups(2, rank), meanwhile())
    finally:
        for g in others:
            await g.close()
    assert all(c.released for c in compressors), "the loop set go while the stages waited"
    for s in sums:
        np.testing.assert_array_equal(s, np.full(3, 2.0))
    loop_thread = threading.get_ident()
    for c in compressors:
        assert set(c.threads) == {"select", "encode", "decode"}
        assert loop_thread not in c.threads.values()
    assert digest(outs[0]) == digest(outs[1])


async def test_a_cancellation_while_computing_lands_in_the_next_collective() -> None:
    """Rank 0 is cancelled while it codes (after the steps' allreduce): the cancellation
    waits for the thread, then lands in the codes' collective, which rank 0 starts, so rank
    1 does not wait out its timeout for it (its allgather completes, or fails with the
    group's error); rank 0's group is broken and its residuals are untouched."""
    go = threading.Event()
    compressors = [Held("encode", go), TopK2Bit(0.015)]
    deltas, residuals = inputs(2, SHAPES, seed=22)
    kept = [e.copy() for e in residuals[0]]
    groups = await memory_groups(2)

    def average(r: int) -> asyncio.Task[list[np.ndarray]]:
        return asyncio.ensure_future(compressors[r].average(
            groups[r], deltas[r], residuals[r], names=[str(i) for i in range(len(SHAPES))],
            round_no=1, nonfinite="raise", strategy=None, timeout=30.0))

    try:
        tasks = [average(0), average(1)]
        await arrival(compressors[0].arrived)  # type: ignore[attr-defined]
        tasks[0].cancel()
        await asyncio.sleep(0)
        assert not tasks[0].done(), "held while the thread runs"
        go.set()
        results = await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        for g in groups:
            await g.close()
    assert isinstance(results[0], asyncio.CancelledError), results[0]
    assert isinstance(results[1], (list, p2pcoll.P2PCollError)), results[1]
    assert not isinstance(results[1], p2pcoll.CollectiveTimeout), results[1]
    assert groups[0].cause is not None  # broken by the cancellation, in a collective
    assert digest(residuals[0]) == digest(kept)


async def test_a_loss_while_topk2bit_computes_ends_the_delayed_exchange_retrieved() -> None:
    """Asynchronous DiLoCo: rank 3 leaves while every rank's round-0 exchange selects on
    its thread; each survivor's next after_inner_step raises the group's error, and no task
    exception is left unretrieved, the victim's included."""
    loop = asyncio.get_running_loop()
    unretrieved: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _, context: unretrieved.append(context))
    go = threading.Event()
    compressors = [Held("select", go) for _ in range(4)]
    groups = await memory_groups(4, heartbeat_timeout=1.0)
    victim: list[training.DiLoCo] = []

    async def rank(group: p2pcoll.Group) -> BaseException | None:
        params = model()
        diloco = training.DiLoCo(group, params, inner_steps=4, compressor=compressors[group.rank],
                                 delay=1, timeout=TIMEOUT)
        try:
            for step in range(1, 41):
                local_steps(params, group.rank, step)
                await diloco.after_inner_step()
                if group.rank == 3 and step == 4:  # every rank's round 0 is selecting
                    for c in compressors:
                        await arrival(c.arrived)
                    await cut_off_and_close(group)
                    go.set()
                    victim.append(diloco)
                    return None  # leaves, never awaiting its exchange again
        except p2pcoll.P2PCollError as exc:
            return exc
        return None

    try:
        errors = await asyncio.gather(*(rank(g) for g in groups))
        assert_survivors_failed(groups[:3], errors[:3])
        await asyncio.wait([task for _, task in victim[0]._in_flight.values()])
    finally:
        for group in groups:
            await group.close()
    assert all(c.released for c in compressors)
    victim.clear()
    del errors, groups, group
    for _ in range(3):
        gc.collect()
        await asyncio.sleep(0)
    assert not unretrieved, [str(c.get("exception")) for c in unretrieved]
