"""train_elastic with ``delay=1``: round r's reduction runs while round r + 1's step computes.

The rounds of :func:`train_elastic` pipelined by one (asynchronous DiLoCo under churn,
:mod:`.delayed`)::

    step(r + 1) computes from the state with rounds < r applied, while r is reduced
    then round r is applied (no await in between), the counter becomes r + 1,
    and round r + 1's reduction starts while step(r + 2) computes

Besides its pair (counter c, state S), each rank *holds* the contributions (step results)
it computed and has not seen applied: round c's, and round c + 1's once its step is done.
A contribution of round r is computed from the state with rounds < r - 1 applied, the same
on every rank, so one computed in one group is as good in the next.

Churn, the deterministic rule. At a formation the members take the most advanced pair
``(m, S_m)`` as always (:mod:`.elastic`), and every member tells which rounds it holds
(in the same allgather as the counters). Round m, the one in flight, is then reduced again
in the new group over the members that hold a contribution to it (the *holders*): each
holder adds its own, every other member (a newcomer, a survivor whose step of round m did
not finish) adds zeros, and with ``op="avg"`` the sum is divided by the number of holders,
a count that travels in the same reduction. So

- a peer that left has its unfinished contribution dropped: nobody holds it any more;
- a peer that joins mid-round receives round m's outcome with the others and computes
  from round m + 1 on (its zeros have the holders' names, shapes and dtypes, broadcast by
  the lowest holder at the formation);
- contributions to rounds below m are dropped (m - 1 was applied by the source); round
  m + 1, if members computed it before the formation (its step runs on while the group
  re-forms, after a loss or when peers wait to join, and while round m's reduction runs
  in the new group), is reduced over those members as round m is over its holders, the
  others adding zeros (a newcomer does not compute it late, so nobody waits for it); if
  none did, everyone computes it from ``S_m``;
- if no member holds round m (a new job, or every holder died), every member computes
  round m at once, from ``S_m``: that one round starts one outer step fresher than the
  rule would have it.

Each round is applied exactly once on every rank and with the same bits: its reduction is
one allreduce whose result is the same everywhere, and the division by the holders' count
is the same element-wise operation on every rank.

Robust ops (``op="median"`` or ``"trimmed_mean"``): zeros would be values like any other
in a median, so a round that not every member holds is reduced over the holders alone:
every member allgathers the contributions and reduces the holders' rows (in rank order)
with the robust allreduce's own element-wise rule (:func:`p2pcoll.engine.robust.reduce_part`),
the same bits on every rank. With fewer holders than ``2 * trim + 1`` the trim is the most
that leaves one value, ``(holders - 1) // 2``, on every rank alike. A round every member
holds is one robust allreduce, as at ``delay=0``.

``step`` must not run collectives on the group: they would interleave with the reduction
in flight, in an order that differs between ranks. :class:`DiLoCoRounds` with ``delay=1``
runs none; the settings are checked at each formation instead (train_elastic's
``settings=``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ..engine.robust import reduce_part
from ..pytree import Pytree, as_array, named_leaves, replace_leaves
from ..types import ROBUST, as_op, check_trim
from .delayed import retrieve_later
from .gradients import allreduce_gradients
from .modes import report_nonfinite

if TYPE_CHECKING:
    from .. import Group

__all__ = ["ADMIT", "HOLDERS", "OPS", "Pipeline", "check_robust", "reduce_round",
           "train_delayed", "zeros_from_holder"]

ADMIT = "p2pcoll.admit"  # the gradient entry that carries how many wait (rank 0's count)
HOLDERS = "p2pcoll.holders"  # the gradient entry that counts the holders of a round
log = logging.getLogger("p2pcoll.training")

OPS = ("avg", "sum", "median", "trimmed_mean")
"""The reductions of train_elastic's rounds."""


def check_robust(op: str, trim: int | None, codec: str | None, min_world_size: int) -> None:
    """``trim`` against ``op`` and the smallest group a round runs in; no codec with a
    robust op.

    Raises:
        ValueError: naming ``trim`` (none for a trimmed mean, one for another op, one that
            leaves nothing of ``min_world_size`` values) or the codec.
    """
    red = as_op(op)
    check_trim(red, trim, min_world_size)
    if red in ROBUST and codec is not None:
        raise ValueError(f"op={op!r} moves the gradients as they are: no codec={codec!r}")


class Pipeline(Protocol):
    """What the pipelined rounds read and change of a rank's elastic run (elastic's _Run)."""

    round: int
    rounds: int
    state: Pytree
    reduce: dict[str, Any]
    held: dict[int, dict[str, Any]]
    holders: int
    next_holders: int
    zeros: dict[str, Any] | None
    computing: tuple[int, asyncio.Task[dict[str, Any]]] | None
    admitted: int  # how many peers waited when the last admission was decided

    def apply(self, state: Pytree, grads: dict[str, Any], round: int) -> None: ...

    async def take_step(self) -> None: ...

    def join_early(self, old: Group) -> asyncio.Task[Group]: ...

    async def compute(self, group: Group, r: int) -> dict[str, Any]: ...


async def zeros_from_holder(group: Group, held: Mapping[str, Any] | None,
                            holder: int) -> dict[str, Any]:
    """Zeros with the names, shapes and dtypes of ``holder``'s contribution (broadcast from
    it: empty arrays of each dtype and the shapes, not the values)."""
    if group.rank == holder:
        assert held is not None
        leaves = [as_array(leaf, path) for path, leaf in named_leaves(dict(held))]
        template: Pytree = {
            "tree": replace_leaves(dict(held), [np.empty(0, a.dtype) for a in leaves]),
            "shapes": [np.array(a.shape, np.int64) for a in leaves]}
        await group.broadcast(template, root=holder)
    else:
        template = await group.broadcast(None, root=holder)
    assert isinstance(template, dict)
    tree, shapes = template["tree"], template["shapes"]
    empties = [as_array(leaf, path) for path, leaf in named_leaves(tree)]
    return dict(replace_leaves(tree, [np.zeros(tuple(int(n) for n in shape), e.dtype)
                                      for e, shape in zip(empties, shapes, strict=True)]))


async def reduce_round(group: Group, grads: Mapping[str, Any], *, holding: bool,
                       admit: int, r: int, reduce: dict[str, Any]
                       ) -> tuple[dict[str, Any], int]:
    """Round r's reduction over the group: the holders' sum (divided by their count under
    ``op="avg"``), or their median or trimmed mean; and rank 0's ``admit``: how many peers
    wait to join (0: none, or not asked; the others pass 0)."""
    op = reduce["op"]
    if as_op(op) in ROBUST:
        return await _reduce_robust(group, grads, holding=holding, admit=admit, r=r,
                                    reduce=reduce)
    options = {**reduce, "op": "sum", "trim": None}
    if reduce["codec"] is None:  # the counts ride in the round's buckets, exactly
        dtypes = [as_array(leaf, path).dtype for path, leaf in named_leaves(dict(grads))]
        dtype = next((d for d in dtypes if d.kind == "f"), np.dtype(np.float64))
        payload = {**grads, ADMIT: np.array([admit], dtype),
                   HOLDERS: np.array([int(holding)], dtype)}
        reduced = await allreduce_gradients(group, payload, round=r, **options)
        admitted, holders = round(float(reduced.pop(ADMIT)[0])), reduced.pop(HOLDERS)[0]
    else:  # not in a compressed bucket, whose block scale could round them
        counts = await group.allreduce(np.array([admit, int(holding)], np.int64), "sum")
        reduced = await allreduce_gradients(group, dict(grads), round=r, **options)
        admitted, holders = int(counts[0]), counts[1]
    if op == "avg":
        reduced = dict(replace_leaves(reduced, [
            a / a.dtype.type(holders) if a.dtype.kind == "f" else a
            for a in (as_array(leaf, path) for path, leaf in named_leaves(reduced))]))
    return reduced, admitted


async def _reduce_robust(group: Group, grads: Mapping[str, Any], *, holding: bool,
                         admit: int, r: int, reduce: dict[str, Any]
                         ) -> tuple[dict[str, Any], int]:
    """Round r's median or trimmed mean over its holders (module docstring) and rank 0's
    admission count: one robust allreduce when every member holds the round, else an
    allgather of the contributions reduced locally over the holders' rows."""
    flags = await group.allgather(np.array([admit, int(holding)], np.int64))
    admitted = int(flags[0][0])
    holders = [rank for rank, f in enumerate(flags) if f[1]]
    if len(holders) == group.world_size:
        return dict(await allreduce_gradients(group, dict(grads), round=r, **reduce)), admitted
    op = reduce["op"]
    trim = (len(holders) - 1) // 2 if op == "median" else min(
        reduce["trim"], (len(holders) - 1) // 2)
    named = named_leaves(dict(grads))
    reduced = []
    for path, leaf in named:
        mine = as_array(leaf, path)
        rows = await group.allgather(np.ascontiguousarray(mine).reshape(-1))
        out = np.empty(mine.size, mine.dtype)
        reduce_part(np.stack([rows[h] for h in holders]), trim, out)
        reduced.append(out.reshape(mine.shape))
    report_nonfinite(f"round {r}'s {op} over its holders", [path for path, _ in named],
                     reduced, reduce["nonfinite"], r)
    return dict(replace_leaves(dict(grads), reduced)), admitted


async def train_delayed(run: Pipeline, group: Group, applied: list[int],
                        ask: Callable[[], int]) -> str:
    """Rounds in ``group``, pipelined by one, until the last or until peers wait; each
    round applied goes into ``applied``; ``ask()`` says how many peers wait (rank 0's;
    0 elsewhere); when they are admitted, the count agreed is ``run.admitted``.

    When the group fails or admits peers, the step of the next round is left running in
    ``run.computing``: the re-formation overlaps it, and so does the new group's first
    reduction, which takes its result before the round is applied."""
    while run.round < run.rounds:
        r = run.round
        if run.holders == 0:  # nobody holds round r: every member computes it now
            run.held = {r: await run.compute(group, r)}
            run.holders, run.next_holders = group.world_size, 0
        mine = run.held.get(r)
        if mine is None:
            mine = run.zeros
        assert mine is not None  # the formation made zeros for a member that holds none
        # Round r + 1's step, unless some computed it before the formation: then the
        # others add zeros for it (elastic's rule) and nobody waits for a late step. A
        # step started before the formation that is still running (run.computing) is
        # this reduction's overlap, as a step started here would be. It is scheduled
        # before the reduction, so its first slice (the inner steps handed to a thread)
        # runs before the reduction's (the agreement, the buckets): the round's compute
        # starts at once. The step runs no collective, so the order on the wire is
        # the reductions' alone, the same on every rank.
        step = None
        if (r + 1 < run.rounds and r + 1 not in run.held and not run.next_holders
                and run.computing is None):
            step = asyncio.ensure_future(run.compute(group, r + 1))
            retrieve_later(step)
        flag = ask()
        reduction = asyncio.ensure_future(reduce_round(
            group, mine, holding=r in run.held, admit=flag, r=r, reduce=run.reduce))
        retrieve_later(reduction)
        try:
            reduced, admit = await reduction
        except BaseException:
            if step is not None:  # goes on while the group re-forms (the caller's)
                run.computing = (r + 1, step)
            raise
        if admit and r + 1 < run.rounds:
            # Peers wait to join: the members go to the rendezvous now, together, while
            # their steps end (each its own time), and round r is applied meanwhile.
            run.admitted = admit
            log.info("elastic: peers wait to join; forming a new group after round %d", r)
            run.join_early(group)
        if step is not None:
            run.held[r + 1] = await step
        await run.take_step()  # the step from before the formation, if one runs
        # No await from here on: round r is applied whole, with the counter.
        run.apply(run.state, reduced, r)
        run.round = r + 1
        run.held.pop(r, None)
        run.holders = (0 if run.round >= run.rounds else run.next_holders
                       if run.next_holders else group.world_size)
        run.next_holders = 0
        applied.append(r)
        if admit and run.round < run.rounds:
            if run.round + 1 < run.rounds:  # computes while the group re-forms
                step = asyncio.ensure_future(run.compute(group, run.round + 1))
                retrieve_later(step)
                run.computing = (run.round + 1, step)
            return "admitting"
    return "finished"
