"""What a rendezvous holds of the peers registered for one job's next group, and of the
groups it formed (the records :mod:`.jobs` keeps; no I/O, no rules but the counting a status
reports)."""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import islice
from typing import Any

__all__ = ["JOINED_SHOWN", "MISSING_SHOWN", "Entry", "Forming", "Roster", "readable"]

MISSING_SHOWN = 16  # missing ranks a status lists (it counts them all)
JOINED_SHOWN = 8  # peers that joined a status names, first come first


@dataclass(eq=False)
class Entry:
    """One peer registered for a job's next group."""

    identity: bytes
    rank: int | None
    endpoints: list[str]
    host: str
    pid: int
    token: str | None  # the process's (None never matches)
    order: float  # None (no preference) sorts last
    arrival: int
    heartbeat: float
    seen: float

    def describe(self) -> str:
        asked = f", asking for rank {self.rank}" if self.rank is not None else ""
        return f"the peer on {readable(self.host)} (pid {self.pid}{asked})"


def readable(host: str) -> str:
    """The part of a host identity a reader knows the host by: its hostname (with the
    ``P2PCOLL_HOST_ID`` given, if any), without the boot id and file systems that follow
    (see :func:`p2pcoll.transport.endpoints.host_identity`)."""
    return host.partition("/")[0] or host


@dataclass
class Forming:
    """The group of one job that is forming."""

    job: str
    world_size: int | None = None
    low: int | None = None  # elastic bounds
    high: int | None = None
    entries: dict[bytes, Entry] = field(default_factory=dict)
    by_rank: dict[int, Entry] = field(default_factory=dict)
    taken: list[int] = field(default_factory=list)  # the requested ranks, sorted
    last_arrival: float = 0.0
    expect: int = 0  # the fewest peers a join expects (0: none said)
    shown: list[list[Any]] | None = None  # the joined a status names; None: to make again

    @property
    def elastic(self) -> bool:
        return self.world_size is None and self.low is not None

    def joined(self) -> list[list[Any]]:
        """``[rank or None, host, pid]`` of the first JOINED_SHOWN peers that joined: made
        again only after an arrival or a departure (O(JOINED_SHOWN) then)."""
        if self.shown is None:
            self.shown = [[e.rank, readable(e.host), e.pid]
                          for e in islice(self.entries.values(), JOINED_SHOWN)]
        return self.shown

    def missing(self) -> tuple[int, list[int]]:
        """How many ranks no peer will get yet, and the first MISSING_SHOWN of them.

        The free ranks (those not requested) go to the unranked peers in order, so the
        missing ones are the free ranks after the first ``unranked``. The j-th free rank is
        ``j + #{i : taken[i] - i <= j}`` (``taken[i] - i`` never decreases): a bisection,
        so this costs O(MISSING_SHOWN log n), never O(world size).
        """
        if self.world_size is None:
            return 0, []
        unranked = len(self.entries) - len(self.taken)
        count = max(0, self.world_size - len(self.entries))
        shown = []
        for j in range(unranked, unranked + min(count, MISSING_SHOWN)):
            lo, hi = 0, len(self.taken)
            while lo < hi:
                mid = (lo + hi) // 2
                if self.taken[mid] - mid <= j:
                    lo = mid + 1
                else:
                    hi = mid
            shown.append(j + lo)
        return count, shown


@dataclass
class Roster:
    """A roster sent to one member of a group that formed (kept to send again)."""

    job: str
    formed: float
    head: bytes  # this peer's part
    body: bytes  # the group's part, one object for every member
