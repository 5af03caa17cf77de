"""Overlap: reducing buckets of gradients while the backward pass is still producing them.

A :class:`GradientReducer` plans its buckets once, from the parameters; each
:class:`Round` takes gradients one at a time (:meth:`Round.add`) and starts a bucket's
allreduce as soon as that bucket and every one before it are full, in bucket order, so
communication proceeds while later gradients are still being computed. The communication
advances whenever the training loop awaits, so run heavy computation in a thread
(``await asyncio.to_thread(layer.backward, ...)``) to overlap it with the transfers.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

import numpy as np

from ..pytree import Pytree, as_array, like, listed_paths, named_leaves, replace_leaves
from ..types import ReduceOp, as_op, check_trim
from .agreement import Call, Kind, agree, table
from .buckets import BucketPlan
from .errors import RoundError
from .gradients import Residuals, codec_for, gradient_specs, raise_refused, reduce_bucket
from .nonfinite import Nonfinite, check_nonfinite, report_nonfinite
from .replicas import check_replicas, replica_table
from .state import state_of

if TYPE_CHECKING:
    from .. import Group

__all__ = ["GradientReducer", "Round"]


class GradientReducer:
    """Reduces the gradients of a fixed set of parameters, round after round, bucket by bucket.

    The buckets are planned once, from the parameters' names, shapes and dtypes, in the order
    the backward pass is expected to produce the gradients. In each round (:meth:`start_round`)
    gradients are added one at a time as they become available; a bucket's allreduce starts
    as soon as it and every bucket before it are full, so early buckets travel while later
    gradients are still being computed::

        reducer = GradientReducer(group, params, check_every=100)
        async with reducer.start_round() as rnd:
            for name, grad in backward_pass():      # e.g. await asyncio.to_thread(...)
                rnd.add(name, grad)
                await asyncio.sleep(0)              # let full buckets get going
            grads = await rnd.wait()

    or, with every gradient at hand, ``grads = await reducer.allreduce(grads)``.

    The reducer's state is its own (the plan, one set of bucket buffers, the open round);
    only the round numbers are the group's, shared with :func:`allreduce_gradients`.

    Args:
        group: the group.
        params: the parameters; their gradients must have the same names, shapes and dtypes.
            With ``check_every`` they are also what is compared between ranks: the reducer
            keeps this pytree (not copies) and reads its leaves at each check, so update the
            arrays in place or assign new ones into the same dicts.
        op: "avg" (default), "sum", "min", "max" or "prod"; or "median" and "trimmed_mean"
            (with ``trim``), as :func:`allreduce_gradients`.
        order: the names in the order their gradients will be produced; None is the
            reverse of the order ``params`` lists them in (dict insertion order, as
            ``model.named_parameters()`` gives), which is what a backward pass through
            layers listed input to output produces (as PyTorch DDP assumes).
        bucket_bytes: bucket size; None is :data:`DEFAULT_BUCKET_BYTES`.
        strategy: the allreduce strategy of the buckets; None is the group's choice.
        nonfinite: "raise", "warn" or "ignore" a NaN or Inf in the result.
        check_every: compare the replicas' parameters at the start of every round whose
            number is a multiple of this (0: never). The digests ride in the round's header,
            so a check costs hashing the parameters but no extra message.
        timeout: seconds for each collective (default: the group's).
        codec: send the gradients compressed ("fp16", "bf16", "int8", a plugin's), as for
            :func:`allreduce_gradients`; None: as they are. In the header the ranks compare.
        error_feedback: with a lossy codec and "sum"/"avg", carry what the codec lost of
            each gradient into the next round (the residuals are the reducer's, per
            parameter; ``reducer.residuals.clear()`` forgets them).
        trim: "trimmed_mean"'s k (``0 <= 2k < world_size``).

    Raises:
        ValueError, TypeError: bad arguments, as for :func:`allreduce_gradients`, or an
            ``order`` that is not a permutation of the parameters' names.
    """

    def __init__(
        self,
        group: Group,
        params: Pytree,
        op: str | ReduceOp = "avg",
        *,
        order: Sequence[str] | None = None,
        bucket_bytes: int | None = None,
        strategy: str | None = None,
        nonfinite: Nonfinite = "raise",
        check_every: int = 0,
        timeout: float | None = None,
        codec: str | None = None,
        error_feedback: bool = True,
        trim: int | None = None,
    ) -> None:
        self.group = group
        self.params = params
        self.op = as_op(op)
        self.trim = trim
        check_trim(self.op, trim, group.world_size)
        check_nonfinite(nonfinite)
        if not isinstance(check_every, int) or check_every < 0:
            raise ValueError(f"check_every must be an int >= 0, got {check_every!r}")
        arrays = {path: as_array(leaf, path) for path, leaf in named_leaves(params)}
        if order is None:
            order = listed_paths(params)[::-1]
        elif sorted(order) != sorted(arrays):
            raise ValueError("order must list every parameter name exactly once")
        self.plan = BucketPlan(gradient_specs(order, [arrays[name] for name in order], self.op),
                               bucket_bytes)
        self.codec = codec_for(codec, self.plan.specs, self.op, group.world_size)
        self.residuals = Residuals() if error_feedback else None
        self.strategy = strategy
        self.nonfinite = nonfinite
        self.check_every = check_every
        self.timeout = timeout
        settings = {"op": self.op.value, "bucket_bytes": self.plan.bucket_bytes,
                    "nonfinite": nonfinite, "check_every": check_every, "codec": codec,
                    "trim": trim}
        self._spec_table = table(settings, self.plan.specs)
        self._open: Round | None = None
        # One set of bucket buffers for all rounds: a round's allreduces have copied them
        # before it finishes, and rounds never overlap.
        self._flats = self.plan.empty_buffers()

    def start_round(self, *, round: int | None = None) -> Round:
        """Begin a round: its header exchange starts at once, and buckets as they fill.

        Args:
            round: this round's number; None takes the group's next.

        Returns:
            The :class:`Round`; use it as ``async with`` so that an error in the loop body
            cancels it.

        Raises:
            RoundError: the previous round of this reducer has not finished.
            ValueError: a bad ``round``.
        """
        if self._open is not None and not self._open.done():
            raise RoundError(f"round {self._open.number} is still open; wait() for it first")
        number = state_of(self.group).take_round(round)
        self._open = Round(self, number)
        return self._open

    async def allreduce(self, grads: Pytree, *, round: int | None = None) -> Pytree:
        """Run a whole round with gradients that are all ready; returns the reduced pytree."""
        async with self.start_round(round=round) as rnd:
            rnd.add_all(grads)
            return await rnd.wait()

    async def check_replicas(self) -> None:
        """:func:`check_replicas` on the reducer's parameters, now."""
        await check_replicas(self.group, self.params, timeout=self.timeout)


class Round:
    """One round of a :class:`GradientReducer`: add gradients, then wait for the result.

    Attributes:
        number: the round number, carried in the header every rank compares.
    """

    def __init__(self, reducer: GradientReducer, number: int) -> None:
        self.number = number
        self._reducer = reducer
        plan = reducer.plan
        self._flats = reducer._flats
        self._added = [False] * len(plan.specs)
        self._waiting = [len(b.members) for b in plan.buckets]
        self._full = [asyncio.Event() for _ in plan.buckets]
        # The parameters are hashed now, before the caller can touch them again.
        check = reducer.check_every and number % reducer.check_every == 0
        data_table = replica_table(reducer.params) if check else None
        self._call = Call(Kind.REDUCER, number, "GradientReducer", reducer._spec_table,
                          data_table)
        self._task = asyncio.get_running_loop().create_task(self._run())

    def add(self, name: str, grad: Any) -> None:
        """Copy gradient ``name`` into its bucket; start buckets that are now full, in order.

        Raises:
            ValueError: an unknown name, a gradient added twice, or a shape or dtype that is
                not the parameter's.
            RoundError: the round was cancelled.
            CollectiveMismatch, ReplicaDivergence, ...: the round has already failed with it
                (in the header exchange, or a bucket).
        """
        if self._task.done():
            if not self._task.cancelled():
                self._task.result()  # raises the error that ended the round
            raise RoundError(f"round {self.number} is over")
        plan = self._reducer.plan
        i = plan.index.get(name)
        if i is None:
            raise ValueError(f"{name!r} is not one of the reducer's parameters")
        if self._added[i]:
            raise ValueError(f"gradient {name!r} was already added in round {self.number}")
        plan.place(i, as_array(grad, name), self._flats)
        self._added[i] = True
        b = plan.bucket_of[i]
        if b is not None:
            self._waiting[b] -= 1
            if self._waiting[b] == 0:
                self._full[b].set()

    def add_all(self, grads: Pytree) -> None:
        """:meth:`add` every leaf of a pytree shaped like the parameters."""
        for name, grad in named_leaves(grads):
            self.add(name, grad)

    async def wait(self) -> Pytree:
        """The reduced gradients, in the parameters' structure, once every bucket is reduced.

        Returns:
            New arrays (torch tensors where the parameters are), equal on every rank.

        Raises:
            ValueError: some gradients were never added (the round is cancelled; peers that
                already sent buckets fail, the others time out).
            CollectiveMismatch, ReplicaDivergence, NonFiniteGradients, and the group's
            errors: as :func:`allreduce_gradients` and :func:`check_replicas`.

        Cancellation: cancels the round, which breaks the group if a collective was under way.
        """
        plan = self._reducer.plan
        missing = [s.name for s, added in zip(plan.specs, self._added, strict=True) if not added]
        if missing:
            await self.cancel()
            raise ValueError(f"round {self.number}: gradients never added: {missing}")
        reduced = await self._task
        report_nonfinite(plan, reduced, self._reducer.nonfinite, self.number)
        by_name = dict(zip((s.name for s in plan.specs), plan.unpack(reduced), strict=True))
        params = self._reducer.params
        return replace_leaves(params, [like(leaf, by_name[name])
                                       for name, leaf in named_leaves(params)])

    def done(self) -> bool:
        """Whether the round's communication has finished (or failed, or was cancelled)."""
        return self._task.done()

    async def cancel(self) -> None:
        """Stop the round. A collective cut off part-way breaks the group."""
        self._task.cancel()
        with contextlib.suppress(BaseException):  # the round is abandoned, its error with it
            await self._task

    async def __aenter__(self) -> Round:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if not self._task.done():
            await self.cancel()

    async def _run(self) -> list[np.ndarray]:
        """Compare headers, then launch each bucket's allreduce once it and those before are
        full. Tasks start in creation order, so every rank numbers the buckets' collectives
        alike."""
        reducer = self._reducer
        if not reducer.plan.specs and self._call.data_table is None:
            return []  # no gradients: a no-op round, like allreduce_gradients({})
        await agree(reducer.group, self._call, reducer.timeout)
        loop = asyncio.get_running_loop()
        tasks: list[asyncio.Task[Any]] = []
        coder = reducer.codec
        try:
            for bucket, flat, full in zip(reducer.plan.buckets, self._flats, self._full,
                                          strict=True):
                await full.wait()
                if coder is None:
                    work = reducer.group.allreduce(flat, reducer.op, strategy=reducer.strategy,
                                                   timeout=reducer.timeout, trim=reducer.trim)
                else:
                    work = reduce_bucket(reducer.group, coder, reducer.plan, bucket, flat,
                                         reducer.op, reducer.residuals, reducer.strategy,
                                         reducer.timeout, reducer.nonfinite)
                tasks.append(loop.create_task(work))
            if coder is None:
                return list(await asyncio.gather(*tasks))
            # Every bucket runs to its end, so that a NaN under int8 (refused alike on
            # every rank) leaves every rank having run the same collectives.
            done = await asyncio.gather(*tasks, return_exceptions=True)
            raise_refused(reducer.plan, coder, done, self.number)
            return [result for result in done if isinstance(result, np.ndarray)]
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
