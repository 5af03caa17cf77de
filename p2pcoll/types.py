"""Small value types shared by the layers: reduction ops, membership, and pytrees."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import numpy as np

# The pytree helpers live in p2pcoll.pytree; re-exported here for the layers that use them.
from .pytree import TreeDef as TreeDef
from .pytree import flatten as flatten
from .pytree import unflatten as unflatten

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
    world_size: int
    endpoints: tuple[str, ...]  # endpoints[r]: where this peer reaches rank r
    hosts: tuple[str, ...] = ()  # host identity of each rank, for transport choice
