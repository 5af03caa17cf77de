"""Local SGD, DiLoCo and streaming DiLoCo (p2pcoll.training) over real peers: the outer
optimizer is the paper's, the limiting cases are plain averaged SGD, every rank holds the
same global state after every outer step, fragments sync on their own staggered steps,
bytes drop by about H, and ranks that disagree are told what differs."""

from __future__ import annotations

import asyncio
import gc
import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import p2pcoll
from p2pcoll import training
from p2pcoll.testing import free_port, memory_groups, run_ranks
from conftest import newcomer_arrives
from losses import cut_off_and_close
from peer_processes import READY, start_together

TIMEOUT = 10.0
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID",
                 "SLURM_NTASKS", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")


def digest(tree: Any) -> str:
    h = hashlib.blake2b(digest_size=16)
    for name, leaf in training.named_leaves(tree):
        h.update(name.encode())
        h.update(np.ascontiguousarray(np.asarray(leaf)).tobytes())
    return h.hexdigest()


def model(seed: int = 0, dtype: Any = np.float32) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"l1.w": rng.standard_normal((16, 24)).astype(dtype),
            "l1.b": rng.standard_normal(24).astype(dtype),
            "l2.w": rng.standard_normal((24, 8)).astype(dtype),
            "l2.b": rng.standard_normal(8).astype(dtype)}


def noisy_grads(params: dict[str, np.ndarray], rank: int, step: int) -> dict[str, np.ndarray]:
    """Each rank's own gradients at each step: what its data would give (pull towards a
    rank-specific target, plus noise)."""
    rng = np.random.default_rng(1000 * step + rank)
    return {k: (0.1 * v - 0.05 * (rank + 1) + 0.01 * rng.standard_normal(v.shape)
                ).astype(v.dtype) for k, v in params.items()}


# --- the outer optimizer ----------------------------------------------------------------------


@pytest.mark.slow  # torch.optim (its first import takes seconds)
def test_outer_sgd_is_torchs_sgd_with_nesterov_momentum() -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    start = rng.standard_normal(10)
    deltas = [rng.standard_normal(10) for _ in range(5)]
    for nesterov, momentum in [(True, 0.9), (False, 0.9), (False, 0.0)]:
        outer = training.OuterSGD(lr=0.7, momentum=momentum, nesterov=nesterov)
        p, v = start.copy(), np.zeros(10)
        tp = torch.tensor(start, requires_grad=True)
        opt = torch.optim.SGD([tp], lr=0.7, momentum=momentum, nesterov=nesterov)
        for d in deltas:
            outer.apply([p], [v], [d])
            tp.grad = torch.tensor(d)
            opt.step()
        np.testing.assert_allclose(p, tp.detach().numpy(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kwargs, match", [
    ({"lr": 0}, "outer_lr"), ({"lr": float("inf")}, "outer_lr"), ({"lr": -1}, "outer_lr"),
    ({"momentum": 1.0}, "outer_momentum"), ({"momentum": -0.1}, "outer_momentum"),
])
def test_outer_sgd_refuses_bad_settings(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        training.OuterSGD(**kwargs)


# --- the limiting cases -------------------------------------------------------------------------


def dyadic_grads(rank: int, step: int) -> dict[str, np.ndarray]:
    """Small integers: every sum, halving and difference below is exact in float64."""
    rng = np.random.default_rng(10 * step + rank)
    return {"w": rng.integers(-8, 8, (4, 3)).astype(np.float64),
            "b": rng.integers(-8, 8, 3).astype(np.float64)}


@pytest.mark.parametrize("n", [3, 4])
async def test_diloco_with_h_1_lr_1_no_momentum_is_plain_averaged_sgd(n: int) -> None:
    # With 4 ranks every value stays a small dyadic fraction, so both ways are exact and give
    # the same bits; with 3 the averages round (to within the last bits).
    steps, lr = 5, 0.5

    async def fn(g: p2pcoll.Group) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        params = {"w": np.zeros((4, 3)), "b": np.ones(3)}
        diloco = training.DiLoCo(g, params, inner_steps=1, outer_lr=1.0, outer_momentum=0.0)
        for t in range(steps):
            for k, grad in dyadic_grads(g.rank, t).items():
                params[k] -= lr * grad                     # the inner step: plain SGD
            assert await diloco.after_inner_step()
        plain = {"w": np.zeros((4, 3)), "b": np.ones(3)}
        for t in range(steps):
            avg = await training.allreduce_gradients(g, dyadic_grads(g.rank, t))
            for k, grad in avg.items():
                plain[k] -= lr * grad
        return params, plain

    results = await run_ranks(n, fn, collective_timeout=TIMEOUT)
    assert len({digest(mine) for mine, _ in results}) == 1
    for mine, plain in results:
        if n == 4:
            assert digest(mine) == digest(plain)
        for k in plain:
            np.testing.assert_allclose(mine[k], plain[k], rtol=1e-13, atol=1e-13)


async def test_local_sgd_averages_the_parameters_every_h_steps() -> None:
    h, n = 3, 2

    async def fn(g: p2pcoll.Group) -> list[tuple[bool, str]]:
        params = {"w": np.zeros((4, 3)), "b": np.ones(3)}
        local = training.LocalSGD(g, params, inner_steps=h)
        seen = []
        for t in range(2 * h):
            for k, grad in dyadic_grads(g.rank, t).items():
                params[k] -= grad
            seen.append((await local.after_inner_step(), digest(params)))
        assert local.syncs == 2 and local.traffic.ratio == h
        return seen

    results = await run_ranks(n, fn, collective_timeout=TIMEOUT)
    for t in range(2 * h):
        synced = {seen[t][0] for seen in results}
        assert synced == {(t + 1) % h == 0}
        assert (len({seen[t][1] for seen in results}) == 1) == ((t + 1) % h == 0)
    # After the first H steps: the mean of what each rank would have alone.
    want = {"w": np.zeros((4, 3)), "b": np.ones(3)}
    for k in want:
        want[k] = want[k] - sum(sum(dyadic_grads(r, t)[k] for t in range(h))
                                for r in range(n)) / n
    assert results[0][h - 1][1] == digest(want)


# --- identical replicas, fragments, bytes ---------------------------------------------------------


@pytest.mark.parametrize("n", [2, 4])
async def test_diloco_keeps_the_global_state_identical_on_every_rank(n: int) -> None:
    h, outer_steps = 4, 3

    async def fn(g: p2pcoll.Group) -> list[str]:
        params = model(seed=g.rank)  # different on purpose: broadcast first, as documented
        await training.broadcast_parameters(g, params)
        diloco = training.DiLoCo(g, params, inner_steps=h)
        digests = []
        for t in range(h * outer_steps):
            for k, grad in noisy_grads(params, g.rank, t).items():
                params[k] -= np.float32(0.1) * grad
            if await diloco.after_inner_step():
                assert digest(params) == digest(diloco.global_state()["params"])
                await training.check_replicas(g, params)
                digests.append(digest(diloco.global_state()))
        assert diloco.outer_steps == outer_steps
        return digests

    results = await run_ranks(n, fn, collective_timeout=TIMEOUT)
    assert len(results[0]) == outer_steps
    assert all(r == results[0] for r in results)
    assert len(set(results[0])) == outer_steps  # the state moved at every outer step


async def test_streaming_fragments_sync_at_their_staggered_steps() -> None:
    h, f = 6, 3  # offsets 0, 2, 4: fragment 1 at steps 2, 8, 14; 2 at 4, 10; 0 at 6, 12

    async def fn(g: p2pcoll.Group) -> tuple[list[int], list[list[str]], list[str]]:
        params = model()
        diloco = training.DiLoCo(g, params, inner_steps=h, fragments=f, strategy="ring")
        when, digests = [], []
        for t in range(1, 15):
            for k, grad in noisy_grads(params, g.rank, t).items():
                params[k] -= np.float32(0.1) * grad
            if await diloco.after_inner_step():
                when.append(t)
                digests.append(digest(diloco.global_state()))
        return when, diloco.fragment_names(), digests

    results = await run_ranks(2, fn, collective_timeout=TIMEOUT)
    when, fragments, digests = results[0]
    assert when == [2, 4, 6, 8, 10, 12, 14]
    # The leaf order l1.b (24), l1.w (16 rows of 24), l2.b (8), l2.w (24 rows of 8): 608
    # elements cut into thirds between rows: 216, 192 and 200.
    assert fragments == [["l1.b", "l1.w[0:8]"], ["l1.w[8:16]"], ["l2.b", "l2.w"]]
    assert results[1][2] == digests


async def test_streaming_with_overlap_applies_tau_steps_later_and_mixes() -> None:
    h, tau, mix = 4, 2, 0.5

    async def fn(g: p2pcoll.Group) -> tuple[list[int], str, str]:
        params = model()
        diloco = training.DiLoCo(g, params, inner_steps=h, fragments=2, overlap=tau, mix=mix)
        applied = []
        for t in range(1, 12):
            for k, grad in noisy_grads(params, g.rank, t).items():
                params[k] -= np.float32(0.1) * grad
            if await diloco.after_inner_step():
                applied.append(t)
        assert await diloco.flush() == 1  # fragment 1's exchange started at step 10
        return applied, digest(diloco.global_state()), digest(params)

    results = await run_ranks(3, fn, collective_timeout=TIMEOUT)
    # Fragment 1 starts at 2, 6, 10 and fragment 0 at 4, 8: each applied 2 steps later.
    assert results[0][0] == [4, 6, 8, 10]
    assert len({r[1] for r in results}) == 1, "the global state is the same on every rank"
    assert len({r[2] for r in results}) == 3, "the mixed local parameters are each rank's"


async def test_diloco_hands_the_network_about_h_times_fewer_bytes() -> None:
    h, steps = 8, 16

    async def fn(g: p2pcoll.Group) -> tuple[int, int, float]:
        params = model(dtype=np.float32)
        diloco = training.DiLoCo(g, params, inner_steps=h, strategy="ring")
        before = g.stats()["bytes_sent"]
        for t in range(steps):
            for k, grad in noisy_grads(params, g.rank, t).items():
                params[k] -= np.float32(0.1) * grad
            await diloco.after_inner_step()
        outer = g.stats()["bytes_sent"] - before
        before = g.stats()["bytes_sent"]
        for t in range(steps):
            await training.allreduce_gradients(g, noisy_grads(params, g.rank, t),
                                               strategy="ring")
        dense = g.stats()["bytes_sent"] - before
        return outer, dense, diloco.traffic.ratio

    for outer, dense, ratio in await run_ranks(3, fn, collective_timeout=TIMEOUT):
        assert ratio == h
        assert outer * (h - 1) < dense, (outer, dense)


@pytest.mark.parametrize("codec, factor", [("int8", 3.8), ("fp16", 1.9)])
async def test_compressed_pseudo_gradients_keep_replicas_identical_and_cut_bytes(
        codec: str, factor: float) -> None:
    h, steps, n = 4, 12, 4

    async def run(g: p2pcoll.Group, codec: str | None) -> tuple[Any, int, float]:
        rng = np.random.default_rng(5)  # large enough that the scales are a small part
        params = {"w": rng.standard_normal((96, 128)).astype(np.float32),
                  "b": rng.standard_normal(128).astype(np.float32)}
        diloco = training.DiLoCo(g, params, inner_steps=h, codec=codec, strategy="ring")
        before = g.stats()["bytes_sent"]
        for t in range(steps):
            for k, grad in noisy_grads(params, g.rank, t).items():
                params[k] -= np.float32(0.1) * grad
            if await diloco.after_inner_step():
                await training.check_replicas(g, params)
        return diloco.global_state(), g.stats()["bytes_sent"] - before, diloco.traffic.ratio

    async def fn(g: p2pcoll.Group) -> tuple[str, Any, Any, int, int, float]:
        coded, coded_bytes, ratio = await run(g, codec)
        plain, plain_bytes, _ = await run(g, None)
        return digest(coded), coded, plain, coded_bytes, plain_bytes, ratio

    results = await run_ranks(n, fn, collective_timeout=TIMEOUT)
    assert len({r[0] for r in results}) == 1, "the global state is the same on every rank"
    for _, coded, plain, coded_bytes, plain_bytes, ratio in results:
        assert coded_bytes * factor < plain_bytes, (coded_bytes, plain_bytes)
        wire = training.modes.get_codec(codec).wire_bytes
        assert ratio == pytest.approx(h * 4 / wire, rel=1e-3)
        for name, want in plain["params"].items():   # close to the uncompressed run
            np.testing.assert_allclose(coded["params"][name], want, rtol=0.05, atol=0.05)


async def test_error_feedback_keeps_int8_from_drifting() -> None:
    # H = 1, outer lr 1, no momentum: the global parameters move by the decoded average of
    # the same pseudo-gradient every step. int8 rounds each element the same way each time;
    # without error feedback that bias adds up, with it the lost part is sent later.
    steps = 30
    step_size = {"w": (np.arange(1, 65, dtype=np.float64) / 67.0).reshape(8, 8)}

    async def fn(g: p2pcoll.Group) -> tuple[float, float]:
        errors = []
        for feedback in (True, False):
            params = {"w": np.zeros((8, 8))}
            diloco = training.DiLoCo(g, params, inner_steps=1, outer_lr=1.0,
                                     outer_momentum=0.0, codec="int8",
                                     error_feedback=feedback)
            for _ in range(steps):
                params["w"] -= step_size["w"]
                await diloco.after_inner_step()
            want = -steps * step_size["w"]
            errors.append(float(np.abs(diloco.global_state()["params"]["w"] - want).max()))
        return errors[0], errors[1]

    for with_feedback, without in await run_ranks(2, fn, collective_timeout=TIMEOUT):
        assert with_feedback * 5 < without, (with_feedback, without)


async def test_an_unknown_codec_is_refused_when_diloco_is_made() -> None:
    async def fn(g: p2pcoll.Group) -> None:
        with pytest.raises(ValueError, match="no codec named 'int3'; installed: .*int8"):
            training.DiLoCo(g, model(), inner_steps=4, codec="int3")

    await run_ranks(1, fn)


async def test_nan_under_int8_is_reported_by_name_and_not_applied() -> None:
    async def fn(g: p2pcoll.Group) -> None:
        params = {"w": np.ones(3), "b": np.zeros(2)}
        diloco = training.DiLoCo(g, params, inner_steps=1, codec="int8")
        before = digest(diloco.global_state())
        params["b"][1] = np.inf if g.rank == 1 else 2.0
        with pytest.raises(training.NonFiniteGradients, match="'b'") as info:
            await diloco.after_inner_step()
        assert info.value.tensors == ["b"]
        assert digest(diloco.global_state()) == before and diloco.outer_steps == 0

    await run_ranks(2, fn, collective_timeout=TIMEOUT)


@pytest.mark.slow  # torch.optim (its first import takes seconds)
async def test_torch_parameters_are_trained_in_place() -> None:
    torch = pytest.importorskip("torch")

    async def fn(g: p2pcoll.Group) -> str:
        torch.manual_seed(0)
        net = torch.nn.Linear(6, 3)
        opt = torch.optim.Adam(net.parameters(), lr=0.01)  # the worker's own inner optimizer
        params = dict(net.named_parameters())
        diloco = training.DiLoCo(g, params, inner_steps=3)
        for t in range(6):
            x = torch.randn(8, 6, generator=torch.Generator().manual_seed(10 * t + g.rank))
            opt.zero_grad()
            net(x).pow(2).mean().backward()
            opt.step()
            await diloco.after_inner_step()
        with torch.no_grad():
            state = {k: v.detach().numpy().copy() for k, v in net.named_parameters()}
        assert digest(state) == digest(diloco.global_state()["params"])
        return digest(state)

    assert len(set(await run_ranks(2, fn, collective_timeout=TIMEOUT))) == 1


# --- disagreement and bad input -------------------------------------------------------------------


async def mismatch(n: int, make: Any, steps: int) -> list[Any]:
    async def fn(g: p2pcoll.Group) -> Exception | None:
        params = model()
        mode = make(g, params)
        try:
            for _ in range(steps):
                await mode.after_inner_step()
        except p2pcoll.CollectiveMismatch as exc:
            return exc
        return None

    return await run_ranks(n, fn, collective_timeout=TIMEOUT)


@pytest.mark.parametrize("what, make, words", [
    ("H", lambda g, p: training.DiLoCo(g, p, inner_steps=2 + g.rank),
     "inner_steps is 2 on rank 0 but 3 on rank 1"),
    ("codec", lambda g, p: training.DiLoCo(g, p, inner_steps=2,
                                           codec="fp16" if g.rank else None),
     "codec is None on rank 0 but 'fp16' on rank 1"),
    ("fragments", lambda g, p: training.DiLoCo(g, p, inner_steps=4, fragments=1 + g.rank),
     "fragments is 1 on rank 0 but 2 on rank 1"),
    ("outer lr", lambda g, p: training.DiLoCo(g, p, inner_steps=2, outer_lr=0.7 + g.rank),
     "outer_lr is 0.7 on rank 0 but 1.7 on rank 1"),
    ("local SGD's H", lambda g, p: training.LocalSGD(g, p, inner_steps=2 + g.rank),
     "inner_steps is 2 on rank 0 but 3 on rank 1"),
])
async def test_ranks_that_disagree_get_a_mismatch_naming_the_setting(
        what: str, make: Any, words: str) -> None:
    for exc in await mismatch(2, make, steps=6):
        assert isinstance(exc, p2pcoll.CollectiveMismatch), what
        assert words in str(exc), str(exc)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"inner_steps": 0}, ValueError, r"inner_steps \(H\) must be an int >= 1"),
    ({"inner_steps": -3}, ValueError, r"inner_steps \(H\) must be an int >= 1"),
    ({"inner_steps": 2.5}, ValueError, r"inner_steps \(H\) must be an int >= 1"),
    ({"inner_steps": 4, "fragments": 0}, ValueError, "fragments must be an int in"),
    ({"inner_steps": 2, "fragments": 3}, ValueError, "fragments must be an int in"),
    ({"inner_steps": 4, "overlap": 5}, ValueError, "overlap must be an int in"),
    ({"inner_steps": 4, "overlap": -1}, ValueError, "overlap must be an int in"),
    ({"inner_steps": 4, "mix": 1.0}, ValueError, r"mix must be a number in \[0, 1\)"),
    ({"inner_steps": 4, "outer_lr": 0.0}, ValueError, "outer_lr"),
    ({"inner_steps": 4, "outer_momentum": 1.5}, ValueError, "outer_momentum"),
    ({"inner_steps": 4, "codec": 8}, TypeError, "codec must be a codec's name"),
    ({"inner_steps": 4, "codec": "int4"}, ValueError, "no codec named 'int4'"),
    ({"inner_steps": 4, "nonfinite": "skip"}, ValueError, "nonfinite"),
])
async def test_bad_settings_are_refused(kwargs: dict[str, Any], error: type[Exception],
                                        match: str) -> None:
    async def fn(g: p2pcoll.Group) -> None:
        with pytest.raises(error, match=match):
            training.DiLoCo(g, model(), **kwargs)

    await run_ranks(1, fn)


async def test_bad_parameters_are_refused() -> None:
    async def fn(g: p2pcoll.Group) -> None:
        with pytest.raises(TypeError, match="'steps' is int64"):
            training.DiLoCo(g, {"w": np.ones(3), "steps": np.arange(2)}, inner_steps=2)
        with pytest.raises(TypeError, match="'steps' is int64"):
            training.LocalSGD(g, {"w": np.ones(3), "steps": np.arange(2)}, inner_steps=2)
        with pytest.raises(ValueError, match="leaves fragment 1 empty"):
            training.DiLoCo(g, {"w": np.ones((1, 10))}, inner_steps=4, fragments=2)
        with pytest.raises(ValueError, match="at least one parameter"):
            training.DiLoCo(g, {}, inner_steps=2)
        frozen = np.ones(3)
        frozen.flags.writeable = False
        with pytest.raises(ValueError, match="'w' is read-only"):
            training.DiLoCo(g, {"w": frozen}, inner_steps=2)
        with pytest.raises(ValueError, match=r"inner_steps \(H\)"):
            training.LocalSGD(g, {"w": np.ones(3)}, inner_steps=0)
        diloco = training.DiLoCo(g, {"w": np.ones(3)}, inner_steps=2)
        with pytest.raises(ValueError, match="parameters changed"):
            await diloco.after_inner_step({"w": np.ones(4)})

    await run_ranks(1, fn)


async def test_ranks_that_start_from_different_parameters_are_told() -> None:
    async def fn(g: p2pcoll.Group) -> Exception | None:
        diloco = training.DiLoCo(g, model(seed=g.rank), inner_steps=1)  # no broadcast first
        try:
            await diloco.after_inner_step()
        except p2pcoll.ReplicaDivergence as exc:
            return exc
        return None

    for exc in await run_ranks(2, fn, collective_timeout=TIMEOUT):
        assert isinstance(exc, p2pcoll.ReplicaDivergence)
        assert exc.ranks == [1] and exc.tensor == "l1.b"
        assert "broadcast_parameters" in str(exc)


async def test_a_nan_pseudo_gradient_is_reported_and_not_applied() -> None:
    async def fn(g: p2pcoll.Group) -> None:
        params = {"w": np.ones(3), "b": np.zeros(2)}
        diloco = training.DiLoCo(g, params, inner_steps=1)
        before = digest(diloco.global_state())
        params["w"][1] = np.nan if g.rank == 0 else 2.0
        with pytest.raises(training.NonFiniteGradients, match="'w'"):
            await diloco.after_inner_step()
        assert digest(diloco.global_state()) == before and diloco.outer_steps == 0

    await run_ranks(2, fn, collective_timeout=TIMEOUT)


async def test_a_lost_peer_ends_every_streaming_exchange_in_flight_with_the_groups_error(
) -> None:
    """Streaming DiLoCo with several fragments' exchanges in flight; rank 3 vanishes. Each
    survivor's after_inner_step raises the group's error and the other exchanges in flight
    end with it too, retrieved: nothing reaches the loop as a task exception never
    retrieved once the objects are gone (the victim's own flush likewise)."""
    loop = asyncio.get_running_loop()
    unretrieved: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _, context: unretrieved.append(context))
    groups = await memory_groups(4, heartbeat_timeout=1.0)

    async def rank(group: p2pcoll.Group) -> BaseException | None:
        params = model(0)
        # H = 8, F = 4: a fragment starts every 2 steps and stays in flight 6: three at once.
        diloco = training.DiLoCo(group, params, inner_steps=8, fragments=4, overlap=6,
                                 timeout=TIMEOUT)
        try:
            for step in range(1, 41):
                for name, g in noisy_grads(params, group.rank, step).items():
                    params[name] -= 0.01 * g
                if group.rank == 3 and step == 12:  # in the middle of the second round
                    await cut_off_and_close(group)
                    await diloco.flush()
                await diloco.after_inner_step()
        except p2pcoll.P2PCollError as exc:
            return exc
        return None

    try:
        errors = await asyncio.gather(*(rank(g) for g in groups))
        for group, exc in zip(groups[:3], errors[:3], strict=True):
            assert isinstance(exc, p2pcoll.PeerLost), exc
            assert exc is group.cause  # the group's own error, not a later one
        assert isinstance(errors[3], p2pcoll.P2PCollError), errors[3]
    finally:
        for group in groups:
            await group.close()
    del errors, groups, group, exc  # the exchanges go with the DiLoCo objects
    for _ in range(3):
        gc.collect()
        await asyncio.sleep(0)
    assert not unretrieved, [str(c.get("exception")) for c in unretrieved]


# --- elastic: a peer lost mid outer step ----------------------------------------------------------


class ElasticJob:
    """Peers of one elastic DiLoCo job as tasks (tests/test_elastic.py's Job, with DiLoCo).
    Each inner step takes every parameter down by exactly 1, so every pseudo-gradient is H
    whatever the world size: the final state tells how many outer steps were applied."""

    H = 3
    POLL = 0.2  # poll_every: rank 0 asks the rendezvous at most this often who waits

    def __init__(self, rounds: int, codec: str | None = None) -> None:
        self.url = f"tcp://127.0.0.1:{free_port()}"
        self.rounds, self.codec = rounds, codec
        self.stuck = asyncio.Event()     # the victim is in an inner step, never to return
        self.smaller = asyncio.Event()   # the survivors took outer steps without it
        self.arrived = asyncio.Event()   # the newcomer waits at the rendezvous

    def start(self, die_at: int | None = None, newcomer: bool = False
              ) -> asyncio.Task[tuple[training.ElasticResult, training.DiLoCoRounds]]:
        return asyncio.create_task(self.peer(die_at, newcomer))

    async def peer(self, die_at: int | None, newcomer: bool
                   ) -> tuple[training.ElasticResult, training.DiLoCoRounds]:
        params = {"w": np.full((2, 3), 9.0 if newcomer else 0.0), "b": np.zeros(3)}

        async def inner(group: p2pcoll.Group, r: int, i: int) -> None:
            if r == die_at and i == 1:
                self.stuck.set()
                await asyncio.sleep(3600)  # until cancelled, while the others wait for it
            if group.world_size < 3 and r >= (die_at or 0) + 3:
                self.smaller.set()
                # Fast rounds could finish the job before the newcomer reaches the
                # rendezvous (it would then wait there alone): two survivors wait for it,
                # then take a round per poll, so that each round boundary brings rank 0 a
                # census asked after it arrived.
                await self.arrived.wait()
                await asyncio.sleep(self.POLL / self.H)
            else:
                await asyncio.sleep(0.002)
            for p in params.values():
                p -= 1.0

        rounds = training.DiLoCoRounds(params, inner, inner_steps=self.H, outer_lr=0.5,
                                       outer_momentum=0.5)
        result = await training.train_elastic(
            rounds.step, rounds.apply, rounds.state, rounds=self.rounds, min_world_size=2,
            max_world_size=3, rendezvous=self.url, timeout=20.0, poll_every=self.POLL,
            codec=self.codec)
        rounds.finish()
        assert digest(params) == digest(rounds.state["params"])
        return result, rounds


@pytest.mark.parametrize("codec", [None, "int8"])
async def test_elastic_diloco_survives_a_lost_peer_and_applies_each_outer_step_once(
        codec: str | None) -> None:
    """Under int8 too: the admission flag does not ride in a compressed bucket (whose block
    scale could round it to 0), so the newcomer still gets in."""
    job = ElasticJob(rounds=20, codec=codec)
    victim = job.start(die_at=4)
    survivors = [job.start(), job.start()]
    await job.stuck.wait()
    victim.cancel()  # it closes its group in the middle of outer step 4
    with pytest.raises(asyncio.CancelledError):
        await victim
    await job.smaller.wait()
    newcomer = job.start(newcomer=True)
    await newcomer_arrives(job.url, job.arrived)
    results = await asyncio.gather(*survivors, newcomer)

    # Every outer step exactly once: the state is H-sized steps replayed rounds times.
    want = {"w": np.zeros((2, 3)), "b": np.zeros(3)}
    velocity = {k: np.zeros_like(v) for k, v in want.items()}
    outer = training.OuterSGD(lr=0.5, momentum=0.5)
    for _ in range(job.rounds):
        outer.apply([want["b"], want["w"]], [velocity["b"], velocity["w"]],
                    [np.full(3, float(job.H)), np.full((2, 3), float(job.H))])
    for result, rounds in results:
        if codec is None:
            assert digest(rounds.state) == digest({"params": want, "velocity": velocity})
        else:  # the pseudo-gradients are all H: int8 carries them exactly
            np.testing.assert_array_equal(rounds.state["params"]["w"], want["w"])
        assert digest(rounds.state) == digest(results[0][1].state)
        applied = result.applied
        assert applied == sorted(set(applied)), "no outer step applied twice"
    survivor, _ = results[0]
    assert [f.world_size for f in survivor.formations] == [3, 2, 3]
    assert survivor.redone == 1  # outer step 4: computed, lost with the group, run again
    late, _ = results[2]
    assert late.joined_at > 4 and late.formations[0].received  # it got the outer state


async def test_elastic_diloco_ranks_that_disagree_on_h_are_told() -> None:
    url = f"tcp://127.0.0.1:{free_port()}"

    async def peer(h: int) -> training.ElasticResult:
        params = {"w": np.zeros(3)}
        rounds = training.DiLoCoRounds(params, lambda g, r, i: None, inner_steps=h)
        return await training.train_elastic(rounds.step, rounds.apply, rounds.state, rounds=2,
                                            min_world_size=2, max_world_size=2,
                                            rendezvous=url, timeout=10)

    errors = await asyncio.gather(peer(5), peer(6), return_exceptions=True)
    for exc in errors:
        assert isinstance(exc, p2pcoll.CollectiveMismatch), exc
        assert "inner_steps is 5 on rank 0 but 6 on rank 1" in str(exc) or \
            "inner_steps is 6 on rank 0 but 5 on rank 1" in str(exc)


WORKER = '''
import asyncio, hashlib, json, os, signal, sys
import numpy as np
from p2pcoll import training

H, ROUNDS, DIE_AT = 3, int(sys.argv[1]), int(sys.argv[2])


async def main() -> None:
    params = {"w": np.zeros((2, 3)), "b": np.zeros(3)}

    async def inner(group, r, i):
        await asyncio.sleep(0.01)
        for p in params.values():
            p -= 1.0

    rounds = training.DiLoCoRounds(params, inner, inner_steps=H, outer_lr=0.5,
                                   outer_momentum=0.5)

    async def step(group, r, state):
        deltas = await rounds.step(group, r, state)
        print(f"round {r}: {group.world_size} peers", flush=True)
        if r == DIE_AT:  # the others wait for these pseudo-gradients in the allreduce
            os.kill(os.getpid(), signal.SIGKILL)
        return deltas

    result = await training.train_elastic(step, rounds.apply, rounds.state, rounds=ROUNDS,
                                          timeout=30.0, poll_every=0.2)
    h = hashlib.blake2b(digest_size=16)
    for name, leaf in training.named_leaves(rounds.state):
        h.update(name.encode())
        h.update(np.ascontiguousarray(leaf).tobytes())
    print("RESULT " + json.dumps({"digest": h.hexdigest(), "applied": result.applied,
                                  "sizes": [f.world_size for f in result.formations]}),
          flush=True)


%s  # imported: the test lets the peers join together
asyncio.run(main())
''' % READY


@pytest.mark.processes
def test_a_killed_peer_mid_outer_step_loses_no_outer_step_and_repeats_none(
        tmp_path: Path) -> None:
    """Three processes; one SIGKILLs itself in outer step 3 while the others wait for its
    pseudo-gradients; the two survivors re-form and end with the state of 12 outer steps,
    each applied once."""
    rounds, die_at = 12, 3
    script = tmp_path / "diloco_worker.py"
    script.write_text(WORKER)
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env.update(P2PCOLL_RENDEZVOUS=f"tcp://127.0.0.1:{free_port()}", PYTHONUNBUFFERED="1",
               P2PCOLL_MIN_WORLD_SIZE="2", P2PCOLL_MAX_WORLD_SIZE="3",
               P2PCOLL_JOIN_TIMEOUT="30")
    procs = [subprocess.Popen([sys.executable, str(script), str(rounds),
                               str(die_at if i == 2 else -1)], env=env, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE)
             for i in range(3)]
    try:
        start_together(procs)
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert procs[2].returncode == -signal.SIGKILL, outs[2]
    reports = []
    for proc, (out, err) in zip(procs[:2], outs[:2], strict=True):
        assert proc.returncode == 0, err
        reports.append(json.loads(out.splitlines()[-1].removeprefix("RESULT ")))

    want = {"b": np.zeros(3), "w": np.zeros((2, 3))}
    velocity = {k: np.zeros_like(v) for k, v in want.items()}
    outer = training.OuterSGD(lr=0.5, momentum=0.5)
    for _ in range(rounds):
        outer.apply(list(want.values()), list(velocity.values()),
                    [np.full(3, 3.0), np.full((2, 3), 3.0)])
    assert {r["digest"] for r in reports} == {digest({"params": want, "velocity": velocity})}
    for report in reports:
        assert report["sizes"] == [3, 2], report
        assert report["applied"] == sorted(set(report["applied"])), report
