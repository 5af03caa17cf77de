"""torch's reduce ops and dtypes in p2pcoll's terms, and tensors as numpy arrays.

Contiguous CPU tensors are shared with numpy without a copy, so results land in the
tensor itself. numpy has no bfloat16: such tensors move as their int16 bits, and are
reduced in float32 (then rounded back once). An op or dtype that cannot be done raises
:class:`UnsupportedOperation` naming it, before anything is sent.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from ...errors import P2PCollError

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
    """How to run one torch reduction: p2pcoll's op name (None: bitwise, see ``fold``)
    and a factor to multiply the input by first (PREMUL_SUM)."""

    op: str | None
    fold: np.ufunc | None = None
    factor: float | None = None


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
    if kind in NATIVE:
        return Reduction(NATIVE[kind])
    if kind in BITWISE:
        return Reduction(None, fold=BITWISE[kind])
    if kind == RedOp.PREMUL_SUM:
        factor = getattr(rop, "factor", None)
        if not isinstance(factor, (int, float)):
            raise UnsupportedOperation(f"the p2pcoll backend's {collective}: PREMUL_SUM "
                                       f"needs a scalar factor, got {factor!r}")
        return Reduction("sum", factor=float(factor))
    raise UnsupportedOperation(f"the p2pcoll backend's {collective} does not support "
                               f"reduce op {kind}")


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


def bits(t: torch.Tensor) -> np.ndarray:
    """``t`` as a numpy array to move unchanged: its memory when contiguous (bfloat16 as
    int16 bits), else a contiguous copy (write it back with :func:`store`)."""
    t = t.detach()
    if t.dtype is torch.bfloat16:
        t = t.view(torch.int16) if t.is_contiguous() else t.contiguous().view(torch.int16)
    return t.numpy() if t.is_contiguous() else t.contiguous().numpy()


def values(t: torch.Tensor, factor: float | None = None) -> np.ndarray:
    """``t`` as a numpy array to reduce: its memory when that is possible, else a copy
    (bfloat16 in float32; times ``factor`` if given)."""
    t = t.detach()
    if t.dtype is torch.bfloat16:
        t = t.float()
    elif factor is not None:
        t = t.clone()
    elif not t.is_contiguous():
        t = t.contiguous()
    if factor is not None:
        t.mul_(factor)
    return t.numpy()


def shares(t: torch.Tensor, a: np.ndarray) -> bool:
    """Whether ``a`` is ``t``'s own memory (so results written to ``a`` are in ``t``)."""
    return (t.is_contiguous() and a.size == t.numel()
            and (a.size == 0 or a.__array_interface__["data"][0] == t.data_ptr()))


def store(t: torch.Tensor, a: np.ndarray) -> None:
    """Write the result ``a`` into ``t`` unless it is already there."""
    if shares(t, a) and (t.dtype is not torch.bfloat16 or a.dtype == np.int16):
        return
    src = torch.from_numpy(np.ascontiguousarray(a))
    if t.dtype is torch.bfloat16 and src.dtype is torch.int16:
        src = src.view(torch.bfloat16)
    with torch.no_grad():
        t.copy_(src.reshape(t.shape))
