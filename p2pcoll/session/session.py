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
from collections.abc import Collection, Mapping
from functools import partial
from typing import TYPE_CHECKING, Any

from .activity import Activity
from ..engine.costs import DEFAULT_CONSTANTS, Constants
from ..engine.executor import Executor
from ..engine.flow import Flow
from ..engine.matching import Matcher
from ..engine.polling import MessageWait
from ..errors import KILLED, UNRESPONSIVE, GroupBroken, PeerLost
from ..settings import Settings
from ..departures import (
    ALIVE,
    CHECK_WAIT,
    Aborted,
    Action,
    DeclaredLost,
    Degrade,
    Departure,
    Departures,
    Fail,
    Forget,
    Leave,
    Post,
    Unwatch,
    Watch,
)
from ..transport.base import LinkEvent, Transport
from ..transport.endpoints import CHECKABLE, answers, listening
from ..transport.lane_poll import LanePoll
from ..types import Membership, OpKey
from ..wire import Header
from . import control
from .calls import Runner
from .contacts import Contacts
from .failure import FailureModel, GroupState
from .flight import Recorder

if TYPE_CHECKING:  # imported when the board is mapped: by a group on one host only
    from ..engine.board_path import BoardPath

log = logging.getLogger("p2pcoll")

RECHECK_S = 0.02  # how often a suspect's address is asked again while something listens

# OpKey(seq) made without a Python call (the named tuple's generated __new__): every
# collective takes one (tests/test_running_operations.py checks that it equals OpKey(seq)).
_collective_key = partial(tuple.__new__, OpKey)


class Session:
    """The state of one epoch of a group; see the module docstring."""

    def __init__(self, membership: Membership, transport: Transport, settings: Settings,
                 constants: Mapping[str, Constants] = DEFAULT_CONSTANTS) -> None:
        self.membership = membership
        self.transport = transport
        self.settings = settings
        # Who has gone, and what follows from it, is decided by the departures machine;
        # this session carries out what it says (see _do) and feeds it what happens.
        self.departures = Departures(membership.rank, membership.world_size,
                                     membership.group_id, endpoints=membership.endpoints,
                                     stall=settings.heartbeat_timeout, running=self._running)
        self._timer: asyncio.TimerHandle | None = None
        self._checks: dict[int, asyncio.Task[None]] = {}  # suspects' addresses (link_down)
        self.contacts = Contacts()  # what the transport's link events say (see on_link)
        self.peers = Record(self)
        self.matcher = Matcher(self.peers)
        self.matcher.flow = Flow(settings.eager_window, self._credit, self._ask_credit,
                                 self.peers.lost, self.matcher.failure)
        self.failures = FailureModel(membership.rank, membership.group_id, self.matcher,
                                     transport, self)
        timeline = None
        if settings.timeline:  # (P2PCOLL_TIMELINE; imported only then: most groups keep none)
            from ..engine.timeline import Timeline
            timeline = Timeline(settings.timeline, membership.group_id, membership.rank,
                                membership.world_size)
        self.executor = Executor(
            transport, self.matcher, self.peers, membership.group_id,
            segment_bytes=settings.segment_bytes, depth=settings.pipeline_depth,
            max_message_bytes=settings.max_message_bytes, timeline=timeline,
        )
        self.seq = 0
        self.transfers: Counter[tuple[int, int, int]] = Counter()  # (src, dst, tag) -> sent
        self.hellos: set[int] = set()
        self.all_hello = asyncio.Event()
        self._progress = asyncio.Event()  # set on each farewell or departure
        self._board: BoardPath | None = None
        self._board_known = False
        # What the group's record of its collectives is (it spans epochs: the group hands
        # its own in) and auto's constants (read and checked when the group was formed).
        self.activity = Activity()
        self.constants = constants
        # The last calls, for `p2pcoll flight` (see .flight); None when it is off.
        self.flight = Recorder(
            settings.flight_record, membership.rank, membership.world_size,
            membership.group_id, self.matcher.waiting_on,
            lambda key: self.failures.status(key.number)[1], settings.flight_dir,
            self.failures.calls,
        ) if settings.flight_record else None
        self.runner = Runner(self)
        self.run = self.runner.run
        if membership.world_size == 1:
            self.all_hello.set()

    # -- the failure model's Operations: what it runs and fails, to the departures machine

    def spread_abort(self, abort: Header) -> None:
        """This rank failed ``abort``'s operation: the departures machine says whom to tell
        (the peers that may not have read all this rank sent them, and its fingers)."""
        self._do(self.departures.failed(abort, self.contacts.unread()))

    def starting(self, op: OpKey, needs: frozenset[int] | None, seq: int | None) -> None:
        """An operation starts after a member has gone (see :class:`.failure.Operations`):
        one that needs a peer gone already fails at once (a Fail action, see :meth:`_do`)."""
        actions = self.departures.starting(op, needs, seq)
        if actions:
            self._do(actions)

    def _running(self) -> list[tuple[OpKey, frozenset[int] | None, int | None]]:
        """What runs, for the departures machine (made before the failure model)."""
        return self.failures.running()

    @property
    def rank(self) -> int:
        return self.membership.rank

    @property
    def world_size(self) -> int:
        return self.membership.world_size

    def start(self) -> None:
        """Connect the transport and watch the first successors; incoming messages are
        dispatched from now on (by :func:`.control.dispatch`, called by the transport
        itself), and its link events come to :meth:`on_link`."""
        poll = self.transport.connect(
            self.membership, partial(control.dispatch, self), self.on_link)
        self.matcher.poll = poll
        if isinstance(poll, LanePoll) and self.settings.spin_us:  # TCP lanes: see .polling
            self.matcher.waits = MessageWait(poll, self.settings.spin_us * 1e-6,
                                             self.world_size)
        self._do(self.departures.start(self._now()))

    @property
    def board(self) -> BoardPath | None:
        """The board path of small collectives, if every peer shares this host and the
        board is mapped (known once every peer's hello has come: the group has formed)."""
        if not self._board_known and self.all_hello.is_set():
            self._board_known = True
            board = getattr(self.transport, "board", None)
            if board is not None:
                from ..engine.board_path import BoardPath
                self._board = BoardPath(board, self.matcher, self.settings.spin_us * 1e-6)
                self._board.history = self.runner.recent
        return self._board

    def next_seq(self) -> OpKey:
        """The next collective's key (its sequence number); the same on every rank that
        agrees."""
        self.failures.check_usable()
        seq = self.seq
        self.seq = seq + 1
        key: OpKey = _collective_key((seq, None, -1, -1))
        return key

    def next_transfer(self, src: int, dst: int, tag: int) -> OpKey:
        """The key of the next point-to-point transfer from ``src`` to ``dst`` with ``tag``
        (one of them this rank), the same on both ranks."""
        self.failures.check_usable()
        channel = (src, dst, tag)
        count = self.transfers[channel]
        self.transfers[channel] = count + 1
        return OpKey.transfer(src, dst, tag, count)

    def on_departure_message(self, header: Header) -> None:
        """A goodbye, a farewell, news of a departure or an abort (validated): the departures
        machine decides what it means (see :mod:`p2pcoll.departures`). A closed group
        passes no abort on."""
        actions = self.departures.received(header, self._now())
        if header.kind == "abort" and self.failures.state is GroupState.CLOSED:
            actions = [a for a in actions if not isinstance(a, Post)]
        self._do(actions)
        if header.kind == "farewell":
            self._progress.set()

    def on_link(self, peer: int, event: LinkEvent) -> None:
        """What the transport saw of its connections to ``peer``: a link or probe that went
        down goes to the departures machine, the rest to :attr:`contacts`."""
        if event is LinkEvent.DOWN or event is LinkEvent.PROBE_DOWN:
            self.link_down(peer, probe=event is LinkEvent.PROBE_DOWN)
        else:
            self.contacts.on_link(peer, event)

    def link_down(self, rank: int, probe: bool = False) -> None:
        """A link (``probe``: the probe) to ``rank`` went down. A new suspect's address is
        checked, so that its loss says whether it was killed or stopped answering, and a
        suspect whose process still answers is kept (see p2pcoll.departures.suspects)."""
        endpoint = self.membership.endpoints[rank]
        checking = (endpoint.startswith(CHECKABLE) and not self.departures.suspects(rank)
                    and rank not in self._checks)
        self._do(self.departures.link_closed(rank, self._now(), checking=checking,
                                             probe=probe))
        if checking and self.departures.suspects(rank):
            self._checks[rank] = asyncio.create_task(self._check(rank, endpoint))

    async def _check(self, rank: int, endpoint: str) -> None:
        """What became of suspect ``rank``: nothing listens at its address any more (its
        process is gone: killed), or something does, and then either its ZeroMQ I/O thread
        greets a new connection (its process runs: alive, only busy or starved) or not (it
        is there, silent: unresponsive). Asked at once, and again every :data:`RECHECK_S`
        until half a grace after the link went down: a process being killed closes its
        connections a moment before its listening sockets. A suspect found killed is
        declared lost soon after (see :data:`~p2pcoll.departures.KILLED_WAIT`), not at the
        end of its grace; a greeting is waited for up to half :data:`CHECK_WAIT`."""
        how = ""
        loop = asyncio.get_running_loop()
        until = loop.time() + self.departures.grace / 2
        try:
            while True:
                found = await listening(endpoint, CHECK_WAIT / 2)
                if found is False or loop.time() >= until:
                    break
                await asyncio.sleep(min(RECHECK_S, max(0.0, until - loop.time())))
            if found is False:
                how = KILLED
            elif found is None:  # no answer at all (a cut network, say)
                how = UNRESPONSIVE
            else:
                how = ALIVE if await answers(endpoint, CHECK_WAIT / 2) else UNRESPONSIVE
        except ValueError:  # an address it cannot check: the loss says it cannot tell
            pass
        finally:
            self._checks.pop(rank, None)
        self._do(self.departures.classified(rank, how, self._now()))

    def _do(self, actions: list[Action]) -> None:
        """Carry out what the departures machine says, and time its next tick."""
        for action in actions:
            if isinstance(action, Post):
                self.transport.post(action.dst, action.header, action.via)
            elif isinstance(action, (Watch, Unwatch)):
                self.transport.follow(action)
            elif isinstance(action, Forget):
                self._departed(action.peer)
                self.transport.follow(action)
            elif isinstance(action, Fail):
                self.failures.interrupt(action.op, action.error)
            elif isinstance(action, Degrade):
                self.failures.degrade()
            elif isinstance(action, Aborted):
                self.failures.taken(action.header, action.origin, action.message)
            elif isinstance(action, DeclaredLost):
                self.failures.declared_lost(action.error)
        self._schedule()

    def _schedule(self) -> None:
        due = self.departures.deadline()
        if due is None or (self._timer is not None and self._timer.when() <= due):
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer = asyncio.get_running_loop().call_at(due, self._tick)

    def _tick(self) -> None:
        self._timer = None
        self._do(self.departures.tick(self._now()))

    @staticmethod
    def _now() -> float:
        return asyncio.get_running_loop().time()

    def _departed(self, rank: int) -> None:
        self.matcher.peer_departed(rank)  # the receives waiting for it
        self.contacts.forget(rank)
        self.peers.departed()
        self._progress.set()

    def _credit(self, peer: int, watermark: int, credited: int) -> None:
        """Tell ``peer`` what of its sends has finished here (see p2pcoll.engine.flow)."""
        self.transport.post(peer, Header("credit", self.membership.group_id, self.rank,
                                         seq=watermark, meta={"b": credited}))

    def _ask_credit(self, peer: int, window: int) -> None:
        """Ask ``peer`` for credit: this rank's sends to it wait."""
        self.transport.post(peer, Header("credit", self.membership.group_id, self.rank,
                                         meta={"ask": window}))

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
        :class:`~p2pcoll.departures.Leave`). Idempotent; :meth:`close` calls it too."""
        self.transport.follow(Leave())

    async def close(self, drain: float) -> None:
        """Say goodbye to the peers, fail everything pending, and wait (at most ``drain``
        seconds) until every peer still there has read the goodbye (the transport stays
        open).

        Every peer answers a goodbye when its reader takes it from the link, which is
        after everything sent before it on that link, so once all have answered nothing
        this peer sent is still in flight: it may close its sockets. (Closing while a
        receiver's queue is full may otherwise lose the tail over ipc, in libzmq.)

        Leaving opens no link (see :class:`~p2pcoll.departures.Leave`), so it needs no
        descriptor and stays within the link budget: the goodbye goes on the links this
        peer has (and to a watcher it has none to, over that watcher's probe) and each
        answer comes back on the connection its goodbye went on (``via="answer"``). A peer
        whose link was closed for the budget gets no goodbye: this peer first waits until
        that peer has read all the link carried (:meth:`Contacts.drained`), and it learns
        of the departure as the peers this one sent nothing to do, from the others' news.
        """
        self.matcher.close(GroupBroken("the group was closed"))
        self.leaving()
        if self.world_size > 1:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + drain
            try:
                await asyncio.wait_for(self.contacts.drained(), drain)
            except TimeoutError:
                log.debug("rank %d: closing before ranks %s read its closed links",
                          self.rank, sorted(self.contacts.draining()))
            # To the peers this one has a link to, and its watchers (over their probes, those
            # it can reach);
            # they tell the others. And back to the peers that send here and were not
            # told: a peer that has a link to this one it did not (yet) say goodbye on
            # reads it when it leaves, and then waits for no farewell from a peer that has
            # gone. The bye says how many collectives this peer started (which it took
            # part in) and what broke its group, if anything.
            self._do(self.departures.close(
                self.seq, unread=self.contacts.linked(), senders=self.contacts.senders(),
                probed_by=self.contacts.probes_known(), report=self._failure_report()))
            while (waiting := self.unanswered()) and loop.time() < deadline:
                self._progress.clear()
                try:
                    await asyncio.wait_for(self._progress.wait(), deadline - loop.time())
                except TimeoutError:
                    break
            if waiting:
                log.debug("rank %d: closing before ranks %s read its goodbye", self.rank,
                          sorted(waiting))
        self.departures.closed()
        for check in list(self._checks.values()):
            check.cancel()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._board is not None:
            self._board.close()
        if self.executor.timeline is not None:
            self.executor.timeline.close()

    def _failure_report(self) -> dict[str, Any]:
        """What this peer's goodbye says broke its group (read as in Departures._report): the
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
        return self.departures.unanswered()


class Record:
    """The session's record of departed peers, as the matcher, the failure model and the
    group's forming read it (see :class:`p2pcoll.engine.matching.Departures`): a view of
    the departures machine, and the events forming feeds it."""

    def __init__(self, session: Session) -> None:
        self._session = session
        self.membership = session.membership
        self._watching: set[asyncio.Future[None]] = set()  # first_lost()s, woken by departed

    def lost(self, rank: int) -> PeerLost | None:
        return self._session.departures.lost(rank)

    def abandoned(self, rank: int, seq: int) -> bool:
        return self._session.departures.abandoned(rank, seq)

    def gone(self) -> dict[int, Departure]:
        return self._session.departures.gone()

    def said_goodbye(self, rank: int) -> bool:
        return self._session.departures.said_goodbye(rank)

    async def first_lost(self, ranks: Collection[int]) -> tuple[int, PeerLost]:
        """The first of ``ranks`` (the lowest, if several) that this session knows to be
        lost, and its loss, as soon as it knows: a peer that closed its group normally is
        not lost. Waits until one is; cancel it to stop waiting."""
        while True:
            gone = self.gone()
            for rank in sorted(ranks):
                departure = gone.get(rank)
                if departure is not None and not departure.graceful:
                    return rank, departure.error
            woken = asyncio.get_running_loop().create_future()
            self._watching.add(woken)
            try:
                await woken
            finally:
                self._watching.discard(woken)

    def departed(self) -> None:
        """A peer has gone: :meth:`first_lost` looks again."""
        for woken in self._watching:
            if not woken.done():
                woken.set_result(None)

    def reported_lost(self, rank: int, by: int) -> None:
        """``rank`` could not be reached by this peer (``by``) while the group formed."""
        s = self._session
        s._do(s.departures.unreachable(rank, s._now()))
