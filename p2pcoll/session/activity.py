"""The group's own record of the collectives it ran: how many, with which strategy, how
long they took, and which errors they ended with.

:meth:`Group.stats` reports it beside the transport's traffic counters, and the service's
``/metrics`` (:mod:`p2pcoll.service.metrics`) is read from the same numbers, so there is
one bookkeeping. Durations are kept as a histogram with fixed bucket bounds (seconds), as
Prometheus wants them: a count per bucket, a count and a sum.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

# Upper bounds of the duration buckets, seconds: 50 us (a small collective on one host)
# to a minute (a large one over a slow link); longer ones fall into +Inf.
DURATION_BUCKETS: tuple[float, ...] = (
    5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)


@dataclass
class Durations:
    """A histogram of one collective's durations (:meth:`Activity.record` counts each)."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(DURATION_BUCKETS) + 1))
    total: float = 0.0

    def report(self) -> dict[str, Any]:
        """``{"count", "sum", "buckets": [[upper bound, cumulative count], ...]}``, the
        last bound ``inf``."""
        cumulative, buckets = 0, []
        for bound, n in zip((*DURATION_BUCKETS, float("inf")), self.counts, strict=True):
            cumulative += n
            buckets.append([bound, cumulative])
        return {"count": cumulative, "sum": self.total, "buckets": buckets}


class Activity:
    """Counts of one group's collectives; :meth:`record` is called once per collective."""

    __slots__ = ("by_strategy", "durations", "errors")

    def __init__(self) -> None:
        self.by_strategy: Counter[tuple[str, str]] = Counter()
        self.durations: dict[str, Durations] = {}
        self.errors: Counter[str] = Counter()

    def record(self, collective: str, strategy: str, seconds: float,
               error: BaseException | None) -> None:
        self.by_strategy[collective, strategy] += 1
        durations = self.durations.get(collective)
        if durations is None:
            durations = self.durations[collective] = Durations()
        durations.counts[bisect_left(DURATION_BUCKETS, seconds)] += 1
        durations.total += seconds
        if error is not None:
            self.errors[type(error).__name__] += 1

    def report(self) -> dict[str, Any]:
        by: dict[str, dict[str, int]] = {}
        for (collective, strategy), n in sorted(self.by_strategy.items()):
            by.setdefault(collective, {})[strategy] = n
        return {
            "collectives_by_strategy": by,
            "collective_seconds": {c: d.report() for c, d in sorted(self.durations.items())},
            "errors_by_type": dict(sorted(self.errors.items())),
        }
