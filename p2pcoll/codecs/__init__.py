"""Codecs for reductions: fewer bytes on the wire, the same bits on every replica.

``group.allreduce(x, op="avg", codec="int8")`` (also ``reduce``, ``reduce_scatter`` and
``p2pcoll.training``'s gradient reductions) sends each rank's floats in a smaller form and
reduces that form with an ordinary collective, so every strategy, the board, auto's cost
model and ``stats()`` see the compressed bytes. Built in:

- ``"fp16"``: float16, 2 bytes per element; sum, avg, min, max.
- ``"bf16"``: bfloat16 (its bits as uint16), 2 bytes per element; sum, avg, min, max.
- ``"int8"``: blockwise int8 with scales agreed by every rank, 1 + 4/1024 bytes per element;
  sum and avg; exact in the integer domain (the same bits under every strategy).

:mod:`p2pcoll.codecs.base` says what a codec is and when it is sound,
:mod:`p2pcoll.codecs.builtin` the precision of each. Third-party codecs are
:class:`Codec` subclasses registered under the entry-point group ``p2pcoll.codecs``.
"""

from .base import Codec, Context, NonFiniteInput, UnknownCodec, fold_op
from .builtin import BLOCK, BFloat16, Float16, Int8, bfloat16_bits, bfloat16_values
from .reduction import Reductions, reduce_coded
from .registry import ENTRY_POINT_GROUP, available_codecs, get_codec, register_codec

__all__ = [
    "BLOCK",
    "ENTRY_POINT_GROUP",
    "BFloat16",
    "Codec",
    "Context",
    "Float16",
    "Int8",
    "NonFiniteInput",
    "Reductions",
    "UnknownCodec",
    "available_codecs",
    "bfloat16_bits",
    "bfloat16_values",
    "fold_op",
    "get_codec",
    "reduce_coded",
    "register_codec",
]
