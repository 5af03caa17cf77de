"""A session: one membership epoch of a group.

Everything that belongs to one roster lives here and nowhere else: the membership, the
collective sequence numbers, the record of departed peers, the matching of messages to
receives and the executor over the transport. A group that re-forms (a new epoch) gets a
new session; nothing of the old one leaks into it.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Mapping
from functools import partial
from typing import Any

from .activity import Activity
from ..engine.board_path import BoardPath
from ..engine.costs import DEFAULT_CONSTANTS, Constants
from ..engine.executor import Executor
from ..engine.matching import Matcher
from ..engine.timeline import Timeline
from ..errors import GroupBroken
from ..settings import Settings
from ..departures import overlay
from ..transport.base import Transport
from ..types import Membership
from ..wire import Header
from . import control
from .calls import Runner
from .failure import FailureModel
from .peers import Peers

log = logging.getLogger("p2pcoll")


class Session:
    """The state of one epoch of a group; see the module docstring."""

    def __init__(self, membership: Membership, transport: Transport, settings: Settings,
                 failures: FailureModel,
                 constants: Mapping[str, Constants] = DEFAULT_CONSTANTS) -> None:
        self.membership = membership
        self.transport = transport
        self.settings = settings
        self.failures = failures
        self.peers = Peers(membership, self._departed)
        self.matcher = Matcher(self.peers)
        self.executor = Executor(
            transport, self.matcher, self.peers, membership.group_id,
            segment_bytes=settings.segment_bytes, depth=settings.pipeline_depth,
            max_message_bytes=settings.max_message_bytes,
            timeline=Timeline(settings.timeline, membership.group_id, membership.rank,
                              membership.world_size) if settings.timeline else None,
        )
        self.seq = 0
        self.transfers: Counter[tuple[int, int, int]] = Counter()  # (src, dst, tag) -> sent
        self.hellos: set[int] = set()
        self.all_hello = asyncio.Event()
        self.farewells: set[int] = set()  # peers that have read this peer's goodbye
        self._told: set[int] = set()  # the peers this peer's goodbye went to
        self._closing = False  # a peer that is leaving passes on no news
        # What broke the group of each peer that said goodbye after a failure (its bye's
        # "lost" and "cause"), read before its departure and passed on with the news of it.
        self._reports: dict[int, dict[str, Any]] = {}
        self._progress = asyncio.Event()  # set on each farewell or departure
        self._board: BoardPath | None = None
        self._board_known = False
        # What the group's record of its collectives is (it spans epochs: the group hands
        # its own in) and auto's constants (read and checked when the group was formed).
        self.activity = Activity()
        self.constants = constants
        self.runner = Runner(self)
        self.run = self.runner.run
        if membership.world_size == 1:
            self.all_hello.set()
        failures.attach(membership.rank, membership.group_id, self.matcher, transport)

    @property
    def rank(self) -> int:
        return self.membership.rank

    @property
    def world_size(self) -> int:
        return self.membership.world_size

    def start(self) -> None:
        """Connect the transport; incoming messages are dispatched from now on (by
        :func:`.control.dispatch`, called by the transport itself)."""
        self.transport.connect(self.membership, partial(control.dispatch, self),
                               self.peers.link_down)

    @property
    def board(self) -> BoardPath | None:
        """The board path of small collectives, if every peer shares this host and the
        board is mapped (known once every peer's hello has come: the group has formed)."""
        if not self._board_known and self.all_hello.is_set():
            self._board_known = True
            board = getattr(self.transport, "board", None)
            if board is not None:
                self._board = BoardPath(board, self.matcher, self.settings.spin_us * 1e-6)
                self._board.history = self.runner.recent
        return self._board

    def next_seq(self) -> int:
        """The next collective's sequence number; the same on every rank that agrees."""
        self.failures.check_usable()
        seq = self.seq
        self.seq += 1
        return seq

    def next_transfer(self, src: int, dst: int, tag: int) -> tuple[int, int, int, int]:
        """The id of the next point-to-point transfer from ``src`` to ``dst`` with ``tag``
        (one of them this rank): ``(src, dst, tag, count)``, the same on both ranks."""
        self.failures.check_usable()
        channel = (src, dst, tag)
        count = self.transfers[channel]
        self.transfers[channel] = count + 1
        return (src, dst, tag, count)

    def read_report(self, header: Header) -> None:
        """A goodbye, or news of one (validated), that says what broke its peer's group:
        take it as news of the peer it lost (``lost``) and as its abort (``cause``), before
        the departure itself, once per departed peer.

        So a peer that hears of a goodbye before the news of what led to it (the news of
        a loss spreads over the overlay's fingers, and the goodbye of a peer that failed
        at once may overtake it) still fails with the root cause: the PeerLost naming the
        rank that was lost, not "rank X left the group" naming the one that left. News of
        a goodbye that was sent here too is left to the goodbye itself, which comes after
        the data its peer sent before it (as in :meth:`gone_from`)."""
        meta = header.meta
        assert meta is not None
        if header.kind == "bye":
            rank = header.src
        elif meta["graceful"] and self.rank not in meta.get("told", ()):
            rank = meta["rank"]
        else:
            return  # a loss; or a goodbye that comes here too, after the data before it
        if rank == self.rank or rank in self._reports or not (
                "lost" in meta or "cause" in meta):
            return
        report = self._reports[rank] = {k: meta[k] for k in ("lost", "cause") if k in meta}
        lost = report.get("lost")
        if lost is not None and lost != self.rank:
            self.peers.reported_lost(lost, by=header.src)
        if "cause" in report:
            self.failures.on_cause(rank, report["cause"])

    def _departed(self, rank: int) -> None:
        self.matcher.peer_departed(rank)  # the receives waiting for it
        self.failures.peer_departed(rank)  # every operation that needs it, sends included
        self._progress.set()
        self.transport.forget(rank)  # and watch another peer in its place (see overlay)
        self._spread(rank)

    def _spread(self, rank: int) -> None:
        """Tell this rank's fingers that ``rank`` has gone (see
        :mod:`p2pcoll.transport.overlay`): each peer does so once, when it first learns it,
        so the news reaches every peer within about log2 p hops, whoever saw it first."""
        departure = self.peers.gone().get(rank)
        if departure is None or self._closing:
            return
        news = self.header("gone")
        news.seq = departure.started
        news.meta = {"rank": rank, "graceful": departure.graceful}
        if departure.graceful:
            news.meta["told"] = sorted(departure.told)
            news.meta.update(self._reports.get(rank, ()))
        for peer in overlay.fingers(self.rank, self.world_size, self.peers.gone()):
            self.transport.post(peer, news)

    def gone_from(self, src: int, rank: int, graceful: bool, started: int,
                  told: frozenset[int]) -> None:
        """``src`` says that ``rank`` has gone: with a goodbye (having started ``started``
        collectives) to the peers ``told``, or lost. A peer told that it is itself lost
        ignores it (whoever lost it will find the group broken at its next collective).

        A goodbye is ordered after everything its peer sent on the same link, and it went
        to every peer that peer ever sent to: a peer in ``told`` waits for it (its data may
        still be on the way); a peer not in it was never sent anything, so the news is
        all there is to wait for."""
        if rank == self.rank:
            return
        if graceful:
            if self.rank not in told:
                self.peers.left(rank, started=started, told=told)
        else:
            self.peers.reported_lost(rank, by=src)

    def header(self, kind: str) -> Header:
        return Header(kind, self.membership.group_id, self.membership.rank)

    def hello_from(self, rank: int) -> None:
        """``rank`` said hello: when its link opened, or while the group formed (see
        :func:`~p2pcoll.session.forming.handshake`, which waits for the hellos of
        ``transport.hello_peers``)."""
        self.hellos.add(rank)
        if self.hellos >= self.transport.hello_peers:
            self.all_hello.set()

    def leaving(self) -> None:
        """This peer is about to leave: nothing it sends from now on opens a link (see
        :meth:`Transport.leaving`). Idempotent; :meth:`close` calls it too."""
        self.transport.leaving()

    async def close(self, drain: float) -> None:
        """Say goodbye to the peers, fail everything pending, and wait (at most ``drain``
        seconds) until every peer still there has read the goodbye (the transport stays
        open).

        Every peer answers a goodbye when its reader takes it from the link, which is
        after everything sent before it on that link, so once all have answered nothing
        this peer sent is still in flight: it may close its sockets. (Closing while a
        receiver's queue is full may otherwise lose the tail over ipc, in libzmq.)

        Leaving opens no link (see :meth:`Transport.leaving`), so it needs no descriptor
        and stays within the link budget: the goodbye goes on the links this peer has (and
        to a watcher it has none to, over that watcher's probe) and each answer comes back
        on the connection its goodbye went on (:meth:`Transport.answer`). A peer whose
        link was closed for the budget gets no goodbye: this peer first waits until that
        peer has read all the link carried (:meth:`Transport.drained`), and it learns of the
        departure as the peers this one sent nothing to do, from the others' news.
        """
        self.matcher.close(GroupBroken("the group was closed"))
        self._closing = True
        self.leaving()
        if self.world_size > 1:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + drain
            try:
                await asyncio.wait_for(self.transport.drained(), drain)
            except TimeoutError:
                log.debug("rank %d: closing before ranks %s read its closed links",
                          self.rank, sorted(self.transport.unread()
                                            - self.transport.contacts()))
            bye = self.header("bye")
            bye.seq = self.seq  # the peers learn which collectives this peer took part in
            # To the peers this one has dealt with (and its watchers); they tell the others
            # (see _spread).
            self._told = self.transport.contacts() - set(self.peers.gone())
            bye.meta = {"told": sorted(self._told), **self._failure_report()}
            for peer in sorted(self._told):
                self.transport.post(peer, bye)
            # And back to the peers that send here and were not told: a peer that has a link
            # to this one it did not (yet) say goodbye on reads it when it leaves, and then
            # waits for no farewell from a peer that has gone. Not in told: they learn of
            # this departure from the news as well, and need not wait for this goodbye.
            for peer in sorted(self.transport.senders() - self._told - set(self.peers.gone())):
                self.transport.answer(peer, bye)
            while (waiting := self.unanswered()) and loop.time() < deadline:
                self._progress.clear()
                try:
                    await asyncio.wait_for(self._progress.wait(), deadline - loop.time())
                except TimeoutError:
                    break
            if waiting:
                log.debug("rank %d: closing before ranks %s read its goodbye", self.rank,
                          sorted(waiting))
        self.peers.close()
        if self._board is not None:
            self._board.close()
        if self.executor.timeline is not None:
            self.executor.timeline.close()

    def _failure_report(self) -> dict[str, Any]:
        """What this peer's goodbye says broke its group (see :meth:`read_report`): the
        first failure (``cause``, see :meth:`FailureModel.first_failure`) and a peer it
        knows to be lost (``lost``: the one the cause names if it was lost, else the first
        lost); nothing after a healthy run, whose goodbye reads as "rank X left"."""
        report: dict[str, Any] = {}
        cause = self.failures.first_failure()
        if cause is not None:
            report["cause"] = cause
        lost = [r for r, d in self.peers.gone().items() if not d.graceful]
        if lost:
            named = cause.get("rank") if cause is not None else None
            report["lost"] = named if named in lost else lost[0]
        return report

    def unanswered(self) -> set[int]:
        """The peers this peer's goodbye went to that have neither answered it nor gone."""
        return self._told - self.farewells - set(self.peers.gone())

    def bye_from(self, rank: int, started: int, told: frozenset[int]) -> None:
        """``rank`` said goodbye (to ``told``): answer that everything before was read (on
        the connection the goodbye came on: it opens no link), and record it (which lets
        go of what the transport keeps for ``rank``, that connection too)."""
        self.transport.answer(rank, self.header("farewell"))
        self.peers.left(rank, started=started, told=told)

    def farewell_from(self, rank: int) -> None:
        self.farewells.add(rank)
        self._progress.set()
