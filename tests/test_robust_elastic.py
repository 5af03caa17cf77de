"""Robust ops (median, trimmed mean) in the rounds of train_elastic and DiLoCoRounds.

A peer that scales its pseudo-gradient by 100 every round moves neither the median nor the
trimmed mean: every replica ends bit-identical, on the state of the honest peers, with
``delay=0`` and ``delay=1``. A round that not every member holds (``delay=1`` after a
formation) is reduced over its holders only, equal on every rank to the robust allreduce's
own rule. Bad settings are ValueErrors naming them; ranks that disagree are told with a
CollectiveMismatch before the state moves.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

import p2pcoll
from p2pcoll import training
from p2pcoll.engine.robust import reduce_part
from p2pcoll.testing import free_port, memory_groups
from p2pcoll.training.elastic_delayed import reduce_round

H = 3


def replayed(rounds: int) -> dict[str, Any]:
    """The state after ``rounds`` outer steps whose averaged pseudo-gradient is H."""
    params = {"b": np.zeros(3), "w": np.zeros((2, 3))}
    velocity = {k: np.zeros_like(v) for k, v in params.items()}
    outer = training.OuterSGD(lr=0.5, momentum=0.5)
    for _ in range(rounds):
        outer.apply(list(params.values()), list(velocity.values()),
                    [np.full(3, float(H)), np.full((2, 3), float(H))])
    return {"params": params, "velocity": velocity}


async def peer(url: str, *, bad: bool, delay: int, op: str, trim: int | None,
               rounds: int) -> dict[str, Any]:
    """One peer of a 3-peer job: each inner step takes every parameter down by 1, so an
    honest pseudo-gradient is H; a bad peer's is 100 H."""
    params = {"w": np.zeros((2, 3)), "b": np.zeros(3)}

    def inner(group: p2pcoll.Group, r: int, i: int) -> None:
        for p in params.values():
            p -= 100.0 if bad else 1.0

    made = training.DiLoCoRounds(params, inner, inner_steps=H, outer_lr=0.5,
                                 outer_momentum=0.5, delay=delay, op=op, trim=trim)
    await training.train_elastic(made.step, made.apply, made.state, rounds=rounds,
                                 min_world_size=3, max_world_size=3, rendezvous=url,
                                 timeout=20.0, delay=delay, op=made.op, trim=made.trim,
                                 settings=made.settings)
    return made.state


@pytest.mark.parametrize("delay", [0, 1])
@pytest.mark.parametrize(("op", "trim"), [("median", None), ("trimmed_mean", 1)])
async def test_one_scaled_peer_moves_no_replica(delay: int, op: str, trim: int | None
                                                ) -> None:
    url, rounds = f"tcp://127.0.0.1:{free_port()}", 4
    states = await asyncio.gather(*(peer(url, bad=i == 2, delay=delay, op=op, trim=trim,
                                         rounds=rounds) for i in range(3)))
    want = replayed(rounds)
    for state in states:
        for key in ("params", "velocity"):
            for name in ("w", "b"):
                assert state[key][name].tobytes() == want[key][name].tobytes(), (key, name)


async def test_with_avg_the_scaled_peer_moves_every_replica() -> None:
    """The same job with ``avg``: what the robust ops are for (the test above could not
    pass by accident)."""
    url = f"tcp://127.0.0.1:{free_port()}"
    states = await asyncio.gather(*(peer(url, bad=i == 2, delay=1, op="avg", trim=None,
                                         rounds=2) for i in range(3)))
    assert not np.array_equal(states[0]["params"]["w"], replayed(2)["params"]["w"])
    assert len({s["params"]["w"].tobytes() for s in states}) == 1


@pytest.mark.parametrize(("op", "trim"), [("median", None), ("trimmed_mean", 1)])
async def test_a_round_not_every_member_holds_is_reduced_over_its_holders(
        op: str, trim: int | None) -> None:
    """Ranks 0, 2 and 3 hold the round; rank 1 (a newcomer) adds zeros, which must not
    count: the result is the rule over the holders' rows, the same bits on every rank."""
    groups = await memory_groups(4)
    rng = np.random.default_rng(7)
    values = [rng.standard_normal((5, 2)).astype(np.float32) for _ in range(4)]
    holding = [True, False, True, True]
    reduce = {"op": op, "trim": trim, "bucket_bytes": None, "strategy": None,
              "nonfinite": "raise", "codec": None}

    async def rank(g: p2pcoll.Group) -> tuple[np.ndarray, bool]:
        mine = values[g.rank] if holding[g.rank] else np.zeros((5, 2), np.float32)
        reduced, admit = await reduce_round(g, {"x": mine}, holding=holding[g.rank],
                                            admit=g.rank == 0, r=3, reduce=reduce)
        return reduced["x"], admit

    try:
        got = await asyncio.gather(*(rank(g) for g in groups))
    finally:
        await asyncio.gather(*(g.close() for g in groups))
    rows = np.stack([values[r].reshape(-1) for r in (0, 2, 3)])
    want = np.empty(10, np.float32)
    reduce_part(rows, 1, want)  # three holders: median and trim=1 keep the middle value
    np.testing.assert_array_equal(want, np.median(rows, axis=0))
    for x, admit in got:
        assert admit
        assert x.tobytes() == want.reshape(5, 2).tobytes()


async def test_two_holders_of_a_trimmed_mean_keep_both() -> None:
    """Fewer holders than 2 trim + 1: the trim is the most that leaves one value."""
    groups = await memory_groups(3)
    reduce = {"op": "trimmed_mean", "trim": 1, "bucket_bytes": None, "strategy": None,
              "nonfinite": "raise", "codec": None}

    async def rank(g: p2pcoll.Group) -> np.ndarray:
        mine = np.array([1.0, 4.0]) * (g.rank + 1) if g.rank < 2 else np.zeros(2)
        reduced, _ = await reduce_round(g, {"x": mine}, holding=g.rank < 2, admit=False,
                                        r=0, reduce=reduce)
        return reduced["x"]

    try:
        got = await asyncio.gather(*(rank(g) for g in groups))
    finally:
        await asyncio.gather(*(g.close() for g in groups))
    for x in got:
        assert x.tolist() == [1.5, 6.0]  # the mean of the two holders' values


async def test_ranks_that_disagree_on_the_op_are_told_before_the_state_moves() -> None:
    url = f"tcp://127.0.0.1:{free_port()}"

    async def one(op: str, trim: int | None) -> Any:
        params = {"w": np.zeros(3)}
        made = training.DiLoCoRounds(params, lambda g, r, i: None, inner_steps=2, delay=1,
                                     op=op, trim=trim)
        return await training.train_elastic(
            made.step, made.apply, made.state, rounds=2, min_world_size=3,
            max_world_size=3, rendezvous=url, timeout=10, delay=1, op=made.op,
            trim=made.trim, settings=made.settings)

    errors = await asyncio.gather(one("median", None), one("median", None),
                                  one("trimmed_mean", 1), return_exceptions=True)
    for exc in errors:
        assert isinstance(exc, p2pcoll.CollectiveMismatch), exc
        assert "op is" in str(exc), str(exc)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"op": "trimmed_mean", "trim": 1, "min_world_size": 2}, "trim=1"),
    ({"op": "trimmed_mean", "min_world_size": 3}, "trim=k"),
    ({"op": "median", "trim": 1, "min_world_size": 3}, "trim=1"),
    ({"op": "median", "codec": "int8", "min_world_size": 3}, "codec"),
    ({"op": "mode", "min_world_size": 3}, "op must be one of"),
    ({"op": "avg", "settings": {"op": "median"}, "min_world_size": 3}, "settings say op"),
])
async def test_bad_settings_are_refused_naming_them(kwargs: dict[str, Any], match: str
                                                    ) -> None:
    with pytest.raises(ValueError, match=match):
        await training.train_elastic(lambda g, r, s: {}, lambda s, g, r: None,
                                     {"w": np.zeros(3)}, rounds=1,
                                     rendezvous="tcp://127.0.0.1:1", **kwargs)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"op": "sum"}, "op must be"),
    ({"op": "trimmed_mean"}, "trim=k"),
    ({"op": "avg", "trim": 1}, "trim=1"),
])
def test_diloco_rounds_refuses_bad_ops(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        training.DiLoCoRounds({"w": np.zeros(3)}, lambda g, r, i: None, inner_steps=2,
                              **kwargs)
