"""Whom a timeout blames: pure rules, no I/O, no clock.

A timeout names the ranks that really did not arrive. The rank whose deadline passed first
only knows whom *it* waits for, which in a ring is its neighbour, itself waiting further up
the chain. So before it breaks the group it asks every peer ``why`` (one control message
each, see :mod:`p2pcoll.session.failure`) and waits a moment (:func:`inquiry_time`, less
once everyone has answered) for their ``waiting`` answers: each peer's state in that
collective (waiting, finished, not started, failed) and the ranks it waits for. Then
:func:`judge` blames, in this order:

1. the peers that did not answer (:data:`~p2pcoll.wire.SILENT`): frozen, overloaded or cut
   off; of several, those somebody waits for;
2. else the peers that somebody waits for and that have not started the collective
   (:data:`~p2pcoll.wire.ABSENT`);
3. else the ranks it waits for itself (:data:`~p2pcoll.wire.OWN`).

Its abort carries the blamed ranks and the rule that found them; for the first two, the
peers' errors name the same ranks (:func:`follow`); the third is only the sender's view,
so each peer names whom it waits for itself. A point-to-point transfer asks nobody: its one
peer is the one to blame (:func:`judge` without answers).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from ..wire import ABSENT, FAILED, FINISHED, NOT_STARTED, OWN, SILENT, WAITING

# The longest a rank whose deadline passed waits for its peers' answers (see inquiry_time).
INQUIRY_S = 1.0

State = tuple[str, list[int]]  # a rank's state in a collective and the ranks it waits for


def inquiry_time(limit: float) -> float:
    """How long to wait for the peers' answers after a deadline of ``limit`` seconds passed:
    long enough for a live peer on a busy host to answer, short against the deadline."""
    return min(INQUIRY_S, max(0.1, limit / 2))


@dataclass(frozen=True)
class Verdict:
    """Whom a timeout blames and why.

    Attributes:
        blamed: the ranks named, sorted.
        rule: the rule that found them: SILENT, ABSENT or OWN (see the module docstring).
        report: what was found, for the error's message (``"rank 2 did not answer ...;
            waiting: rank 0 for [2]"``).
    """

    blamed: list[int]
    rule: str
    report: str


def judge(me: int, mine: Sequence[int], answers: Mapping[int, State] | None = None,
          asked: Collection[int] = (), excused: Collection[int] = ()) -> Verdict:
    """Whom rank ``me``, which waits for ``mine``, blames for a timeout.

    Args:
        me: the rank whose deadline passed.
        mine: the ranks it waits for itself.
        answers: the peers' answers to its ``why``, by rank (None: nobody was asked, as
            for a transfer).
        asked: the peers it asked.
        excused: peers among ``asked`` that left having taken their part (a goodbye after
            starting the collective): not silent, though they did not answer.
    """
    states: dict[int, State] = {me: (WAITING, list(mine))}
    silent: list[int] = []
    if answers is not None:
        states.update(answers)
        silent = sorted(set(asked) - answers.keys() - set(excused))
    waited = sorted({r for state, on in states.values() if state in (WAITING, FAILED)
                     for r in on})
    absent = [r for r in waited if states.get(r, ("",))[0] == NOT_STARTED]
    report: list[str] = []
    if silent:
        # Of several that did not answer, those somebody waits for are the likelier
        # cause (another may just be slow to answer).
        blamed, rule = [r for r in silent if r in waited] or silent, SILENT
        report.append(f"{ranks_text(blamed)} did not answer (frozen, overloaded or cut off)")
    elif absent:
        blamed, rule = absent, ABSENT
        report.append(f"{ranks_text(absent)} {'has' if len(absent) == 1 else 'have'} "
                      f"not started it")
    else:
        blamed, rule = list(mine) or waited, OWN
        report.append(f"still waiting for ranks {blamed}")
    if answers is not None:
        waiting = [f"rank {r} for {on}" + (" (failed)" if state == FAILED else "")
                   for r, (state, on) in sorted(states.items())
                   if state in (WAITING, FAILED)]
        report.append("waiting: " + (", ".join(waiting) or "nobody"))
        rest = sorted(states.keys() - set(blamed))
        for what, ranks in (
            (FINISHED, [r for r in rest if states[r][0] == FINISHED]),
            (NOT_STARTED, [r for r in rest if states[r][0] == NOT_STARTED]),
            ("no answer", [r for r in silent if r not in blamed]),
        ):
            if ranks:
                report.append(f"{what}: {ranks_text(ranks)}")
    return Verdict(sorted(set(blamed)), rule, "; ".join(report))


def follow(their_rule: str, their_blamed: Sequence[int], mine: Sequence[int]) -> list[int]:
    """Whom a rank names when another rank's timeout of the same collective reaches it
    first: the same ranks if that rank found them (SILENT or ABSENT); if it only knew whom
    it waited for (OWN), whom this rank waits for itself (or, waiting for nobody, theirs)."""
    if their_rule != OWN:
        return list(their_blamed)
    return list(mine) or list(their_blamed)


def is_found(rule: str) -> bool:
    """Whether a timeout's blame names the ranks that did not come (what the peers then
    name too), not only whom its rank waited for."""
    return rule != OWN


def ranks_text(ranks: Sequence[int]) -> str:
    """``rank 3`` or ``ranks 1, 4``."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


__all__ = ["INQUIRY_S", "Verdict", "follow", "inquiry_time", "is_found", "judge",
           "ranks_text"]
