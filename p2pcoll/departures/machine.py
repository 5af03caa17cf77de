"""How one peer learns that others have left its group, as a state machine without I/O.

:class:`Departures` is fed events (a probe or a link went down, a control message came, this
peer failed an operation or is closing, the clock moved) and answers each with the
:mod:`actions <.actions>` its peer must carry out (post a message, watch a peer, forget one,
fail an operation). It holds the one record of who has gone and how, and it never touches a
socket, a task or a clock: the time is passed in, so every scenario runs in a test in
microseconds, in any order of events.

The protocol, in the order things happen:

- **Watching.** Each peer watches its :data:`~.overlay.WATCHED` live ring successors (see
  :mod:`.overlay`) with a probe. A probe or a link that goes down makes its peer a
  *suspect* (:mod:`.suspects`): unless it says goodbye within :data:`LINK_LOSS_GRACE` (its
  port closes right after its goodbye, which may come second), or only its probe went down
  and its process is found to answer (busy or starved, not gone: watched anew), it is
  declared lost. The caller finds out meanwhile what became of it
  (:meth:`Departures.classified`: ``killed``, ``unresponsive`` or ``alive``), which its
  loss then names (held up to :data:`CHECK_WAIT` for that answer). One found ``killed`` is
  declared lost :data:`KILLED_WAIT` after that, if its grace is not over first: it can
  send nothing more, and a goodbye it sent came before its port closed; only the reading
  of one may still be under way. When a watched peer goes, the next live successor is
  watched instead (a ``late`` probe, which also calls the peer lost if it cannot connect
  at all), so a run of consecutive losses is found one after the other.
- **News.** A peer that learns of a departure first-hand or from another tells its
  :func:`~.overlay.fingers` once (``gone``), so every survivor knows within about log2 p
  hops. A goodbye's news carries the peers it went to (``told``): those wait for the
  goodbye itself, which comes after the data its peer sent them. News from a peer known to
  be lost is not believed: that peer stalled and is answered that it was declared lost.
- **Goodbyes.** A closing peer says goodbye (``bye``, with how many collectives it
  started) to the peers that may not have read all it sent (``unread``: its open and
  draining links) and to its watchers (over their probe if it has no link to them), and
  back to the peers whose links to it are read (``senders``, as an answer); each answers a
  ``farewell`` on the connection the goodbye came on. A closing peer opens no link and
  passes on no news. A goodbye sent after a failure carries what broke the group
  (``cause``, ``lost``), taken by its readers before the departure itself.
- **Aborts.** A peer whose operation failed sends the abort to its ``unread`` peers (it
  comes after the data on their links) and its fingers; a peer that learns of a failed
  operation passes it on to its own fingers once (again only for a timeout that found whom
  to blame).
- **Operations.** A running operation that needs a peer that has gone fails at once with
  that peer's :class:`~p2pcoll.errors.PeerLost`, exactly once: a collective, any member
  lost or gone before it started it; a send, its receiver lost (a goodbye ends only the
  sends that start after it). The machine keeps no table of what runs: it reads the
  caller's (:data:`Running`) when a peer goes or this peer is declared lost, and is asked
  about an operation as it starts (:meth:`Departures.starting`) only once a peer has gone,
  so a call while everyone is there costs it nothing.
- **A stalled peer.** The clock passed in also tells a peer that it was itself stopped: a
  gap between events longer than ``stall`` (the heartbeat timeout) followed within the
  grace by a suspect not found out, or after a gap past its watchers' probe and check
  (``stopped_past``) by one found alive (its own probes' timers ran out as it resumed; a
  loop that was only blocked keeps its probes, which libzmq answers on its own thread,
  and a peer that died meanwhile is found killed). It fails everything it runs
  with that (:class:`~.actions.DeclaredLost`), not with the loss of its healthy
  neighbours. A survivor that hears news from a peer it declared lost does not believe
  it, and answers that peer that it was declared lost (should its clock not have seen it).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Collection, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import KILLED, UNRESPONSIVE, PeerLost
from ..wire.header import Header
from . import aborts, overlay
from .actions import Aborted, Action, DeclaredLost, Degrade, Fail, Forget, Post, Unwatch, Watch
from .suspects import CHECK_WAIT, KILLED_WAIT, LINK_LOSS_GRACE, Suspect, dropped, verdict
from .words import LOST, left

__all__ = ["KILLED_WAIT", "LINK_LOSS_GRACE", "Departure", "Departures", "Running"]

log = logging.getLogger("p2pcoll")



@dataclass(frozen=True)
class Departure:
    """How one peer went."""

    error: PeerLost
    graceful: bool  # said goodbye, as opposed to lost
    started: int = 0  # with a goodbye: how many collectives the peer had started
    # with a goodbye: the peers it went to, on the links that carried all the peer sent
    # them (the others were never sent anything by it)
    told: frozenset[int] = frozenset()


# The operations running at a peer, read when one may have to fail: each operation, the
# peers it needs (None: every member; empty: nobody, as a receive) and a collective's
# sequence number (None: a transfer).
Running = Callable[[], Iterable[tuple[Hashable, Collection[int] | None, int | None]]]


def _nothing_runs() -> tuple[()]:
    return ()


class Departures:
    """The departures of one peer's group, seen from ``rank``; see the module docstring.

    Every event method returns the actions to carry out, in order. Times are seconds on any
    monotonic clock, the same for every call.

    Args:
        rank: this peer's rank.
        size: the group's size.
        group: the group's id (for the headers of the messages it posts).
        endpoints: the peers' endpoints, named in errors (optional).
        grace: how long a suspect may still say goodbye before it is declared lost.
        killed_wait: how long, once a suspect is found killed, it may still (be read to)
            say goodbye, if that ends before ``grace``.
        stall: a gap between two events longer than this may be this peer's own stop
            (see :mod:`.suspects`; None: never); the caller then ticks every ``stall / 4``.
        running: the operations running at this peer (see :data:`Running`; none by
            default), read when a peer goes or this peer is declared lost.
    Raises:
        ValueError: ``rank`` is not a rank of a group of ``size``.
    """

    def __init__(self, rank: int, size: int, group: str, *,
                 endpoints: Sequence[str] = (), grace: float = LINK_LOSS_GRACE,
                 killed_wait: float = KILLED_WAIT, stall: float | None = None,
                 running: Running = _nothing_runs) -> None:
        overlay.watched(rank, size)  # checks the rank
        self.rank, self.size, self.group = rank, size, group
        self.endpoints = tuple(endpoints)
        self.grace, self.stall = grace, stall
        # a gap this long: the watchers' probe and check have surely run out (.suspects)
        self.stopped_past = math.inf if stall is None else stall * 1.25 + CHECK_WAIT
        self.killed_wait = min(killed_wait, grace)
        self._gone: dict[int, Departure] = {}
        self._suspects: dict[int, Suspect] = {}  # see .suspects
        self._watched: list[int] = []
        self._last: float | None = None  # the time of the last event
        self._resumed: tuple[float, float] | None = None  # after a gap: (when, how long)
        self._late_at = -math.inf  # when an event last came late (see .suspects)
        self._asked: float | None = None  # the gap after which the watchers were asked
        self._closing = False  # said goodbye: passes on no news, opens no link
        self._muted = False  # closed: nothing happens any more
        self._declared: PeerLost | None = None  # the others declared this peer lost
        self._answered: set[int] = set()  # stalled peers told they were declared lost
        self.told: frozenset[int] = frozenset()  # whom this peer's goodbye went to
        self.farewells: set[int] = set()  # who has read it
        self._reports: dict[int, dict[str, Any]] = {}  # a leaver's cause and loss, once
        self._newsed: dict[int, set[int]] = {}  # finger -> the departures it was told of
        self._seen: dict[tuple[int, int, int | None], int] = {}  # aborts taken
        self._passed_on: dict[tuple[int, int | None], int] = {}  # aborts passed on, level
        self._running = running
        self._failed: set[Hashable] = set()  # operations failed here that still run
        self._degraded = False

    # -- what it knows ---------------------------------------------------------------

    def gone(self) -> dict[int, Departure]:
        """Every peer known to have gone, and how."""
        return dict(self._gone)

    def lost(self, rank: int) -> PeerLost | None:
        """The error of ``rank``'s departure, or None while it is there."""
        gone = self._gone.get(rank)
        return gone.error if gone else None

    def said_goodbye(self, rank: int) -> bool:
        return (gone := self._gone.get(rank)) is not None and gone.graceful

    def abandoned(self, rank: int, seq: int) -> bool:
        """Whether ``rank`` is gone without taking its part in collective ``seq``: lost, or
        said goodbye before it started it."""
        gone = self._gone.get(rank)
        return gone is not None and (not gone.graceful or gone.started <= seq)

    @property
    def watched(self) -> list[int]:
        """The peers this one watches now."""
        return list(self._watched)

    def watchers(self) -> list[int]:
        """The live peers that watch this one."""
        return overlay.watchers(self.rank, self.size, gone=self._gone)

    def unanswered(self) -> set[int]:
        """The peers this peer's goodbye went to that have neither answered nor gone."""
        return set(self.told) - self.farewells - set(self._gone)

    def deadline(self) -> float | None:
        """When the next :meth:`tick` is due (None: no need)."""
        if self._muted:
            return None
        times = [s.due + CHECK_WAIT if s.how is None else s.due
                 for s in self._suspects.values()]
        if self.stall is not None and self._last is not None:
            times.append(self._last + self.stall / 4)  # a gap is then measured within that
        return min(times, default=None)

    # -- events ----------------------------------------------------------------------

    def start(self, now: float) -> list[Action]:
        """The group has formed: watch the first successors."""
        actions = self._clock(now)
        self._watched = overlay.watched(self.rank, self.size, gone=self._gone)
        return actions + [Watch(peer) for peer in self._watched]

    def probe_lost(self, peer: int, now: float, *, checking: bool = False) -> list[Action]:
        """A probe of ``peer`` went down (or a late one could not connect)."""
        return self.link_closed(peer, now, checking=checking, probe=True)

    def link_closed(self, peer: int, now: float, *, checking: bool = False,
                    probe: bool = False) -> list[Action]:
        """A connection to ``peer`` went down (``probe``: its probe): a suspect (see
        :mod:`.suspects`). Once this peer knows it was declared lost, the losses it sees
        are its own, and ignored. ``checking``: the caller finds out how it went, and says
        so with :meth:`classified` (its loss waits for that, see :data:`CHECK_WAIT`)."""
        actions = self._clock(now)
        if (self._muted or self._declared is not None or peer in self._gone
                or peer == self.rank):
            return actions
        suspect = self._suspects.get(peer)
        if suspect is not None:  # a data link down too: what it sent there is lost
            suspect.probe_only &= probe
            return actions
        resumed = self._resumed  # right after this peer's own gap? (see .suspects)
        gap = resumed[1] if resumed is not None and now - resumed[0] <= self.grace else None
        self._suspects[peer] = Suspect(now + self.grace, None if checking else "", probe, gap,
                                       now - self._late_at <= self.grace)
        return actions + (self._ask_if_lost() if gap is not None else [])

    def suspects(self, peer: int) -> bool:
        """Whether ``peer`` is a suspect (its link or probe went down; see .suspects)."""
        return peer in self._suspects

    def classified(self, peer: int, how: str, now: float) -> list[Action]:
        """What became of suspect ``peer``, as the caller found out after its
        :meth:`link_closed`: :data:`~p2pcoll.errors.KILLED`,
        :data:`~p2pcoll.errors.UNRESPONSIVE`, :data:`.suspects.ALIVE` or "" (unknown; see
        :mod:`.suspects`). A goodbye that comes still wins; one found killed has
        :data:`KILLED_WAIT` for it, if that ends before its grace (module docstring)."""
        actions = self._clock(now)
        suspect = self._suspects.get(peer)
        if suspect is not None:
            suspect.how = how
            if how == KILLED and suspect.after_gap is None:  # (after one: the ask's answer)
                suspect.due = min(suspect.due, now + self.killed_wait)
        return actions + self.tick(now)

    def unreachable(self, peer: int, now: float) -> list[Action]:
        """``peer`` could not be reached at all (it never said hello while the group
        formed): lost at once."""
        return self._out(self._clock(now) + self._lose(peer, by=self.rank))

    def tick(self, now: float) -> list[Action]:
        """Time has passed: declare the suspects whose grace is over."""
        actions = self._clock(now)
        alone = dropped(self._watched, self._suspects)  # (see .suspects)
        for peer, suspect in sorted(self._suspects.items()):
            decided = verdict(suspect, now, self.stopped_past)
            if decided == "wait" or peer not in self._suspects:
                continue
            decided = "self" if alone and decided == "lost" else decided
            del self._suspects[peer]
            if decided == "self":  # its own stop made it a suspect
                actions += self._declared_lost(None, suspect.after_gap or 0.0)
            elif decided == "kept":  # busy or starved: watched anew (a late probe)
                log.info("rank %d: rank %d missed its heartbeats but its process answers: "
                         "kept (busy or starved of CPU, not lost)", self.rank, peer)
                actions += [Unwatch(peer), Watch(peer, late=True)] * (peer in self._watched)
            else:
                actions += self._lose(peer, by=self.rank, how=suspect.lost_how())
        return self._out(actions)

    def received(self, header: Header, now: float) -> list[Action]:
        """A validated control message of this group: ``bye``, ``farewell``, ``gone`` or
        ``abort`` (anything else is not this machine's and returns nothing)."""
        actions = self._clock(now)
        if self._muted:
            return actions
        kind = header.kind
        if kind == "farewell":
            self.farewells.add(header.src)
        elif kind == "bye":
            # The news goes out before the farewell, which lets the leaver close its port:
            # a peer that watches it and was not told then hears of the goodbye rather
            # than seeing its probe go down first (and calling it lost).
            meta = header.meta or {}
            told = frozenset(meta.get("told", ()))
            actions += self._report(header)
            actions += self._record(header.src, Departure(
                left(header.src), True,
                header.seq, told))
            actions.append(Post(header.src, self._header("farewell"), "answer"))
        elif kind == "gone":
            actions += self._news_from(header)
        elif kind == "abort":
            actions += self._abort_from(header)
        return self._out(actions)

    def failed(self, abort: Header, unread: Collection[int]) -> list[Action]:
        """This peer failed ``abort``'s operation (its header, with ``err`` and ``meta``):
        tell directly the peers that may not have read all it sent them (``unread``; the
        abort comes after that data on their links), and everyone else over the fingers."""
        if self._muted:
            return []
        told = sorted(p for p in unread if p not in self._gone and p != self.rank)
        abort.meta = {**(abort.meta or {}), "told": told}
        return self._posts(told, abort) + self._pass_on(abort, self.rank, skip=set(told))

    def close(self, seq: int, unread: Collection[int], senders: Collection[int],
              probed_by: Collection[int] | None = None,
              report: dict[str, Any] | None = None) -> list[Action]:
        """This peer leaves, having started ``seq`` collectives: say goodbye (see the module
        docstring) to ``unread`` and to the watchers whose probe of it can be reached
        (``probed_by``; None: all), and back to the ``senders`` not told; ``report`` is what
        broke the group, if anything did. Watch :meth:`unanswered` for the farewells."""
        if self._muted or self._closing:
            return []
        self._closing = True
        gone = set(self._gone) | {self.rank}
        links = set(unread) - gone
        watchers = {w for w in self.watchers()
                    if probed_by is None or w in probed_by or w in links} - gone
        self.told = frozenset(links | watchers)
        bye = self._header("bye")
        bye.seq = seq
        bye.meta = {"told": sorted(self.told), **(report or {})}
        actions: list[Action] = [Post(p, bye, "link" if p in links else "probe")
                                 for p in sorted(self.told)]
        return actions + [Post(p, bye, "answer")
                          for p in sorted(set(senders) - self.told - gone)]

    def closed(self) -> None:
        """This peer has closed: nothing happens any more."""
        self._muted, self._suspects = True, {}

    def starting(self, op: Hashable, needs: Collection[int] | None,
                 seq: int | None = None) -> list[Action]:
        """Operation ``op`` starts, needing ``needs`` (None: every member): a collective
        numbered ``seq``, or a transfer (``seq`` None). It fails at once if one of them has
        already abandoned it, or if this peer was declared lost. Nothing is recorded: once
        it runs, the caller's :data:`Running` lists it. A caller may skip this until a
        peer has gone or this one was declared lost (the first
        :class:`~.actions.Degrade` or a :class:`~.actions.DeclaredLost` says so): it
        returns nothing until then."""
        if self._declared is not None:
            return self._fail(op, self._declared)
        if not self._gone:
            return []
        gone = self._gone
        for rank in sorted(gone if needs is None else gone.keys() & set(needs)):
            if seq is None or self.abandoned(rank, seq):
                return self._fail(op, gone[rank].error)
        return []

    # -- the rules ---------------------------------------------------------------------

    def _clock(self, now: float) -> list[Action]:
        """Note the time of an event, and a gap longer than ``stall`` before it (see
        :mod:`.suspects`). Returns no action (one day, maybe: hence the list)."""
        last, self._last = self._last, now
        stall = math.inf if self.stall is None else self.stall
        gap = 0.0 if last is None or self._closing else now - last
        if gap > stall / 2:  # its ticks ran late: its probes' timers may have too
            self._late_at = now
        for suspect in self._suspects.values() if gap > stall / 2 else ():
            suspect.late = True  # what it suspected before a gap may be its own loss too
            if gap > stall:
                suspect.due, suspect.after_gap = now + self.grace, gap
        if gap > stall:
            self._resumed = (now, gap)
        return []

    def _lose(self, peer: int, by: int, how: str = "") -> list[Action]:
        """``peer`` is lost, as ``by`` (this peer, or the one that says so) saw: ``how``
        (KILLED, UNRESPONSIVE, or "" unknown)."""
        if self._muted or peer in self._gone or peer == self.rank or (
                by == self.rank and self._declared is not None):
            return []
        where = f" ({self.endpoints[peer]})" if peer < len(self.endpoints) else ""
        text = (f"rank {peer}{where} {LOST.get(how, LOST[''])}; rank {by} lost the "
                f"connection to rank {peer}")
        if by != self.rank:
            text += f" (reported to rank {self.rank})"
        # A peer that is leaving sees its neighbours close too: nothing to warn of. Nor
        # does one whose group is closing around it (a peer has left after a healthy run):
        # a peer that closes says goodbye to its watchers, and they pass on no news once
        # leaving themselves, so a peer watched only later (a late probe) may be found gone
        # with its goodbye unheard. What it was running still fails, saying so.
        winding_down = any(d.graceful and r not in self._reports
                           for r, d in self._gone.items())
        level = (logging.DEBUG if self._closing
                 else logging.INFO if winding_down else logging.WARNING)
        log.log(level, "rank %d: %s%s", self.rank,
                f"lost the connection to rank {peer}" if by == self.rank
                else f"rank {by} reports that it lost rank {peer}",
                " as the group closes (it most likely closed too)" if winding_down else "")
        return self._record(peer, Departure(PeerLost(text, peer, how=how), False))

    def _record(self, rank: int, departure: Departure) -> list[Action]:
        """The one place a departure is recorded, and what follows from it."""
        if self._muted or rank in self._gone or rank == self.rank:
            return []
        self._gone[rank] = departure
        self._suspects.pop(rank, None)
        actions: list[Action] = [Forget(rank, departure.graceful)]
        for op, needs, seq in self._still_running():
            if (needs is None or rank in needs) and (not departure.graceful or (
                    seq is not None and departure.started <= seq)):
                actions += self._fail(op, departure.error)
        if not self._degraded:
            self._degraded = True
            actions.append(Degrade())
        watched = overlay.watched(self.rank, self.size, gone=self._gone)
        actions += [Unwatch(p) for p in self._watched if p not in watched]
        actions += [Watch(p, late=True) for p in watched if p not in self._watched]
        self._watched = watched
        if self._closing:
            return actions
        fingers = overlay.fingers(self.rank, self.size, self._gone)
        actions += self._spread(fingers, rank)
        # The news this peer passed to ``rank`` may have gone no further (it was leaving,
        # and a leaving peer passes on none, or it died first): pass it to the finger that
        # replaces ``rank`` now, so that it goes on around the ring.
        before = overlay.fingers(self.rank, self.size, set(self._gone) - {rank})
        for other in sorted(self._newsed.pop(rank, ())):
            actions += self._spread([p for p in fingers if p not in before], other)
        return actions

    def _spread(self, fingers: list[int], rank: int) -> list[Action]:
        """Tell ``fingers`` that ``rank`` has gone (and remember who was told)."""
        for p in fingers:
            self._newsed.setdefault(p, set()).add(rank)
        return self._posts(fingers, self._news(rank, self._gone[rank]))

    def _still_running(self) -> list[tuple[Hashable, Collection[int] | None, int | None]]:
        """The running operations not failed here yet (each fails at most once); those
        failed that have ended since are forgotten."""
        running = list(self._running())
        if not self._failed:
            return running
        self._failed &= {op for op, _, _ in running}
        return [entry for entry in running if entry[0] not in self._failed]

    def _fail(self, op: Hashable, error: PeerLost) -> list[Action]:
        self._failed.add(op)
        return [Fail(op, error)]

    def _news(self, rank: int, departure: Departure) -> Header:
        news = self._header("gone")
        news.seq = departure.started
        news.meta = {"rank": rank, "graceful": departure.graceful}
        if departure.error.how in (KILLED, UNRESPONSIVE):
            news.meta["how"] = departure.error.how
        if departure.graceful:
            news.meta["told"] = sorted(departure.told)
            news.meta.update(self._reports.get(rank, ()))
        return news

    def _news_from(self, header: Header) -> list[Action]:
        """``header.src`` says that ``meta["rank"]`` has gone: with a goodbye (having started
        ``seq`` collectives) to ``told``, or lost.

        A goodbye is ordered after everything its peer sent on the same link, so a peer in
        its ``told`` waits for the goodbye itself; the others were never sent anything."""
        meta = header.meta or {}
        rank, src = int(meta["rank"]), header.src
        if src in self._gone and not self._gone[src].graceful:
            # A peer this one declared lost is talking: it stalled and has resumed. Its news
            # is not believed (it lost its neighbours because it stopped, most likely).
            if src in self._answered:
                return []
            self._answered.add(src)
            return [Post(src, self._news(src, self._gone[src]), "answer")]
        if rank == self.rank:
            if meta["graceful"] or self._declared is not None or self._closing:
                return []
            return self._declared_lost(src)
        actions = self._report(header)
        if meta["graceful"]:
            if self.rank in meta.get("told", ()):
                return actions
            return actions + self._record(rank, Departure(
                left(rank), True, header.seq,
                frozenset(meta.get("told", ()))))
        return actions + self._lose(rank, by=src, how=meta.get("how", ""))

    def _declared_lost(self, by: int | None, stalled: float = 0.0) -> list[Action]:
        """The others declared this peer lost (``by`` said so, or it saw itself stopped for
        ``stalled`` seconds): what it runs fails, and the losses it suspects were its own."""
        if by is None:
            text = (f"rank {self.rank} was stopped for {stalled:.1f} s, longer than its "
                    f"watchers wait: the group has declared it lost")
        else:
            text = (f"rank {by} says that rank {self.rank} was declared lost: it stopped "
                    f"answering for longer than the heartbeat timeout (it was stopped, or "
                    f"cut off)")
        log.warning("rank %d: %s", self.rank, text)
        self._declared = PeerLost(text, self.rank)
        self._suspects.clear()
        actions: list[Action] = []
        for op, _, _ in self._still_running():
            actions += self._fail(op, self._declared)
        return [*actions, DeclaredLost(self.rank if by is None else by, self._declared)]

    def _report(self, header: Header) -> list[Action]:
        """A goodbye, or news of one, that says what broke its peer's group: taken as news of
        the peer it lost (``lost``) and as its abort (``cause``), before the departure
        itself, once per departed peer. News of a goodbye that was sent here too is left to
        the goodbye, which comes after the data its peer sent before it."""
        meta = header.meta or {}
        if header.kind == "bye":
            rank = header.src
        elif meta.get("graceful") and self.rank not in meta.get("told", ()):
            rank = int(meta["rank"])
        else:
            return []
        if rank == self.rank or rank in self._reports or not (
                "lost" in meta or "cause" in meta):
            return []
        report = self._reports[rank] = {k: meta[k] for k in ("lost", "cause") if k in meta}
        actions: list[Action] = []
        lost = report.get("lost")
        if lost is not None and lost != self.rank:
            actions += self._lose(int(lost), by=header.src)
        cause = report.get("cause")
        if cause is not None:
            named = cause.get("rank")
            kind, text = cause["err"]
            actions.append(Aborted(Header(
                "abort", self.group, rank, cause["q"], err=[kind, text],
                meta=None if named is None else {
                    "lost": named, **{k: cause[k] for k in ("how",) if k in cause}},
                tag=cause.get("t"),
            ), rank, f"{text} (reported by rank {rank} as it left)"))
        return actions

    def _abort_from(self, header: Header) -> list[Action]:
        """A peer reports that an operation failed at ``origin`` (itself, or the rank whose
        abort it passes on): taken once, and passed on.

        An abort the origin sent here as well (``told``) comes after everything the origin
        sent here before it; a copy passed on by another may overtake that data, so it is
        left to the origin's own."""
        if header.err is None:
            return []
        meta = header.meta or {}
        origin = int(meta.get("origin", header.src))
        if origin == self.rank or (origin != header.src and self.rank in meta.get("told", ())):
            return []
        key = (origin, header.seq, header.tag)
        if key in self._seen:
            return []
        aborts.remember(self._seen, key, 1)
        what = (f"collective #{header.seq}" if header.tag is None
                else f"a point-to-point transfer (tag {header.tag})")
        message = f"rank {origin} failed {what}: {header.err[1]}"
        return [*self._pass_on(header, origin), Aborted(header, origin, message)]

    def _pass_on(self, abort: Header, origin: int, skip: Collection[int] = ()) -> list[Action]:
        """Forward ``origin``'s abort to this peer's fingers, the first time it learns that
        the operation failed, or when it learns whom a timeout of it blames."""
        op, level = (abort.seq, abort.tag), aborts.level(abort)
        if self._passed_on.get(op, 0) >= level:
            return []
        aborts.remember(self._passed_on, op, level)
        meta = dict(abort.meta or ())
        meta.setdefault("told", [])
        if origin != self.rank:
            meta["origin"] = origin
        relay = Header("abort", self.group, self.rank, abort.seq, err=abort.err, meta=meta,
                       tag=abort.tag)
        return self._posts([p for p in overlay.fingers(self.rank, self.size, self._gone)
                            if p != origin and p != abort.src and p not in skip], relay)

    def _out(self, actions: list[Action]) -> list[Action]:
        """An event's actions, without the posts to peers it found gone on the way (a
        departure's news may name a peer that the next departure of the same event is)."""
        return [a for a in actions if not (isinstance(a, Post) and a.via != "answer"
                                           and a.dst in self._gone)]

    def _posts(self, peers: Collection[int], header: Header) -> list[Action]:
        return [Post(p, header) for p in peers if p not in self._gone and p != self.rank]

    def _ask_if_lost(self) -> list[Action]:
        """A suspect right after a gap (see .suspects): ask the watchers, once a gap, whether
        they declared this peer lost: news of itself, said goodbye and told them, which a
        peer that has it takes for nothing (it waits for that goodbye) and one that
        declared it lost answers, as any news from it (see :meth:`_news_from`)."""
        if self._resumed is None or self._asked == (asked := self._resumed[0]):
            return []
        self._asked = asked
        return [a for w in self.watchers() for a in self._posts([w], Header(
            "gone", self.group, self.rank, meta={"rank": self.rank, "graceful": True,
                                                 "told": [w]}))]

    def _header(self, kind: str) -> Header:
        return Header(kind, self.group, self.rank)

