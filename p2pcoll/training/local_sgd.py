"""Local SGD and DiLoCo: many local steps, then one exchange of parameters.

Data-parallel training exchanges every gradient at every step. These modes let each worker
take ``H`` steps (the *inner* steps) with its own optimizer on its own data, and only then
bring the replicas together:

- :class:`LocalSGD` (Stich 2019; Lin et al. 2020, "post-local SGD") averages the parameters
  themselves every ``H`` steps: one allreduce of the model per ``H`` steps.
- :class:`DiLoCo` (Douillard et al. 2023, *DiLoCo: Distributed Low-Communication Training of
  Language Models*) averages the *pseudo-gradient* ``theta_start - theta_now``, each
  worker's change since the last exchange, and takes an *outer* step with it on the global
  parameters, with SGD and Nesterov momentum (:class:`OuterSGD`; the paper: lr 0.7,
  momentum 0.9). The pseudo-gradient can travel compressed (``codec="int8"`` or
  ``"fp16"``), since it is an update, not the weights; with a lossy codec what it loses of
  each tensor is added to that tensor's next pseudo-gradient (error feedback). Or sparse:
  ``compressor="topk2bit", density=0.015`` sends 1.5 % of each chunk of the pseudo-gradient
  as 2-bit codes and keeps the rest for the next exchange (:mod:`.compressors`). Every
  worker then starts the next ``H`` steps from the new global parameters.
- Streaming DiLoCo (Douillard et al. 2025, *Streaming DiLoCo with overlapping
  communication*): ``DiLoCo(..., fragments=F)`` splits the parameters into ``F`` fragments
  of nearly equal size (the tensors in leaf order, cut between rows where needed: one large
  layer would otherwise make one fragment the whole model; the paper's transformer has
  layers of equal size, which it groups strided) and syncs fragment ``f`` at the inner
  steps ``t`` with ``(t - offset_f) % H == 0``,
  ``offset_f = f * H // F``, so each exchange is ``1/F`` of the model and the exchanges are
  spread over the ``H`` steps. With ``overlap=tau`` a fragment's exchange starts at step
  ``t`` as a task and is applied at step ``t + tau``: the worker trains on meanwhile, and
  the fragment's local parameters become ``mix * local + (1 - mix) * global`` (the paper's
  merge, with its mixing factor alpha as ``mix``).

One outer step, per fragment (all the tensors when ``F = 1``)::

    delta    = anchor - params              this worker's pseudo-gradient (anchor: global)
    delta    = avg over ranks (delta)       one allreduce per bucket, or one through the
                                            codec (plus error feedback's residual)
    velocity = momentum * velocity + delta
    anchor  -= lr * (delta + momentum * velocity)     (Nesterov; lr * velocity without it)
    params   = anchor                       (mix * params + (1 - mix) * anchor with overlap)

Identical replicas. The *global* state, ``anchor`` and ``velocity``, is what the replicas
share: both start equal (the parameters as every rank passed them: broadcast them first,
:func:`broadcast_parameters`), the averaged delta comes out of an allreduce with the same
bits on every rank (codecs keep that promise too), and the outer step is element-wise numpy
in a fixed order, so after every outer step every rank holds the same bits in both
(:meth:`DiLoCo.global_state`). Without overlap (or with ``mix=0``) the working parameters
equal the anchor right after each exchange; between exchanges they are each worker's own.

Cost in bytes per inner step (``N`` bytes of float parameters, plain allreduce = ``N`` per
step): local SGD ``N / H``; DiLoCo ``N / H`` times the codec's ratio (int8: about a
quarter of float32's), so DiLoCo with ``H = 50`` and int8 hands the network about 200x
fewer bytes than a per-step allreduce; streaming DiLoCo the same on average, in pieces of
``N / F``; topk2bit at density 1.5 % hands over about 0.027 bytes per float32 element,
about 7,300x fewer with H = 50 (on the wire its allgather reaches p - 1 peers: about
3,800x fewer than an allreduce's at p = 4, 1,000x at 16). The agreement header adds 48
bytes per rank per exchange.

Overlap, what it does and does not do: an exchange in flight is an asyncio task on the
group's event loop, so it advances only while the loop runs. :meth:`DiLoCo.after_inner_step`
gives it one turn of the loop per inner step, and ZeroMQ's I/O thread moves bytes already
queued even while Python computes; for the network to move during the whole inner step, run
the step's computation in a thread (``await asyncio.to_thread(train_step, batch)``: numpy
and torch release the GIL in their kernels), and the loop drives the exchange meanwhile.
Exchanges are chained: each starts its collectives only after the previous one finished, so
every rank issues the same collectives in the same order. An exchange that fails and takes
the group with it (a peer lost) ends the others in flight too: the call that met the
failure waits for them, each ends with the group's error, and none is left running to be
reported as a task exception never retrieved.

:class:`~.diloco_rounds.DiLoCoRounds` runs DiLoCo's outer steps as :func:`train_elastic`
rounds: the outer state is the elastic state, so a peer that joins gets it, and no outer step
is applied twice (with ``delay=1`` too).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import ReplicaDivergence
from ..session.failure import GroupState
from ..pytree import Pytree, replace_leaves
from .buckets import DEFAULT_BUCKET_BYTES, TensorSpec
from .compressors import Compressor, make_compressor
from .delayed import check_delay, retrieve_later, step_aside
from .fragments import split_fragments
from .modes import (
    Traffic,
    agree_on,
    average,
    check_codec,
    outer_op,
    positive_int,
    report_nonfinite,
    wire_bytes,
)
from .nonfinite import Nonfinite, check_nonfinite
from .outer import Model, OuterSGD
from .state import state_of

if TYPE_CHECKING:
    from .. import Group

__all__ = ["DiLoCo", "LocalSGD", "OuterSGD"]


class LocalSGD:
    """Local SGD: every worker steps on its own; every ``inner_steps`` steps the group
    averages the parameters (module docstring)::

        local = training.LocalSGD(group, params, inner_steps=8)
        for batch in batches:
            inner_optimizer_step(params, batch)      # in place
            await local.after_inner_step()           # True when the parameters were averaged

    Args:
        group: the group.
        params: a pytree of writable floating-point arrays or CPU torch tensors, updated in
            place by the caller's optimizer; the same names, shapes and dtypes on every rank.
            Give every rank the same values first (:func:`broadcast_parameters`).
        inner_steps: H, the steps between averages, >= 1.
        bucket_bytes, strategy: as :func:`allreduce_gradients`.
        timeout: seconds for each collective (default: the group's).

    Attributes:
        step: inner steps taken so far; syncs: averages done.
        traffic: bytes handed to collectives, against an allreduce of the parameters' size
            at every inner step.

    Raises:
        ValueError: ``inner_steps`` < 1, no parameters, a read-only one.
        TypeError: a parameter that is not floating-point.
    """

    def __init__(self, group: Group, params: Pytree, *, inner_steps: int,
                 bucket_bytes: int | None = None, strategy: str | None = None,
                 timeout: float | None = None) -> None:
        self.group = group
        self.inner_steps = positive_int(inner_steps, "inner_steps (H)")
        self.model = Model(params, "LocalSGD")
        self.bucket_bytes, self.strategy, self.timeout = bucket_bytes, strategy, timeout
        self.step = 0
        self.syncs = 0
        self.traffic = Traffic()

    async def after_inner_step(self, params: Pytree | None = None) -> bool:
        """Count one inner step; every ``H``-th, average the parameters over the group.

        Args:
            params: the parameters, if the caller's arrays are not the ones it was made with
                (an optimizer that rebinds instead of updating in place); else None.

        Returns:
            Whether the parameters were averaged (written into the caller's arrays).

        Raises:
            CollectiveMismatch: the ranks are at different steps, or disagree on H or the
                tensors (named, on every rank).
            CollectiveTimeout, PeerLost, GroupBroken: as the group's collectives.

        Cancellation: breaks the group if it happens during the exchange; the parameters
            are then this rank's own, unaveraged.
        """
        self.model.reread(params, "LocalSGD")
        self.step += 1
        self.traffic.dense_bytes += self.model.nbytes
        if self.step % self.inner_steps:
            return False
        round_no = state_of(self.group).take_round()
        # "step" sorts after the settings, so a rank with another H is told about H first.
        settings = {"mode": "local_sgd", "inner_steps": self.inner_steps, "step": self.step,
                    "bucket_bytes": _bucket_bytes(self.bucket_bytes)}
        await agree_on(self.group, "LocalSGD", round_no, settings, self.model.specs,
                       self.timeout)
        averaged = await average(self.group, self.model.arrays, bucket_bytes=self.bucket_bytes,
                                 strategy=self.strategy, timeout=self.timeout)
        for mine, avg in zip(self.model.arrays, averaged, strict=True):
            np.copyto(mine, avg)
        self.syncs += 1
        self.traffic.rounds += 1
        self.traffic.sent_bytes += self.model.nbytes
        return True


class DiLoCo:
    """DiLoCo and streaming DiLoCo: inner steps on each worker, outer steps on the average
    of the workers' parameter changes (module docstring)::

        diloco = training.DiLoCo(group, params, inner_steps=50, codec="int8")
        for batch in batches:
            inner_optimizer_step(params, batch)          # the worker's own, in place
            await diloco.after_inner_step()              # True when an outer step happened
        await diloco.flush()                             # apply exchanges still in flight

    Args:
        group: the group.
        params: a pytree of writable floating-point arrays or CPU torch tensors, updated in
            place by the inner optimizer; the same names, shapes and dtypes on every rank,
            and the same values at the start (:func:`broadcast_parameters`).
        inner_steps: H, inner steps between a fragment's exchanges, >= 1.
        outer_lr, outer_momentum, nesterov: the outer optimizer (:class:`OuterSGD`).
        codec: how the pseudo-gradients travel: None (their own dtype), "int8", "fp16",
            "bf16" or a plugin's (:mod:`p2pcoll.codecs`).
        error_feedback: with a lossy codec, what it lost of a tensor's pseudo-gradient is
            added to that tensor's next one (kept per tensor, on this rank only), as
            :func:`allreduce_gradients` does; False: every exchange on its own.
        fragments: F, the number of fragments (streaming DiLoCo), 1 <= F <= H; each is
            about 1/F of the parameters, whole rows of them; 1 is DiLoCo.
        overlap: tau, inner steps between the start of a fragment's exchange and its outer
            step, 0 <= tau <= H; 0 waits for the exchange at once.
        mix: alpha of the merge ``mix * local + (1 - mix) * global``, in [0, 1).
        bucket_bytes, strategy: as :func:`allreduce_gradients`.
        nonfinite: a NaN or Inf in a pseudo-gradient: "raise" :class:`NonFiniteGradients`
            naming the tensors (the outer state is left as it was), "warn", "ignore".
        compressor: another way for the pseudo-gradients to travel, instead of a codec:
            "topk2bit", each chunk's largest entries (``density`` of them) as 2-bit codes
            against a step the group agrees, the rest kept for the next exchange (with
            ``error_feedback``), summed exactly in the integer domain
            (:mod:`.compressors`); another name from the ``p2pcoll.compressors`` entry
            points, or a :class:`~.compressors.Compressor` object; None: the codec's way.
        density: the share of the entries a named ``compressor`` sends, in (0, 1] (None:
            its default, 1.5 % for topk2bit).
        delay: 0, each outer step waits for its own reduction; 1, asynchronous DiLoCo:
            round k's reduction runs while round k+1's inner steps compute and is applied
            at round k+1's end (:mod:`.delayed`; one fragment, no overlap).
        timeout: seconds for each collective (default: the group's).
        op, trim: how the pseudo-gradients are combined: "avg", or the robust "median" or
            "trimmed_mean" with ``trim=k`` (one bad peer cannot move the update; no codec or
            compressor; :meth:`p2pcoll.Group.allreduce`).

    Attributes:
        step: inner steps taken; outer_steps: fragment exchanges applied (one per outer
            step when F = 1).
        traffic: bytes handed to collectives (in the codec's bytes per element), against
            an allreduce of the parameters at every inner step.

    Raises:
        ValueError: H < 1, a bad F, tau, mix, outer lr or momentum, no parameters, a
            read-only parameter; a codec that cannot average over this group (int8: more
            than 127 ranks); an unknown ``compressor`` (naming the known ones), a
            ``density`` outside (0, 1] or without a named compressor, both a codec and a
            compressor, one that is neither a name nor a Compressor; ``delay`` other than
            0 or 1, or 1 with fragments or overlap; another ``op``, a bad ``trim``, a
            robust op with a codec or a compressor.
        UnknownCodec: no codec of that name (a ValueError; it lists the installed ones).
        TypeError: a parameter that is not floating-point; a codec that is not a name.
        PluginValidationError: the plugin that provides ``compressor`` is broken.
    """

    def __init__(self, group: Group, params: Pytree, *, inner_steps: int,
                 outer_lr: float = 0.7, outer_momentum: float = 0.9, nesterov: bool = True,
                 codec: str | None = None, error_feedback: bool = True, fragments: int = 1,
                 overlap: int = 0, mix: float = 0.0, bucket_bytes: int | None = None,
                 strategy: str | None = None, nonfinite: Nonfinite = "raise",
                 compressor: str | Compressor | None = None, density: float | None = None,
                 delay: int = 0, timeout: float | None = None, op: str = "avg",
                 trim: int | None = None) -> None:
        self.group = group
        self.inner_steps = positive_int(inner_steps, "inner_steps (H)")
        self.outer = OuterSGD(outer_lr, outer_momentum, nesterov)
        self.model = Model(params, "DiLoCo")
        self.compressor = make_compressor(compressor, density)
        if self.compressor is not None and codec is not None:
            raise ValueError(f"codec={codec!r} and compressor={compressor!r} are two ways to "
                             f"send the pseudo-gradients; pass one")
        self.codec = check_codec(codec, [s.dtype for s in self.model.specs], group.world_size)
        self.op = outer_op(op, trim, group.world_size, codec=codec, compressor=compressor)
        self.trim = trim
        self.error_feedback = bool(error_feedback)
        self.fragments = split_fragments(self.model.specs, self.model.names, fragments,
                                    self.inner_steps)
        if (not isinstance(overlap, int) or isinstance(overlap, bool)
                or not 0 <= overlap <= self.inner_steps):
            raise ValueError(f"overlap must be an int in [0, inner_steps={self.inner_steps}], "
                             f"got {overlap!r}")
        if (not isinstance(mix, (int, float)) or isinstance(mix, bool)
                or not 0 <= mix < 1):
            raise ValueError(f"mix must be a number in [0, 1), got {mix!r}")
        check_nonfinite(nonfinite)
        self.delay = check_delay(delay, len(self.fragments), overlap)
        self.overlap, self.mix, self.nonfinite = overlap, float(mix), nonfinite
        self.bucket_bytes, self.strategy, self.timeout = bucket_bytes, strategy, timeout
        self.anchor = [a.copy() for a in self.model.arrays]  # the global parameters
        self.velocity = [np.zeros_like(a) for a in self.anchor]
        # What the codec lost of each tensor's pseudo-gradient, this rank's own.
        self.residuals = ([np.zeros_like(a) for a in self.anchor]
                          if self.error_feedback and (self.compressor is not None or (
                              self.codec is not None and self.codec.lossy))
                          else None)
        self.step = 0
        self.outer_steps = 0
        self.traffic = Traffic()
        self._offsets = [f * self.inner_steps // len(self.fragments)
                         for f in range(len(self.fragments))]
        self._in_flight: dict[int, tuple[int, asyncio.Task[list[np.ndarray]]]] = {}
        self._last: asyncio.Task[list[np.ndarray]] | None = None
        self._checked: set[int] = set()  # fragments whose starting parameters were compared
        # delay=1: where this worker's round started (the anchor plus its own progress of
        # the round in flight); the pseudo-gradient is measured from it.
        self._origin = [a.copy() for a in self.anchor] if self.delay else None
        # delay=1: the outer step of the round in flight, taken aside (step_aside).
        self._prepared: asyncio.Task[tuple[list[np.ndarray], list[np.ndarray]]] | None = None

    @property
    def settings(self) -> dict[str, Any]:
        """What every rank must agree on (it goes into the agreement header)."""
        return {"mode": "diloco", "inner_steps": self.inner_steps,
                "codec": self.codec.name if self.codec is not None else None,
                "error_feedback": self.residuals is not None,
                "fragments": len(self.fragments), "overlap": self.overlap, "mix": self.mix,
                "delay": self.delay,
                "nonfinite": self.nonfinite, "bucket_bytes": _bucket_bytes(self.bucket_bytes),
                "op": self.op.value, "trim": self.trim,
                **(self.compressor.settings if self.compressor is not None
                   else {"compressor": None}),
                **self.outer.settings()}

    def offset(self, fragment: int) -> int:
        """The inner step (mod H) at which ``fragment``'s exchanges start."""
        return self._offsets[fragment]

    def fragment_names(self) -> list[list[str]]:
        """The pieces of each fragment: a tensor's name, or ``"name[a:b]"`` for its rows a
        to b."""
        return [[piece.name for piece in pieces] for pieces in self.fragments]

    def global_state(self) -> dict[str, Pytree]:
        """The state every replica shares: ``{"params": ..., "velocity": ...}``, the global
        parameters (the anchor) and the outer momentum, in the parameters' structure (as
        numpy arrays, the object's own: copy before changing them)."""
        return {"params": replace_leaves(self.model.tree, self.anchor),
                "velocity": replace_leaves(self.model.tree, self.velocity)}

    async def after_inner_step(self, params: Pytree | None = None) -> bool:
        """Count one inner step; finish the exchanges that are due and start the next ones.

        Exchanges that are due (started ``overlap`` steps ago) are applied first, then the
        fragments whose turn it is start theirs (and, without overlap, are applied at once),
        in fragment order on every rank.

        Args:
            params: the parameters, if the caller's arrays are not the ones this was made
                with (an optimizer that rebinds instead of updating in place); else None.

        Returns:
            Whether an outer step was applied (to some fragment) in this call.

        Raises:
            CollectiveMismatch: the ranks are at different inner steps or rounds, or disagree
                on H, F, the codec, the compressor or its density, the outer optimizer or
                the tensors (named, every rank).
            ReplicaDivergence: at a fragment's first exchange, the ranks' global parameters
                (those they gave DiLoCo) differ: broadcast them first.
            NonFiniteGradients: an averaged pseudo-gradient holds NaN or Inf; that fragment's
                outer step is not applied.
            CollectiveTimeout, PeerLost, GroupBroken: as the group's collectives.

        Cancellation: breaks the group if it happens during an exchange; the fragments
            already applied stay applied, the others keep their state.
        """
        self.model.reread(params, "DiLoCo")
        self.step += 1
        self.traffic.dense_bytes += self.model.nbytes
        if self.delay:
            return await self._delayed_step()
        applied = False
        for f in sorted(self._in_flight):
            if self._in_flight[f][0] <= self.step:
                _, task = self._in_flight.pop(f)
                self._apply(f, await self._outcome(task))
                applied = True
        for f, offset in enumerate(self._offsets):
            if (self.step - offset) % self.inner_steps:
                continue  # steps offset, offset + H, ...: fragment 0 first at H
            task = self._start(f)
            if self.overlap == 0:
                self._apply(f, await self._outcome(task))
                applied = True
            else:
                self._in_flight[f] = (self.step + self.overlap, task)
        if self._in_flight:
            await asyncio.sleep(0)  # a turn of the loop for the exchanges in flight
        return applied

    async def _delayed_step(self) -> bool:
        """Asynchronous DiLoCo's inner step (``delay=1``, :mod:`.delayed`): at the end of a
        round, start its exchange, take the previous round's outer step, and go on from the
        new anchor plus this worker's own progress of the round that is still travelling;
        between, surface a failed exchange at once.

        The next round's inner steps wait for this, so it does the least it can: the
        pseudo-gradient is computed once, for the exchange and the new start alike, and
        the outer step was taken on copies of the global state in a thread as soon as the
        reduction landed (:func:`.delayed.step_aside`), so here it is only swapped in."""
        pending = self._in_flight.get(0)
        if self.step % self.inner_steps:
            if pending is not None and pending[1].done() and not pending[1].cancelled() \
                    and pending[1].exception() is not None:
                del self._in_flight[0]
                await self._outcome(pending[1])  # raises its error, ends the others
            return False
        assert self._origin is not None
        own = [np.subtract(o, a) for o, a in zip(self._origin, self.model.arrays, strict=True)]
        task = self._start(0, own)  # from where the round started
        retrieve_later(task)
        self._in_flight[0] = (self.step + self.inner_steps, task)
        if pending is not None:
            await self._take_prepared(pending[1])
        for local, origin, anchor, mine in zip(self.model.arrays, self._origin, self.anchor,
                                               own, strict=True):
            np.subtract(anchor, mine, out=local)
            np.copyto(origin, local)
        self._prepared = step_aside(self.outer, self.anchor, self.velocity, task)
        return pending is not None

    async def _take_prepared(self, exchange: asyncio.Task[list[np.ndarray]]) -> None:
        """Swap in the outer step of ``exchange``'s round (waiting for it if need be); its
        failure is raised as :meth:`_outcome` raises the exchange's."""
        prepared, self._prepared = self._prepared, None
        assert prepared is not None
        try:
            anchor, velocity = await prepared
        except asyncio.CancelledError:  # as one during an exchange: every one in flight
            prepared.cancel()  # ends, the group broken, and this round is not applied
            exchange.cancel()
            await self._end_in_flight(cancel=True)
            await asyncio.wait([exchange])
            raise
        except BaseException:
            await self._outcome(exchange)  # the exchange's error, the others ended
            raise
        self.anchor[:], self.velocity[:] = anchor, velocity
        self.outer_steps += 1

    async def flush(self) -> int:
        """Wait for the exchanges in flight and apply them now; returns how many.

        Raises and cancellation as :meth:`after_inner_step`.
        """
        done = 0
        for f in sorted(self._in_flight):
            _, task = self._in_flight.pop(f)
            if self._origin is None:
                self._apply(f, await self._outcome(task))
            else:
                await self._take_prepared(task)
            done += 1
        if self._origin is not None:  # every round applied: the next starts from the anchor
            for local, origin, anchor in zip(self.model.arrays, self._origin, self.anchor,
                                             strict=True):
                np.copyto(local, anchor)
                np.copyto(origin, anchor)
        return done

    async def _outcome(self, task: asyncio.Task[list[np.ndarray]]) -> list[np.ndarray]:
        """The averaged pseudo-gradients of one exchange, the one place that awaits them.

        When the exchange fails and takes the group with it (the group is no longer
        ``ready``), or this call is cancelled, the other exchanges in flight cannot finish
        either: they are ended here (cancelled if this call was) and awaited, so each ends
        with the group's error, retrieved, instead of being left running to be reported as
        a task exception never retrieved. A failure that leaves the group usable (a
        mismatch, NaN in a pseudo-gradient) leaves the others in flight, due as before.
        """
        try:
            return await task
        except asyncio.CancelledError:
            await self._end_in_flight(cancel=True)
            raise
        except BaseException:
            if self.group.state is not GroupState.READY:
                await self._end_in_flight(cancel=False)
            raise

    async def _end_in_flight(self, *, cancel: bool) -> None:
        """End every exchange still in flight and retrieve how each ended."""
        tasks = {task for _, task in self._in_flight.values()}
        if self._last is not None:
            tasks.add(self._last)
        self._in_flight.clear()
        self._last = None
        pending = {task for task in tasks if not task.done()}
        if cancel:
            for task in pending:
                task.cancel()
        if pending:
            # On a group that broke each of them fails at its next collective.
            await asyncio.wait(pending)
        for task in tasks:
            if not task.cancelled():
                task.exception()  # retrieved: the error is the group's, raised already

    def _start(self, f: int, delta: list[np.ndarray] | None = None
               ) -> asyncio.Task[list[np.ndarray]]:
        """Start fragment f's exchange: its pseudo-gradient (``delta``, or taken now),
        averaged in a task that waits for the previous exchange (so the collectives keep
        one order)."""
        pieces = self.fragments[f]
        base = self._origin if self._origin is not None else self.anchor
        if delta is None:
            delta = [p.of(base) - p.of(self.model.arrays) for p in pieces]
        round_no = state_of(self.group).take_round()  # now, in the same order on every rank
        specs = [TensorSpec.of(p.name, d) for p, d in zip(pieces, delta, strict=True)]
        # "step" and "this_fragment" sort after the settings, so a rank with another H or F
        # is told about that first (it is at another step too).
        settings = {**self.settings, "step": self.step, "this_fragment": f}
        previous = self._last
        residuals = (None if self.residuals is None
                     else [p.of(self.residuals) for p in pieces])

        # A fragment's first exchange also compares the global parameters it starts from:
        # ranks that were not given the same parameters would never hold the same state.
        first = f not in self._checked
        self._checked.add(f)
        anchors = [p.of(self.anchor).copy() for p in pieces] if first else None

        async def exchange() -> list[np.ndarray]:
            if previous is not None:
                await asyncio.wait([previous])  # its failure is its awaiter's to see
            try:
                await agree_on(self.group, "DiLoCo", round_no, settings, specs, self.timeout,
                               anchors)
            except ReplicaDivergence as exc:
                raise ReplicaDivergence(
                    f"DiLoCo started from different parameters on different ranks ({exc}); "
                    f"give every rank the same parameters before making it "
                    f"(training.broadcast_parameters)", exc.ranks, exc.tensor) from None
            if self.compressor is not None:
                averaged = await self.compressor.average(
                    self.group, delta, residuals, names=[s.name for s in specs],
                    round_no=round_no, nonfinite=self.nonfinite, strategy=self.strategy,
                    timeout=self.timeout)
            else:
                averaged = await average(
                    self.group, delta, names=[s.name for s in specs], codec=self.codec,
                    residuals=residuals, nonfinite=self.nonfinite, round_no=round_no,
                    bucket_bytes=self.bucket_bytes, strategy=self.strategy,
                    timeout=self.timeout, op=self.op, trim=self.trim)
            report_nonfinite("DiLoCo's averaged pseudo-gradient", [s.name for s in specs],
                             averaged, self.nonfinite, round_no)
            return averaged

        self._last = asyncio.ensure_future(exchange())
        self.traffic.rounds += 1
        self.traffic.sent_bytes += (
            wire_bytes(delta, self.codec) if self.compressor is None
            else self.compressor.message_bytes([d.size for d in delta], self.group.world_size))
        return self._last

    def _apply(self, f: int, averaged: list[np.ndarray]) -> None:
        """Fragment f's outer step on the global state, and the merge into the parameters."""
        pieces = self.fragments[f]
        self.outer.apply([p.of(self.anchor) for p in pieces],
                         [p.of(self.velocity) for p in pieces], averaged)
        for p in pieces:
            local, anchor = p.of(self.model.arrays), p.of(self.anchor)
            if self.mix == 0:
                np.copyto(local, anchor)
            else:
                alpha = local.dtype.type(self.mix)
                np.copyto(local, alpha * local + (local.dtype.type(1) - alpha) * anchor)
        self.outer_steps += 1


def _bucket_bytes(bucket_bytes: int | None) -> int:
    return DEFAULT_BUCKET_BYTES if bucket_bytes is None else bucket_bytes
