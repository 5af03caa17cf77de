"""Streaming DiLoCo's fragments: the parameters cut into nearly equal runs of whole rows."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .buckets import TensorSpec

__all__ = ["Piece", "split_fragments"]


@dataclass(frozen=True)
class Piece:
    """Rows ``start:stop`` of tensor ``index`` (all of a 0-d tensor), named for messages."""

    index: int
    start: int
    stop: int
    name: str

    def of(self, arrays: Sequence[np.ndarray]) -> np.ndarray:
        """The piece of its tensor in ``arrays``: a view (writes go to the tensor)."""
        array = arrays[self.index]
        return array[...] if array.ndim == 0 else array[self.start:self.stop]


def split_fragments(specs: Sequence[TensorSpec], names: Sequence[str], count: Any,
               inner_steps: int) -> list[list[Piece]]:
    """``count`` fragments of nearly equal size: the non-empty tensors in leaf order, laid end
    to end and cut into ``count`` runs, each row going to the fragment its first element
    falls in.

    Raises:
        ValueError: ``count`` is not an int in [1, H], or rows too large leave a fragment
            empty.
    """
    if (not isinstance(count, int) or isinstance(count, bool)
            or not 1 <= count <= inner_steps):
        raise ValueError(f"fragments must be an int in [1, inner_steps={inner_steps}], got "
                         f"{count!r}")
    tensors = [i for i, spec in enumerate(specs) if spec.size]
    total = sum(specs[i].size for i in tensors)
    fragments: list[list[Piece]] = [[] for _ in range(count)]
    done = 0  # elements laid down before this tensor
    for i in tensors:
        spec, name = specs[i], names[i]
        if not spec.shape:
            fragments[done * count // total].append(Piece(i, 0, 0, name))
            done += 1
            continue
        rows = spec.shape[0]
        owner = (done + np.arange(rows, dtype=np.int64) * (spec.size // rows)) * count // total
        bounds = [0, *(np.flatnonzero(np.diff(owner)) + 1).tolist(), rows]
        for a, b in itertools.pairwise(bounds):
            fragments[int(owner[a])].append(
                Piece(i, a, b, name if (a, b) == (0, rows) else f"{name}[{a}:{b}]"))
        done += spec.size
    empty = [f for f, pieces in enumerate(fragments) if not pieces]
    if empty:
        raise ValueError(f"fragments={count} leaves fragment {empty[0]} empty: a row of a "
                         f"tensor holds more than 1/{count} of the parameters; use fewer "
                         f"fragments")
    return fragments
