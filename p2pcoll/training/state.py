"""What p2pcoll.training remembers about a group between calls, and the one place it is kept.

Round numbers are counted per group, not per caller: :func:`~p2pcoll.training.
allreduce_gradients` and every :class:`~p2pcoll.training.GradientReducer` of a group draw
from one sequence (0, 1, 2, ...), so a rank that skipped or repeated a round, by either path,
is caught at its next one. Alongside it, ``allreduce_gradients`` keeps its bucket buffers for
the next call: fresh memory costs a page fault per 4 KiB on first touch, which made packing
100 MB five times slower.

Everything else lives in objects the caller holds (a GradientReducer keeps its own buffers).
The state is kept with the group itself (:meth:`Group.extension`), so it goes with it and
no module holds any.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .. import Group

__all__ = ["TrainingState", "state_of"]


@dataclass
class TrainingState:
    """Training's state for one group.

    Attributes:
        next_round: the number the next round takes unless it is given one.
        scratch: bucket buffers that ``allreduce_gradients`` fills again in its next call;
            a buffer is free once the group has copied it, when the bucket's allreduce starts.
    """

    next_round: int = 0
    scratch: list[np.ndarray] = field(default_factory=list)

    def take_round(self, explicit: int | None = None) -> int:
        """The number of the round that starts now; the one after it becomes the next.

        Raises:
            ValueError: ``explicit`` is not an int >= 0.
        """
        if explicit is not None and (not isinstance(explicit, int) or explicit < 0):
            raise ValueError(f"round must be an int >= 0, got {explicit!r}")
        number = self.next_round if explicit is None else explicit
        self.next_round = number + 1
        return number

    def take_scratch(self) -> list[np.ndarray]:
        """The kept buffers, now the caller's until it hands them back in ``scratch``."""
        buffers, self.scratch = self.scratch, []
        return buffers


def state_of(group: Group) -> TrainingState:
    """The training state of ``group``, created empty on first use."""
    return group.extension("p2pcoll.training", TrainingState)
