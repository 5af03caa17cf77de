"""A collective's arguments as the arrays a call moves: the leaves of a pytree (a bfloat16
tensor as its int16 bits, :mod:`p2pcoll.tensors`), ``out=`` buffers checked, the results
given back in the kind of the leaves given, and the reductions' calls. Used by
:class:`p2pcoll.Group`; nothing here touches the session.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import tensors
from ..errors import CollectiveMismatch
from ..pytree import LEAF, TreeDef, flatten_with
from ..session.calls import Call, describe_specs
from ..types import (ROBUST, CustomOp, Pytree, ReduceOp, as_op, check_dtype,
                     check_op_dtype)


def native(a: Any) -> np.ndarray:
    """Validate a leaf and return it C-contiguous in native byte order (no copy if it is);
    a bfloat16 tensor as its int16 bits (:mod:`p2pcoll.tensors`)."""
    arr = a if isinstance(a, np.ndarray) else tensors.as_array(a, bits=True)
    dtype = check_dtype(arr.dtype)
    # ascontiguousarray turns 0-d arrays into 1-d ones; keep the caller's shape.
    return np.ascontiguousarray(arr, dtype=dtype).reshape(arr.shape)


def _pair(leaf: Any, path: str) -> tuple[Any, np.ndarray]:
    return leaf, tensors.as_array(leaf, path, bits=True)


def flatten_leaves(tree: Pytree) -> tuple[list[Any], list[np.ndarray], TreeDef]:
    """A pytree's leaves as given, the arrays they move as (a bfloat16 tensor: its int16
    bits), and its treedef."""
    if type(tree) is np.ndarray:  # one array: the common call, no pytree walk
        return [tree], [tree], LEAF
    pairs, treedef = flatten_with(tree, _pair)
    return [given for given, _ in pairs], [arr for _, arr in pairs], treedef


def as_given(given: list[Any] | None, arrays: list[np.ndarray]) -> list[Any]:
    """Each result array in the kind of the leaf given for it (a tensor for a tensor);
    ``arrays`` as they are for ``given`` None (arrays were given)."""
    if given is None:
        return arrays
    return [a if type(g) is np.ndarray else tensors.result(g, a)
            for g, a in zip(given, arrays, strict=True)]


def no_codec_for_bfloat16(given: list[Any], codec: str) -> None:
    if any(tensors.is_bfloat16(leaf) for leaf in given):
        raise TypeError(f"codec {codec!r} takes float16, float32 and float64 data, not "
                        f"bfloat16 tensors (reduce them without a codec)")


def reduction_call(
    collective: str, value: Pytree, op: str | ReduceOp | CustomOp, root: int | None,
    strategy: str | None, timeout: float | None, out: Pytree | None = None,
) -> tuple[Call, list[Any] | None, bool]:
    """The call, the leaves as given (for :func:`as_given`; None for one ndarray), and
    whether to divide the results by the world size (a bfloat16 avg:
    :func:`p2pcoll.tensors.reduction`)."""
    given: list[Any] | None
    if type(value) is np.ndarray and (out is None or type(out) is np.ndarray):
        given, leaves, treedef = None, [value], LEAF  # one array: no pytree walk
        targets = None if out is None else [check_out(out, value)]
        red, average = as_op(op), False  # no tensor: the op as it is
    else:
        given, leaves, treedef = flatten_leaves(value)
        targets = out_leaves(out, treedef, leaves) if out is not None else None
        rule = tensors.reduction(op, given)
        red, average = rule.op, rule.average
    if red in ROBUST:
        raise ValueError(f"op {red.value!r} folds nothing pairwise: only allreduce computes "
                         f"it, not {collective}")
    work = []
    for i, arr in enumerate(leaves):
        dtype = check_dtype(arr.dtype)
        check_op_dtype(red, dtype)
        if targets is None:
            work.append(np.array(arr, dtype=dtype, order="C", copy=True))
        else:
            if targets[i] is not arr:
                np.copyto(targets[i], arr)
            work.append(targets[i])
    call = Call(collective, work, treedef, red, root, strategy, timeout,
                flat=[w if w.ndim == 1 else w.reshape(-1) for w in work])
    return call, given, average


def finish(call: Call, average: bool, world_size: int) -> list[np.ndarray]:
    """A reduction's result arrays, a bfloat16 avg's sum divided by the world size."""
    if average:
        for arr in call.leaves:
            tensors.divide(arr, world_size)
    return call.leaves

def learner(call: Call, given: Pytree | None, what: str, rank: int) -> list[Any] | None:
    """Make ``call`` learn its layout from the origin's: into the caller's buffers
    ``given`` where they fit (checked), else new arrays. Returns ``given``'s leaves."""
    flat = flatten_leaves(given) if given is not None else None
    mine = (flat[1], flat[2]) if flat is not None else None

    def learn(treedef: TreeDef, specs: list[tuple[np.dtype[Any], tuple[int, ...]]],
              strategy: str) -> None:
        if mine is not None:
            have = [(leaf.dtype, leaf.shape) for leaf in mine[0]]
            if mine[1] != treedef or have != specs:
                raise CollectiveMismatch(
                    f"{what}: rank {call.root} sends {describe_specs(specs)}, rank "
                    f"{rank} passed {describe_specs(have)}")
            call.leaves = [
                leaf if isinstance(leaf, np.ndarray) and leaf.flags.c_contiguous
                and leaf.flags.writeable and leaf.dtype.isnative else np.empty(s, d)
                for leaf, (d, s) in zip(mine[0], specs, strict=True)]
        else:
            call.leaves = [np.empty(s, d) for d, s in specs]
        call.treedef = treedef

    call.learn = learn
    return flat[0] if flat is not None else None


def plain_op(op: str | ReduceOp | CustomOp) -> str | ReduceOp:
    """``op`` unless it is a CustomOp, which no codec carries (ValueError)."""
    if isinstance(op, CustomOp):
        raise ValueError(f"a codec carries the built-in ops (sum, avg, ...), not the "
                         f"CustomOp {op.name!r}")
    return op


def out_leaves(out: Pytree, treedef: TreeDef, leaves: list[np.ndarray]) -> list[np.ndarray]:
    """Validate an ``out=`` argument against the input and return its leaves."""
    _, targets, out_def = flatten_leaves(out)
    if out_def != treedef:
        raise ValueError("out= must have the same pytree structure as the input")
    return [check_out(target, leaf) for target, leaf in zip(targets, leaves, strict=True)]


def check_out(target: np.ndarray, leaf: Any) -> np.ndarray:
    """``target`` if it can hold the result for input ``leaf``, else ValueError."""
    arr = leaf if isinstance(leaf, np.ndarray) else tensors.as_array(leaf, bits=True)
    want = (arr.shape, check_dtype(arr.dtype))
    if (target.shape, target.dtype) != want:
        raise ValueError(
            f"out= array {target.dtype}{list(target.shape)} does not match the input "
            f"{want[1]}{list(want[0])}"
        )
    if not (target.flags.c_contiguous and target.flags.writeable):
        raise ValueError("out= arrays must be C-contiguous and writable")
    return target
