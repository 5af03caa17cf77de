"""The built-in codecs: "fp16", "bf16" and "int8".

========  ==========  ============  ===================  ====================================
codec     on the wire  bytes/element  ops                 precision
========  ==========  ============  ===================  ====================================
fp16      float16      2              sum avg min max      11-bit significand: each value and
                                                           each partial sum rounded to 2**-11
                                                           relative; range +-65504 (beyond it
                                                           +-inf, on every rank)
bf16      bfloat16     2              sum avg min max      8-bit significand: 2**-8 relative,
          (uint16                                          per value and per partial sum;
          bits)                                            float32's range
int8      int8 + one   1 + 4/1024     sum avg              per block of 1024 elements, 2L + 1
          float32 per                                      levels, L = 127 // p (p=2: 127,
          1024                                             p=4: 63, p=8: 31 levels); each
                                                           value off by at most s/2 (plus
                                                           L 2**-23 s of float32 rounding),
                                                           s = M / L
========  ==========  ============  ===================  ====================================

fp16 and bf16 for "avg" divide each rank's value by p before it is summed (as torch's fp16
DDP hook does; here in float32, before the one rounding to half precision), so the sum of p
values stays in range where their average is; "sum" sends the values as they are. Their
folds round every partial sum, so the bits of a result depend on the strategy as float32
sums do (every rank gets the same bits).

int8 is exact in the integer domain. Before the data moves, the ranks agree on a scale per
block of :data:`BLOCK` elements: one allreduce(max) of each block's largest magnitude
(float32, 4 bytes per block). With ``M`` that maximum over every rank and ``L = 127 // p``,
each rank sends ``q = round(x * L / M)`` (``s = M / L``), so ``|q| <= L`` and the sum of the
p ranks' q, and every partial sum of some of them, lies within [-127, 127]: integer
addition that cannot overflow is associative, so every strategy, segmentation and board
gives the same bits. The result is ``sum(q) * s`` (divided by p for "avg"): off from the
exact sum by at most ``p * s / 2`` (the average by ``s / 2``). Why so few levels: the sum of
p int8 values must itself be an int8 for the wire to stay one byte per element through
every step of every strategy; the alternative, re-quantising partial sums per step, would
make each strategy round differently. NaN or Inf anywhere makes that block's maximum NaN or
Inf on every rank: :func:`~p2pcoll.codecs.reduce_coded` raises
:class:`~p2pcoll.codecs.NonFiniteInput` on every rank (or, asked to, gives NaN for that block
on every rank), never a wrong scale. "min", "max" and "prod" are refused: a sum of codes is
not their meaning.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from ..types import CustomOp, ReduceOp
from .base import Codec, Context, fold_op

__all__ = ["BLOCK", "BFloat16", "Float16", "Int8", "bfloat16_bits", "bfloat16_values"]

BLOCK = 1024
"""Elements per int8 block (one agreed scale each)."""

SUMS = frozenset({ReduceOp.SUM, ReduceOp.AVG})
ORDERED = SUMS | {ReduceOp.MIN, ReduceOp.MAX}
_UFUNC = {ReduceOp.SUM: np.add, ReduceOp.AVG: np.add, ReduceOp.MIN: np.minimum,
          ReduceOp.MAX: np.maximum}


def _working(x: np.ndarray) -> np.dtype[Any]:
    """The dtype arithmetic on ``x`` is done in before rounding: float32 or float64."""
    return np.dtype(np.float64) if x.dtype == np.float64 else np.dtype(np.float32)


def _prescaled(x: np.ndarray, ctx: Context) -> np.ndarray:
    """``x / p`` for "avg" (one rounding, in float32 or float64), else ``x`` itself."""
    if ctx.op is ReduceOp.AVG:
        scaled: np.ndarray = np.true_divide(x, ctx.world_size, dtype=_working(x))
        return scaled
    return x


class _TwoBytes(Codec):
    """A 16-bit float on the wire, summed (or min/max'ed) in it; subclasses give the
    conversions and the fold. "avg" divides by p before the rounding, as torch's hooks do."""

    wire_bytes = 2.0
    ops = ORDERED

    def __init__(self) -> None:
        self._folds = {op: self._make_fold(op) for op in self.ops}

    def _make_fold(self, op: ReduceOp) -> CustomOp:
        raise NotImplementedError

    def _to_wire(self, values: np.ndarray) -> np.ndarray:
        """``values`` rounded to the wire dtype (beyond its range: +-inf)."""
        raise NotImplementedError

    def _values(self, wire: np.ndarray) -> np.ndarray:
        """The values the wire holds, in a dtype numpy computes in (exactly)."""
        raise NotImplementedError

    def encode(self, x: np.ndarray, ctx: Context) -> np.ndarray:
        with np.errstate(over="ignore"):  # beyond the wire's range: +-inf on every rank alike
            return self._to_wire(_prescaled(x, ctx))

    def fold(self, op: ReduceOp) -> CustomOp:
        return self._folds[op]

    def decode(self, total: np.ndarray, ctx: Context, out: np.ndarray, start: int = 0) -> None:
        with np.errstate(over="ignore"):  # into a narrower ``out``: beyond its range, +-inf
            out[...] = self._values(total)

    def restore(self, wire: np.ndarray, ctx: Context, out: np.ndarray) -> None:
        with np.errstate(over="ignore"):
            if ctx.op is ReduceOp.AVG:
                np.multiply(self._values(wire), ctx.world_size, out=out, dtype=np.float32,
                            casting="unsafe")
            else:
                out[...] = self._values(wire)


class Float16(_TwoBytes):
    """IEEE half precision on the wire: 2 bytes per element, float16 sums."""

    name = "fp16"
    wire_dtype = np.dtype(np.float16)

    def _make_fold(self, op: ReduceOp) -> CustomOp:
        return fold_op(self, op, _UFUNC[op])

    def _to_wire(self, values: np.ndarray) -> np.ndarray:
        return values.astype(np.float16)

    def _values(self, wire: np.ndarray) -> np.ndarray:
        return wire


def bfloat16_values(bits: np.ndarray) -> np.ndarray:
    """bfloat16 values given as their 16 bits (uint16 or int16), as float32 (exactly)."""
    return (bits.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def bfloat16_bits(values: np.ndarray) -> np.ndarray:
    """float32 ``values`` rounded to bfloat16 as torch rounds them (to nearest, ties to
    even; every NaN to the quiet NaN 0x7FC0, as c10::BFloat16 does), as uint16 bits."""
    u = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    out = ((u + (((u >> 16) & 1) + 0x7FFF)) >> 16).astype(np.uint16)
    out[np.isnan(values)] = 0x7FC0
    return out


class BFloat16(_TwoBytes):
    """bfloat16 on the wire (its bits as uint16): 2 bytes per element, float32's range."""

    name = "bf16"
    wire_dtype = np.dtype(np.uint16)

    def _make_fold(self, op: ReduceOp) -> CustomOp:
        """Widen both operands to float32 (exact), combine, round back to bfloat16: what
        Gloo's bfloat16 arithmetic does, and commutative bit for bit."""
        ufunc = _UFUNC[op]

        def fold(mine: np.ndarray, incoming: np.ndarray) -> None:
            result = bfloat16_values(mine)
            ufunc(result, bfloat16_values(incoming), out=result)
            mine[...] = bfloat16_bits(result)

        return CustomOp(f"codec:{self.name}:{op.value}", fold)

    def _to_wire(self, values: np.ndarray) -> np.ndarray:
        return bfloat16_bits(values.astype(np.float32))  # float64 beyond float32's: +-inf

    def _values(self, wire: np.ndarray) -> np.ndarray:
        return bfloat16_values(wire)


class Int8(Codec):
    """Blockwise int8 with scales agreed by every rank: sums exact in the integer domain."""

    name = "int8"
    wire_dtype = np.dtype(np.int8)
    wire_bytes = 1.0 + 4.0 / BLOCK
    ops = SUMS
    block = BLOCK
    exact = True

    def __init__(self) -> None:
        self._folds = {op: fold_op(self, op, np.add) for op in self.ops}

    def check(self, op: ReduceOp, dtype: np.dtype[Any], world_size: int) -> None:
        super().check(op, dtype, world_size)
        if world_size > 127:
            raise ValueError(f"codec 'int8' sums at most 127 ranks' int8 values exactly; "
                             f"this group has {world_size}")

    def statistics(self, x: np.ndarray) -> np.ndarray:
        """The largest magnitude of each block of ``x`` (NaN if it holds one; Inf if it
        holds an Inf), float32 rounded up so that it is never below the block's values."""
        out = np.empty(-(-x.size // BLOCK), np.float32)
        for seg, lo, hi in _pieces(x, 0):
            wide = np.asarray(np.abs(seg).max(axis=-1), np.float64).reshape(hi - lo)
            with np.errstate(over="ignore"):
                narrow = wide.astype(np.float32)
            # float64 data may round down to float32: step up to stay above every value.
            out[lo:hi] = np.where(narrow < wide, np.nextafter(narrow, np.float32(np.inf)),
                                  narrow)
        return out

    def levels(self, world_size: int) -> int:
        """L: each rank's codes lie in [-L, L], so the sum of ``world_size`` of them in
        [-127, 127]."""
        return 127 // world_size

    def scales(self, ctx: Context) -> np.ndarray:
        """Each block's step s = M / L (float64; 1 where M is 0; NaN where M is not
        finite)."""
        if ctx.agreed is None:
            raise ValueError("codec 'int8' needs the agreed block maxima (Context.agreed)")
        m = ctx.agreed.astype(np.float64)
        s = m / self.levels(ctx.world_size)
        s[m == 0] = 1.0
        s[~np.isfinite(m)] = np.nan
        return s

    def encode(self, x: np.ndarray, ctx: Context) -> np.ndarray:
        """Codes ``round(x * (L / M))`` (ties to even), clipped to [-L, L]; zeros in a block
        whose maximum is not finite. float16/float32 data is multiplied in float32 (the
        product's rounding adds at most L * 2**-23 of a step) unless L / M leaves float32's
        range (blocks of subnormal numbers), float64 data in float64."""
        limit = self.levels(ctx.world_size)
        m = self.scales(ctx) * limit  # the agreed maxima, float64 (1*L where M is 0)
        finite = np.isfinite(m)
        inverse = np.where(finite, limit / np.where(finite, m, 1.0), 0.0)
        work = _working(x)
        if work == np.float32 and np.all(inverse < float(np.finfo(np.float32).max)):
            inverse = inverse.astype(np.float32)
        wire = np.empty(x.size, np.int8)
        for (seg, lo, hi), (codes, _, _) in zip(_pieces(x, 0), _pieces(wire, 0), strict=True):
            inv = inverse[lo:hi]
            with np.errstate(invalid="ignore"):  # NaN or Inf times 0, in refused blocks
                v = np.multiply(seg, inv[:, None] if seg.ndim == 2 else inv[0], dtype=inv.dtype)
                np.rint(v, out=v)
                np.clip(v, -limit, limit, out=v)
            if not finite[lo:hi].all():
                v[~finite[lo:hi] if seg.ndim == 2 else ...] = 0
            codes[...] = v
        return wire

    def fold(self, op: ReduceOp) -> CustomOp:
        return self._folds[op]

    def decode(self, total: np.ndarray, ctx: Context, out: np.ndarray, start: int = 0) -> None:
        """``sum(q) * s`` (divided by p for "avg"); NaN in a block whose maximum is not
        finite."""
        step = self.scales(ctx)
        if ctx.op is ReduceOp.AVG:
            step = step / ctx.world_size
        _times(total, step, out, start)

    def restore(self, wire: np.ndarray, ctx: Context, out: np.ndarray) -> None:
        _times(wire, self.scales(ctx), out, 0)


def _times(codes: np.ndarray, step: np.ndarray, out: np.ndarray, start: int) -> None:
    """``out = codes * step`` per block, for elements ``start, start + len(codes)``: one
    rounding, in float32 for float16/float32 results (float64 otherwise)."""
    work = _working(out)
    if work == np.float32:
        with np.errstate(over="ignore"):
            step = step.astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        for (seg, lo, hi), (dst, _, _) in zip(_pieces(codes, start), _pieces(out, start),
                                              strict=True):
            s = step[lo:hi]
            np.multiply(seg, s[:, None] if seg.ndim == 2 else s[0], out=dst, dtype=work,
                        casting="unsafe")


def _pieces(a: np.ndarray, start: int) -> Iterator[tuple[np.ndarray, int, int]]:
    """Views of flat ``a``, which holds elements ``start, start + a.size`` of data cut into
    blocks of :data:`BLOCK`, cut where the blocks are: ``(view, first block, end block)``,
    the view 2-d ``(blocks, BLOCK)`` for whole blocks, 1-d for the part of one block at
    either end."""
    pos, end = 0, a.size
    if start % BLOCK and end:  # the rest of the block that ``start`` falls in
        pos = min(BLOCK - start % BLOCK, end)
        yield a[:pos], start // BLOCK, start // BLOCK + 1
    whole = (end - pos) // BLOCK
    if whole:
        b = (start + pos) // BLOCK
        yield a[pos:pos + whole * BLOCK].reshape(whole, BLOCK), b, b + whole
        pos += whole * BLOCK
    if pos < end:
        b = (start + pos) // BLOCK
        yield a[pos:end], b, b + 1
