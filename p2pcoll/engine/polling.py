"""Hybrid waiting for messages: a receive polls its peer's socket before it parks.

A receive whose message has not come parks in the event loop: its task sleeps until the
loop's ``epoll`` wakes on the socket, runs the descriptor's callback, resolves a future
and schedules the task again. Where the peer's answer is tens of microseconds away (a
4 KiB exchange over a TCP lane), that round trip and the scheduler's wake-up of a process
that slept are most of the exchange. A receive that polls instead sees the message within
a poll of its arrival and never leaves its task.

:class:`MessageWait` polls with the board's policy (:class:`.waiting.Patience`, whose
docstring says why): a quick poll first, then a budget learned per peer, capped by
``P2PCOLL_SPIN`` (0: never), only the margin for a peer that usually comes late (a
stopped, slow or busy one: a poll there would only burn the core), and with more peers
than cores the core yielded between polls, only the time this rank held it counted.
One difference: a message found while polling counts as early however much of the budget
it took. On the board a partner in step is found within the margin; a message is a wire's
latency behind its sender (some 20 us over loopback TCP), so two peers in step find each
other's messages a little after the margin, and counted by the clock they would look late
for ever, each parking and waking the other late (measured: 73-92 us per 4 KiB allreduce
at p = 2 counted so, 114-329 us counted by the clock, load ~3). Catching one at the
budget's end still saves the loop's round trip and a sleeping process's wake-up. It
polls only peers the transport can poll alone (:class:`PeerPoll`: over a TCP lane, in
another process); then it parks as before, so a stopped partner costs a budget, never a
hang.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Protocol

from .waiting import Patience, yield_core

__all__ = ["MessageWait", "PeerPoll"]


class PeerPoll(Protocol):
    """What the transport offers a receive that waits for one peer."""

    def polled(self, peer: int) -> bool:
        """Whether :meth:`poll_from` reads what ``peer`` sends."""
        ...

    def poll_from(self, peer: int) -> None:
        """Take in what ``peer`` (and the transport's shared socket) holds now; never
        waits, never raises."""
        ...


class MessageWait:
    """The polling of one rank's receives (see the module docstring).

    Args:
        transport: the transport's per-peer poll.
        ceiling: the most a wait polls, in seconds (``P2PCOLL_SPIN``).
        world_size: the group's size.
        cores: the cores this process may run on (more peers than that: crowded).
    """

    def __init__(self, transport: PeerPoll, ceiling: float, world_size: int,
                 cores: int | None = None) -> None:
        self.transport = transport
        self.patience = Patience(ceiling, world_size)
        if cores is None:
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
        self.crowded = world_size > cores
        self._quick = int(self.patience.quick * 1e9)
        # A crowded wait polls at most the ceiling on the clock too: a yield may give the
        # core to the host's other work for a time slice, and a parked receive is woken
        # by the kernel as its message comes.
        self._reach = int(ceiling * 1e9)
        #: Messages found while polling, and waits that parked after polling (for tests
        #: and benchmarks).
        self.found = self.parked = 0
        self._held = 0  # ns this wait held the core while polling (crowded)

    def poll(self, src: int, came: Callable[[], bool]) -> int:
        """Poll for ``src``'s message until ``came()`` or the budget is spent. Returns 0
        if it came, else the ``time.perf_counter_ns()`` at which the wait began (hand it
        to :meth:`parked_until` once the message comes); -1: ``src`` is not polled here."""
        transport = self.transport
        if not transport.polled(src):
            return -1
        patience = self.patience
        look = transport.poll_from
        began = time.perf_counter_ns()
        self._held = 0
        if self._poll(src, came, look, began, self._quick):
            if not patience.sure:
                patience.learn(src, 0.0)
            self.found += 1
            return 0
        budget = int(patience.budget((src,)) * 1e9)
        if budget > self._quick and self._poll(src, came, look, began, budget):
            patience.learn(src, 0.0)  # caught: early, however much of the budget it took
            self.found += 1
            return 0
        self.parked += 1
        return began

    def parked_until(self, src: int, began: int) -> None:
        """``src``'s message came after the wait that began at ``began`` parked."""
        if self.patience.ceiling:
            self.patience.learn(src, (time.perf_counter_ns() - began) * 1e-9)

    def _poll(self, src: int, came: Callable[[], bool], look: Callable[[int], None],
              began: int, budget: int) -> bool:
        clock = time.perf_counter_ns
        if not self.crowded:
            until = began + budget
            while True:
                look(src)
                if came():
                    return True
                if clock() >= until:
                    return False
        # Crowded: yield between polls; only this thread's time on the core counts.
        cpu = time.thread_time_ns
        start, until = cpu() - self._held, began + self._reach
        try:
            while True:
                look(src)
                if came():
                    return True
                if cpu() - start >= budget or clock() >= until:
                    return False
                yield_core()
        finally:
            self._held = cpu() - start
