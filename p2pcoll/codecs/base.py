"""What a codec is: how a reduction's floats become the smaller numbers that travel.

A codec turns each rank's floating-point data into *wire* arrays (float16, bfloat16's bits,
int8, ...), the group runs an ordinary reduction of those with the codec's *fold*, and the
codec turns the reduced wire array back into floats. The engine never knows: every strategy,
the shared-memory board, auto's cost model and ``stats()`` see the encoded arrays and count
their bytes. One reduction under a codec is::

    stats  = codec.statistics(x)                     # optional: int8's block maxima
    agreed = allreduce(stats, codec.agreement())     # the element-wise max over the ranks
    wire   = codec.encode(x, ctx)                    # ctx: op, world size, agreed
    total  = allreduce(wire, codec.fold(op))         # any strategy, any transport
    codec.decode(total, ctx, out)                    # out: the op's result, in x's dtype

:func:`p2pcoll.codecs.reduce_coded` runs that (``Group.allreduce(..., codec=)`` calls it);
the methods are public so that other layers (DDP hooks, error feedback) can call them one
by one.

**When a codec is sound.** Every allreduce strategy gives every rank the same bits of a
fold that is commutative bit for bit: each element is either combined on one rank and
passed on (ring, reduce-broadcast, Rabenseifner, the board, which folds in rank order), or
combined on two ranks as ``fold(a, b)`` and ``fold(b, a)`` (recursive doubling). So a
codec's fold must be commutative; the registry checks it on sample data where the codec
loads and refuses a codec whose fold is not (:class:`~p2pcoll.PluginValidationError`).
A codec whose fold is also associative (``exact = True``: int8's integer sums, which cannot
overflow) gives the same bits under every strategy, every segmentation, on the board or
not. One that is not (fp16, bf16: rounded float sums) gives every rank the same bits, but
which bits depends on the strategy, exactly as float32 sums do today; that is sound for
replicas (they are identical) and is said here rather than refused.

Errors::

    NonFiniteInput       also a P2PCollError and a FloatingPointError: a codec that needs
                         a scale agreed by the ranks found NaN or Inf in some rank's data;
                         every rank raises it (the group stays usable)
    UnknownCodec         also a ValueError: no codec of that name; lists the installed ones
    TypeError            a codec on integer, bool or complex data (names dtype and codec)
    ValueError           an op the codec cannot carry (names codec and op), or a world
                         size it cannot sum over (int8: more than 127 ranks)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from ..errors import NonFiniteInput, UnknownCodec
from ..types import CustomOp, ReduceOp

__all__ = ["Codec", "Context", "NonFiniteInput", "UnknownCodec", "fold_op"]


@dataclass(frozen=True)
class Context:
    """What a codec knows about one reduction, the same on every rank.

    Attributes:
        op: the reduction the caller asked for (one of the codec's ``ops``).
        world_size: how many ranks contribute.
        agreed: the element-wise maximum over the ranks of their :meth:`Codec.statistics`
            (float32), or None for a codec that needs none.
    """

    op: ReduceOp
    world_size: int
    agreed: np.ndarray | None = None


class Codec(ABC):
    """A way to carry a reduction of floating-point data in fewer bytes.

    Subclass it and declare the class attributes; register the class under the entry-point
    group ``p2pcoll.codecs`` (``int4 = "mypkg.codecs:Int4"``) or with
    :func:`p2pcoll.codecs.register_codec`. The registry validates it where it loads.

    Attributes:
        name: what callers pass as ``codec=``.
        wire_dtype: the dtype of the arrays that travel.
        wire_bytes: bytes on the wire per element of the data, everything included (int8:
            1 + 4/1024, its block maxima counted); the factor of the saving is
            ``itemsize / wire_bytes``.
        ops: the reductions it can carry.
        block: elements per number of :meth:`statistics` (int8: 1024; 0: it has none).
        exact: its fold is associative as well as commutative (integer sums that cannot
            overflow), so its results do not depend on the strategy.
        lossy: ``decode(encode(x))`` may differ from ``x`` (error feedback applies).
    """

    name: ClassVar[str] = ""
    wire_dtype: ClassVar[np.dtype[Any]]
    wire_bytes: ClassVar[float]
    ops: ClassVar[frozenset[ReduceOp]]
    block: ClassVar[int] = 0
    exact: ClassVar[bool] = False
    lossy: ClassVar[bool] = True

    def check(self, op: ReduceOp, dtype: np.dtype[Any], world_size: int) -> None:
        """Raise unless this codec can reduce ``dtype`` data with ``op`` over ``world_size``
        ranks.

        Raises:
            TypeError: ``dtype`` is not floating point (float16, float32, float64).
            ValueError: the codec cannot carry ``op``.
        """
        if dtype.kind != "f":
            raise TypeError(f"codec {self.name!r} compresses floating-point data (float16, "
                            f"float32, float64), got dtype {dtype}")
        if op not in self.ops:
            carried = ", ".join(sorted(o.value for o in self.ops))
            raise ValueError(f"codec {self.name!r} cannot carry op {op.value!r}; it carries "
                             f"{carried}")

    def statistics(self, x: np.ndarray) -> np.ndarray | None:
        """Numbers of this rank's flat ``x`` whose element-wise maximum over the ranks the
        codec needs before it encodes (float32; the same length on every rank for the same
        length of ``x``), or None: it needs none (the default)."""
        return None

    def agreement(self) -> CustomOp:
        """The fold of the statistics' allreduce: the element-wise maximum (NaN wins), named
        after the codec so ranks that disagree on the codec get a CollectiveMismatch."""
        return CustomOp(f"codec:{self.name}:statistics-max", _maximum)

    @abstractmethod
    def encode(self, x: np.ndarray, ctx: Context) -> np.ndarray:
        """This rank's contribution: flat ``x`` (floating point) as a new flat array of
        ``wire_dtype`` and the same length. Deterministic: the same bits for the same
        ``x`` and ``ctx``."""

    @abstractmethod
    def fold(self, op: ReduceOp) -> CustomOp | ReduceOp:
        """How the ranks' wire arrays combine for ``op``; commutative bit for bit. A
        :class:`~p2pcoll.CustomOp` named ``codec:<name>:<op>`` puts the codec in the
        collective's signature, so ranks that disagree on it get a CollectiveMismatch."""

    @abstractmethod
    def decode(self, total: np.ndarray, ctx: Context, out: np.ndarray, start: int = 0) -> None:
        """Write the op's result into ``out`` (flat, floating point, ``len(total)``) from
        ``total``, the folded wire arrays of every rank. ``total`` holds elements
        ``start, start + len(total)`` of the data (a part of a reduce_scatter)."""

    @abstractmethod
    def restore(self, wire: np.ndarray, ctx: Context, out: np.ndarray) -> None:
        """Write into ``out`` what the reduction counts of this rank's own contribution
        ``wire`` (= ``encode(x, ctx)``), in the units of ``x``: ``x - out`` is what the
        codec lost of ``x``, the residual of error feedback."""

    def __repr__(self) -> str:
        return (f"<codec {self.name!r}: {self.wire_dtype} on the wire, "
                f"{self.wire_bytes:g} bytes per element>")


def fold_op(codec: Codec, op: ReduceOp, ufunc: np.ufunc) -> CustomOp:
    """A :class:`~p2pcoll.CustomOp` named ``codec:<codec>:<op>`` that folds with ``ufunc``
    in place (``ufunc(mine, incoming, out=mine)``)."""
    def fold(mine: np.ndarray, incoming: np.ndarray) -> None:
        ufunc(mine, incoming, out=mine)

    return CustomOp(f"codec:{codec.name}:{op.value}", fold)


def _maximum(mine: np.ndarray, incoming: np.ndarray) -> None:
    np.maximum(mine, incoming, out=mine)
