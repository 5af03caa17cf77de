"""Asynchronous DiLoCo: the outer reduction of round k runs while round k+1 computes.

``DiLoCo(..., delay=1)`` (and :func:`train_elastic` with ``delay=1``, which
:class:`DiLoCoRounds` runs under) takes the *one-step-delayed outer update* of PCCL's
asynchronous DiLoCo and of the overlapping baseline of Kale et al. 2025 (*Eager updates for
overlapped communication and computation in DiLoCo*). With ``x_k`` the global parameters
(the anchor) after k outer steps, ``s_k`` the point a worker's round k starts from,
``theta_k`` where its H inner steps end, and ``avg`` the group's reduction::

    round 0:    s_0 = x_0
    round k:    H inner steps from s_k to theta_k
                delta_k = s_k - theta_k                 start avg(delta_k), in the background
                wait for avg(delta_{k-1})               (k >= 1; it ran during round k)
                x_k = OuterSGD(x_{k-1}, avg(delta_{k-1}))  (x_0 unchanged at k = 0)
                s_{k+1} = x_k - delta_k                 the worker's own round-k progress
    at the end: wait for avg(delta_last), apply it      (DiLoCo.flush; then s = x)

Each round's pseudo-gradient is measured from the point its inner steps started and is
applied to the global state exactly once, one round late; meanwhile each worker goes on
from the global parameters plus its own progress of the round still travelling, which the
group's average replaces one round later. Only the global state (anchor and outer
momentum) is shared, and it stays bit-identical on every replica; the working parameters
are each worker's own between outer steps, as in DiLoCo. The worker's own progress is what
keeps the paper's outer optimizer (lr 0.7, Nesterov 0.9) stable: restarting each round from
``x_k`` alone applies round k's delta on top of round k - 1's, which both measured from the
same start at k = 1 (on the digits MLP of ``benchmarks/slow_training.py``, 4 workers, H = 50,
300 steps: 71.9 % against synchronous DiLoCo's 96.9 %; with the own progress 97.2 %).
Kale et al.'s *eager* variant, which mixes the worker's own fresh delta into the outer step
itself, would make the global state differ between replicas, so it is not used.

What a round waits for is the previous round's reduction only if it took longer than the
H inner steps that ran meanwhile; else the inner steps never stop. Nor does the outer step
hold them up at the round's end: it is taken on copies of the global state, in a thread
(numpy lets the training thread run), as soon as the reduction lands (:func:`step_aside`),
and the round's end only swaps it in and sets the next start (two passes over the
parameters), besides computing the round's pseudo-gradient. For the network to move
during an inner step the step runs in a thread (``await asyncio.to_thread(...)``) or lets
the event loop turn, as streaming DiLoCo's overlap needs (:mod:`.local_sgd`).

A reduction that fails in the background (a peer lost) is kept, not printed: its task's
exception is marked retrieved as soon as it ends (:func:`retrieve_later`), and the next
``after_inner_step`` (any step, not only the round's last) or ``flush`` raises it.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from .outer import OuterSGD

__all__ = ["DELAYS", "check_delay", "retrieve_later", "step_aside"]

DELAYS = (0, 1)
"""The delays there are: 0, each outer step waits for its own reduction; 1, asynchronous."""


def check_delay(delay: Any, fragments: int = 1, overlap: int = 0) -> int:
    """``delay`` if it is 0 or 1 (and, for 1, with one fragment and no overlap).

    Raises:
        ValueError: naming ``delay`` and its value, or the setting it does not go with.
    """
    if not isinstance(delay, int) or isinstance(delay, bool) or delay not in DELAYS:
        raise ValueError(f"delay must be 0 or 1, got {delay!r}")
    if delay and fragments != 1:
        raise ValueError(f"delay=1 overlaps whole rounds; fragments={fragments} overlaps "
                         f"fragments: pass one of them")
    if delay and overlap:
        raise ValueError(f"delay=1 overlaps whole rounds; overlap={overlap} is streaming "
                         f"DiLoCo's: pass one of them")
    return delay


def retrieve_later(task: asyncio.Future[Any]) -> None:
    """Mark ``task``'s exception retrieved when it ends, so that one nobody awaits any more
    (the loop closed after a loss) is not logged as never retrieved; awaiting the task still
    raises it."""
    task.add_done_callback(_retrieve)


def _retrieve(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


Stepped = tuple[list[np.ndarray], list[np.ndarray]]


def step_aside(outer: OuterSGD, anchor: list[np.ndarray], velocity: list[np.ndarray],
               exchange: asyncio.Future[list[np.ndarray]]) -> asyncio.Task[Stepped]:
    """The outer step of ``exchange``'s round, on copies of ``anchor`` and ``velocity``, in a
    thread as soon as the reduction lands: the new (anchor, velocity) to swap in at the
    round's end, the same bits as :meth:`OuterSGD.apply` in place. The lists are read when
    the reduction lands, so the caller swaps the previous round's in (in place, into the
    same lists) before that; the task fails as ``exchange`` does (its error retrieved)."""

    async def step() -> Stepped:
        averaged = await exchange
        return await asyncio.to_thread(outer.stepped, list(anchor), list(velocity), averaged)

    task = asyncio.ensure_future(step())
    retrieve_later(task)
    return task
