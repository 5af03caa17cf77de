"""One reduction under a codec: agree on scales, encode, one ordinary collective, decode.

The group's own collectives do the communication, so this module needs nothing of the
group but its reductions (:class:`Reductions`); ``Group.allreduce(..., codec=)``,
``p2pcoll.training`` (with error feedback) and the torch hooks all come here.

**Order.** A coded reduction with scales is two collectives, the data's starting only
once the scales' has finished; it takes a turn of the group's :mod:`p2pcoll.session.turns`,
so every call the group starts meanwhile waits and starts in the order the caller started
it, on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, Protocol

import numpy as np

from ..types import CustomOp, ReduceOp, as_op, check_dtype
from .base import Codec, Context, NonFiniteInput
from ..session.turns import Turns
from .registry import get_codec

__all__ = ["Reductions", "reduce_coded"]

Collective = Literal["allreduce", "reduce", "reduce_scatter"]


class Reductions(Protocol):
    """What :func:`reduce_coded` needs of a group (a :class:`p2pcoll.Group` has it)."""

    @property
    def world_size(self) -> int: ...

    @property
    def rank(self) -> int: ...

    async def allreduce(self, value: Any, op: Any = ..., *, strategy: str | None = ...,
                        timeout: float | None = ..., out: Any = ...) -> Any: ...

    async def reduce(self, value: Any, root: int = ..., op: Any = ..., *,
                     strategy: str | None = ..., timeout: float | None = ...) -> Any: ...

    async def reduce_scatter(self, array: np.ndarray, op: Any = ..., *,
                             strategy: str | None = ..., timeout: float | None = ...
                             ) -> np.ndarray: ...

    @property
    def turns(self) -> Turns:
        """The order the group's calls start in (every call consults it)."""
        ...


async def reduce_coded(
    group: Reductions,
    codec: Codec | str,
    arrays: Sequence[np.ndarray],
    op: str | ReduceOp = "sum",
    *,
    collective: Collective = "allreduce",
    root: int = 0,
    strategy: str | None = None,
    timeout: float | None = None,
    out: Sequence[np.ndarray] | None = None,
    residuals: Sequence[np.ndarray] | None = None,
    nonfinite: Literal["raise", "nan"] = "raise",
) -> list[np.ndarray] | None:
    """Reduce ``arrays`` over the group through ``codec``: every rank gets the same bits.

    The arrays travel as one collective of the codec's wire dtype (int8 first agrees on its
    scales in a small allreduce(max) of one float32 per 1024 elements). With
    ``residuals`` (error feedback), each array's residual is added to it before it is
    encoded, and replaced by what the codec lost of that sum:
    ``residual = (x + residual) - restore(encode(x + residual))``, computed by this rank
    alone (NaN or Inf there is reset to 0).

    Args:
        group: the group (its ``allreduce``/``reduce``/``reduce_scatter`` run the data).
        codec: a codec or its name.
        arrays: floating-point arrays (any shapes); for "reduce_scatter", exactly one with at
            least one dimension (its rows are split as ``Group.reduce_scatter`` splits them).
        op: one of the codec's ops ("sum", "avg"; fp16 and bf16 also "min", "max").
        collective: "allreduce", "reduce" (the result on ``root``) or "reduce_scatter".
        root: the root of a "reduce".
        strategy, timeout: for the data's collective, as the group's methods take them.
        out: where to put the results (C-contiguous, writable, the arrays' shapes; for
            "reduce_scatter", this rank's part); None: new arrays of the arrays' dtypes.
        residuals: error feedback: one C-contiguous, writable floating array per array, of
            its shape, updated in place (only where the codec is lossy).
        nonfinite: NaN or Inf where the codec needs an agreed scale: "raise"
            :class:`NonFiniteInput` on every rank, or "nan": the blocks concerned are NaN
            in the result on every rank (as a plain float sum would be).

    Returns:
        The results, one per array ("reduce_scatter": this rank's part); None on a rank
        that is not the root of a "reduce".

    Raises:
        TypeError: an array that is not floating point; a codec that is not a name.
        ValueError: an op the codec cannot carry (or a CustomOp), a world size it cannot
            sum over, ``out``/``residuals`` that do not fit, a bad ``collective``.
        UnknownCodec: no codec of that name (a ValueError; lists the installed ones).
        NonFiniteInput: NaN or Inf in some rank's data and ``nonfinite="raise"`` (every rank
            raises it; nothing but the scales has moved).
        CollectiveTimeout, CollectiveMismatch, PeerLost, GroupBroken: as the group's
            collectives (a rank that uses another codec or none is a CollectiveMismatch
            naming the codec's fold, ``custom:codec:<name>:<op>``).

    Cancellation: breaks the group if it happens during a collective.
    """
    coder = codec if isinstance(codec, Codec) else get_codec(codec)
    red = as_op(op)
    if isinstance(red, CustomOp):
        raise ValueError(f"codec {coder.name!r} carries the built-in ops "
                         f"({', '.join(sorted(o.value for o in coder.ops))}), not a CustomOp")
    if collective not in ("allreduce", "reduce", "reduce_scatter"):
        raise ValueError(f"a codec reduces with allreduce, reduce or reduce_scatter, not "
                         f"{collective!r}")
    if nonfinite not in ("raise", "nan"):
        raise ValueError(f"nonfinite must be 'raise' or 'nan', got {nonfinite!r}")
    p = group.world_size
    data = [a if isinstance(a, np.ndarray) else np.asarray(a) for a in arrays]
    for a in data:
        coder.check(red, check_dtype(a.dtype), p)
    if collective == "reduce_scatter" and (len(data) != 1 or data[0].ndim == 0):
        raise ValueError("a coded reduce_scatter takes one array with at least one dimension")
    if residuals is not None:
        _check_buffers(residuals, data, "residuals", scatter=False)
    if out is not None:
        _check_buffers(out, data, "out", scatter=collective == "reduce_scatter", rank=group.rank,
                       size=p)

    # The values to send: each array plus its residual.
    values = [a.reshape(-1) for a in data]
    if residuals is not None and coder.lossy and red in (ReduceOp.SUM, ReduceOp.AVG):
        values = [np.add(v, r.reshape(-1), dtype=v.dtype) for v, r in zip(values, residuals,
                                                                            strict=True)]
    else:
        residuals = None

    async with group.turns.hold() as turn:  # taken before the first await
        agreed = await _agree(group, coder, values, nonfinite, timeout)
        contexts = [Context(red, p, scales) for scales in agreed]
        wires = [coder.encode(v, ctx) for v, ctx in zip(values, contexts, strict=True)]
        if residuals is not None:
            for v, wire, ctx, r in zip(values, wires, contexts, residuals, strict=True):
                _feedback(coder, v, wire, ctx, r.reshape(-1))
        wire = wires[0] if len(wires) == 1 else np.concatenate(wires)
        # Passing the turn on only schedules the next one's wake-up: the data's
        # collective, started below before any await, takes its number first.
        turn.release()
        total, start = await _run(group, collective, wire, coder.fold(red), root, strategy,
                                  timeout, data[0].shape)
    if total is None:
        return None
    if collective == "reduce_scatter":
        shape = data[0].shape
        rows = len(np.array_split(np.arange(shape[0]), p)[group.rank])
        target = out[0] if out is not None else np.empty((rows, *shape[1:]), data[0].dtype)
        coder.decode(total, contexts[0], target.reshape(-1), start)
        return [target]
    results = []
    offset = 0
    for i, (a, ctx) in enumerate(zip(data, contexts, strict=True)):
        target = out[i] if out is not None else np.empty(a.shape, a.dtype)
        coder.decode(total[offset:offset + a.size], ctx, target.reshape(-1), start)
        offset += a.size
        results.append(target)
    return results


async def _run(group: Reductions, collective: str, wire: np.ndarray, fold: CustomOp | ReduceOp,
               root: int, strategy: str | None, timeout: float | None,
               shape: tuple[int, ...]) -> tuple[np.ndarray | None, int]:
    """The data's collective: (the folded wire array or this rank's part of it, or None
    off the root of a reduce; the index of its first element in the data)."""
    if collective == "allreduce":
        await group.allreduce(wire, fold, strategy=strategy, timeout=timeout, out=wire)
        return wire, 0
    if collective == "reduce":
        return await group.reduce(wire, root, fold, strategy=strategy, timeout=timeout), 0
    part = await group.reduce_scatter(wire.reshape(shape), fold, strategy=strategy,
                                      timeout=timeout)
    rows = np.array_split(np.arange(shape[0]), group.world_size)[group.rank]
    row_size = int(np.prod(shape[1:], dtype=np.int64))
    return part.reshape(-1), (int(rows[0]) if rows.size else 0) * row_size


async def _agree(group: Reductions, codec: Codec, values: Sequence[np.ndarray],
                 nonfinite: str, timeout: float | None) -> list[np.ndarray | None]:
    """Each array's agreed statistics (None for a codec that needs none); raises
    NonFiniteInput on every rank when they are not finite and ``nonfinite`` is "raise"."""
    stats = [codec.statistics(v) for v in values]
    if all(s is None for s in stats):
        return [None] * len(values)
    if any(s is None for s in stats):
        raise ValueError(f"codec {codec.name!r} gave statistics for some arrays only")
    parts = [np.asarray(s, np.float32).reshape(-1) for s in stats]
    mine = parts[0] if len(parts) == 1 else np.concatenate(parts)
    agreed = await group.allreduce(mine, codec.agreement(), timeout=timeout)
    ends = np.cumsum([len(s) for s in parts])
    split = np.split(agreed, ends[:-1])
    if nonfinite == "raise" and not np.isfinite(agreed).all():
        blocks = []
        for i, (v, s) in enumerate(zip(values, split, strict=True)):
            per = codec.block or v.size
            blocks += [(i, int(k) * per, min((int(k) + 1) * per, v.size))
                       for k in np.flatnonzero(~np.isfinite(s))]
        arrays = sorted({b[0] for b in blocks})
        raise NonFiniteInput(
            f"codec {codec.name!r}: NaN or Inf in the data of some rank ({len(blocks)} "
            f"block(s) of array(s) {arrays}): no scale can be agreed, nothing was sent",
            codec=codec.name, blocks=blocks)
    return list(split)


def _feedback(codec: Codec, value: np.ndarray, wire: np.ndarray, ctx: Context,
              residual: np.ndarray) -> None:
    """``residual = value - restore(wire)``; NaN or Inf reset to 0."""
    sent = np.empty(value.size, residual.dtype)
    codec.restore(wire, ctx, sent)
    with np.errstate(invalid="ignore", over="ignore"):
        np.subtract(value, sent, out=residual, casting="unsafe")
    bad = ~np.isfinite(residual)
    if bad.any():
        residual[bad] = 0


def _check_buffers(buffers: Sequence[np.ndarray], data: Sequence[np.ndarray], what: str, *,
                   scatter: bool, rank: int = 0, size: int = 1) -> None:
    """ValueError unless ``buffers`` are C-contiguous writable floating arrays, one per
    array of ``data`` and of its shape (a reduce_scatter's ``out``: this rank's part)."""
    if len(buffers) != len(data):
        raise ValueError(f"{what}: {len(buffers)} arrays for {len(data)}")
    for b, a in zip(buffers, data, strict=True):
        shape = a.shape
        if scatter:
            shape = (len(np.array_split(np.arange(a.shape[0]), size)[rank]), *a.shape[1:])
        if not isinstance(b, np.ndarray) or b.shape != shape or b.dtype.kind != "f" or not (
                b.flags.c_contiguous and b.flags.writeable):
            got = f"{b.dtype}{list(b.shape)}" if isinstance(b, np.ndarray) else repr(b)
            raise ValueError(f"{what} must be C-contiguous, writable floating-point arrays "
                             f"of the shapes {list(shape)}, got {got}")
