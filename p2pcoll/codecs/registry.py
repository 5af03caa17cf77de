"""Finds codecs: the built-ins, then entry points of the group ``p2pcoll.codecs``, each
validated where it loads, through the one entry-point table strategies use too
(:mod:`p2pcoll.plugin_table`).

The built-ins ("fp16", "bf16", "int8") are registered first, by the same validation as any
plugin, so a plugin cannot displace one; p2pcoll's own entry points for them (when the
package declares them) name the same classes and are no clash. A third-party entry point
names a :class:`~p2pcoll.codecs.Codec` subclass (``int4 = "mypkg.codecs:Int4"``); one that
fails to import or to validate is recorded with its problem, logged once as a WARNING on
the ``p2pcoll.codecs`` logger, and asking for it by name raises
:class:`~p2pcoll.PluginValidationError` naming the plugin, its distribution and the
problem. Loading is all or nothing: the table is swapped in once complete.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from importlib.metadata import EntryPoint, entry_points
from typing import Any

import numpy as np

from ..errors import PluginValidationError
from ..plugin_table import PluginTable, named_class
from ..types import CustomOp, ReduceOp, check_dtype
from .base import Codec, UnknownCodec
from .builtin import BFloat16, Float16, Int8

__all__ = ["ENTRY_POINT_GROUP", "available_codecs", "get_codec", "register_codec", "validate"]

log = logging.getLogger("p2pcoll.codecs")

ENTRY_POINT_GROUP = "p2pcoll.codecs"
BUILTINS: tuple[type[Codec], ...] = (Float16, BFloat16, Int8)


def validate(obj: object, where: str) -> Codec:
    """An instance of ``obj`` if it is a usable Codec class, else PluginValidationError
    naming ``where``.

    Checked: a Codec subclass with every method; a name; a wire dtype that can be
    communicated; a positive ``wire_bytes``; a non-empty set of ops; and, on sample data,
    that each op's fold is commutative bit for bit (a fold that is not would give the two
    ranks of a recursive-doubling exchange different bits).
    """
    cls: type[Codec] = named_class(obj, Codec, "p2pcoll.codecs.Codec", "int8", where)
    try:
        check_dtype(np.dtype(getattr(cls, "wire_dtype", None)))
    except TypeError as exc:
        raise PluginValidationError(f"{where}: {cls.__name__}.wire_dtype: {exc}") from None
    wire_bytes = getattr(cls, "wire_bytes", None)
    if not isinstance(wire_bytes, (int, float)) or isinstance(wire_bytes, bool) or not (
            wire_bytes > 0):
        raise PluginValidationError(f"{where}: {cls.__name__}.wire_bytes must be a positive "
                                    f"number of bytes per element, got {wire_bytes!r}")
    ops = getattr(cls, "ops", None)
    if not isinstance(ops, frozenset) or not ops or not all(isinstance(o, ReduceOp)
                                                            for o in ops):
        raise PluginValidationError(f"{where}: {cls.__name__}.ops must be a non-empty "
                                    f"frozenset of p2pcoll.ReduceOp, got {ops!r}")
    try:
        codec = cls()
    except Exception as exc:
        raise PluginValidationError(f"{where}: {cls.__name__}() raised "
                                    f"{type(exc).__name__}: {exc}") from exc
    for op in sorted(ops, key=lambda o: o.value):
        _check_commutative(codec, op, where)
    return codec


def _check_commutative(codec: Codec, op: ReduceOp, where: str) -> None:
    fold = codec.fold(op)
    if not isinstance(fold, (CustomOp, ReduceOp)):
        raise PluginValidationError(f"{where}: {type(codec).__name__}.fold({op.value!r}) "
                                    f"must return a CustomOp or a ReduceOp, got {fold!r}")
    if isinstance(fold, ReduceOp):
        return  # the built-in ufuncs are commutative
    rng = np.random.default_rng(0)
    kind = codec.wire_dtype.kind
    sample = (rng.standard_normal((2, 64)) * 3 if kind in "fc"  # small numbers of its kind
              else rng.integers(0 if kind in "ub" else -3, 2 if kind == "b" else 4, (2, 64)))
    a, b = sample.astype(codec.wire_dtype)
    ab, ba = a.copy(), b.copy()
    try:
        fold.fold(ab, b)
        fold.fold(ba, a)
    except Exception as exc:
        raise PluginValidationError(f"{where}: {type(codec).__name__}'s fold for "
                                    f"{op.value!r} raised {type(exc).__name__}: {exc}") from exc
    if ab.tobytes() != ba.tobytes():
        raise PluginValidationError(
            f"{where}: {type(codec).__name__}'s fold for {op.value!r} is not commutative "
            f"(fold(a, b) and fold(b, a) differ): ranks that combine the same two parts in "
            f"the two orders, as recursive doubling does, would get different bits")


class CodecRegistry:
    """Every codec known to this process, by name; loaded on first use."""

    def __init__(self) -> None:
        self._table: PluginTable[str, Codec] = PluginTable(
            kind="codec", scan=lambda: entry_points(group=ENTRY_POINT_GROUP),
            check=validate, key=lambda codec: codec.name, intended=_intended,
            key_of=lambda _, name: name, builtins=_builtins, log=log)

    def get(self, name: Any) -> Codec:
        """The codec called ``name``.

        Raises:
            TypeError: ``name`` is not a string.
            PluginValidationError: the plugin that provides it is installed but broken.
            UnknownCodec: no codec of that name; the message lists the installed ones.
        """
        if not isinstance(name, str):
            raise TypeError(f"codec must be a codec's name ({self._names()}) or None, got "
                            f"{name!r}")
        found = self._table.entries().get(name)
        if found is not None:
            return found.value
        plugin = self._table.broken_for(name)
        if plugin is not None:
            raise PluginValidationError(f"codec {name!r} cannot be used: {plugin}"
                                        ) from plugin.error
        raise UnknownCodec(f"no codec named {name!r}; installed: {self._names()}")

    def available(self) -> dict[str, float]:
        """``{name: bytes on the wire per element}`` of every usable codec."""
        return {name: e.value.wire_bytes for name, e in sorted(self._table.entries().items())}

    def broken(self) -> dict[str, str]:
        """``{entry point: problem}`` of the codec plugins that failed to load."""
        return {plugin.entry_point: str(plugin) for plugin in self._table.broken()}

    def register(self, cls: type[Codec], origin: str) -> None:
        """Add a codec class. Raises PluginValidationError on a bad class or a name clash."""
        self._table.add(cls, origin)

    def _names(self) -> str:
        return ", ".join(repr(n) for n in sorted(self._table.entries()))


def _builtins() -> Iterator[tuple[object, str]]:
    for cls in BUILTINS:
        yield cls, "p2pcoll (built-in)"


def _intended(ep: EntryPoint, obj: object) -> tuple[str | None, str | None]:
    """(None, the name) a codec entry point was meant to provide: the loaded class's name
    when it has a usable one, else the entry point's name."""
    name = getattr(obj, "name", None)
    return None, name if isinstance(name, str) and name else ep.name


registry = CodecRegistry()


def get_codec(name: str) -> Codec:
    """The installed codec called ``name`` (``"fp16"``, ``"bf16"``, ``"int8"``, or a
    plugin's). Raises TypeError, UnknownCodec (a ValueError) or PluginValidationError."""
    return registry.get(name)


def available_codecs() -> dict[str, float]:
    """``{name: bytes on the wire per element}`` of every installed codec."""
    return registry.available()


def register_codec(cls: type[Codec]) -> type[Codec]:
    """Register a codec class in this process (usable as a class decorator).

    Raises:
        PluginValidationError: the class is not a usable codec, or its name is taken.
    """
    registry.register(cls, f"{cls.__module__}.{cls.__qualname__} (runtime)")
    return cls
