"""Hybrid waiting: how long a board collective polls for its peers before it sleeps.

A rank that waits on the board for a peer's count can poll (it sees the count within a
microsecond of its publication, and burns its core meanwhile) or sleep (it burns nothing;
the publisher writes into its wake-up pipe and the scheduler has to run it again: some
tens of microseconds on a quiet host, up to a scheduler slice on a busy one). The
progress engines of Open MPI and UCX poll without end; UCC polls a bounded count
(``n_polls``) and then blocks. A board wait polls for a budget learned per peer, then
sleeps (:meth:`BoardPath._wait <p2pcoll.engine.board_path.BoardPath>`):

- Every rank stamps each publication with the host's monotonic clock (the board's STAMP
  word), so a waiting rank learns how late each partner arrived, whether it polled until
  then or slept.
- Per peer, :class:`Patience` keeps a moving average over recent waits (weight
  :data:`WEIGHT`) of how often the peer came early: within half the ceiling.
- Every wait first polls for :attr:`Patience.quick` (the margin, or half the ceiling if
  less), without asking for a budget: a partner found meanwhile came early. While every
  peer has lately come early (:attr:`Patience.sure`), such a wait teaches nothing and
  ends there; it is most waits (a partner a few microseconds behind, as after a
  barrier), so the policy costs them no more than a plain poll.
- A wait polls for the ceiling, ``P2PCOLL_SPIN`` (0 never polls), if every peer it
  still waits for usually comes early, else for :data:`MARGIN` only: a stopped, slow
  or computing partner, or one that shares this rank's core and cannot run while it
  polls (it comes at the budget's end, not early), would only cost the core.
- One wait in :data:`PROBE` for a partner that usually comes late polls the ceiling
  anyway. Two ranks that both sleep keep each other late: each publishes a wake-up after
  the other, so each sees the other late by a wake-up however short it is, and neither
  would poll again. A probe that catches its partner (a wake-up within the ceiling) puts
  the two back in step: next time both publish together and find each other early. A
  partner late for its own reasons costs a probe of the ceiling in :data:`PROBE` waits.
- Where the group has more peers than the host has cores ("crowded"), a wait yields the
  core between two polls (``sched_yield``), so that a partner waiting for a core gets this
  one instead of waiting for this rank's time slice to end, and only the time it held the
  core (its thread's CPU time) counts against its budget: the time a yield gives away
  runs a partner (or the host's other work), which is no cost of the wait. A partner
  found while it polled came within that time. Counted on the clock, as before, the time
  a yield gave a partner used the budget up and made the partner "late": on 2 cores with
  4 or 8 ranks every budget fell to the margin, and every rank slept at nearly every
  collective, a wake-up each, one after another on the shared cores. A crowded wait
  polls at most a sleep's first nap on the clock (``MIN_NAP`` of the board path), so
  that it notices a failure as soon as a sleeping one. On a busy host partners still
  come late (the host's other work has the cores), and the budget falls to the margin
  as with a core per peer: polling there would burn what the partners need.
- With a core per peer a wait does not yield: the partner is on a core of its own, and a
  yield would only hand this one to the host's other work (a CPU-bound process), for a
  whole time slice (Linux's EEVDF scheduler puts the yielder behind every other eligible
  task).
"""

from __future__ import annotations

import os
from collections.abc import Iterable

MARGIN = 5e-6  # seconds polled for any peer: one that is arriving right now
WEIGHT = 1 / 8  # of the newest wait in each moving average
HIT = 0.5  # poll for a peer that came early (within half the ceiling) this often
PROBE = 16  # one wait in this many polls the ceiling for a peer that usually comes late
# A moving average above this is 1 (it would only approach 1: 1 - 2**-52 plus an eighth
# of the gap rounds back to itself), so that a run of early arrivals settles exactly.
SURE = 1 - 1e-6

# Gives the core to another runnable task, if any (Linux; the board only runs there).
yield_core = getattr(os, "sched_yield", lambda: None)


class Patience:
    """The polling budget of one rank's board waits, learned per peer (see the module
    docstring).

    Args:
        ceiling: the most any wait polls, in seconds (``P2PCOLL_SPIN``); 0: never.
        world_size: the group's size (peers are ranks ``0 .. world_size - 1``).
    """

    def __init__(self, ceiling: float, world_size: int) -> None:
        self.ceiling = max(0.0, ceiling)
        self._early = self.ceiling / 2  # a peer that comes within this came early
        #: Seconds every wait polls before it asks for a budget: a peer found meanwhile
        #: came early.
        self.quick = min(MARGIN, self._early)
        # Until a peer has been waited for, assume it comes early: a group starts
        # polling and learns otherwise.
        self._hits = [1.0] * world_size
        self._unsure = 0  # peers whose average is below 1
        self._doubts = 0  # budgets given for a late peer: every PROBE-th polls anyway
        #: Whether every peer came early lately (every average is 1): then an early
        #: arrival teaches nothing, and a wait need not :meth:`learn` it.
        self.sure = True

    def budget(self, ranks: Iterable[int]) -> float:
        """Seconds to poll for ``ranks`` (those not there yet) before sleeping; each call
        is a wait (it counts towards the next probe)."""
        if not self.ceiling:
            return 0.0
        hits, budget = self._hits, 0.0
        for q in ranks:
            if hits[q] < HIT:  # it has to wait for this one anyway, unless it probes
                self._doubts += 1
                return self.ceiling if not self._doubts % PROBE else min(MARGIN, self.ceiling)
            budget = self.ceiling
        return budget

    def learn(self, rank: int, late: float) -> None:
        """Peer ``rank`` published ``late`` seconds after this rank began to wait for it
        (0 or less: it was there first)."""
        hits = self._hits
        before = hits[rank]
        now = before + WEIGHT * ((late <= self._early) - before)
        if now > SURE:
            now = 1.0
        hits[rank] = now
        if (before == 1.0) is not (now == 1.0):
            self._unsure += 1 if before == 1.0 else -1
            self.sure = not self._unsure

    def usual(self, rank: int) -> float:
        """How often peer ``rank`` came early recently (the moving average)."""
        return self._hits[rank]


__all__ = ["MARGIN", "PROBE", "Patience", "yield_core"]
