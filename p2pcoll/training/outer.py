"""DiLoCo's outer optimizer and the parameters the low-communication modes train in place."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..pytree import Pytree
from .modes import float_tensors

__all__ = ["Model", "OuterSGD"]


@dataclass(frozen=True)
class OuterSGD:
    """The outer optimizer: SGD with (Nesterov) momentum on the averaged pseudo-gradient.

    Attributes:
        lr: the outer learning rate (> 0; DiLoCo's paper: 0.7).
        momentum: in [0, 1) (the paper: 0.9); 0 is plain SGD.
        nesterov: Nesterov momentum (the paper's), else heavy ball.

    Raises:
        ValueError: an ``lr`` that is not a finite number > 0, a momentum outside [0, 1).
    """

    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True

    def __post_init__(self) -> None:
        if (not isinstance(self.lr, (int, float)) or isinstance(self.lr, bool)
                or not math.isfinite(self.lr) or self.lr <= 0):
            raise ValueError(f"outer_lr must be a finite number > 0, got {self.lr!r}")
        if (not isinstance(self.momentum, (int, float)) or isinstance(self.momentum, bool)
                or not 0 <= self.momentum < 1):
            raise ValueError(f"outer_momentum must be a number in [0, 1), got "
                             f"{self.momentum!r}")

    def apply(self, params: Sequence[np.ndarray], velocity: Sequence[np.ndarray],
              delta: Sequence[np.ndarray]) -> None:
        """One step, in place on ``params`` and ``velocity``: element-wise numpy in a fixed
        order, so equal inputs give equal bits on every rank."""
        for p, v, d in zip(params, velocity, delta, strict=True):
            lr, mu = p.dtype.type(self.lr), p.dtype.type(self.momentum)
            if self.momentum == 0:
                step = lr * d
            else:
                v *= mu
                v += d
                if self.nesterov:  # lr * (d + mu * v), in one temporary
                    step = np.multiply(v, mu)
                    step += d
                    step *= lr
                else:
                    step = lr * v
            p -= step

    def stepped(self, params: Sequence[np.ndarray], velocity: Sequence[np.ndarray],
                delta: Sequence[np.ndarray]) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """One step on copies of ``params`` and ``velocity`` (the same bits as :meth:`apply`
        in place); the originals are only read, so it may run in a thread meanwhile."""
        params, velocity = [p.copy() for p in params], [v.copy() for v in velocity]
        self.apply(params, velocity, delta)
        return params, velocity

    def settings(self) -> dict[str, Any]:
        return {"outer_lr": float(self.lr), "outer_momentum": float(self.momentum),
                "nesterov": bool(self.nesterov)}


class Model:
    """The caller's parameters: names, specs, and writable arrays (views of tensors)."""

    def __init__(self, params: Pytree, what: str) -> None:
        self.tree = params
        self.names, self.arrays, self.specs = float_tensors(params, what)
        if not self.specs:
            raise ValueError(f"{what} needs at least one parameter")
        for name, array in zip(self.names, self.arrays, strict=True):
            if not array.flags.writeable:
                raise ValueError(f"{what}: parameter {name!r} is read-only; the exchanges "
                                 f"write into it")

    def reread(self, params: Pytree | None, what: str) -> None:
        """Take the arrays of ``params`` (the same tensors, maybe new arrays) if given.

        Raises:
            ValueError: other names, shapes or dtypes than at the start.
        """
        if params is None:
            return
        _, arrays, specs = float_tensors(params, what)
        if specs != self.specs:
            raise ValueError(f"{what}: the parameters changed (names, shapes or dtypes) since "
                             f"it was made")
        self.tree, self.arrays = params, arrays

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.specs)
