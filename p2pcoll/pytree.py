"""Pytrees: nested dicts, lists and tuples of arrays, and the one order their leaves come in.

A pytree is a leaf, or a dict, list or tuple of pytrees. A leaf is a numpy array, a CPU torch
tensor or a number; None is not a leaf. Dict keys must be str. Every part of p2pcoll that walks
a pytree (the group's collectives, :mod:`p2pcoll.training`) visits the leaves in the same
order, the *leaf order*:

- a dict's items in sorted key order, at each level: two ranks that built the same dict in
  different insertion orders agree on it;
- a list's or tuple's items by position.

:func:`flatten` splits a tree into its leaves, as arrays in leaf order, and a *treedef*: the
structure as plain nested lists and strings, which msgpack carries in a broadcast's header and
which compares equal on every rank whose tree has the same structure::

    a leaf       "*"
    a dict       ["d", [[key, treedef], ...]]       keys sorted
    a list       ["l", [treedef, ...]]
    a tuple      ["t", [treedef, ...]]              a namedtuple comes back as a plain tuple

:func:`named_leaves` gives the same leaves in the same order, each with a path: the dict keys
and list or tuple positions (decimal, from 0) that lead to it, joined by dots. These are the
names ``torch.nn.Module.named_parameters()`` gives::

    {"fc": {"w": a, "b": b}, "blocks": [c, (d,)]}
    -> [("blocks.0", c), ("blocks.1.0", d), ("fc.b", b), ("fc.w", a)]

A bare leaf's path is ``""``. The order is by key at each level and by position, not by the
joined path: ``{"a": {"x": p}, "a-b": q}`` gives ``"a.x"`` before ``"a-b"``, and a list of
eleven leaves gives ``"10"`` after ``"9"``.

Leaves become arrays through :mod:`p2pcoll.tensors` (a torch tensor: an array over its own
memory). This module never imports torch: a tensor can only exist once its program has
imported torch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

from .tensors import as_array as _as_array
from .tensors import is_tensor
from .tensors import like as like

__all__ = [
    "Pytree",
    "TreeDef",
    "as_array",
    "flatten",
    "flatten_with",
    "is_torch_tensor",
    "like",
    "listed_paths",
    "named_leaves",
    "replace_leaves",
    "unflatten",
]

Pytree = Any  # a leaf, or a dict / list / tuple of pytrees
TreeDef = Any  # "*" or [kind, children], as drawn in the module docstring

LEAF = "*"


# --- leaves -------------------------------------------------------------------------------

L = TypeVar("L")


def is_torch_tensor(obj: Any) -> bool:
    """Whether ``obj`` is a torch tensor (without importing torch)."""
    return is_tensor(obj)


def as_array(leaf: Any, path: str = "") -> np.ndarray:
    """A leaf as an ndarray: itself, a CPU torch tensor's own memory, or a new array of a
    number (:func:`p2pcoll.tensors.as_array`, where bfloat16 is a TypeError: numpy has no
    bfloat16; the group's collectives take such tensors as they are).

    Args:
        leaf: the leaf.
        path: its path, for error messages.

    Raises:
        TypeError: a tensor not on the CPU or of a dtype numpy has not, None, or a leaf
            that is not numeric.
    """
    return _as_array(leaf, path)


# --- the walk -----------------------------------------------------------------------------


def flatten(tree: Pytree) -> tuple[list[np.ndarray], TreeDef]:
    """Split a pytree into its leaves, as arrays in leaf order, and its treedef.

    Raises:
        TypeError: a dict key that is not a str, or a leaf that :func:`as_array` refuses.
    """
    return flatten_with(tree, as_array)


def flatten_with(tree: Pytree, convert: Callable[[Any, str], L]) -> tuple[list[L], TreeDef]:
    """:func:`flatten` with each leaf turned into ``convert(leaf, path)`` (which may raise)."""
    leaves: list[L] = []

    def walk(node: Any, path: str) -> TreeDef:
        if isinstance(node, Mapping):
            return ["d", [[key, walk(node[key], _join(path, key))]
                          for key in _sorted_keys(node, path)]]
        if isinstance(node, (list, tuple)):
            return ["l" if isinstance(node, list) else "t",
                    [walk(child, _join(path, i)) for i, child in enumerate(node)]]
        leaves.append(convert(node, path))
        return LEAF

    treedef = walk(tree, "")
    return leaves, treedef


def unflatten(treedef: TreeDef, leaves: Sequence[Any]) -> Pytree:
    """Inverse of :func:`flatten`: the structure ``treedef`` holding ``leaves`` in leaf order.

    Raises:
        ValueError: ``treedef`` is malformed, or has room for more or fewer leaves.
    """
    if treedef == LEAF and len(leaves) == 1:  # one array: every collective's common case
        return leaves[0]
    it = iter(leaves)

    def build(td: TreeDef) -> Any:
        if td == LEAF:
            return next(it)
        try:
            kind, children = td
        except (TypeError, ValueError):
            raise ValueError(f"malformed pytree treedef {td!r}") from None
        if kind == "d":
            return {key: build(child) for key, child in children}
        if kind in ("l", "t"):
            items = [build(child) for child in children]
            return items if kind == "l" else tuple(items)
        raise ValueError(f"malformed pytree treedef: unknown kind {kind!r}")

    try:
        tree = build(treedef)
    except StopIteration:
        raise ValueError(f"the treedef has more leaves than the {len(leaves)} given") from None
    if next(it, _END) is not _END:
        raise ValueError(f"the treedef has fewer leaves than the {len(leaves)} given")
    return tree


def named_leaves(tree: Pytree) -> list[tuple[str, Any]]:
    """The leaves of a pytree, in leaf order, each with its path.

    ``{"fc": {"w": a, "b": b}, "blocks": [c]}`` gives
    ``[("blocks.0", c), ("fc.b", b), ("fc.w", a)]``; a bare leaf is named ``""``.
    The leaves are returned as they are (arrays, tensors, numbers), not converted.

    Raises:
        TypeError: a dict key is not a str, or a leaf is None.
        ValueError: two leaves get the same path (``{"a": {"b": x}, "a.b": y}``).
    """
    named = _walk(tree, sort_keys=True)
    seen: set[str] = set()
    for path, _ in named:
        if path in seen:
            raise ValueError(f"two leaves of the pytree are both named {path!r}")
        seen.add(path)
    return named


def listed_paths(tree: Pytree) -> list[str]:
    """The leaves' paths in the order the tree lists them: dicts in insertion order.

    This is not the leaf order. It is for callers to whom insertion order means something,
    such as a model whose parameters are listed from input to output (the order a backward
    pass reverses); never match leaves between ranks by it.

    Raises:
        TypeError: a dict key is not a str, or a leaf is None.
    """
    return [path for path, _ in _walk(tree, sort_keys=False)]


def replace_leaves(tree: Pytree, leaves: Sequence[Any]) -> Pytree:
    """A copy of ``tree``'s containers holding ``leaves``, given in leaf order.

    ``replace_leaves(tree, [f(x) for _, x in named_leaves(tree)])`` maps ``f`` over the tree.
    Dicts come back as dicts with ``tree``'s key order, lists as lists, tuples as tuples.

    Raises:
        ValueError: the number of leaves is not the tree's.
        TypeError: a dict key is not a str.
    """
    it = iter(leaves)

    def build(node: Any, path: str) -> Any:
        if isinstance(node, Mapping):
            built = {key: build(node[key], _join(path, key)) for key in _sorted_keys(node, path)}
            return {key: built[key] for key in node}
        if isinstance(node, (list, tuple)):
            items = [build(child, _join(path, i)) for i, child in enumerate(node)]
            return items if isinstance(node, list) else tuple(items)
        return next(it)

    try:
        out = build(tree, "")
    except StopIteration:
        raise ValueError(f"the tree has more leaves than the {len(leaves)} given") from None
    if next(it, _END) is not _END:
        raise ValueError(f"the tree has fewer leaves than the {len(leaves)} given")
    return out


# --- helpers ------------------------------------------------------------------------------

_END = object()


def _walk(tree: Pytree, *, sort_keys: bool) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    keys: Callable[[Mapping[Any, Any], str], list[str]] = (
        _sorted_keys if sort_keys else _listed_keys)

    def walk(node: Any, path: str) -> None:
        if isinstance(node, Mapping):
            for key in keys(node, path):
                walk(node[key], _join(path, key))
        elif isinstance(node, (list, tuple)):
            for i, child in enumerate(node):
                walk(child, _join(path, i))
        elif node is None:
            raise TypeError(f"pytree leaf {_where(path)} is None; leaves must be arrays")
        else:
            out.append((path, node))

    walk(tree, "")
    return out


def _listed_keys(node: Mapping[Any, Any], path: str) -> list[str]:
    keys = list(node)
    for key in keys:
        if not isinstance(key, str):
            where = f" in {path!r}" if path else ""
            raise TypeError(f"pytree dict keys must be str, got {key!r}{where}")
    return keys


def _sorted_keys(node: Mapping[Any, Any], path: str) -> list[str]:
    return sorted(_listed_keys(node, path))  # checked first: sorting 1 and "a" would fail


def _join(path: str, key: str | int) -> str:
    return f"{path}.{key}" if path else str(key)


def _where(path: str) -> str:
    return repr(path) if path else "at the root"
