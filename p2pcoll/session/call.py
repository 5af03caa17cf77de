"""One call of the group API, its arguments checked (:class:`Call`), and the key of its
program: what the session's runner (:mod:`.calls`) runs, built by each public method of
:class:`~p2pcoll.Group`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

import numpy as np

from ..pytree import TreeDef
from ..strategy import Strategy
from ..types import CustomOp, ReduceOp
from ..errors import CollectiveMismatch

Spec = tuple[str, tuple[int, ...]]  # a leaf's dtype string and shape
# An array's dtype and shape, as a program's key holds them (in C: on every call's path;
# the dtype itself, whose hash numpy keeps, rather than its ``str``, built on each call).
_spec = attrgetter("dtype", "shape")


def describe_data(arrays: Sequence[np.ndarray], treedef: TreeDef = None) -> str:
    """A short string that equals on two ranks iff their data has the same layout."""
    text = f"{treedef}|" + ",".join(f"{a.dtype.str}{tuple(a.shape)}" for a in arrays)
    if len(text) > 200:
        digest = hashlib.blake2b(text.encode(), digest_size=8).hexdigest()
        return f"{len(arrays)} arrays, layout digest {digest}"
    return text


def describe_specs(specs: Sequence[tuple[np.dtype[Any], tuple[int, ...]]]) -> str:
    return ", ".join(f"{d}{list(s)}" for d, s in specs) or "nothing"


Learn = Callable[[TreeDef, list[tuple[np.dtype[Any], tuple[int, ...]]], str], None]
Learned = tuple[TreeDef, list[tuple[np.dtype[Any], tuple[int, ...]]], str]


@dataclass(slots=True, eq=False)
class Call:
    """One call of the group API, its arguments checked.

    Attributes:
        collective: one of p2pcoll.strategy.COLLECTIVES, or "send"/"recv".
        leaves: this rank's data, C-contiguous native arrays written in place (a
            receiver's are set by ``learn`` from the sender's layout).
        treedef: their pytree.
        op: a reduction's op.
        root: a rooted collective's root, a transfer's peer; None otherwise.
        strategy: the strategy asked for (None: the group's default or auto).
        timeout: seconds (None: the group's).
        tag: a transfer's tag (None: a collective).
        rows: reduce_scatter: elements per row, where chunks may be cut.
        counts: alltoall: the elements of every block, row by row (``counts[i * p + j]``
            rank i sends rank j), agreed by every rank; ``leaves`` are this rank's p parts
            to send, then the p buffers it receives into.
        learn: for a rank that learns the layout from the data's origin (a broadcast or
            scatter that is not the root, a receive): called with the origin's tree, leaf
            specs and strategy name; it checks them against what the caller passed and
            sets ``leaves`` and ``treedef``, or raises CollectiveMismatch.
        strategy_used: set by the run: the strategy (or "shm") it ran with.
        schedule: an engine's own strategy to run, never a registered one (the robust
            reductions' exchange, :mod:`p2pcoll.engine.robust`); None: ``strategy``'s.
        refused: set by the run: an alltoall on the board whose agreed lengths do not add
            up (the same on every rank, nothing moved); the caller raises it, the group
            stays usable.
    """

    collective: str
    leaves: list[np.ndarray]
    treedef: TreeDef = None
    op: ReduceOp | CustomOp | None = None
    root: int | None = None
    strategy: str | None = None
    timeout: float | None = None
    tag: int | None = None
    rows: int = 1
    learn: Learn | None = None
    strategy_used: str = ""
    flat: list[np.ndarray] = field(default_factory=list)
    schedule: Strategy | None = None
    counts: tuple[int, ...] = ()
    refused: CollectiveMismatch | None = None

    def key(self) -> tuple[Any, ...]:
        """What a prepared program depends on."""
        op = self.op
        # A built-in op's value read as the plain attribute it is (ReduceOp.value is a
        # chain of Python calls in enum); a CustomOp's is its name.
        value = "" if op is None else op._value_ if type(op) is ReduceOp else op.value
        return (self.collective, self.strategy, value, self.root, self.tag is None, self.rows,
                str(self.treedef), tuple(map(_spec, self.leaves)), self.counts)


__all__ = ["Call", "Learn", "Learned", "Spec", "describe_data", "describe_specs"]
