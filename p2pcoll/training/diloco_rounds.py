"""DiLoCo's outer steps as the rounds of :func:`train_elastic`, so peers may die and join."""

from __future__ import annotations

import inspect
import sys
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ..pytree import Pytree, as_array, named_leaves, replace_leaves
from .delayed import check_delay
from .modes import agree_on, outer_op, positive_int
from .outer import Model, OuterSGD

if TYPE_CHECKING:
    from .. import Group

__all__ = ["DiLoCoRounds", "InnerStep"]

InnerStep = Callable[["Group", int, int], Awaitable[None] | None]
"""``inner(group, round, i)``: one inner step (i = 0 .. H-1 of outer step ``round``) on the
parameters, in place; a plain function or a coroutine function."""


class DiLoCoRounds:
    """DiLoCo's outer steps as the rounds of :func:`train_elastic`, so that peers may die and
    join: the outer state (global parameters and momentum) is the elastic state, which a new
    group takes from its most advanced member, and each outer step is applied exactly once::

        rounds = training.DiLoCoRounds(params, inner, inner_steps=50)
        await training.train_elastic(rounds.step, rounds.apply, rounds.state,
                                     rounds=outer_steps, min_world_size=2, ...)
        rounds.finish()                       # the global parameters into ``params``

    ``step`` copies the global parameters into ``params``, runs ``inner`` H times, checks
    that the ranks agree on the settings (one small allgather) and returns the
    pseudo-gradients; train_elastic averages them (``op="avg"``) and ``apply`` takes the
    outer step on the state. For int8 (or fp16) pseudo-gradients pass ``codec="int8"`` to
    train_elastic, which reduces each round under it. Streaming and overlap are
    :class:`DiLoCo`'s only.

    Asynchronous DiLoCo (``delay=1``, :mod:`.delayed`): pass the same to train_elastic,
    with the settings, so that round k's reduction runs while round k+1's inner steps do::

        rounds = training.DiLoCoRounds(params, inner, inner_steps=50, delay=1)
        await training.train_elastic(rounds.step, rounds.apply, rounds.state,
                                     rounds=outer_steps, delay=rounds.delay,
                                     settings=rounds.settings, ...)

    There ``step`` runs no collective (one would interleave with the reduction in flight):
    train_elastic checks the settings at each formation instead.

    Args:
        params: the model's parameters (writable float arrays or CPU torch tensors), which
            the inner steps train in place.
        inner: ``inner(group, round, i)``, one inner step (see :data:`InnerStep`); with
            ``delay=1`` it must not run collectives on the group either.
        inner_steps: H, >= 1.
        outer_lr, outer_momentum, nesterov: the outer optimizer (:class:`OuterSGD`).
        delay: 0, or 1 for asynchronous DiLoCo (train_elastic's ``delay`` must match).
        op, trim: how train_elastic combines the pseudo-gradients: "avg", or the robust
            "median" or "trimmed_mean" with ``trim=k`` (pass the same to train_elastic,
            which checks ``trim`` against ``min_world_size``)::

                rounds = training.DiLoCoRounds(params, inner, inner_steps=50,
                                               op="trimmed_mean", trim=1)
                await training.train_elastic(..., op=rounds.op, trim=rounds.trim,
                                             settings=rounds.settings)
        timeout: seconds for the settings check.

    Attributes:
        state: ``{"params": ..., "velocity": ...}``, numpy copies in the parameters'
            structure (and, with ``delay=1``, ``"applied"``: the outer steps it holds):
            pass it to train_elastic as its state.

    Raises:
        ValueError, TypeError: as :class:`DiLoCo`; ``delay`` other than 0 or 1; another
            ``op``, a ``trim`` without a trimmed mean or a trimmed mean without one.
    """

    def __init__(self, params: Pytree, inner: InnerStep, *, inner_steps: int,
                 outer_lr: float = 0.7, outer_momentum: float = 0.9, nesterov: bool = True,
                 delay: int = 0, timeout: float | None = None, op: str = "avg",
                 trim: int | None = None) -> None:
        self.inner_steps = positive_int(inner_steps, "inner_steps (H)")
        # The group's size is train_elastic's to check the trim against (min_world_size).
        self.op, self.trim = outer_op(op, trim, sys.maxsize).value, trim
        self.outer = OuterSGD(outer_lr, outer_momentum, nesterov)
        self.delay = check_delay(delay)
        self.model = Model(params, "DiLoCoRounds")
        self.inner, self.timeout = inner, timeout
        self.state: dict[str, Pytree] = {
            "params": replace_leaves(params, [a.copy() for a in self.model.arrays]),
            "velocity": replace_leaves(params, [np.zeros_like(a) for a in self.model.arrays]),
        }
        if self.delay:  # how many outer steps the state holds: travels with it
            self.state["applied"] = np.zeros(1, np.int64)
        self._returned: dict[int, list[np.ndarray]] = {}  # delay=1: this rank's last deltas

    @property
    def settings(self) -> dict[str, Any]:
        """What every rank must agree on (train_elastic's ``settings=`` with ``delay=1``)."""
        return {"mode": "diloco-elastic", "inner_steps": self.inner_steps,
                "delay": self.delay, "op": self.op, "trim": self.trim,
                **self.outer.settings()}

    async def step(self, group: Group, round: int, state: Pytree) -> dict[str, np.ndarray]:
        """train_elastic's step: H inner steps from the global parameters; the
        pseudo-gradients by parameter name. Does not change ``state``.

        Raises:
            CollectiveMismatch: the ranks disagree on H or the outer optimizer (``delay=0``;
                with 1, train_elastic's formation checks them).
            Whatever ``inner`` raises.
        """
        anchor = _leaves(state["params"])
        # delay=1: round - 1 in flight, this rank goes on from its own progress in it too.
        own = (self._returned.get(round - 1) if self.delay
               and int(as_array(state["applied"])[0]) == round - 1 else None)
        start = anchor if own is None else [a - o for a, o in zip(anchor, own, strict=True)]
        for mine, begin in zip(self.model.arrays, start, strict=True):
            np.copyto(mine, begin)
        for i in range(self.inner_steps):
            result = self.inner(group, round, i)
            if inspect.isawaitable(result):
                await result
        if not self.delay:
            await agree_on(group, "DiLoCoRounds", round, self.settings, self.model.specs,
                           self.timeout)
        deltas = [begin - mine for begin, mine in zip(start, self.model.arrays, strict=True)]
        if self.delay:
            self._returned = {round: deltas, **{r: d for r, d in self._returned.items()
                                                if r == round - 1}}
        return dict(zip(self.model.names, deltas, strict=True))

    def apply(self, state: Pytree, deltas: dict[str, Any], round: int) -> None:
        """train_elastic's apply: the outer step on ``state`` with the averaged deltas."""
        self.outer.apply(_leaves(state["params"]), _leaves(state["velocity"]),
                         [as_array(deltas[name], name) for name in self.model.names])
        if self.delay:
            as_array(state["applied"])[0] = round + 1

    def finish(self) -> None:
        """Copy the global parameters into the model's (after train_elastic returned)."""
        for mine, start in zip(self.model.arrays, _leaves(self.state["params"]), strict=True):
            np.copyto(mine, start)


def _leaves(tree: Pytree) -> list[np.ndarray]:
    return [as_array(leaf, path) for path, leaf in named_leaves(tree)]
