"""Suspects: the peers whose link or probe went down, and what becomes of each.

A heartbeat that stops is not a death. libzmq answers a probe's heartbeats on its own I/O
thread, so a peer whose event loop is held (a long synchronous compute step, a call that
holds the GIL) keeps its probes up; but on a host so crowded that a watcher is not
scheduled while its heartbeat's timer runs out, it loses a probe though both processes
are alive. So a suspect's address is asked
(the session's check) and :func:`verdict` decides, from what it found and from this
peer's own clock:

- :data:`~p2pcoll.errors.KILLED`: nothing listens at its address: lost.
- :data:`~p2pcoll.errors.UNRESPONSIVE`: its kernel accepts a connection, but nothing greets
  on it (the process is stopped, or frozen): lost.
- :data:`ALIVE`: its ZeroMQ I/O thread greets a new connection: the process runs. A
  suspect that only lost its probe (:attr:`Suspect.probe_only`) right after this peer's
  own clock ran late (:attr:`Suspect.late`: its ticks came more than half the stall apart,
  so it was starved too, and its probe's timer may have run out before it read the
  answer) is kept and watched anew: a crowded host, not a death. Otherwise it is lost
  (as unresponsive: it did miss its heartbeats while this peer ran, and what its
  connections carried may be lost with them, as in a reset), once its grace is over,
  unless it said goodbye; so is one whose data link went down too.
- ``""`` (could not be asked: an endpoint not of tcp or ipc) or no answer yet: lost once
  its grace is over (held up to ``CHECK_WAIT`` for the answer).

A suspect that this peer's own clock saw right after a gap (this peer's events stopped for
longer than the heartbeat timeout: :attr:`Suspect.after_gap`) and that is found alive was
lost by this peer's own stop: its heartbeats' timers ran out while its process did not
run. Its watchers lost it likewise, but they too ask its address, and keep it if it
answered by then: so it declares itself lost (verdict ``"self"``) only after a gap longer
than their probe and their check together (``stopped_past``), when they have surely found
it silent. After a shorter one it keeps the suspect, as they most likely kept it. After
any gap it asks them, once, whether they declared it lost (one that did answers so, within
the suspect's grace, and it is the lost one then: see ``Departures._ask_if_lost``); and if
every peer it watches is found gone right after a gap (:func:`dropped`), it is the lost one
too: its group dropped it while it was stopped, and closed (two neighbours seldom die while
one is held). A suspect that could not be asked, or whose data link a live peer closed,
after any gap is its own loss too (as before there were checks). One found killed or
unresponsive after a gap is a real loss all the same: a peer may die while this one is
busy. A goodbye within the grace always wins.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Literal

from ..errors import KILLED, UNRESPONSIVE

__all__ = ["ALIVE", "CHECK_WAIT", "KILLED_WAIT", "LINK_LOSS_GRACE", "Suspect", "Verdict",
           "dropped", "verdict"]

LINK_LOSS_GRACE = 0.3  # seconds between a link's disconnect and declaring its peer lost
CHECK_WAIT = 2.0  # seconds more a loss waits for what became of its peer (its check)
# Seconds from finding a suspect's process gone (classified KILLED) to declaring it lost: time
# for this peer's reader to take a goodbye that came before the port closed.
KILLED_WAIT = 0.05

# What a suspect's check found: its process answers a new connection (see module docstring)
ALIVE = "alive"

# "wait": its grace, or the wait for its check, is not over; "lost": declare it lost;
# "kept": not lost, watch it anew; "self": this peer's own stop made it a suspect (this
# peer is the lost one)
Verdict = Literal["wait", "lost", "kept", "self"]


@dataclass(slots=True)
class Suspect:
    """A peer whose link or probe went down, until :func:`verdict` decides."""

    due: float  # when its grace is over (seconds, the machine's clock)
    how: str | None  # what its check found (KILLED, UNRESPONSIVE, ALIVE, ""); None: asking
    probe_only: bool  # only its probe went down (a heartbeat timeout): no data was lost
    after_gap: float | None = None  # suspected right after a gap this long in this peer's clock
    late: bool = False  # right after this peer's own clock ran late (a gap > half the stall)

    def lost_how(self) -> str:
        """How its loss says it went (see :data:`~p2pcoll.departures.words.LOST`)."""
        if self.how == ALIVE and self.probe_only:
            return UNRESPONSIVE  # it missed its heartbeats, and answers now
        return self.how if self.how in (KILLED, UNRESPONSIVE) else ""


def verdict(suspect: Suspect, now: float, stopped_past: float) -> Verdict:
    """What becomes of ``suspect`` at ``now``; ``stopped_past``: a gap in this peer's clock
    longer than this means its watchers have declared it lost. A kept one is kept at once;
    a loss waits for its grace (a goodbye may still come), and up to :data:`CHECK_WAIT`
    more for its check's answer."""
    gap = suspect.after_gap
    if suspect.how == ALIVE and suspect.probe_only:
        if gap is not None and gap > stopped_past:
            return "self"
        if suspect.late:
            return "kept"
    if suspect.how is None and now < suspect.due + CHECK_WAIT:
        return "wait"
    if now < suspect.due:
        return "wait"
    if gap is not None and suspect.how not in (KILLED, UNRESPONSIVE):
        return "self"
    return "lost"


def dropped(watched: Collection[int], suspects: Mapping[int, Suspect]) -> bool:
    """Whether every peer this one watches is a suspect right after a gap in its clock,
    found gone (killed or unresponsive): this peer was stopped while its group dropped it
    (and closed, or went on without it)."""
    return bool(watched) and all(
        (s := suspects.get(w)) is not None and s.after_gap is not None
        and s.how in (KILLED, UNRESPONSIVE) for w in watched)
