"""torch's reduce ops and dtypes in p2pcoll's terms, and tensors as numpy arrays.

Contiguous CPU tensors are shared with numpy without a copy, so results land in the
tensor itself. numpy has no bfloat16: such tensors move as their int16 bits, and are
reduced by a :class:`~p2pcoll.CustomOp` that widens both operands to float32, combines
them and rounds the result to bfloat16 (to nearest even, as torch does) at every step, as
Gloo's bfloat16 arithmetic does. An op or dtype that cannot be done raises
:class:`UnsupportedOperation` naming it, before anything is sent.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from ...errors import P2PCollError
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
# numpy's dtype of each supported torch dtype (bfloat16 moves as its int16 bits).
NUMPY = {d: torch.empty(0, dtype=d).numpy().dtype for d in SUPPORTED if d is not torch.bfloat16}


class UnsupportedOperation(P2PCollError, ValueError):
    """A reduce op, dtype or device that the p2pcoll backend cannot do."""


def widen(bits: np.ndarray) -> np.ndarray:
    """bfloat16 values given as int16 bits, as float32 (exactly)."""
    return (bits.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def narrow(values: np.ndarray) -> np.ndarray:
    """float32 values rounded to bfloat16 as torch rounds them (to nearest, ties to even;
    every NaN to the quiet NaN 0x7FC0, as c10::BFloat16 does), as int16 bits."""
    u = values.view(np.uint32)
    out = ((u + (((u >> 16) & 1) + 0x7FFF)) >> 16).astype(np.uint16)
    out[np.isnan(values)] = 0x7FC0
    return out.view(np.int16)


def _bfloat16(name: str, ufunc: np.ufunc) -> CustomOp:
    def fold(mine: np.ndarray, incoming: np.ndarray) -> None:
        result = widen(mine)
        ufunc(result, widen(incoming), out=result)
        mine[...] = narrow(result)

    return CustomOp(f"bfloat16-{name}", fold)


# p2pcoll's op per native op, on bfloat16's int16 bits (AVG: a SUM, then a division).
BFLOAT16 = {name: _bfloat16(name, ufunc) for name, ufunc in
            (("sum", np.add), ("prod", np.multiply), ("min", np.minimum),
             ("max", np.maximum))}


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
    for t in tensors:
        check_tensor(t, collective)
        if kind in BITWISE and t.dtype not in INTEGER:
            raise UnsupportedOperation(f"the p2pcoll backend's {collective}: {kind.name} "
                                       f"needs an integer dtype, got {t.dtype}")
        if kind == RedOp.AVG and t.dtype in INTEGER:
            raise UnsupportedOperation(f"the p2pcoll backend's {collective}: AVG needs a "
                                       f"floating dtype, got {t.dtype}")
    half = {t.dtype is torch.bfloat16 for t in tensors}
    if len(half) > 1:
        raise UnsupportedOperation(f"the p2pcoll backend's {collective}: bfloat16 tensors "
                                   f"cannot be reduced together with tensors of other dtypes")
    if half == {True} and kind in NATIVE:
        name = NATIVE[kind]
        return Reduction(BFLOAT16["sum" if name == "avg" else name], average=name == "avg")
    if half == {True} and kind == RedOp.PREMUL_SUM:
        return Reduction(BFLOAT16["sum"], factor=_factor(rop, collective))
    if kind in NATIVE:
        return Reduction(NATIVE[kind])
    if kind in BITWISE:
        return Reduction(None, fold=BITWISE[kind])
    if kind == RedOp.PREMUL_SUM:
        return Reduction("sum", factor=_factor(rop, collective))
    raise UnsupportedOperation(f"the p2pcoll backend's {collective} does not support "
                               f"reduce op {kind}")


def _factor(rop: dist.ReduceOp | RedOp, collective: str) -> float:
    factor = getattr(rop, "factor", None)
    if not isinstance(factor, (int, float)):
        raise UnsupportedOperation(f"the p2pcoll backend's {collective}: PREMUL_SUM "
                                   f"needs a scalar factor, got {factor!r}")
    return float(factor)


def check_tensor(t: torch.Tensor, collective: str) -> None:
    """Raises UnsupportedOperation unless ``t`` is a dense CPU tensor of a known dtype."""
    if t.device.type != "cpu":
        raise UnsupportedOperation(f"the p2pcoll backend's {collective} runs on CPU tensors "
                                   f"only, got one on {t.device}")
    if t.layout is not torch.strided:
        raise UnsupportedOperation(f"the p2pcoll backend's {collective} needs dense tensors, "
                                   f"got layout {t.layout}")
    if t.dtype not in SUPPORTED:
        raise UnsupportedOperation(f"the p2pcoll backend's {collective} does not support "
                                   f"dtype {t.dtype}")


class _Exported:
    """A contiguous tensor's memory for ``np.asarray``, which keeps this (so the tensor)
    alive. ``Tensor.numpy()`` would mark the tensor's storage non-resizable for ever, which
    Gloo does not: DDP's bucket buffers are resized by torch's batched PowerSGD hook, and
    FSDP-style code frees storages with ``resize_(0)`` after a collective."""

    __slots__ = ("__array_interface__", "tensor")

    def __init__(self, t: torch.Tensor) -> None:
        self.tensor = t
        self.__array_interface__ = {"data": (t.data_ptr(), False), "shape": tuple(t.shape),
                                    "typestr": NUMPY[t.dtype].str, "version": 3}


def _array(t: torch.Tensor) -> np.ndarray:
    """Contiguous ``t``'s own memory as a numpy array (see :class:`_Exported`)."""
    return np.asarray(_Exported(t))


def bits(t: torch.Tensor) -> np.ndarray:
    """``t`` as a numpy array to move unchanged: its memory when contiguous (bfloat16 as
    int16 bits), else a contiguous copy (write it back with :func:`store`)."""
    t = t.detach()
    if t.dtype is torch.bfloat16:
        t = t.view(torch.int16) if t.is_contiguous() else t.contiguous().view(torch.int16)
    return _array(t if t.is_contiguous() else t.contiguous())


def values(t: torch.Tensor, factor: float | None = None) -> np.ndarray:
    """``t`` as a numpy array to reduce: its memory when that is possible, else a copy
    (times ``factor`` if given, in ``t``'s dtype); bfloat16 as its int16 bits."""
    t = t.detach()
    if factor is not None:
        t = t.clone(memory_format=torch.contiguous_format).mul_(factor)
    elif not t.is_contiguous():
        t = t.contiguous()
    return _array(t.view(torch.int16) if t.dtype is torch.bfloat16 else t)


def shares(t: torch.Tensor, a: np.ndarray) -> bool:
    """Whether ``a`` is ``t``'s own memory (so results written to ``a`` are in ``t``)."""
    return (t.is_contiguous() and a.size == t.numel()
            and (a.size == 0 or a.__array_interface__["data"][0] == t.data_ptr()))


def store(t: torch.Tensor, a: np.ndarray, *, divide: int | None = None) -> None:
    """Write the result ``a`` into ``t`` unless it is already there; then divide it by
    ``divide`` if given (a bfloat16 AVG, whose sum p2pcoll took)."""
    with torch.no_grad():
        if not (shares(t, a) and (t.dtype is not torch.bfloat16 or a.dtype == np.int16)):
            src = torch.from_numpy(np.ascontiguousarray(a))
            if t.dtype is torch.bfloat16 and src.dtype is torch.int16:
                src = src.view(torch.bfloat16)
            t.copy_(src.reshape(t.shape))
        if divide is not None:
            t.div_(divide)
