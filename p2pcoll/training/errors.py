"""The errors p2pcoll.training raises on purpose, besides those of the group's collectives.

```
P2PCollError
├── CollectiveMismatch        the ranks are in different rounds or calls, or disagree about
│                             the tensors or settings (p2pcoll.errors)
├── ReplicaDivergence         the replicas' parameters differ (p2pcoll.errors)
├── NonFiniteGradients        also a FloatingPointError: a reduced gradient holds NaN or Inf
├── RoundError                also a RuntimeError: a GradientReducer round used out of turn
├── HealFailed                no source gave a range of the state intact (.heal)
└── RendezvousError           join() could not form the group (p2pcoll.errors)
    └── WorldTooSmall         train_elastic found fewer peers than its minimum
```

NonFiniteGradients and RoundError derive from a builtin as well, so code written against
the builtins (``except FloatingPointError``) still catches them; WorldTooSmall is a
RendezvousError, the error of a group that did not form. Bad arguments raise ``ValueError`` /
``TypeError``, as everywhere in p2pcoll.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..errors import P2PCollError, RendezvousError

__all__ = ["NonFiniteGradients", "RoundError", "WorldTooSmall"]


class NonFiniteGradients(P2PCollError, FloatingPointError):
    """Reduced gradients hold NaN or Inf (with ``nonfinite="raise"``).

    The reduced values are equal on every rank, so every rank raises it alike.

    Attributes:
        round: the round number.
        tensors: the names of the tensors that hold a NaN or an Inf, in bucket order.
    """

    def __init__(self, message: str, *, round: int, tensors: Iterable[str]) -> None:
        super().__init__(message)
        self.round = round
        self.tensors = list(tensors)


class RoundError(P2PCollError, RuntimeError):
    """A :class:`~p2pcoll.training.Round` used out of turn: a second round started while one
    is open, or a gradient added to a round that is over."""


class WorldTooSmall(RendezvousError):
    """:func:`~p2pcoll.training.train_elastic` found fewer peers than ``min_world_size``
    at the rendezvous within the join timeout, so the job stops.

    Attributes:
        minimum: the ``min_world_size``.
        found: the most peers (this one included) seen waiting at the rendezvous at once
            while this one waited, or None if it never answered.
        round: the round this peer had reached.
    """

    def __init__(
        self, message: str, *, minimum: int, found: int | None, round: int,
    ) -> None:
        super().__init__(message)
        self.minimum = minimum
        self.found = found
        self.round = round
