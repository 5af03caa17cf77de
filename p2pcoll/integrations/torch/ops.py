"""torch's reduce ops and dtypes in p2pcoll's terms, and tensors as numpy arrays.

Tensors become arrays through :mod:`p2pcoll.tensors`, as in every front end: contiguous
CPU tensors are shared with numpy without a copy, so results land in the tensor itself;
bfloat16 moves as its int16 bits and is reduced by :data:`p2pcoll.tensors.BFLOAT16`,
exactly on the bfloat16 bits (rounded at every step, as Gloo's bfloat16 arithmetic is).
An op or dtype that cannot be done raises :class:`UnsupportedOperation` naming it, before
anything is sent.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from ... import tensors
from ...errors import P2PCollError
from ...tensors import BFLOAT16 as BFLOAT16
from ...types import CustomOp

RedOp = dist.ReduceOp.RedOpType

# torch's ops that are p2pcoll's own, by name.
NATIVE = {RedOp.SUM: "sum", RedOp.PRODUCT: "prod", RedOp.MIN: "min", RedOp.MAX: "max",
          RedOp.AVG: "avg"}
# Bitwise ops, done by gathering every rank's data and folding it in rank order.
BITWISE = {RedOp.BAND: np.bitwise_and, RedOp.BOR: np.bitwise_or, RedOp.BXOR: np.bitwise_xor}
INTEGER = {torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64}
SUPPORTED = INTEGER | {torch.float16, torch.bfloat16, torch.float32, torch.float64,
                       torch.complex64, torch.complex128}


class UnsupportedOperation(P2PCollError, ValueError):
    """A reduce op, dtype or device that the p2pcoll backend cannot do."""


@dataclass(frozen=True)
class Reduction:
    """How to run one torch reduction: p2pcoll's op (None: bitwise, see ``fold``), a factor
    to multiply the input by first (PREMUL_SUM), and a divisor of the result (bfloat16's
    AVG, whose bits cannot be divided by p2pcoll)."""

    op: str | CustomOp | None
    fold: np.ufunc | None = None
    factor: float | None = None
    average: bool = False


def reduction(rop: dist.ReduceOp | RedOp, collective: str,
              tensors: list[torch.Tensor]) -> Reduction:
    """The :class:`Reduction` for ``rop`` over ``tensors``.

    Raises:
        UnsupportedOperation: naming the op (and dtype) that cannot be done.
    """
    kind = rop.op if isinstance(rop, dist.ReduceOp) else rop
    # Compared by value: torch's enum compares and hashes slowly, and every call asks.
    code = kind.value
    for t in tensors:
        check_tensor(t, collective)
        if code in _BITWISE_CODES and t.dtype not in INTEGER:
            raise UnsupportedOperation(f"the p2pcoll backend's {collective}: {kind.name} "
                                       f"needs an integer dtype, got {t.dtype}")
        if code == _AVG_CODE and t.dtype in INTEGER:
            raise UnsupportedOperation(f"the p2pcoll backend's {collective}: AVG needs a "
                                       f"floating dtype, got {t.dtype}")
    half = {t.dtype is torch.bfloat16 for t in tensors}
    if len(half) > 1:
        raise UnsupportedOperation(f"the p2pcoll backend's {collective}: bfloat16 tensors "
                                   f"cannot be reduced together with tensors of other dtypes")
    known = _REDUCTIONS.get((code, half == {True}))
    if known is not None:
        return known
    if half == {True} and kind in NATIVE:
        name = NATIVE[kind]
        red = Reduction(BFLOAT16["sum" if name == "avg" else name], average=name == "avg")
    elif half == {True} and kind == RedOp.PREMUL_SUM:
        return Reduction(BFLOAT16["sum"], factor=_factor(rop, collective))
    elif kind in NATIVE:
        red = Reduction(NATIVE[kind])
    elif kind in BITWISE:
        red = Reduction(None, fold=BITWISE[kind])
    elif kind == RedOp.PREMUL_SUM:
        return Reduction("sum", factor=_factor(rop, collective))
    else:
        raise UnsupportedOperation(f"the p2pcoll backend's {collective} does not support "
                                   f"reduce op {kind}")
    _REDUCTIONS[code, half == {True}] = red  # (not PREMUL_SUM's: its factor is the call's)
    return red


_BITWISE_CODES = frozenset(k.value for k in BITWISE)
_AVG_CODE = RedOp.AVG.value
_REDUCTIONS: dict[tuple[int, bool], Reduction] = {}  # (op's value, bfloat16) -> Reduction


def _factor(rop: dist.ReduceOp | RedOp, collective: str) -> float:
    factor = getattr(rop, "factor", None)
    if not isinstance(factor, (int, float)):
        raise UnsupportedOperation(f"the p2pcoll backend's {collective}: PREMUL_SUM "
                                   f"needs a scalar factor, got {factor!r}")
    return float(factor)


def check_tensor(t: torch.Tensor, collective: str) -> None:
    """Raises UnsupportedOperation unless ``t`` is a dense CPU tensor of a known dtype."""
    if not t.is_cpu:  # (quicker than reading t.device)
        raise UnsupportedOperation(f"the p2pcoll backend's {collective} runs on CPU tensors "
                                   f"only, got one on {t.device}")
    if t.layout is not torch.strided:
        raise UnsupportedOperation(f"the p2pcoll backend's {collective} needs dense tensors, "
                                   f"got layout {t.layout}")
    if t.dtype not in SUPPORTED:
        raise UnsupportedOperation(f"the p2pcoll backend's {collective} does not support "
                                   f"dtype {t.dtype}")


def bits(t: torch.Tensor) -> np.ndarray:
    """``t`` as a numpy array to move unchanged: its memory when contiguous (bfloat16 as
    int16 bits), else a contiguous copy (write it back with :func:`store`; a lazy conjugate's
    values are a copy too)."""
    # Not torch's Tensor.numpy() (10x quicker): it marks the storage not resizable, and
    # torch's batched PowerSGD hook resizes the bucket's buffer (tests/test_torch_hooks.py).
    a = tensors.as_array(t, bits=True)
    return a if a.flags.c_contiguous and a.flags.writeable else np.array(a, order="C")


def values(t: torch.Tensor, factor: float | None = None) -> np.ndarray:
    """``t`` as a numpy array to reduce: its memory when that is possible, else a copy
    (times ``factor`` if given, in ``t``'s dtype); bfloat16 as its int16 bits."""
    if factor is not None:
        t = t.detach().clone(memory_format=torch.contiguous_format).mul_(factor)
    return bits(t)


def shares(t: torch.Tensor, a: np.ndarray) -> bool:
    """Whether ``a`` is ``t``'s own memory (so results written to ``a`` are in ``t``)."""
    return tensors.shares(t, a)


def store(t: torch.Tensor, a: np.ndarray, *, divide: int | None = None) -> None:
    """Write the result ``a`` into ``t`` unless it is already there; then divide it by
    ``divide`` if given (a bfloat16 AVG, whose sum p2pcoll took)."""
    with torch.no_grad():
        if not shares(t, a):
            t.copy_(tensors.like(t, np.ascontiguousarray(a)).reshape(t.shape))
        if divide is not None:
            t.div_(divide)
