"""allreduce_gradients: one training round with every gradient at hand."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from ..pytree import Pytree, as_array, like, named_leaves, replace_leaves
from ..types import CustomOp, ReduceOp, as_op, check_op_dtype
from .agreement import Call, Kind, agree, table
from .buckets import BucketPlan, TensorSpec
from .nonfinite import Nonfinite, check_nonfinite, report_nonfinite
from .state import state_of

if TYPE_CHECKING:
    from .. import Group

__all__ = ["allreduce_gradients", "gradient_specs"]


async def allreduce_gradients(
    group: Group,
    grads: Pytree,
    op: str | ReduceOp = "avg",
    *,
    bucket_bytes: int | None = None,
    strategy: str | None = None,
    nonfinite: Nonfinite = "raise",
    round: int | None = None,
    timeout: float | None = None,
) -> Pytree:
    """Reduce named gradients over the group, fused into buckets; every rank gets the result.

    Every rank calls this once per training round with gradients of the same names, shapes
    and dtypes. Before any gradient moves, the ranks check that they are in the same round
    and agree on the tensors (one small allgather); then each bucket is one allreduce. The
    buckets are filled in leaf order (:mod:`p2pcoll.pytree`).

    Args:
        group: the group.
        grads: a pytree of gradients (usually a dict of name -> ndarray or CPU torch tensor).
            An empty pytree is a no-op without communication on every rank (it still counts
            as a round).
        op: "avg" (default), "sum", "min", "max" or "prod".
        bucket_bytes: how large a fused buffer may grow; None is :data:`DEFAULT_BUCKET_BYTES`,
            0 reduces each tensor on its own.
        strategy: the allreduce strategy of every bucket ("ring", "recursive_doubling",
            "reduce_broadcast", ...); None is the group's choice.
        nonfinite: a NaN or Inf in the result: "raise" :class:`NonFiniteGradients` (a
            FloatingPointError), "warn" (RuntimeWarning), or "ignore". Either way it names
            the tensors.
        round: this round's number; None takes the group's next (0, 1, 2, ...). The number
            after it becomes the group's next.
        timeout: seconds for each collective (default: the group's).

    Returns:
        ``grads``' structure holding new arrays (torch tensors where the input had them) of
        the same shapes and dtypes, equal bit for bit on every rank. ``grads`` is unchanged.

    Raises:
        ValueError: an unknown op or ``nonfinite``, "avg" on an integer gradient, a negative
            ``bucket_bytes``, a bad ``round``.
        TypeError: a leaf whose dtype cannot be communicated.
        CollectiveMismatch: the ranks are in different rounds, or a gradient's name, shape or
            dtype (or ``op``/``bucket_bytes``/``nonfinite``) differs between ranks; the
            message names the first tensor that differs, and every rank raises it.
        NonFiniteGradients: a reduced gradient holds NaN or Inf and ``nonfinite="raise"``.
        CollectiveTimeout, PeerLost, GroupBroken: as the group's collectives.

    Cancellation: breaks the group if it happens during a collective.
    """
    red = as_op(op)
    check_nonfinite(nonfinite)
    named = named_leaves(grads)
    arrays = [as_array(leaf, path) for path, leaf in named]
    specs = gradient_specs([path for path, _ in named], arrays, red)
    plan = BucketPlan(specs, bucket_bytes)
    state = state_of(group)
    round_no = state.take_round(round)
    if not specs:
        return replace_leaves(grads, [])
    settings = {"op": red.value, "bucket_bytes": plan.bucket_bytes, "nonfinite": nonfinite}
    await agree(group, Call(Kind.GRADIENTS, round_no, "allreduce_gradients",
                            table(settings, specs)), timeout)
    flats = plan.pack(arrays, reuse=state.take_scratch())
    try:
        reduced = await asyncio.gather(*(
            group.allreduce(flat, red, strategy=strategy, timeout=timeout) for flat in flats
        ))
    finally:
        state.scratch = flats  # every allreduce has copied its bucket by now
    report_nonfinite(plan, reduced, nonfinite, round_no)
    return replace_leaves(grads, [like(leaf, out) for (_, leaf), out
                                  in zip(named, plan.unpack(reduced), strict=True)])


def gradient_specs(names: Sequence[str], arrays: Sequence[np.ndarray],
                   op: ReduceOp | CustomOp) -> list[TensorSpec]:
    """The specs of gradients that ``op`` can reduce.

    Raises:
        TypeError: a dtype that cannot be communicated.
        ValueError: ``op`` is not defined for a gradient's dtype ("avg" of integers).
    """
    specs = [TensorSpec.of(name, array) for name, array in zip(names, arrays, strict=True)]
    for spec in specs:
        try:
            check_op_dtype(op, spec.dtype)
        except ValueError as exc:
            raise ValueError(f"gradient {spec.name!r}: {exc}") from None
    return specs
