"""What :func:`~p2pcoll.training.train_elastic` did on a rank: the groups it trained in."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..pytree import Pytree

__all__ = ["ElasticResult", "Formation"]


@dataclass
class Formation:
    """One group this rank trained in, from its formation to its close.

    Attributes:
        rank, world_size: this rank's place in the group, and its size.
        round: the round the group started from (the source's counter).
        source: the rank whose state every member took.
        applied: the rounds this rank applied in this group, in order.
        ended: why the group ended: ``"finished"``, ``"admitting"`` (peers were waiting),
            or the failure (``"PeerLost: ..."``).
        shrunk: whether the group was formed by the survivors of a loss among themselves
            (:mod:`.shrinking`), not through the rendezvous.
    """

    rank: int
    world_size: int
    round: int
    source: int
    applied: list[int] = field(default_factory=list)
    ended: str = ""
    shrunk: bool = False

    @property
    def received(self) -> bool:
        """Whether this rank took another rank's state at the formation."""
        return self.rank != self.source


@dataclass
class ElasticResult:
    """What :func:`train_elastic` did on this rank.

    Attributes:
        state: the trained state (the caller's own pytree, updated in place).
        formations: the groups this rank trained in, in order. Groups that broke before
            their state was in sync are not listed.
        redone: how many rounds this rank computed a second time, after a failure lost them.
    """

    state: Pytree
    formations: list[Formation]
    redone: int

    @property
    def applied(self) -> list[int]:
        """Every round this rank applied itself, in order; the rounds missing from it came
        with another rank's state at a formation."""
        return [r for f in self.formations for r in f.applied]

    @property
    def rounds_done(self) -> int:
        """How many rounds this rank applied itself."""
        return sum(len(f.applied) for f in self.formations)

    @property
    def joined_at(self) -> int:
        """The round this rank started from: 0 for the first peers, later for a newcomer."""
        return self.formations[0].round
