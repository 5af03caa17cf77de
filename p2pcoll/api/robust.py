"""``allreduce(x, op="median")`` and ``allreduce(x, op="trimmed_mean", trim=k)``.

Each array goes through the robust reductions' two collectives
(:mod:`p2pcoll.engine.robust`): the exchange of the inputs (every rank receives every
rank's slice of its partition), the median or trimmed mean of each element of its part,
then an allgather of the parts. ``strategy=`` names the allgather's strategy: an
allreduce strategy folds values pairwise and cannot compute these ops, so naming one that
is not also an allgather strategy is a ValueError. ``auto`` picks the allgather by its
cost, and :func:`predict` gives the cost of the whole reduction.

Order: the two collectives of one call (and of each dtype of a pytree's leaves) take a
turn of the group's :mod:`p2pcoll.session.turns`, as a coded reduction's do, so calls
started meanwhile start after them in the order they were started, on every rank.

bfloat16 tensors are reduced as float32 values (widened exactly) and the result is
rounded once to bfloat16.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from .. import tensors
from ..engine.costs import CostModel
from ..engine.robust import EXCHANGE, exchange, reduce_part, stage_size
from ..errors import UnknownStrategy
from ..pytree import unflatten
from ..registry import registry
from ..session.calls import Call
from ..types import CustomOp, Pytree, ReduceOp, check_dtype, check_op_dtype, check_trim
from .arguments import as_given, flatten_leaves, out_leaves

if TYPE_CHECKING:
    from ..session.session import Session
    from ..session.turns import Turns

__all__ = ["Label", "RobustGroup", "predict", "robust_allreduce"]


class RobustGroup(Protocol):
    """What the robust reductions use of a :class:`p2pcoll.Group`."""

    @property
    def world_size(self) -> int: ...

    @property
    def rank(self) -> int: ...

    @property
    def turns(self) -> Turns: ...

    @property
    def session(self) -> Session: ...


def _nothing(mine: np.ndarray, incoming: np.ndarray) -> None:
    """The exchange only copies: its op is there to name the reduction in the signature."""


@dataclass(frozen=True)
class Label(CustomOp):
    """What the ranks compare of a robust op: ``median`` or ``trimmed_mean(trim=k)`` (a
    rank with another op or trim is a CollectiveMismatch showing both)."""

    @property
    def value(self) -> str:
        return self.name


def label(op: ReduceOp, trim: int) -> Label:
    return Label("median" if op is ReduceOp.MEDIAN else f"trimmed_mean(trim={trim})", _nothing)


def check_strategy(strategy: str | None, op: ReduceOp) -> None:
    """ValueError unless ``strategy`` is None, "auto" or an allgather strategy."""
    if strategy in (None, "auto"):
        return
    assert strategy is not None
    try:
        registry.get("allgather", strategy)
    except UnknownStrategy:
        raise ValueError(
            f"strategy={strategy!r} cannot compute op {op.value!r}: allreduce strategies "
            f"fold values pairwise; a robust op runs an exchange and then an allgather, and "
            f"strategy= names the allgather's: auto or one of "
            f"{', '.join(registry.available()['allgather'])}") from None


def predict(model: CostModel, nbytes: int, size: int) -> float:
    """The seconds ``model`` predicts for a robust allreduce of ``nbytes`` per rank on
    ``size`` ranks: the exchange, then the allgather auto picks."""
    gather = registry.auto("allgather", nbytes, size, model)
    return (model.predict(EXCHANGE, nbytes, size) or 0.0) + (
        model.predict(gather, nbytes, size) or 0.0)


async def robust_allreduce(
    group: RobustGroup, value: Pytree, op: ReduceOp | CustomOp, trim: int | None,
    strategy: str | None, timeout: float | None, out: Pytree | None, codec: str | None = None,
) -> Pytree:
    """:meth:`p2pcoll.Group.allreduce` with ``op`` "median" or "trimmed_mean" (see there).

    Raises:
        ValueError: a bad ``trim`` (:func:`~p2pcoll.types.check_trim`), a dtype that is not
            floating point, a strategy that is not an allgather's, a bad ``out``.
        TypeError: a dtype that cannot be communicated.
        CollectiveMismatch, CollectiveTimeout, PeerLost, GroupBroken: as any collective.
    Cancellation: breaks the group if it happens during a collective.
    """
    p = group.world_size
    k = check_trim(op, trim, p)  # trim without trimmed_mean: a ValueError naming it
    assert isinstance(op, ReduceOp)
    if codec is not None:
        raise ValueError(f"codec={codec!r} cannot carry op {op.value!r}: a codec sums or "
                         f"averages; the robust ops move the data as it is")
    if op is ReduceOp.MEDIAN:
        k = (p - 1) // 2
    check_strategy(strategy, op)
    given, arrays, treedef = flatten_leaves(value)
    half = [tensors.is_bfloat16(g) for g in given]
    values = [tensors.widen(a) if h else a for a, h in zip(arrays, half, strict=True)]
    for a in values:
        check_op_dtype(op, check_dtype(a.dtype))
    targets = out_leaves(out, treedef, arrays) if out is not None else None
    # One stage per dtype, leaves in order of first appearance of their dtype.
    dtypes = list(dict.fromkeys(a.dtype for a in values))
    groups = [[i for i, a in enumerate(values) if a.dtype == d] for d in dtypes]
    name = label(op, k)

    results: list[np.ndarray] = [np.empty(0)] * len(values)
    async with group.turns.hold() as turn:  # taken before the first await
        for g, members in enumerate(groups):
            last = g == len(groups) - 1
            done = await _reduce(group, [values[i] for i in members], k, name, strategy,
                                 timeout, turn.release if last else None)
            at = 0
            for i in members:
                results[i] = done[at:at + values[i].size].reshape(values[i].shape)
                at += values[i].size
    final = [tensors.narrow(r).reshape(r.shape) if h else r
             for r, h in zip(results, half, strict=True)]
    if targets is not None:
        for t, r in zip(targets, final, strict=True):
            np.copyto(t, r)
        return out
    return unflatten(treedef, as_given(given, final))


async def _reduce(group: RobustGroup, leaves: list[np.ndarray], trim: int, name: Label,
                  strategy: str | None, timeout: float | None,
                  release: Callable[[], None] | None) -> np.ndarray:
    """The robust reduction of ``leaves`` (one dtype) as one flat run: exchange, reduce
    this rank's part, allgather (``release``: passes the turn on just before the allgather
    starts)."""
    p, r, n = group.world_size, group.rank, sum(a.size for a in leaves)
    dtype = leaves[0].dtype
    plan = exchange(r, n)
    stage = np.empty(stage_size(n, p), dtype)
    cuts = plan.cuts(p, stage.size, dtype.itemsize)
    at = cuts[r * p]  # this rank's own row: its input, every part of it
    for a in leaves:
        stage[at:at + a.size] = a.reshape(-1)
        at += a.size
    session = group.session
    await session.run(Call("allreduce", [stage], None, name, None, None, timeout,
                           flat=[stage], schedule=plan))
    result = np.empty(n, dtype)
    parts = np.array_split(result, p)
    rows = np.stack([stage[cuts[q * p + r]:cuts[q * p + r + 1]] for q in range(p)])
    reduce_part(rows, trim, parts[r])
    if release is not None:
        # Passing the turn on only schedules the next one's wake-up: the allgather,
        # started below before any await, takes its number first.
        release()
    if p > 1:
        await session.run(Call("allgather", list(parts), None, None, None, strategy, timeout,
                               flat=list(parts)))
    return result
