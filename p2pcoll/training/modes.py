"""What the low-communication modes share: float tensors, one settings check, traffic counts.

PowerSGD (:mod:`.powersgd`), top-k (:mod:`.topk`), local SGD and DiLoCo (:mod:`.local_sgd`)
each move less than a plain allreduce of every gradient. They all

- take pytrees of floating-point arrays (numpy, or CPU torch tensors through ``.numpy()``)
  and refuse anything else by name (:func:`float_tensors`);
- check, before anything moves, that the ranks agree on the round, the tensors and the
  mode's settings (rank r, H, fraction, codec ...): the settings go into the table the
  agreement header digests (:func:`agree_on`), so a rank that differs gets
  :class:`~p2pcoll.CollectiveMismatch` naming the first setting that differs;
- count what they hand to the collectives against what a plain allreduce of the same
  tensors would have carried (:class:`Traffic`): the ratio does not depend on the
  strategy; ``group.stats()`` has the bytes that actually went on the wire.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..codecs import Codec, NonFiniteInput, get_codec, reduce_coded
from ..pytree import Pytree, as_array, named_leaves
from ..types import ROBUST, ReduceOp, as_op, check_trim
from .agreement import Call, Kind, agree, table
from .buckets import BucketPlan, TensorSpec
from .errors import NonFiniteGradients
from .nonfinite import report_tensors
from .replicas import content_digest

if TYPE_CHECKING:
    from .. import Group

__all__ = ["Traffic", "agree_on", "average", "check_codec", "float_tensors", "positive_int",
           "report_nonfinite", "same_tensors", "wire_bytes"]


@dataclass
class Traffic:
    """What a mode handed to the group's collectives, against a plain allreduce of the same tensors.

    Attributes:
        rounds: how many rounds (or outer steps) moved data.
        dense_bytes: the bytes a plain allreduce of the same tensors would have reduced,
            summed over the rounds (each tensor's ``nbytes``).
        sent_bytes: the bytes this rank handed to collectives instead (P and Q for PowerSGD,
            values and indices for top-k, the pseudo-gradients for DiLoCo, in the codec's
            bytes per element when there is one).
    """

    rounds: int = 0
    dense_bytes: int = 0
    sent_bytes: int = 0

    @property
    def saved_bytes(self) -> int:
        """``dense_bytes - sent_bytes``."""
        return self.dense_bytes - self.sent_bytes

    @property
    def ratio(self) -> float:
        """How many times fewer bytes than the dense allreduce (inf when nothing was sent)."""
        return self.dense_bytes / self.sent_bytes if self.sent_bytes else float("inf")

    def add(self, dense: int, sent: int) -> None:
        self.rounds += 1
        self.dense_bytes += dense
        self.sent_bytes += sent


def positive_int(value: Any, what: str) -> int:
    """``value`` if it is an int >= 1. Raises ValueError naming ``what`` otherwise."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{what} must be an int >= 1, got {value!r}")
    return value


def check_codec(codec: Any, dtypes: Iterable[np.dtype[Any]], world_size: int) -> Codec | None:
    """The codec called ``codec`` (None for None), checked for averaging ``dtypes`` over
    ``world_size`` ranks.

    Raises:
        TypeError: ``codec`` is not a name.
        UnknownCodec: no codec of that name (a ValueError; lists the installed ones).
        ValueError: the codec cannot average over that many ranks (int8: 127 at most).
        PluginValidationError: the plugin that provides it is broken.
    """
    if codec is None:
        return None
    found = get_codec(codec)
    for dtype in set(dtypes):
        found.check(ReduceOp.AVG, dtype, world_size)
    return found


def outer_op(op: Any, trim: int | None, world_size: int, *, codec: Any = None,
             compressor: Any = None) -> ReduceOp:
    """How a mode averages its pseudo-gradients: "avg", "median" or "trimmed_mean" (with
    ``trim``, checked against ``world_size``); a robust op moves the data as it is.

    Raises:
        ValueError: another op, a bad ``trim`` (naming it), a robust op with a codec or a
            compressor.
    """
    red = as_op(op)
    if red is not ReduceOp.AVG and red not in ROBUST:
        raise ValueError(f"op must be 'avg', 'median' or 'trimmed_mean', got {op!r}")
    check_trim(red, trim, world_size)
    if red in ROBUST and (codec is not None or compressor is not None):
        raise ValueError(f"op={red.value!r} moves the pseudo-gradients as they are: no "
                         f"codec={codec!r} or compressor={compressor!r}")
    return red


def float_tensors(tree: Pytree, what: str) -> tuple[list[str], list[np.ndarray],
                                                    list[TensorSpec]]:
    """The names, arrays (views of torch tensors) and specs of a pytree of float tensors.

    Raises:
        TypeError: a leaf that is not a floating-point array (integer, bool, complex ...),
            named with ``what`` (``"PowerSGD: gradient 'fc.w' is int64; ..."``).
    """
    names, arrays = [], []
    for path, leaf in named_leaves(tree):
        array = as_array(leaf, path)
        if array.dtype.kind != "f":
            raise TypeError(f"{what}: {path or 'the tensor'!r} is {array.dtype}; only "
                            f"floating-point tensors can be averaged this way")
        names.append(path)
        arrays.append(array)
    return names, arrays, [TensorSpec.of(n, a) for n, a in zip(names, arrays, strict=True)]


async def agree_on(group: Group, what: str, round_no: int, settings: Mapping[str, Any],
                   specs: Sequence[TensorSpec], timeout: float | None,
                   contents: Sequence[np.ndarray] | None = None) -> None:
    """The agreement header of a round of a mode: every rank in the same round, with the same
    tensors and ``settings`` (which name the mode, so a rank in another mode differs too),
    and, if ``contents`` are given, the same bits in them (in the same header).

    Raises:
        CollectiveMismatch: naming the round, or the first setting or tensor that differs.
        ReplicaDivergence: ``contents`` differ between ranks (naming the first tensor).
        CollectiveTimeout, PeerLost, GroupBroken: as the group's collectives.
    """
    data = None
    if contents is not None:
        data = table({}, specs, [content_digest(a) for a in contents])
    await agree(group, Call(Kind.GRADIENTS, round_no, what, table(settings, specs), data),
                timeout)


async def average(group: Group, arrays: Sequence[np.ndarray], *, names: Sequence[str] = (),
                  codec: Codec | None = None, residuals: Sequence[np.ndarray] | None = None,
                  nonfinite: str = "raise", round_no: int = -1,
                  bucket_bytes: int | None = None, strategy: str | None = None,
                  timeout: float | None = None, op: ReduceOp = ReduceOp.AVG,
                  trim: int | None = None) -> list[np.ndarray]:
    """The average over the group of each of ``arrays``; the same bits on every rank (new
    arrays). ``op``: "avg", or a robust op (:func:`outer_op`; no codec) with its ``trim``.

    Every rank passes arrays of the same shapes and dtypes in the same order; the caller has
    checked that (:func:`agree_on`). Without a codec they are fused into buckets of
    ``bucket_bytes``, one allreduce each. With one they travel as the codec's wire dtype
    (:func:`p2pcoll.codecs.reduce_coded`), with error feedback into ``residuals`` (one
    per array, updated in place) if given.

    Raises:
        NonFiniteGradients: the codec needs a scale agreed by the ranks and some rank's data
            holds NaN or Inf (``nonfinite="raise"``), naming the tensors (``names``); nothing
            but the scales has moved and the residuals are as they were. With other
            ``nonfinite`` those blocks come back NaN (report them with
            :func:`report_nonfinite`).
        CollectiveTimeout, PeerLost, GroupBroken: as the group's collectives.
    """
    if codec is not None:
        try:
            coded = await reduce_coded(group, codec, arrays, "avg", strategy=strategy,
                                       timeout=timeout, residuals=residuals,
                                       nonfinite="raise" if nonfinite == "raise" else "nan")
        except NonFiniteInput as exc:
            where = sorted({names[i] if i < len(names) else f"#{i}" for i, _, _ in exc.blocks})
            raise NonFiniteGradients(
                f"NaN or Inf in the data of some rank (round {round_no}), which codec "
                f"{codec.name!r} cannot scale: {', '.join(repr(w) for w in where)}",
                round=round_no, tensors=where) from exc
        assert coded is not None  # an allreduce gives every rank the result
        return coded
    specs = [TensorSpec(str(i), a.dtype, tuple(a.shape)) for i, a in enumerate(arrays)]
    plan = BucketPlan(specs, bucket_bytes)
    flats = plan.pack(list(arrays))
    reduced = await asyncio.gather(*(
        group.allreduce(flat, op, strategy=strategy, timeout=timeout, trim=trim)
        for flat in flats))
    return plan.unpack(reduced)


def wire_bytes(arrays: Iterable[np.ndarray], codec: Codec | None) -> int:
    """The bytes ``arrays`` take on the wire: their own, or the codec's per element."""
    if codec is None:
        return sum(a.nbytes for a in arrays)
    return math.ceil(sum(a.size for a in arrays) * codec.wire_bytes)


def report_nonfinite(what: str, names: Sequence[str], arrays: Sequence[np.ndarray],
                     mode: str, round_no: int) -> None:
    """Raise or warn, naming every tensor of ``arrays`` that holds a NaN or an Inf (see
    :func:`~.nonfinite.report_tensors`).

    Raises:
        NonFiniteGradients: with ``mode="raise"``.
    """
    report_tensors(what, zip(names, arrays, strict=True), mode, round_no, stacklevel=4)


def same_tensors(mode: str, first: Sequence[TensorSpec] | None,
                 specs: Sequence[TensorSpec]) -> bool:
    """Whether a mode that keeps a residual per tensor has seen ``specs`` already (False:
    this is its first round, lay the tensors out).

    Raises:
        ValueError: a later round brings other tensors than the first (``first``).
    """
    if first is None:
        return False
    if list(specs) != list(first):
        raise ValueError(f"{mode} keeps a residual per tensor: every round must bring the same "
                         "gradients (names, shapes, dtypes) as its first; use one reducer per "
                         "set of gradients")
    return True
