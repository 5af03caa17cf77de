"""Top-k with error feedback (p2pcoll.training.TopK) over real peers: the right entries, summed
in rank order to the same bits everywhere, nothing lost for good, fewer bytes, clear errors."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import pytest

import p2pcoll
from p2pcoll import training
from p2pcoll.testing import run_ranks
from p2pcoll.training.topk import top_k_indices

TIMEOUT = 10.0


def digest(tree: dict[str, Any]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(tree):
        h.update(name.encode())
        h.update(np.ascontiguousarray(np.asarray(tree[name])).tobytes())
    return h.hexdigest()


def test_top_k_indices_are_the_largest_magnitudes_in_order() -> None:
    values = np.array([0.5, -9.0, 3.0, 0.0, -4.0, 8.0, 1.0])
    assert top_k_indices(values, 3).tolist() == [1, 4, 5]
    assert top_k_indices(values, 7).tolist() == list(range(7))
    assert top_k_indices(values, 1).tolist() == [1]


def test_k_is_a_share_of_each_tensor_and_at_least_one() -> None:
    reducer = training.TopK(fraction=0.01)
    assert [reducer.k_of(n) for n in (0, 1, 99, 100, 101, 1000)] == [0, 1, 1, 1, 2, 10]
    assert training.TopK(fraction=1).k_of(37) == 37


def grads_of(rank: int) -> dict[str, np.ndarray]:
    """Distinct magnitudes, so the top entries are unambiguous: a permutation per rank."""
    rng = np.random.default_rng(rank)
    w = (rng.permutation(60) + 1.0).reshape(6, 10) * rng.choice([-1.0, 1.0], size=(6, 10))
    b = (rng.permutation(9) + 1.0).astype(np.float32)
    return {"w": w, "b": b}


@pytest.mark.parametrize("n", [1, 3])
async def test_each_rank_sends_its_top_entries_and_everyone_gets_their_average(n: int) -> None:
    async def fn(g: p2pcoll.Group) -> dict[str, np.ndarray]:
        return await training.TopK(fraction=0.1).allreduce(g, grads_of(g.rank))

    results = await run_ranks(n, fn, collective_timeout=TIMEOUT)
    for name in ("w", "b"):
        total = np.zeros(grads_of(0)[name].size, grads_of(0)[name].dtype)
        for r in range(n):
            mine = grads_of(r)[name].reshape(-1)
            k = 6 if name == "w" else 1
            top = np.argsort(-np.abs(mine))[:k]
            total[top] += mine[top]
        want = (total / n).astype(grads_of(0)[name].dtype).reshape(grads_of(0)[name].shape)
        for out in results:
            assert out[name].dtype == want.dtype
            np.testing.assert_array_equal(out[name], want, err_msg=name)
    assert len({digest(out) for out in results}) == 1


async def test_what_is_held_back_is_sent_later() -> None:
    # One rank, fraction 0.25 of 8 entries: two per round. What a round holds back grows
    # until it is among the largest and is sent.
    grad = {"v": np.array([8.0, 1.0, 7.0, 2.0, 6.0, 3.0, 5.0, 4.0])}

    async def fn(g: p2pcoll.Group) -> list[np.ndarray]:
        reducer = training.TopK(fraction=0.25)
        return [(await reducer.allreduce(g, grad))["v"] for _ in range(3)]

    (outs,) = await run_ranks(1, fn)
    assert outs[0].tolist() == [8, 0, 7, 0, 0, 0, 0, 0]
    assert outs[1].tolist() == [0, 0, 0, 0, 12, 0, 10, 0]   # 6 + 6 and 5 + 5, held back once
    assert outs[2].tolist() == [16, 0, 14, 0, 0, 0, 0, 0]   # 8 + 8 and 7 + 7 outgrow 4 + 4 + 4


async def test_replicas_stay_identical_and_bytes_drop() -> None:
    n, rounds = 4, 5

    async def fn(g: p2pcoll.Group) -> tuple[str, float, int, int]:
        params = {"w": np.zeros((100, 100), np.float32), "b": np.zeros(100, np.float32)}
        reducer = training.TopK(fraction=0.01, strategy="ring")

        def grads(t: int) -> dict[str, np.ndarray]:
            rng = np.random.default_rng(1000 * t + g.rank)
            return {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in params.items()}

        before = g.stats()["bytes_sent"]
        for t in range(rounds):
            for name, grad in (await reducer.allreduce(g, grads(t))).items():
                params[name] -= np.float32(0.1) * grad
        sparse = g.stats()["bytes_sent"] - before
        await training.check_replicas(g, params)
        before = g.stats()["bytes_sent"]
        for t in range(rounds):
            await training.allreduce_gradients(g, grads(t), strategy="ring")
        dense = g.stats()["bytes_sent"] - before
        return digest(params), reducer.traffic.ratio, sparse, dense

    results = await run_ranks(n, fn, collective_timeout=TIMEOUT)
    assert len({d for d, *_ in results}) == 1
    # 10100 float32 -> 100 + 1 entries of 4 + 4 bytes each
    assert results[0][1] == pytest.approx(10100 * 4 / (101 * 8))
    for _, _, sparse, dense in results:
        assert sparse * 5 < dense, (sparse, dense)


async def test_torch_tensors_come_back_as_tensors() -> None:
    torch = pytest.importorskip("torch")

    async def fn(g: p2pcoll.Group) -> tuple[dict[str, Any], dict[str, Any]]:
        as_numpy = await training.TopK(fraction=0.2).allreduce(g, grads_of(g.rank))
        as_torch = await training.TopK(fraction=0.2).allreduce(
            g, {k: torch.from_numpy(v) for k, v in grads_of(g.rank).items()})
        return as_numpy, as_torch

    for as_numpy, as_torch in await run_ranks(2, fn, collective_timeout=TIMEOUT):
        for name, want in as_numpy.items():
            assert isinstance(as_torch[name], torch.Tensor)
            assert as_torch[name].numpy().tobytes() == want.tobytes()


@pytest.mark.parametrize("fraction", [0, -0.1, 1.01, float("nan"), "0.1", True])
def test_a_fraction_outside_0_1_is_refused(fraction: Any) -> None:
    with pytest.raises(ValueError, match=r"top-k fraction must be a number in \(0, 1\]"):
        training.TopK(fraction=fraction)


async def test_bad_gradients_and_disagreeing_fractions() -> None:
    async def fn(g: p2pcoll.Group) -> None:
        with pytest.raises(TypeError, match="'mask' is bool"):
            await training.TopK().allreduce(g, {"mask": np.ones(3, bool)})
        reducer = training.TopK(fraction=0.5 if g.rank == 0 else 0.25)
        with pytest.raises(p2pcoll.CollectiveMismatch,
                           match="fraction is 0.5 on rank 0 but 0.25 on rank 1"):
            await reducer.allreduce(g, {"w": np.ones(8)})
        same = training.TopK(fraction=0.5)
        await same.allreduce(g, {"w": np.ones(8)})
        with pytest.raises(ValueError, match="same gradients"):
            await same.allreduce(g, {"w": np.ones(9)})

    await run_ranks(2, fn, collective_timeout=TIMEOUT)


async def test_inf_is_reported_by_name() -> None:
    async def fn(g: p2pcoll.Group) -> None:
        grads = {"a": np.ones(4), "b": np.array([1.0, np.inf if g.rank else 0.0])}
        with pytest.raises(training.NonFiniteGradients, match="'b'"):
            await training.TopK(fraction=1.0).allreduce(g, grads)

    await run_ranks(2, fn, collective_timeout=TIMEOUT)
