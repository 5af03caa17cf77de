"""Elastic training: rounds that go on when peers die, and take in peers that arrive.

    async def step(group, round, params):          # this rank's gradients for this round
        shard = batch_of(round)[group.rank::group.world_size]
        return gradients(params, shard)

    def apply(params, grads, round):               # the same update on every rank, in place
        for name, p in params.items():
            p -= lr * grads[name]

    result = await training.train_elastic(step, apply, params, rounds=1000,
                                          min_world_size=2, max_world_size=4)

Like torchelastic, Horovod elastic or torchft, but in the process: nothing restarts. Each
peer runs :func:`train_elastic`, which joins an elastic group (:func:`p2pcoll.join` with
``min_world_size``/``max_world_size``) and runs rounds in it. In round ``r`` every rank
calls ``step(group, r, state)`` for its gradients, the group reduces them
(:func:`allreduce_gradients`) and every rank calls ``apply(state, reduced, r)``. When a
peer dies (the round fails with :class:`~p2pcoll.PeerLost`, :class:`~p2pcoll.GroupBroken`
or :class:`~p2pcoll.CollectiveTimeout`), the survivors form a new group among themselves
(:mod:`.shrinking`: ``Group.shrink``, no rendezvous) or, when they cannot, close the group
and join anew, passing their old rank as ``order`` so they keep their order; when peers wait at the
rendezvous, everyone closes and joins anew at the next round boundary so they get in. Each
new group starts with a *formation*: the ranks compare their round counters (one small
allgather), and the rank with the highest counter (ties: the lowest rank, so the lowest
old rank among the survivors) is the source of the state; a newcomer has no counter and
always receives. Every member at the highest counter holds the same bits, so each of them
sends a stripe of the state to those behind, every range checked against the digest they
agree on (:func:`~p2pcoll.training.heal.heal`: a heal from every survivor; a range a lost
member did not send is fetched from the others in the next group). Everyone then goes on
from that same (round, state).

Exactly once. A rank's round counter ``c`` and its state ``S`` change only together, and
only in two ways, each with no ``await`` inside, so nothing (no failure, no cancellation)
can come between the two halves:

- *applying* round ``c``: once the allreduce of round ``c`` has returned on this rank,
  ``apply`` runs and ``c`` becomes ``c + 1``. If the allreduce fails, neither changes.
- *adopting* at a formation: the source's state is received into fresh buffers and
  copied over ``S``, with its counter, only once every range has arrived and matched its
  digest (a heal cut off half-way leaves ``S`` and ``c`` as they were).

So a rank's pair always satisfies: ``S`` is the initial state updated by rounds
``0 .. c-1``, each exactly once, in order (by induction: applying extends such a pair by
one round, adopting replaces it by another such pair). A round is reduced over the group
that ran it, and its result is the same bits on every rank that completed it, so ranks with
the same counter in one group hold the same state, and after every formation all members
hold the source's pair. The ambiguous case is a failure during round ``r``'s allreduce,
which may complete on some ranks and not on others: those hold ``(r + 1, S')``, the others
``(r, S)``. At the formation the highest counter wins, so everyone takes ``(r + 1, S')`` and
nobody runs round ``r`` again; if every rank that completed it died, the survivors all hold
``(r, S)`` and run round ``r`` again in the new group, exactly once in what survives. Counters
of one group differ by at most one (a rank cannot finish round ``r + 1`` without the
others' part of it). The heal never reads a half-applied state, since ``apply``
is a plain function, not a coroutine. Finishing is the one place no protocol can agree
(two generals): if round ``rounds - 1``'s allreduce completes on some ranks, which return,
and fails on others, the others run it again without them and may end with other bits.

Admission. At each round boundary rank 0 asks the rendezvous how many peers wait
(:func:`p2pcoll.rendezvous.client.waiting`), in the background and at most every
``poll_every`` seconds, and the answer rides in that round's allreduce as one extra element
(``"p2pcoll.admit"``, in a bucket of the gradients' own dtype), instead of a broadcast of
its own: no extra message per round, and every rank that completes the round learns the
decision with the round itself. A full group (``max_world_size`` members) does not ask.
The members then join expecting themselves and the peers counted, and keep the old group
open meanwhile: a member lost on the way lowers that count (:mod:`.admitting`), so the
group forms without it at once. With ``delay=1`` each member starts that join as soon as the
reduction tells it, beside its step of the next round, so the members arrive together and a
newcomer who came after the count does not take a slow member's place.

Pipelined rounds (``delay=1``, :mod:`.elastic_delayed`): round r's reduction runs while
round r + 1's step computes; each rank also holds the contributions it computed and has
not seen applied, and a formation reduces the round in flight again over the members that
hold one (zeros from the others), so the pair above still changes only in the two ways
described, and each round is applied exactly once. Every formation starts with the ranks
agreeing on ``delay`` and ``settings`` (a :class:`~p2pcoll.CollectiveMismatch` naming the
first that differs, before the state moves).

Formation. The rendezvous forms a group once ``max_world_size`` peers are there, or at
least ``min_world_size`` are and nobody new arrived for a second; after a loss, survivors
that cannot shrink expect themselves and the peers counted waiting, and the group forms
as soon as those are there. A join that fails for a
passing reason (a peer lost while the group formed, the rendezvous host gone while another
takes over) is tried again until the join timeout; when that passes with fewer than
``min_world_size`` peers at the rendezvous, :class:`WorldTooSmall` says how many there were.

What to know:

- Put everything that must survive in ``state`` (weights and optimizer moments): it is
  what the formation copies. ``step`` must not change it; ``apply`` changes it in place.
- The data shard of a round must depend only on ``(round, group.rank, group.world_size)``
  for a redone round to be the same computation on the new group. With ``op="sum"`` and
  gradients divided by the global batch size, each round's update is the mean over the whole
  global batch, whatever the world size (see ``examples/train_elastic.py``); with
  ``op="avg"`` it is the mean of the ranks' means.
- Two groups of one job can run at once if ``2 * min_world_size`` peers or more are alive:
  peers beyond ``max_world_size`` that wait while a full group runs form a group of their
  own once ``min_world_size`` of them are there (and start from round 0), and so do the
  sides of a partition. Each is a valid run; where they meet at a later formation, the
  most advanced state wins and the other's rounds are dropped, never mixed. Start at most
  ``max_world_size`` peers, or keep ``min_world_size`` above half of them.
- A peer that arrives after the job finished waits for the join timeout and then raises
  :class:`WorldTooSmall`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from ..api import join
from ..errors import CollectiveTimeout, GroupBroken, PeerLost, RendezvousError, SettingsError
from ..pytree import Pytree, as_array, named_leaves
from ..settings import Settings, check_seconds
from .agreement import NOT_A_ROUND
from .census import Census
from .delayed import check_delay
from .elastic_delayed import (ADMIT, HOLDERS, OPS, check_robust, train_delayed,
                              zeros_from_holder)
from .elastic_result import ElasticResult, Formation
from .errors import WorldTooSmall
from .gradients import allreduce_gradients
from .modes import agree_on
from .nonfinite import Nonfinite
from .heal import HealFailed, HealProgress, heal
from .admitting import live, watch
from .shrinking import shrunk, survivors

if TYPE_CHECKING:
    from .. import Group

__all__ = ["ADMIT", "ElasticResult", "Formation", "train_elastic"]

log = logging.getLogger("p2pcoll.training")

Step = Callable[["Group", int, Pytree], Awaitable[Mapping[str, Any]]]
Apply = Callable[[Pytree, dict[str, Any], int], None]

# The failures of a round or a formation after which the survivors form a new group.
RECOVERABLE = (PeerLost, GroupBroken, CollectiveTimeout)
RETRY_S = 0.2  # pause before joining again after a join that failed for a passing reason
CENSUS_S = 1.0  # how often the peers at the rendezvous are counted while joining



async def train_elastic(
    step: Step,
    apply: Apply,
    state: Pytree,
    *,
    rounds: int,
    min_world_size: int | None = None,
    max_world_size: int | None = None,
    rendezvous: str | None = None,
    timeout: float | None = None,
    poll_every: float = 1.0,
    op: Literal["avg", "sum", "median", "trimmed_mean"] = "avg",
    trim: int | None = None,
    bucket_bytes: int | None = None,
    strategy: str | None = None,
    nonfinite: Nonfinite = "raise",
    codec: str | None = None,
    delay: int = 0,
    settings: Mapping[str, Any] | None = None,
    **join_kwargs: Any,
) -> ElasticResult:
    """Run rounds ``0 .. rounds-1`` in elastic groups, each exactly once (module docstring).

    Args:
        step: ``await step(group, round, state)`` returns this rank's gradients for the
            round, a dict of name -> array (or pytree), the same names, shapes and dtypes on
            every rank. It reads ``state``, never changes it; it may run collectives on
            ``group`` if every rank runs the same ones.
        apply: ``apply(state, grads, round)`` applies the reduced gradients to ``state`` in
            place. A plain function: it must not await, so a round is applied whole or not.
        state: a pytree of writable arrays (numpy, or CPU torch tensors): the weights and
            whatever else must survive. A newcomer passes arrays of the right shapes and
            dtypes (its initial weights): they are overwritten by the group's.
        rounds: how many rounds the job runs.
        min_world_size, max_world_size: the elastic bounds (``$P2PCOLL_MIN_WORLD_SIZE``,
            ``$P2PCOLL_MAX_WORLD_SIZE``); the minimum must be given, no maximum means no bound.
        rendezvous: ``"tcp://HOST:PORT"`` (``$P2PCOLL_RENDEZVOUS``, ...): required.
        timeout: seconds each (re)formation may take (``$P2PCOLL_JOIN_TIMEOUT``, 60 s), the
            time a replacement has to arrive when the survivors are too few.
        poll_every: rank 0 asks the rendezvous whether peers wait at most this often.
        op: "avg" or "sum" (see the module docstring), or the robust "median" or
            "trimmed_mean" (with ``trim=k``, ``2 * k < min_world_size``; no codec): one bad
            peer cannot move a round's update (:meth:`p2pcoll.Group.allreduce`);
            bucket_bytes, strategy, nonfinite, codec: as :func:`allreduce_gradients`. Under
            a lossy codec each group keeps its own error-feedback residuals: a
            re-formation starts them again from zero.
        delay: 0, or 1: round r's reduction runs while round r + 1's step computes, and
            is applied after it (:mod:`.elastic_delayed`: what a peer that joins or leaves
            mid-round contributes). ``step`` then must not run collectives, and must
            return a flat dict of name -> array.
        settings: what every rank must agree on besides ``delay`` (a dict of JSON-able
            values, :attr:`DiLoCoRounds.settings`), checked at each formation before the
            state moves.
        **join_kwargs: other arguments of :func:`p2pcoll.join` (``key_file``,
            ``heartbeat_timeout``, ``job_id``, ``collective_timeout``, ``transport``,
            ``strategies``); not ``world_size``, ``rank``, ``order`` or ``expect``.

    Returns:
        An :class:`ElasticResult`; ``state`` holds round ``rounds - 1``'s update.

    Raises:
        WorldTooSmall: a (re)formation found fewer than ``min_world_size`` peers within
            the join timeout.
        SettingsError: a bad setting, no rendezvous address or no minimum, or a fixed
            world size or rank in the environment (``$WORLD_SIZE``, ``$RANK``: a launcher's).
        TypeError, ValueError: bad arguments; ``step`` returned something that is not a
            dict, or one that holds ``"p2pcoll.admit"``.
        RendezvousError: the rendezvous rejected this peer (bounds that disagree with the
            others') or the handshake with it failed (another job key).
        CollectiveMismatch, NonFiniteGradients: as :func:`allreduce_gradients` (the ranks
            disagree about the gradients; NaN or Inf), or the ranks disagree on ``delay``
            or ``settings`` (named): these are not recovered from.
        HealFailed: the members that hold the state disagree on its bytes with no majority,
            none sent a range intact, or every one was lost while this rank received it.
        Whatever ``step`` or ``apply`` raise, other than the failures recovered from.

    Cancellation: closes the group; ``state`` holds a whole number of rounds (the round in
        progress is not applied).
    """
    for name in ("world_size", "rank", "order", "expect"):
        if name in join_kwargs:
            raise TypeError(f"train_elastic assigns {name}; do not pass {name}=")
    if not isinstance(rounds, int) or isinstance(rounds, bool) or rounds < 0:
        raise ValueError(f"rounds must be an int >= 0, got {rounds!r}")
    check_seconds(poll_every, "poll_every=")
    if op not in OPS:
        raise ValueError(f"op must be one of {', '.join(map(repr, OPS))}, got {op!r}")
    check_delay(delay)
    given = dict(settings) if settings is not None else {}
    for name, value in (("op", op), ("trim", trim)):
        if name in given and given[name] != value:
            raise ValueError(f"settings say {name}={given[name]!r} but train_elastic was "
                             f"given {name}={value!r}: pass the same (DiLoCoRounds' op/trim)")
    agreed = {**given, "delay": delay, "op": op, "trim": trim}
    run = _Run(step, apply, state, rounds, poll_every, agreed,
               {"op": op, "trim": trim, "bucket_bytes": bucket_bytes, "strategy": strategy,
                "nonfinite": nonfinite, "codec": codec},
               {"rendezvous": rendezvous, "min_world_size": min_world_size,
                "max_world_size": max_world_size, "timeout": timeout, **join_kwargs})
    return await run.run()


class _Run:
    """One rank's elastic run: its (round, state) pair and the groups it goes through."""

    def __init__(self, step: Step, apply: Apply, state: Pytree, rounds: int,
                 poll_every: float, agreed: dict[str, Any], reduce: dict[str, Any],
                 joining: dict[str, Any]) -> None:
        self.step, self.apply, self.state, self.rounds = step, apply, state, rounds
        self.agreed, self.delay = agreed, agreed["delay"]
        self.poll_every, self.reduce, self.joining = poll_every, reduce, joining
        self.leaves = [as_array(leaf, path) for path, leaf in named_leaves(state)]
        for (path, _), array in zip(named_leaves(state), self.leaves, strict=True):
            if not array.flags.writeable:
                raise ValueError(f"state {path!r} is read-only; a formation writes into it")
        self.settings = _elastic_settings(join(**joining).settings)  # checked, nothing opened
        # The smallest group a round may run in must leave something after the trim.
        check_robust(reduce["op"], reduce["trim"], reduce["codec"],
                     self.settings.min_world_size or 1)
        self.round = 0
        self.synced = False  # whether (round, state) came from a formation: a newcomer's not
        self.order: int | None = None  # the last group's rank, this rank's place in the next
        self.expect: int | None = None  # how many peers the next join expects, if known
        self.admitted = 0  # how many peers waited when the last admission was decided
        self.started = -1  # the highest round whose step this rank ran
        self.redone = 0
        self.formations: list[Formation] = []
        # delay=1 (elastic_delayed): this rank's contributions by round, not yet applied;
        # how many members hold one for the round in flight; zeros for a member that does not.
        self.held: dict[int, dict[str, Any]] = {}
        self.holders = 0
        self.zeros: dict[str, Any] | None = None
        # delay=1: holders of the round after the one in flight, computed before a
        # formation (0: every member computes it); a step that runs across a re-formation.
        self.next_holders = 0
        self.computing: tuple[int, asyncio.Task[dict[str, Any]]] | None = None
        self.stale: Group | None = None  # the group ``computing``'s step runs in
        self.healing = HealProgress()  # what this rank holds of a heal a loss cut short
        self.early: asyncio.Task[Group] | None = None  # the join after an admission

    async def run(self) -> ElasticResult:
        try:
            group = await self._join()
            shrank = False
            while True:
                self.order = group.rank
                formation: Formation | None = None
                following: Group | None = None
                try:
                    formation = await self._sync(group)
                    formation.shrunk = shrank
                    formation.ended = await self._train(group, formation)
                except RECOVERABLE as exc:
                    why = f"{type(exc).__name__}: {exc}"
                    if formation is not None:
                        formation.ended = why
                    log.warning("elastic: rank %d of %d at round %d: %s; forming a new group",
                                group.rank, group.world_size, self.round, why)
                    await self._drop_early()
                    census = Census(self.settings, CENSUS_S)
                    try:
                        following = await shrunk(group, self.settings.min_world_size or 1,
                                                 census.ask)
                        if following is None:  # to the rendezvous: who is coming there
                            waiting = await census.ask()
                            self.expect = (None if waiting is None
                                           else len(survivors(group)) + waiting)
                    finally:
                        await census.aclose()
                finally:
                    admitting = formation is not None and formation.ended == "admitting"
                    if self.computing is not None and self.stale is None:
                        self.stale = group  # the step still reads it: closed once it is done
                    elif not admitting:  # (a step from an earlier group reads that one)
                        await group.close()
                if self.round >= self.rounds:
                    if following is not None:
                        await following.close()
                    if admitting and group is not self.stale:
                        await group.close()
                    return ElasticResult(self.state, self.formations, self.redone)
                # delay=1: the next round's step goes on meanwhile (self.computing).
                shrank = following is not None
                if following is not None:
                    group = following
                elif not admitting:
                    group = await self._join()
                else:  # the old group stays open while its members join: it tells a loss
                    old = group
                    try:
                        group = await self.join_early(old)
                    finally:
                        self.early = None
                        if old is not self.stale:
                            await old.close()
        finally:
            await self._drop_early()
            if self.computing is not None:  # not taken into a formation: nobody needs it
                self.computing[1].cancel()
                with contextlib.suppress(Exception, asyncio.CancelledError):
                    await self._computed()

    def join_early(self, old: Group) -> asyncio.Task[Group]:
        """The join after an admission, started (once) as soon as the members learn of it
        (delay=1: before the step of the next round ends; :func:`train_delayed`), so
        that they reach the rendezvous together, not each when its own step ends: a
        newcomer who came after the count is then not formed in place of a slow member."""
        if self.early is None:
            self.expect = len(live(old)) + self.admitted
            self.early = asyncio.ensure_future(self._join(old))
        return self.early

    async def _drop_early(self) -> None:
        """End an early join nobody took (a failure came first); close its group."""
        early, self.early = self.early, None
        if early is not None and not early.done():
            early.cancel()
        if early is not None:
            await asyncio.wait([early])
            if not early.cancelled() and early.exception() is None:
                await early.result().close()

    async def take_step(self) -> None:
        """The step that ran while the group re-formed, if one did, into ``held``."""
        if self.computing is not None:
            r = self.computing[0]
            computed = await self._computed()
            assert computed is not None
            self.held[r] = computed

    async def _computed(self) -> dict[str, Any] | None:
        """The result of the step that ran while the group re-formed, if one did (then the
        group it ran in is closed)."""
        if self.computing is None:
            return None
        _, task = self.computing
        self.computing = None
        try:
            await asyncio.wait([task])
            return task.result()
        finally:
            if self.stale is not None:
                await self.stale.close()
                self.stale = None

    async def _join(self, old: Group | None = None) -> Group:
        """A new elastic group, trying again after passing failures until the join timeout;
        ``old``: the group its members leave to admit newcomers, watched meanwhile (a
        member lost on the way lowers what the group forming expects: :func:`watch`).

        Raises:
            WorldTooSmall: the timeout passed with fewer than the minimum at the rendezvous.
            RendezvousError: this peer was rejected or the handshake failed; or the timeout
                passed although enough peers were there (the last attempt's error).
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.join_timeout
        census = Census(self.settings, CENSUS_S)
        counts: list[int] = []
        counting = asyncio.create_task(census.count_into(counts))
        watching = (asyncio.create_task(watch(old, census, self.admitted))
                    if old is not None else None)
        last: RendezvousError | None = None
        try:
            while (left := deadline - loop.time()) > 0:
                try:
                    return await join(**{**self.joining, "order": self.order,
                                         "expect": self.expect, "timeout": left})
                except RendezvousError as exc:
                    if exc.permanent:  # rejected, or not this job's rendezvous
                        raise
                    last = exc
                    log.info("elastic: joining again: %s", exc)
                await asyncio.sleep(min(RETRY_S, max(0.0, deadline - loop.time())))
        finally:
            self.expect = None  # said once: the join after the next loss counts again
            for task in (counting, watching):
                if task is not None:
                    task.cancel()
            await asyncio.gather(counting, *[watching] if watching else [],
                                 return_exceptions=True)
            await census.aclose()
        low = self.settings.min_world_size
        assert low is not None  # checked by _elastic_settings
        found = max(counts, default=None)  # the most that were there at once
        if found is not None and found >= low and last is not None:
            raise last  # enough peers came, and the group still did not form
        raise WorldTooSmall(
            f"elastic training needs at least {low} peers, and "
            + (f"only {found} {'was' if found == 1 else 'were'} at the rendezvous"
               if found is not None else "fewer came to the rendezvous")
            + f" {self.settings.rendezvous} for {self.settings.join_timeout:g}s (at round "
            f"{self.round}); start more peers, or lower min_world_size",
            minimum=low, found=found, round=self.round,
        ) from last

    async def _sync(self, group: Group) -> Formation:
        """The formation: everyone takes the (round, state) of the most advanced member.

        Cancellation, or a failure: ``state`` and the round are as they were, or the
        source's, never a mix.
        """
        await agree_on(group, "train_elastic", NOT_A_ROUND, self.agreed, [], None)
        mine = self.round if self.synced else -1  # a newcomer has no state to offer
        # A step that runs on while the group re-forms counts as held: it is taken below.
        computing = [self.computing[0]] if self.computing is not None else []
        held = sorted({*self.held, *computing})[-2:] if self.synced else []
        counters = await group.allgather(np.array([mine, *held, *[-1] * (2 - len(held))],
                                                  np.int64))
        have = [int(c[0]) for c in counters]
        top = max(have)
        source = have.index(top)  # the first of the highest: the lowest rank
        if top < 0 and self.healing.held:
            raise HealFailed(
                f"elastic: every member that held the state was lost while this rank "
                f"received it ({len(self.healing.held)} ranges received), and no member "
                f"of the new group holds it: not starting over from this rank's own state",
                ranges=sorted(self.healing.held), bad=[])
        m = max(top, 0)
        holding = [r for r, c in enumerate(counters) if m in c[1:].tolist()]
        # Every member at the top counter holds the same bits: each serves a stripe.
        sources = [r for r, h in enumerate(have) if h == top] if top >= 0 else [source]
        # A source's step goes on during the heal, which only reads the state; a receiver's
        # ends first, since the heal then writes the state the step reads.
        if have[group.rank] < top:
            await self.take_step()
        if group.world_size > 1:  # a receiver's state changes all at once, or not at all
            # yielding=False: every member waits for the heal, its hashing comes first
            await heal(group, self.state, sources, progress=self.healing, yielding=False)
        # delay=1: round m is reduced again over its holders, round m + 1 over those that
        # computed it already, if any (elastic_delayed's rule).
        following = ([r for r, c in enumerate(counters) if m + 1 in c[1:].tolist()]
                     if holding else [])
        if self.computing is not None and not (self.computing[0] == m + 1 and following):
            await self.take_step()  # one the group has no use for (dropped below)
        # else round m + 1's step goes on: round m's reduction overlaps it (train_delayed)
        self.round, self.synced = m, True
        self.held = {r: c for r, c in self.held.items()
                     if (r == m and group.rank in holding) or (r == m + 1 and following)}
        self.holders, self.next_holders = len(holding), len(following)
        self.zeros = None
        if holding and min(len(holding), len(following) or group.world_size) < group.world_size:
            self.zeros = await zeros_from_holder(group, self.held.get(m), holding[0])
        formation = Formation(group.rank, group.world_size, self.round, source)
        self.formations.append(formation)
        log.info("elastic: rank %d of %d from round %d (state of rank %d)", group.rank,
                 group.world_size, self.round, source)
        return formation

    async def compute(self, group: Group, r: int) -> dict[str, Any]:
        """``step(group, r, state)``, counted (a round computed again is ``redone``).

        Raises:
            TypeError, ValueError: it returned no dict, or one with a name train_elastic
                uses (or, with delay=1, not a flat one).
        """
        if r <= self.started:
            self.redone += 1
        self.started = max(self.started, r)
        grads = await self.step(group, r, self.state)
        if not isinstance(grads, Mapping):
            raise TypeError(f"step must return a dict of gradients, got "
                            f"{type(grads).__name__}")
        for name in (ADMIT, HOLDERS):
            if name in grads:
                raise ValueError(f"a gradient is named {name!r}, the name train_elastic uses")
        if self.delay and any(isinstance(v, (Mapping, list, tuple)) for v in grads.values()):
            raise ValueError("with delay=1, step must return a flat dict of name -> array")
        return dict(grads)

    async def _train(self, group: Group, formation: Formation) -> str:
        """Rounds in ``group`` until the last, or until peers wait to get in."""
        high = self.settings.max_world_size
        census = (Census(group.settings, self.poll_every)
                  if group.rank == 0 and (high is None or group.world_size < high) else None)
        try:
            if self.delay:
                return await train_delayed(
                    self, group, formation.applied,
                    lambda: (census.fresh() or 0) if census is not None else 0)
            while self.round < self.rounds:
                r = self.round
                grads = await self.compute(group, r)
                flag = (census.fresh() or 0) if census is not None else 0
                payload = _with_flag(grads, flag, group.world_size, self.reduce["op"])
                if self.reduce["codec"] is None and self.reduce["op"] in ("avg", "sum"):
                    # the flag rides in the round's buckets
                    reduced = await allreduce_gradients(group, payload, round=r,
                                                        **self.reduce)
                    admit = round(float(reduced.pop(ADMIT)[0]))
                else:
                    # Not in a compressed bucket: int8's block scale, taken from large
                    # gradients, could round the flag to 0; nor under a median, which
                    # would drop rank 0's vote. One exact allreduce of its own.
                    del payload[ADMIT]
                    got = await group.allreduce(np.array([flag], np.int64), "max")
                    reduced = await allreduce_gradients(group, payload, round=r,
                                                        **self.reduce)
                    admit = int(got[0])
                # No await from here on: round r is applied whole, with the counter.
                self.apply(self.state, reduced, r)
                self.round = r + 1
                formation.applied.append(r)
                if admit and self.round < self.rounds:
                    log.info("elastic: peers wait to join; forming a new group after round %d",
                             r)
                    self.admitted = admit
                    return "admitting"
            return "finished"
        finally:
            if census is not None:
                await census.aclose()


def _elastic_settings(settings: Settings) -> Settings:
    """``settings`` if they describe an elastic group.

    Raises:
        SettingsError: a fixed world size or rank, no minimum, or no rendezvous.
    """
    if settings.world_size is not None or settings.rank is not None:
        raise SettingsError(
            "train_elastic forms elastic groups, but a fixed world size or rank is set (by "
            "$WORLD_SIZE / $RANK, or a launcher's equivalents): start the peers without them",
            name="world_size", value=settings.world_size, allowed="unset")
    if settings.min_world_size is None:
        raise SettingsError(
            "train_elastic needs min_world_size= (or $P2PCOLL_MIN_WORLD_SIZE)",
            name="min_world_size=", allowed="an integer >= 1")
    if settings.rendezvous is None:
        raise SettingsError(
            "train_elastic needs a rendezvous address: rendezvous='tcp://HOST:PORT' or "
            "$P2PCOLL_RENDEZVOUS", name="rendezvous=", allowed="tcp://HOST:PORT")
    return settings


def _with_flag(grads: Mapping[str, Any], admit: int, world_size: int, op: str
               ) -> dict[str, Any]:
    """``grads`` and rank 0's admission count (how many wait; 0 elsewhere), in the dtype of
    the first float gradient (so it shares a bucket); reduced, it is rank 0's count."""
    if not isinstance(grads, Mapping):
        raise TypeError(f"step must return a dict of gradients, got {type(grads).__name__}")
    if ADMIT in grads:
        raise ValueError(f"a gradient is named {ADMIT!r}, the name train_elastic uses")
    dtypes = [as_array(leaf, path).dtype for path, leaf in named_leaves(dict(grads))]
    dtype = next((d for d in dtypes if d.kind == "f"), np.dtype(np.float64))
    scale = world_size if op == "avg" else 1  # avg divides by the world size
    return {**grads, ADMIT: np.array([scale * admit], dtype)}
