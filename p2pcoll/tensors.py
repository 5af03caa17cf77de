"""numpy arrays and CPU torch tensors as the arrays p2pcoll moves, and the one bfloat16 rule.

Every front end (:class:`p2pcoll.Group` and so :mod:`p2pcoll.blocking`, the torch backend,
the Ray backend) turns its caller's values into arrays here:

- a numpy array is itself;
- a CPU torch tensor is a numpy array over the tensor's own memory (any strides), read
  through ``__array_interface__`` rather than ``Tensor.numpy()``, which would mark the
  tensor's storage non-resizable for ever (Gloo does not: DDP's bucket buffers are resized
  by torch's batched PowerSGD hook, and FSDP-style code frees storages with ``resize_(0)``
  after a collective);
- a number is a new 0-d array.

**bfloat16.** numpy has no bfloat16, so a bfloat16 tensor moves as its int16 bits
(:func:`as_array` with ``bits=True``; without, it is a TypeError rather than numbers that
are not the tensor's values). Reductions of bfloat16 are exact on the bfloat16 bits, as
Gloo's bfloat16 arithmetic and torch's own ops are: each step of a reduction widens both
operands to float32 (exactly), combines them and rounds the result to bfloat16 (to nearest,
ties to even; every NaN to 0x7FC0, as ``c10::BFloat16``). The ops are :data:`BFLOAT16`,
:class:`~p2pcoll.CustomOp` s on the int16 bits, chosen by :func:`reduction`; ``avg`` is their
sum, then a division by the world size in torch (:func:`divide`). A sum rounded at every
step depends on the order of its terms, so the same strategy gives the same bits through
every front end. This module never imports torch: a tensor exists only once its program
has imported torch.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .types import CustomOp, ReduceOp, as_op

__all__ = [
    "BFLOAT16",
    "Reduction",
    "as_array",
    "divide",
    "is_bfloat16",
    "is_tensor",
    "like",
    "narrow",
    "reduction",
    "result",
    "shares",
    "widen",
    "writable",
]


# --- telling leaves apart -----------------------------------------------------------------


def is_tensor(obj: Any) -> bool:
    """Whether ``obj`` is a torch tensor (without importing torch)."""
    if type(obj) is np.ndarray:  # the common case, without torch's slower isinstance
        return False
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def is_bfloat16(obj: Any) -> bool:
    """Whether ``obj`` is a bfloat16 torch tensor."""
    return is_tensor(obj) and obj.dtype is sys.modules["torch"].bfloat16


# --- tensors and arrays -------------------------------------------------------------------


def as_array(leaf: Any, path: str = "", *, bits: bool = False) -> np.ndarray:
    """``leaf`` as an ndarray: itself, a CPU tensor's own memory, or a new array of a number.

    Args:
        leaf: a numpy array, a CPU torch tensor (any strides) or a number.
        path: where the leaf is in its pytree, for error messages.
        bits: a bfloat16 tensor as its int16 bits (what moves over the wire) rather than
            a TypeError.

    Raises:
        TypeError: None; a tensor not on the CPU, not dense, of a dtype numpy cannot hold
            (bfloat16 unless ``bits``); a leaf that is not numeric.
    """
    if isinstance(leaf, np.ndarray):
        return leaf
    if leaf is None:
        raise TypeError(f"pytree leaf {_where(path)} is None; leaves must be arrays")
    if is_tensor(leaf):
        return _tensor_memory(leaf, path, bits)
    arr = np.asarray(leaf)
    if arr.dtype == object:
        raise TypeError(
            f"pytree leaf {_where(path)} of type {type(leaf).__name__} is not a numeric array")
    return arr


class _Exported:
    """A tensor's memory for ``np.asarray``, which keeps this (so the tensor) alive."""

    __slots__ = ("__array_interface__", "tensor")

    def __init__(self, t: Any, dtype: np.dtype[Any]) -> None:
        self.tensor = t
        self.__array_interface__ = {
            "data": (t.data_ptr(), False), "shape": tuple(t.shape), "typestr": dtype.str,
            "strides": tuple(s * dtype.itemsize for s in t.stride()), "version": 3}


_NUMPY: dict[Any, np.dtype[Any] | None] = {}  # torch dtype -> numpy's (None: numpy has none)


def _numpy_dtype(dtype: Any) -> np.dtype[Any] | None:
    if dtype not in _NUMPY:
        torch = sys.modules["torch"]
        try:
            _NUMPY[dtype] = torch.empty(0, dtype=dtype).numpy().dtype
        except TypeError:
            _NUMPY[dtype] = None
    return _NUMPY[dtype]


def _tensor_memory(t: Any, path: str, bits: bool) -> np.ndarray:
    torch = sys.modules["torch"]
    if t.device.type != "cpu":
        raise TypeError(f"tensor {_where(path)} is on {t.device}; move it to the CPU first")
    if t.layout is not torch.strided:
        raise TypeError(f"tensor {_where(path)} has layout {t.layout}; p2pcoll moves dense "
                        f"tensors (call .to_dense() first)")
    t = t.detach()
    lazy = t.is_conj() or t.is_neg()
    if lazy:  # a lazy conjugate or negation: its values are a copy's
        t = t.resolve_conj().resolve_neg()
    if t.dtype is torch.bfloat16:
        if not bits:
            raise TypeError(
                f"tensor {_where(path)} is bfloat16, which numpy has no dtype for; p2pcoll's "
                f"collectives take it as it is, elsewhere convert it (.float())")
        t = t.view(torch.int16)
    dtype = _numpy_dtype(t.dtype)
    if dtype is None:
        raise TypeError(f"tensor {_where(path)} has dtype {t.dtype}, which numpy cannot hold")
    array: np.ndarray = np.asarray(_Exported(t, dtype))
    if lazy:  # results written here would not reach the tensor: refuse them
        array.flags.writeable = False
    return array


def shares(given: Any, array: np.ndarray) -> bool:
    """Whether ``array`` is the memory of the array or tensor ``given``, laid out the same way
    (so results written to ``array`` are in ``given``)."""
    mine = as_array(given, bits=True) if is_tensor(given) else given
    if not isinstance(mine, np.ndarray) or mine.shape != array.shape:
        return False
    return (mine.size == 0 or (mine.__array_interface__["data"][0]
                               == array.__array_interface__["data"][0]
                               and mine.strides == array.strides
                               and mine.dtype.itemsize == array.dtype.itemsize))


def like(template: Any, array: np.ndarray) -> Any:
    """``array`` as a torch tensor sharing its memory if ``template`` is a tensor (a bfloat16
    one: ``array`` holds its int16 bits), else ``array`` itself."""
    if not is_tensor(template):
        return array
    t = sys.modules["torch"].from_numpy(array)
    return t.view(template.dtype) if is_bfloat16(template) and array.dtype == np.int16 else t


def result(given: Any, array: np.ndarray) -> Any:
    """A collective's result for the leaf ``given``: ``given`` itself when ``array`` is its
    memory, else ``array`` in ``given``'s kind (:func:`like`)."""
    if given is array or (is_tensor(given) and shares(given, array)):
        return given
    return like(given, array)


def writable(array: np.ndarray) -> np.ndarray:
    """``array``'s memory as a writable array, even when numpy's flag says read-only.

    For memory that is writable but handed out read-only, as Ray's object store hands out
    arrays: Ray's GLOO backend writes results into them (through ``torch.from_numpy``), and
    so does p2pcoll's Ray backend. Never use it on memory that is read-only in fact (a
    ``bytes`` object, a read-only mmap).
    """
    if array.flags.writeable:
        return array
    exported = _Raw(array)
    out: np.ndarray = np.asarray(exported)
    return out


class _Raw:
    """``array``'s memory through ``__array_interface__``, which numpy reads as writable."""

    __slots__ = ("__array_interface__", "array")

    def __init__(self, array: np.ndarray) -> None:
        self.array = array
        self.__array_interface__ = {**array.__array_interface__,
                                    "data": (array.__array_interface__["data"][0], False)}


# --- the bfloat16 rule ----------------------------------------------------------------------


def widen(bits: np.ndarray) -> np.ndarray:
    """bfloat16 values given as int16 bits, as float32 (exactly)."""
    return (bits.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def narrow(values: np.ndarray) -> np.ndarray:
    """float32 values rounded to bfloat16 as torch rounds them (to nearest, ties to even;
    every NaN to the quiet NaN 0x7FC0, as c10::BFloat16 does), as int16 bits."""
    u = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    out = ((u + (((u >> 16) & 1) + 0x7FFF)) >> 16).astype(np.uint16)
    out[np.isnan(values)] = 0x7FC0
    return out.view(np.int16)


def _bfloat16(name: str, ufunc: np.ufunc) -> CustomOp:
    def fold(mine: np.ndarray, incoming: np.ndarray) -> None:
        combined = widen(mine)
        ufunc(combined, widen(incoming), out=combined)
        mine[...] = narrow(combined)

    return CustomOp(f"bfloat16-{name}", fold)


BFLOAT16 = {name: _bfloat16(name, ufunc) for name, ufunc in
            (("sum", np.add), ("prod", np.multiply), ("min", np.minimum),
             ("max", np.maximum))}
"""The reduction of each built-in op (avg: see :func:`reduction`) on bfloat16's int16 bits."""


@dataclass(frozen=True)
class Reduction:
    """The op to run over the arrays of some leaves, and whether to divide the results by
    the world size afterwards (:func:`divide`: a bfloat16 ``avg``, whose bits p2pcoll
    cannot divide)."""

    op: ReduceOp | CustomOp
    average: bool = False


def reduction(op: str | ReduceOp | CustomOp, leaves: Sequence[Any]) -> Reduction:
    """How to reduce ``leaves`` (arrays or tensors, as given) with ``op``.

    Raises:
        ValueError: an unknown op.
        TypeError: bfloat16 tensors with leaves of other dtypes (reduce them in separate
            calls), or with a CustomOp (which would see their int16 bits).
    """
    red = as_op(op)
    half = [is_bfloat16(leaf) for leaf in leaves]
    if not any(half):
        return Reduction(red)
    if not all(half):
        raise TypeError("bfloat16 tensors cannot be reduced together with leaves of other "
                        "dtypes in one call: reduce them in separate calls")
    if isinstance(red, CustomOp):
        if red in BFLOAT16.values():
            return Reduction(red)
        raise TypeError(f"the CustomOp {red.name!r} cannot reduce bfloat16 tensors: it would "
                        f"see their int16 bits")
    if red is ReduceOp.AVG:
        return Reduction(BFLOAT16["sum"], average=True)
    return Reduction(BFLOAT16[red.value])


def divide(bits: np.ndarray, n: int) -> None:
    """Divide bfloat16 values, given as their int16 bits, by ``n`` in place, as torch's
    bfloat16 division rounds (the torch backend's AVG divides the same way)."""
    torch = sys.modules["torch"]
    with torch.no_grad():
        torch.from_numpy(bits).view(torch.bfloat16).div_(n)


def _where(path: str) -> str:
    return repr(path) if path else "at the root"
