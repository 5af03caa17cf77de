"""PowerSGD (p2pcoll.training.PowerSGD) over real peers: exact on low-rank gradients, error
feedback that loses nothing for good, the same bits on every rank, fewer bytes on the wire,
and clear errors for bad input."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import pytest

import p2pcoll
from p2pcoll import training
from p2pcoll.testing import run_ranks
from p2pcoll.training.powersgd import low_rank_product, orthonormal_columns

TIMEOUT = 10.0


def digest(tree: dict[str, Any]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(tree):
        h.update(name.encode())
        h.update(np.ascontiguousarray(np.asarray(tree[name])).tobytes())
    return h.hexdigest()


# --- the pieces computed alike on every rank --------------------------------------------------


def test_orthonormal_columns_are_orthonormal_and_rank_deficiency_gives_zeros() -> None:
    rng = np.random.default_rng(1)
    p = rng.standard_normal((50, 4))
    q = orthonormal_columns(p)
    np.testing.assert_allclose(q.T @ q, np.eye(4), atol=1e-12)
    # Same span as p: projecting p onto q's columns gives p back.
    np.testing.assert_allclose(q @ (q.T @ p), p, atol=1e-10)

    deficient = np.column_stack([p[:, 0], 2 * p[:, 0], p[:, 1], np.zeros(50)])
    q = orthonormal_columns(deficient)
    assert not q[:, 1].any() and not q[:, 3].any(), "dependent columns become zero"
    np.testing.assert_allclose(q[:, [0, 2]].T @ q[:, [0, 2]], np.eye(2), atol=1e-12)


def test_low_rank_product_is_the_matrix_product() -> None:
    rng = np.random.default_rng(2)
    p, q = rng.standard_normal((7, 3)), rng.standard_normal((5, 3))
    np.testing.assert_allclose(low_rank_product(p, q), p @ q.T, rtol=1e-12)


# --- over real peers -------------------------------------------------------------------------


def low_rank_grads(rank: int, r: int = 2) -> dict[str, np.ndarray]:
    """Rank ``rank``'s gradients: a multiple of one rank-r matrix, a conv-shaped tensor that is
    a multiple of another, and a bias; their average is rank r as well."""
    rng = np.random.default_rng(11)
    a, b = rng.standard_normal((40, r)), rng.standard_normal((30, r))
    c, d = rng.standard_normal((8, r)), rng.standard_normal((3 * 3 * 4, r))
    return {"fc.w": (rank + 1) * (a @ b.T),
            "conv.w": ((rank + 1) * (c @ d.T)).reshape(8, 4, 3, 3),
            "fc.b": np.full(30, float(rank))}


@pytest.mark.parametrize("n", [1, 3])
async def test_a_rank_r_average_comes_back_exact(n: int) -> None:
    mean = {k: sum(low_rank_grads(r)[k] for r in range(n)) / n for k in low_rank_grads(0)}

    async def fn(g: p2pcoll.Group) -> list[dict[str, np.ndarray]]:
        reducer = training.PowerSGD(rank=4)  # more than the true rank 2: extra columns vanish
        outs = [await reducer.allreduce(g, low_rank_grads(g.rank)) for _ in range(3)]
        assert sorted(reducer.compressed()) == ["conv.w", "fc.w"]
        return outs

    results = await run_ranks(n, fn, collective_timeout=TIMEOUT)
    for outs in results:
        for out in outs[1:]:  # after the warm start (the first is exact already here)
            for name, want in mean.items():
                assert out[name].shape == want.shape and out[name].dtype == want.dtype
                np.testing.assert_allclose(out[name], want, rtol=1e-9, atol=1e-9,
                                           err_msg=name)
        np.testing.assert_array_equal(outs[-1]["fc.b"], mean["fc.b"])  # averaged whole
    assert len({digest(outs[-1]) for outs in results}) == 1


async def test_error_feedback_delivers_what_rank_r_leaves_out_later() -> None:
    # Full-rank gradients, rank 1: each round's estimate is poor, but what it leaves out is
    # sent in later rounds, so the running mean of the estimates converges to the true mean.
    def grads(rank: int) -> dict[str, np.ndarray]:
        return {"w": np.random.default_rng(rank).standard_normal((12, 10))}

    mean = sum(grads(r)["w"] for r in range(2)) / 2

    async def fn(g: p2pcoll.Group) -> list[float]:
        reducer = training.PowerSGD(rank=1)
        total = np.zeros_like(mean)
        errors = []
        for t in range(1, 61):
            total += (await reducer.allreduce(g, grads(g.rank)))["w"]
            errors.append(float(np.linalg.norm(total / t - mean) / np.linalg.norm(mean)))
        return errors

    for errors in await run_ranks(2, fn, collective_timeout=TIMEOUT):
        assert errors[0] > 0.3, "rank 1 of a full-rank matrix is far from it"
        assert errors[-1] < errors[0] / 5, errors[::10]


async def test_replicas_stay_identical_while_training_and_bytes_drop() -> None:
    """Four ranks train a two-layer model on their own data with PowerSGD; their weights
    keep the same bits, and the wire carries a fraction of a plain allreduce's bytes."""
    n, rounds = 4, 6

    def gradients(params: dict[str, np.ndarray], rank: int, t: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(100 * t + rank)
        x = rng.standard_normal((16, 64)).astype(np.float32)
        h = np.tanh(x @ params["w1"])
        err = h @ params["w2"] - rng.standard_normal((16, 32)).astype(np.float32)
        gw2 = h.T @ err / 16
        gh = (err @ params["w2"].T) * (1 - h * h)
        return {"w1": x.T @ gh / 16, "w2": gw2, "b": err.mean(axis=0)}

    async def fn(g: p2pcoll.Group) -> tuple[str, float, int, int]:
        rng = np.random.default_rng(0)
        params = {"w1": rng.standard_normal((64, 128)).astype(np.float32) * 0.1,
                  "w2": rng.standard_normal((128, 32)).astype(np.float32) * 0.1,
                  "b": np.zeros(32, np.float32)}
        # A named strategy, so that even small buffers go over the sockets the stats count
        # (by default they would take the shared-memory board of peers on one host).
        reducer = training.PowerSGD(rank=2, strategy="ring")
        before = g.stats()["bytes_sent"]
        for t in range(rounds):
            grads = await reducer.allreduce(g, gradients(params, g.rank, t))
            for name, grad in grads.items():
                assert grad.dtype == np.float32
                params[name] -= 0.1 * grad
        compressed = g.stats()["bytes_sent"] - before
        await training.check_replicas(g, params)  # raises ReplicaDivergence if not
        before = g.stats()["bytes_sent"]
        for t in range(rounds):
            await training.allreduce_gradients(g, gradients(params, g.rank, t), strategy="ring")
        dense = g.stats()["bytes_sent"] - before
        return digest(params), reducer.traffic.ratio, compressed, dense

    results = await run_ranks(n, fn, collective_timeout=TIMEOUT)
    assert len({d for d, *_ in results}) == 1
    # w1: 64 x 128 -> 2 x 192; w2: 128 x 32 -> 2 x 160; b whole: 10272 -> 736 elements.
    assert results[0][1] == pytest.approx((64 * 128 + 128 * 32 + 32) / (2 * 192 + 2 * 160 + 32))
    for _, _, compressed, dense in results:
        assert compressed * 5 < dense, (compressed, dense)


async def test_torch_tensors_come_back_as_tensors_with_the_numpy_bits() -> None:
    torch = pytest.importorskip("torch")

    async def fn(g: p2pcoll.Group) -> tuple[dict[str, Any], dict[str, Any]]:
        grads = low_rank_grads(g.rank)
        as_numpy = await training.PowerSGD(rank=2).allreduce(g, grads)
        as_torch = await training.PowerSGD(rank=2).allreduce(
            g, {k: torch.from_numpy(v.copy()) for k, v in grads.items()})
        return as_numpy, as_torch

    for as_numpy, as_torch in await run_ranks(2, fn, collective_timeout=TIMEOUT):
        for name, want in as_numpy.items():
            assert isinstance(as_torch[name], torch.Tensor)
            assert as_torch[name].numpy().tobytes() == want.tobytes(), name


async def test_float16_gradients_are_computed_in_float32_and_returned_as_float16() -> None:
    async def fn(g: p2pcoll.Group) -> dict[str, np.ndarray]:
        grads = {k: v.astype(np.float16) for k, v in low_rank_grads(g.rank).items()}
        return await training.PowerSGD(rank=2).allreduce(g, grads)

    mean = (low_rank_grads(0)["fc.w"] + low_rank_grads(1)["fc.w"]) / 2
    for out in await run_ranks(2, fn, collective_timeout=TIMEOUT):
        assert out["fc.w"].dtype == np.float16
        np.testing.assert_allclose(out["fc.w"], mean, rtol=2e-2, atol=2e-2)


# --- bad input -----------------------------------------------------------------------------


@pytest.mark.parametrize("rank", [0, -1, 1.5, True, "4"])
def test_a_bad_rank_is_refused(rank: Any) -> None:
    with pytest.raises(ValueError, match="PowerSGD rank must be an int >= 1"):
        training.PowerSGD(rank=rank)


def test_other_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="nonfinite"):
        training.PowerSGD(nonfinite="maybe")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="seed"):
        training.PowerSGD(seed=-1)
    with pytest.raises(ValueError, match="bucket_bytes"):
        training.PowerSGD(bucket_bytes=-5)


async def test_bad_gradients_are_refused_before_communicating() -> None:
    async def fn(g: p2pcoll.Group) -> None:
        reducer = training.PowerSGD(rank=2)
        with pytest.raises(TypeError, match="'steps' is int64"):
            await reducer.allreduce(g, {"w": np.ones((4, 4)), "steps": np.arange(3)})
        await reducer.allreduce(g, {"w": np.ones((8, 8))})
        with pytest.raises(ValueError, match="the same gradients"):
            await reducer.allreduce(g, {"w": np.ones((8, 9))})

    await run_ranks(1, fn)


async def test_ranks_that_disagree_on_the_rank_get_a_mismatch_naming_it() -> None:
    async def fn(g: p2pcoll.Group) -> Exception | None:
        reducer = training.PowerSGD(rank=2 + g.rank)
        try:
            await reducer.allreduce(g, {"w": np.ones((8, 8))})
        except p2pcoll.CollectiveMismatch as exc:
            return exc
        return None

    for exc in await run_ranks(2, fn, collective_timeout=TIMEOUT):
        assert isinstance(exc, p2pcoll.CollectiveMismatch)
        assert "rank is 2 on rank 0 but 3 on rank 1" in str(exc)


async def test_nan_is_reported_and_leaves_the_residuals_alone() -> None:
    async def fn(g: p2pcoll.Group) -> None:
        reducer = training.PowerSGD(rank=1)
        good = {"w": np.arange(64.0).reshape(8, 8)}
        first = await reducer.allreduce(g, good)
        bad = {"w": good["w"].copy()}
        bad["w"][3, 3] = np.nan if g.rank == 1 else 0.0
        with pytest.raises(training.NonFiniteGradients, match="'w'"):
            await reducer.allreduce(g, bad)
        # The failed round changed nothing: the next is the same as a second round would be.
        again = training.PowerSGD(rank=1)
        await again.allreduce(g, good)
        assert (await reducer.allreduce(g, good))["w"].tobytes() == \
            (await again.allreduce(g, good))["w"].tobytes()
        assert first["w"].shape == (8, 8)

    await run_ranks(2, fn, collective_timeout=TIMEOUT)
