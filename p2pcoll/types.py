"""Small value types shared by the layers: reduction ops, membership and operation keys."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, NamedTuple

import numpy as np

Rank = int
Pytree = Any  # an ndarray, or a dict / list / tuple of pytrees


class ReduceOp(StrEnum):
    """Reduction applied element-wise across ranks.

    MEDIAN and TRIMMED_MEAN (with ``trim=k``: the k largest and k smallest values of each
    element dropped, the rest averaged) are robust ops: they fold nothing pairwise, so
    only ``allreduce`` computes them, over an exchange of the inputs
    (:mod:`p2pcoll.engine.robust`).
    """

    SUM = "sum"
    PROD = "prod"
    MIN = "min"
    MAX = "max"
    AVG = "avg"
    MEDIAN = "median"
    TRIMMED_MEAN = "trimmed_mean"


# The ops no pairwise fold computes: each rank needs every rank's value of an element.
ROBUST = frozenset({ReduceOp.MEDIAN, ReduceOp.TRIMMED_MEAN})


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


@dataclass(frozen=True)
class CustomOp:
    """A reduction of the caller's own (as ``MPI_Op_create``): ``fold(mine, incoming)``
    combines ``incoming`` into ``mine`` in place, element by element; both are flat arrays of
    the collective's dtype and length. It must be commutative and associative for results
    not to depend on the strategy, and every rank must pass the same ``name``: the name,
    not the function, is what the ranks compare (a different name is a CollectiveMismatch).

    Example, the element of larger magnitude (the torch backend's bfloat16 sums, carried as
    int16 bits, are CustomOps too: ``p2pcoll.integrations.torch.ops.BFLOAT16``)::

        def max_abs(mine, incoming):
            np.copyto(mine, np.where(np.abs(incoming) > np.abs(mine), incoming, mine))

        await g.allreduce(x, p2pcoll.CustomOp("max-abs", max_abs))
    """

    name: str
    fold: Callable[[np.ndarray, np.ndarray], Any]

    @property
    def value(self) -> str:
        """What the ranks compare (a built-in op's value is its name)."""
        return f"custom:{self.name}"

    def __call__(self, dst: np.ndarray, src: np.ndarray, out: np.ndarray) -> None:
        # The executor folds with a ufunc's calling convention, ``ufunc(dst, src, out=dst)``.
        self.fold(dst, src)



# Each built-in op by its value (a ReduceOp is a str equal to its value: it finds itself).
# One dict lookup per call, where ReduceOp(op) is a chain of Python calls in enum.
_BY_VALUE: dict[str, ReduceOp] = {o.value: o for o in ReduceOp}


def as_op(op: str | ReduceOp | CustomOp) -> ReduceOp | CustomOp:
    """Validate a reduction op given as a string, a ReduceOp or a CustomOp."""
    if isinstance(op, str):  # first: every call's op (a ReduceOp is a str too)
        found = _BY_VALUE.get(op)
        if found is not None:
            return found
    elif isinstance(op, CustomOp):
        if not isinstance(op.name, str) or not op.name or not callable(op.fold):
            raise ValueError(f"a CustomOp needs a non-empty name and a callable fold, got "
                             f"{op!r}")
        return op
    names = ", ".join(o.value for o in ReduceOp)
    raise ValueError(f"unknown reduce op {op!r}; expected one of {names} or a CustomOp")


def fold_of(op: ReduceOp | CustomOp) -> Callable[..., Any]:
    """What the executor folds an incoming piece into this rank's with (a robust op has
    no fold: ValueError)."""
    if isinstance(op, CustomOp):
        return op
    if op in ROBUST:
        raise ValueError(f"op {op.value!r} folds nothing pairwise: only allreduce computes it")
    return UFUNCS[op]


def check_trim(op: ReduceOp | CustomOp, trim: int | None, world_size: int) -> int:
    """The trim of a robust op (0 for median), checked against the group's size.

    Raises:
        ValueError: ``trim`` without ``op="trimmed_mean"``, a trimmed mean without ``trim``,
            or a ``trim`` that is not an int with ``0 <= 2 * trim < world_size`` (naming it).
    """
    if op is not ReduceOp.TRIMMED_MEAN:
        if trim is not None:
            name = op.value if isinstance(op, (ReduceOp, CustomOp)) else op
            raise ValueError(f"trim={trim!r} needs op='trimmed_mean', not {name!r}")
        return 0
    if trim is None:
        raise ValueError("op='trimmed_mean' needs trim=k: the k largest and k smallest "
                         "values of each element to drop")
    if not isinstance(trim, int) or isinstance(trim, bool) or trim < 0:
        raise ValueError(f"trim must be an int >= 0, got {trim!r}")
    if 2 * trim >= world_size:
        raise ValueError(f"trim={trim} drops {2 * trim} of the {world_size} values of each "
                         f"element: nothing is left (trim must be below {world_size / 2:g})")
    return trim


def check_op_dtype(op: ReduceOp | CustomOp, dtype: np.dtype[Any]) -> None:
    """Reject op/dtype pairs that have no sensible meaning (a CustomOp takes any)."""
    kind: str = dtype.kind
    if kind == "f":
        return  # every op is defined on real floating point: the usual call ends here
    if op is ReduceOp.AVG and kind != "c":
        raise ValueError(f"op 'avg' needs a floating-point dtype, got {dtype}; use 'sum' instead")
    if op in ROBUST:
        raise ValueError(f"op {op.value!r} needs a real floating-point dtype, got {dtype}")
    if op in (ReduceOp.MIN, ReduceOp.MAX) and kind == "c":
        raise ValueError(f"op {op.value!r} is not defined for complex dtype {dtype}")


def check_dtype(dtype: np.dtype[Any]) -> np.dtype[Any]:
    """Return the native-endian form of an allowed dtype, else raise TypeError."""
    native = _NATIVE.get(dtype)  # (every call checks its dtypes: a dict look-up, usually)
    if native is not None:
        return native
    native = dtype.newbyteorder("=") if dtype.byteorder not in "=|" else dtype
    if native.str not in ALLOWED_DTYPES:
        allowed = ", ".join(sorted(np.dtype(s).name for s in ALLOWED_DTYPES))
        raise TypeError(f"dtype {dtype} cannot be communicated; allowed: {allowed}")
    if len(_NATIVE) < 64:  # the allowed dtypes in either byte order, a few times over
        _NATIVE[dtype] = native
    return native


_NATIVE: dict[np.dtype[Any], np.dtype[Any]] = {}  # allowed dtypes checked: their native form


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
    # The group's link secret: a random token only the members learn (from the rendezvous
    # or the torch store). It names the members' links (see ``link_identity``), so an
    # outsider who knows the group id still cannot pass for a member. Never logged or served.
    secret: str = field(default="", repr=False, compare=False)


class OpKey(NamedTuple):
    """Which operation of a session a message, a deadline or a failure belongs to.

    A collective is keyed by its sequence number alone (``OpKey(seq)``; every rank numbers
    its collectives alike). A point-to-point transfer has no sequence number: only its two
    ranks take part, so it is keyed by its channel ``(src, dst, tag)`` and its count on that
    channel (``OpKey.transfer(src, dst, tag, count)``: how many messages ``src`` had sent
    ``dst`` with ``tag`` before, which both ranks count alike, MPI's non-overtaking rule).

    A frozen value. It is a NamedTuple rather than a dataclass because it keys the
    matcher's dicts for every message: a tuple hashes and compares in C.
    """

    number: int  # the collective's sequence number, or the transfer's count
    tag: int | None = None  # None: a collective
    src: int = -1  # a transfer's sending rank (-1 for a collective)
    dst: int = -1  # a transfer's receiving rank (-1 for a collective)

    @classmethod
    def transfer(cls, src: int, dst: int, tag: int, count: int) -> OpKey:
        """The key of message ``count`` from ``src`` to ``dst`` with ``tag``."""
        return cls(count, tag, src, dst)

    @property
    def is_transfer(self) -> bool:
        return self.tag is not None

    @property
    def channel(self) -> tuple[int, int, int] | None:
        """``(src, dst, tag)`` of a transfer; None for the collectives (one channel)."""
        return None if self.tag is None else (self.src, self.dst, self.tag)

    def title(self, name: str) -> str:
        """How errors name the operation: ``allreduce #3``, or ``send #3 from rank 0 to
        rank 1 with tag 7``."""
        if self.tag is None:
            return f"{name} #{self.number}"
        return f"{name} #{self.number} from rank {self.src} to rank {self.dst} with tag {self.tag}"
