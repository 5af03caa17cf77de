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
- Per peer, :class:`Patience` keeps two moving averages over recent waits (weight
  :data:`WEIGHT`): how often the peer came early in the wait's budget (within half of
  it, or within the margin), and how late it was when it did.
- A wait polls for the largest budget among the peers it still waits for: twice that
  peer's usual lateness plus :data:`MARGIN` if it usually comes early; only the margin
  if it does not (a stopped, slow or computing partner, or one that shares this rank's
  core and cannot run while it polls: polling would only burn the core, or delay the
  partner and so teach a longer budget). Never more than the ceiling, ``P2PCOLL_SPIN``;
  0 never polls.
- Where the group has more peers than the host has cores, it yields the core between two
  polls (``sched_yield``), so that a partner waiting for a core gets this one instead of
  waiting for this rank's time slice to end. With a core per peer it does not: the
  partner is on a core of its own, and a yield would only hand this one to the host's
  other work (a CPU-bound process), for a whole time slice (Linux's EEVDF scheduler puts
  the yielder behind every other eligible task).
"""

from __future__ import annotations

import os
from collections.abc import Iterable

MARGIN = 5e-6  # seconds polled for any peer: one that is arriving right now
WEIGHT = 1 / 8  # of the newest wait in each moving average
HIT = 0.5  # poll for a peer that came early at least this often

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
        # Until a peer has been waited for, assume it comes soon (half the ceiling's worth
        # of lateness): a group starts polling and learns otherwise.
        self._hits = [1.0] * world_size
        self._late = [self.ceiling / 4] * world_size

    def budget(self, ranks: Iterable[int]) -> float:
        """Seconds to poll for ``ranks`` (those not there yet) before sleeping."""
        if not self.ceiling:
            return 0.0
        most = 0.0
        for q in ranks:
            if self._hits[q] >= HIT:
                most = max(most, 2 * self._late[q] + MARGIN)
            else:
                most = max(most, MARGIN)
        return min(most, self.ceiling)

    def learn(self, rank: int, late: float, budget: float) -> None:
        """Peer ``rank`` published ``late`` seconds after this rank began to wait for it
        (0 or less: it was there first) in a wait that polled for ``budget`` seconds.

        It came early if within half the budget (or the margin): a partner that comes
        only towards the budget's end may have been waiting for this rank's core."""
        hit = late <= max(budget / 2, MARGIN)
        self._hits[rank] += WEIGHT * (hit - self._hits[rank])
        if hit:
            self._late[rank] += WEIGHT * (max(late, 0.0) - self._late[rank])

    def usual(self, rank: int) -> tuple[float, float]:
        """How often peer ``rank`` came early, and how late it was when it did (seconds):
        the moving averages the budget comes from."""
        return self._hits[rank], self._late[rank]


__all__ = ["MARGIN", "Patience", "yield_core"]
