"""The errors p2pcoll.training raises on purpose, besides those of the group's collectives.

```
P2PCollError
├── CollectiveMismatch        the ranks are in different rounds or calls, or disagree about
│                             the tensors or settings (p2pcoll.errors)
├── ReplicaDivergence         the replicas' parameters differ (p2pcoll.errors)
├── NonFiniteGradients        also a FloatingPointError: a reduced gradient holds NaN or Inf
└── RoundError                also a RuntimeError: a GradientReducer round used out of turn
```

The two here derive from a builtin as well, so code written against the builtins
(``except FloatingPointError``) still catches them. Bad arguments raise ``ValueError`` /
``TypeError``, as everywhere in p2pcoll.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..errors import P2PCollError

__all__ = ["NonFiniteGradients", "RoundError"]


class NonFiniteGradients(P2PCollError, FloatingPointError):
    """Reduced gradients hold NaN or Inf (with ``nonfinite="raise"``).

    The reduced values are equal on every rank, so every rank raises it alike.

    Attributes:
        round: the round number.
        tensors: the names of the tensors that hold a NaN or an Inf, in bucket order.
    """

    def __init__(self, message: str, *, round: int, tensors: Iterable[str]) -> None:  # noqa: A002
        super().__init__(message)
        self.round = round
        self.tensors = list(tensors)


class RoundError(P2PCollError, RuntimeError):
    """A :class:`~p2pcoll.training.Round` used out of turn: a second round started while one
    is open, or a gradient added to a round that is over."""
