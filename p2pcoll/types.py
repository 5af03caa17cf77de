"""Small value types shared by the layers: reduction ops, membership, and pytrees."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import numpy as np

Rank = int
Pytree = Any  # an ndarray, or a dict / list / tuple of pytrees


class ReduceOp(StrEnum):
    """Reduction applied element-wise across ranks."""

    SUM = "sum"
    PROD = "prod"
    MIN = "min"
    MAX = "max"
    AVG = "avg"


# The binary ufunc each op folds with; "avg" folds with add and divides once at the end.
UFUNCS: dict[ReduceOp, Callable[..., Any]] = {
    ReduceOp.SUM: np.add,
    ReduceOp.PROD: np.multiply,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
    ReduceOp.AVG: np.add,
}

# dtypes allowed on the wire: plain numbers only, never objects or structured records.
ALLOWED_DTYPES = frozenset(
    np.dtype(t).str
    for t in (
        "bool", "uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64",
        "float16", "float32", "float64", "complex64", "complex128",
    )
)


def as_op(op: str | ReduceOp) -> ReduceOp:
    """Validate a reduction op given as a string or ReduceOp."""
    try:
        return ReduceOp(op)
    except ValueError:
        names = ", ".join(o.value for o in ReduceOp)
        raise ValueError(f"unknown reduce op {op!r}; expected one of {names}") from None


def check_op_dtype(op: ReduceOp, dtype: np.dtype[Any]) -> None:
    """Reject op/dtype pairs that have no sensible meaning."""
    if op is ReduceOp.AVG and dtype.kind not in "fc":
        raise ValueError(f"op 'avg' needs a floating-point dtype, got {dtype}; use 'sum' instead")
    if op in (ReduceOp.MIN, ReduceOp.MAX) and dtype.kind == "c":
        raise ValueError(f"op {op.value!r} is not defined for complex dtype {dtype}")


def check_dtype(dtype: np.dtype[Any]) -> np.dtype[Any]:
    """Return the native-endian form of an allowed dtype, else raise TypeError."""
    native = dtype.newbyteorder("=") if dtype.byteorder not in "=|" else dtype
    if native.str not in ALLOWED_DTYPES:
        allowed = ", ".join(sorted(np.dtype(s).name for s in ALLOWED_DTYPES))
        raise TypeError(f"dtype {dtype} cannot be communicated; allowed: {allowed}")
    return native


@dataclass(frozen=True)
class Membership:
    """Who is in a group: a value handed out by the rendezvous, never mutated.

    ``epoch`` counts re-formations of the same group (elastic membership bumps it).
    """

    group_id: str
    epoch: int
    rank: Rank
    size: int
    endpoints: tuple[str, ...]  # endpoints[r]: where this peer reaches rank r
    hosts: tuple[str, ...] = ()  # host identity of each rank, for transport choice


# --- pytrees ------------------------------------------------------------------------------
# A pytree is flattened into leaves in a fixed order (dict keys sorted) plus a treedef, a
# plain nested structure of lists/strings that msgpack can carry and that compares equal on
# every rank with the same structure.

TreeDef = Any


def flatten(tree: Pytree) -> tuple[list[np.ndarray], TreeDef]:
    """Split a pytree into its array leaves and a msgpack-able description of its shape."""
    leaves: list[np.ndarray] = []

    def walk(node: Any) -> TreeDef:
        if isinstance(node, dict):
            keys = sorted(node)
            for k in keys:
                if not isinstance(k, str):
                    raise TypeError(f"pytree dict keys must be str, got {k!r}")
            return ["d", [[k, walk(node[k])] for k in keys]]
        if isinstance(node, (list, tuple)):
            return ["l" if isinstance(node, list) else "t", [walk(x) for x in node]]
        if node is None:
            raise TypeError("pytree leaves must be arrays, got None")
        arr = node if isinstance(node, np.ndarray) else np.asarray(node)
        if arr.dtype == object:
            raise TypeError(f"pytree leaf of type {type(node).__name__} is not a numeric array")
        leaves.append(arr)
        return "*"

    return leaves, walk(tree)


def unflatten(treedef: TreeDef, leaves: Sequence[np.ndarray]) -> Pytree:
    """Inverse of :func:`flatten`."""
    it = iter(leaves)

    def build(td: TreeDef) -> Any:
        if td == "*":
            return next(it)
        kind, children = td
        if kind == "d":
            return {k: build(c) for k, c in children}
        items = [build(c) for c in children]
        return items if kind == "l" else tuple(items)

    return build(treedef)
