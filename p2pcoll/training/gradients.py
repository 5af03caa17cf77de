"""allreduce_gradients: one training round with every gradient at hand.

Under a codec (``codec="int8"``, "fp16", "bf16": :mod:`p2pcoll.codecs`) each bucket still
travels as one collective, of the codec's wire dtype; its tensors are encoded one by one
(int8's blocks never straddle two tensors). The lossy codecs use *error feedback*: what
the codec lost of a gradient this round is added to that gradient next round::

    value    = grad + residual                         # residual: zeros at first
    wire     = encode(value)                           # with the scales every rank agreed
    residual = value - restore(wire)                   # this rank's own loss, computed alone

so, summed over rounds, every gradient arrives in full, only later (Seide et al. 2014;
Karimireddy et al. 2019). The residuals are kept per tensor name (per group for
:func:`allreduce_gradients`, per reducer for a GradientReducer); a tensor whose shape or
dtype changes starts again from zero. They are this rank's own and never travel; the
results are the same bits on every rank regardless.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..codecs import Codec, NonFiniteInput, get_codec, reduce_coded
from ..pytree import Pytree, as_array, like, named_leaves, replace_leaves
from ..types import CustomOp, ReduceOp, as_op, check_op_dtype, check_trim
from .agreement import Call, Kind, agree, table
from .buckets import Bucket, BucketPlan, TensorSpec
from .errors import NonFiniteGradients
from .nonfinite import Nonfinite, check_nonfinite, report_nonfinite
from .state import state_of

if TYPE_CHECKING:
    from .. import Group

__all__ = ["Residuals", "allreduce_gradients", "gradient_specs"]


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
    codec: str | None = None,
    error_feedback: bool = True,
    trim: int | None = None,
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
        op: "avg" (default), "sum", "min", "max" or "prod"; or the robust "median" and
            "trimmed_mean" (with ``trim``; no codec), as :meth:`p2pcoll.Group.allreduce`.
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
        codec: send the gradients compressed: "fp16", "bf16", "int8" or a plugin's
            (:mod:`p2pcoll.codecs`: bytes per element, precision, ops); floating-point
            gradients only. None: as they are. The ranks must agree on it (it is in the
            header they compare).
        error_feedback: with a lossy codec and "sum"/"avg", add what the codec lost of each
            gradient last time to it this time (the residuals are kept per tensor name,
            with the group; see the module docstring). False: every round on its own.
        trim: "trimmed_mean"'s k: the k largest and smallest values of each element dropped.

    Returns:
        ``grads``' structure holding new arrays (torch tensors where the input had them) of
        the same shapes and dtypes, equal bit for bit on every rank. ``grads`` is unchanged.

    Raises:
        ValueError: an unknown op or ``nonfinite``, "avg" on an integer gradient, a negative
            ``bucket_bytes``, a bad ``round``; an op the codec cannot carry (int8: min,
            max, prod); an unknown codec (UnknownCodec, listing the installed ones).
        TypeError: a leaf whose dtype cannot be communicated; a codec on a gradient that is
            not floating point (the message names the gradient, its dtype and the codec).
        CollectiveMismatch: the ranks are in different rounds, or a gradient's name, shape or
            dtype (or ``op``/``bucket_bytes``/``nonfinite``/``codec``) differs between
            ranks; the message names the first tensor or setting that differs, and every
            rank raises it.
        NonFiniteGradients: a reduced gradient holds NaN or Inf and ``nonfinite="raise"``;
            under int8, also a gradient that holds NaN or Inf on any rank before the
            reduction (no scale can be agreed; every rank names the same tensors).
        CollectiveTimeout, PeerLost, GroupBroken: as the group's collectives.

    Cancellation: breaks the group if it happens during a collective.
    """
    red = as_op(op)
    check_trim(red, trim, group.world_size)
    check_nonfinite(nonfinite)
    named = named_leaves(grads)
    arrays = [as_array(leaf, path) for path, leaf in named]
    specs = gradient_specs([path for path, _ in named], arrays, red)
    coder = codec_for(codec, specs, red, group.world_size)
    plan = BucketPlan(specs, bucket_bytes)
    state = state_of(group)
    round_no = state.take_round(round)
    if not specs:
        return replace_leaves(grads, [])
    settings = {"op": red.value, "bucket_bytes": plan.bucket_bytes, "nonfinite": nonfinite,
                "codec": codec, "trim": trim}
    await agree(group, Call(Kind.GRADIENTS, round_no, "allreduce_gradients",
                            table(settings, specs)), timeout)
    flats = plan.pack(arrays, reuse=state.take_scratch())
    try:
        if coder is None:
            reduced = await asyncio.gather(*(
                group.allreduce(flat, red, strategy=strategy, timeout=timeout, trim=trim)
                for flat in flats
            ))
        else:
            residuals = (group.extension("p2pcoll.training.residuals", Residuals)
                         if error_feedback else None)
            reduced = await reduce_buckets(group, coder, plan, flats, red, residuals,
                                           strategy, timeout, nonfinite, round_no)
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


def codec_for(codec: str | None, specs: Sequence[TensorSpec], op: ReduceOp | CustomOp,
              world_size: int) -> Codec | None:
    """The codec called ``codec`` (None for None), checked against every gradient.

    Raises:
        TypeError: ``codec`` is not a name; a gradient that is not floating point (named).
        ValueError: an unknown codec (UnknownCodec), an op it cannot carry, a CustomOp.
    """
    if codec is None:
        return None
    coder = get_codec(codec)
    if isinstance(op, CustomOp):
        raise ValueError(f"codec {coder.name!r} carries the built-in ops, not the CustomOp "
                         f"{op.name!r}")
    for spec in specs:
        try:
            coder.check(op, spec.dtype, world_size)
        except TypeError as exc:
            raise TypeError(f"gradient {spec.name!r}: {exc}") from None
    if not specs:
        coder.check(op, np.dtype(np.float32), world_size)
    return coder


class Residuals:
    """Error feedback's residuals, one per tensor name: what a lossy codec has not yet
    delivered of that tensor (this rank's own; they never travel)."""

    def __init__(self) -> None:
        self._by_name: dict[str, np.ndarray] = {}

    def of(self, spec: TensorSpec) -> np.ndarray:
        """The flat residual of ``spec``'s tensor: zeros at first, and again when its shape
        or dtype has changed."""
        r = self._by_name.get(spec.name)
        if r is None or r.dtype != spec.dtype or r.size != spec.size:
            r = self._by_name[spec.name] = np.zeros(spec.size, spec.dtype)
        return r

    def clear(self) -> None:
        """Forget every residual (after a model is replaced, say)."""
        self._by_name.clear()

    def __len__(self) -> int:
        return len(self._by_name)


async def reduce_buckets(group: Group, coder: Codec, plan: BucketPlan, flats: list[np.ndarray],
                         op: ReduceOp | CustomOp, residuals: Residuals | None,
                         strategy: str | None, timeout: float | None, nonfinite: str,
                         round_no: int) -> list[np.ndarray]:
    """Every bucket through ``coder`` in one coded reduction (int8: one exchange of scales
    and one of data for the whole round, the fewest round trips on a slow link); each tensor
    encoded on its own. Returns new flat arrays, one per bucket.

    Raises:
        NonFiniteGradients: int8 found NaN or Inf in some rank's gradients (naming them).
    """
    results = [np.empty_like(flat) for flat in flats]
    members = [(i, b, start) for b, bucket in enumerate(plan.buckets)
               for i, start in zip(bucket.members, bucket.offsets, strict=True)]
    try:
        await _reduce_tensors(group, coder, plan, members, flats, results, op, residuals,
                              strategy, timeout, nonfinite)
    except NonFiniteInput as exc:
        raise refused(plan, coder, [[members[k][0] for k, _, _ in exc.blocks]],
                      round_no) from None
    return results


async def reduce_bucket(group: Group, coder: Codec, plan: BucketPlan, bucket: Bucket,
                        flat: np.ndarray, op: ReduceOp | CustomOp, residuals: Residuals | None,
                        strategy: str | None, timeout: float | None, nonfinite: str
                        ) -> np.ndarray:
    """One bucket through ``coder``: one collective of its wire dtype, each tensor encoded
    on its own (with its residual); the result is a new flat array (``flat`` may be
    refilled once this returns).

    Raises:
        NonFiniteInput: int8 found NaN or Inf in some rank's bucket, with
            ``nonfinite="raise"`` (otherwise those blocks come back NaN).
    """
    result = np.empty_like(flat)
    members = [(i, 0, start) for i, start in zip(bucket.members, bucket.offsets, strict=True)]
    await _reduce_tensors(group, coder, plan, members, [flat], [result], op, residuals,
                          strategy, timeout, nonfinite)
    return result


async def _reduce_tensors(group: Group, coder: Codec, plan: BucketPlan,
                          members: list[tuple[int, int, int]], flats: list[np.ndarray],
                          results: list[np.ndarray], op: ReduceOp | CustomOp,
                          residuals: Residuals | None, strategy: str | None,
                          timeout: float | None, nonfinite: str) -> None:
    """Tensors ``(spec index, flat index, offset)`` of ``flats`` through ``coder`` in one
    coded reduction, decoded into the same places of ``results``."""
    assert not isinstance(op, CustomOp)  # codec_for refused it
    cuts = [(b, start, start + plan.specs[i].size) for i, b, start in members]
    kept = None if residuals is None else [residuals.of(plan.specs[i]) for i, _, _ in members]
    await reduce_coded(group, coder, [flats[b][lo:hi] for b, lo, hi in cuts], op,
                       strategy=strategy, timeout=timeout,
                       out=[results[b][lo:hi] for b, lo, hi in cuts], residuals=kept,
                       nonfinite="raise" if nonfinite == "raise" else "nan")


def refused(plan: BucketPlan, coder: Codec, tensors: Sequence[Sequence[int]],
            round_no: int) -> NonFiniteGradients:
    """The NonFiniteGradients of tensors (spec indices, in groups) that int8 refused."""
    names: list[str] = []
    for group_of in tensors:
        names += [plan.specs[i].name for i in sorted(set(group_of))
                  if plan.specs[i].name not in names]
    return NonFiniteGradients(
        f"gradients of round {round_no} hold NaN or Inf on some rank, so codec "
        f"{coder.name!r} cannot agree on a scale for them (nothing of them was sent): "
        f"{', '.join(repr(n) for n in names)}", round=round_no, tensors=names)


def raise_refused(plan: BucketPlan, coder: Codec, done: Sequence[Any], round_no: int) -> None:
    """Raise the first error of ``done`` (one result per bucket): NonFiniteGradients naming
    every tensor int8 refused, in bucket order, if there are such, else the first error."""
    bad = [[bucket.members[k] for k, _, _ in result.blocks]
           for bucket, result in zip(plan.buckets, done, strict=True)
           if isinstance(result, NonFiniteInput)]
    if bad:
        raise refused(plan, coder, bad, round_no)
    for result in done:
        if isinstance(result, BaseException):
            raise result
