"""The rendezvous's rules, without I/O: requests in, replies out, the clock passed in.

:class:`Jobs` is the state of a rendezvous server (:mod:`.server` does its I/O): every
request a client sends (its routing identity and the request's bytes) goes to
:meth:`Jobs.request` with the time it was read, and every :data:`~.server.TICK` the server
calls :meth:`Jobs.tick` with the time; both return the :class:`Reply` messages to send. It
imports no socket and no event loop (as h11 does for HTTP), so every rule below is tested
by feeding it requests (``tests/test_rendezvous_jobs.py``).

The protocol (msgpack maps; every client keeps one routing identity for the whole join,
across reconnections):

- ``join``: endpoints, host, pid, process token, requested rank, world size (or, for an
  elastic group, ``min``/``max``), heartbeat and ``order``. Clients re-send it every
  :data:`RESEND` seconds until the roster comes; that is their heartbeat, and it is how a
  restarted server learns the peers again. Each one is answered, to that client alone, with
  a ``status`` (how many arrived, how many ranks are missing and the first
  :data:`MISSING_SHOWN` of them, the first :data:`JOINED_SHOWN` peers that joined), an
  ``error`` for the peers concerned (duplicate rank, rank out of range, world size
  disagreement, a bound of :class:`~p2pcoll.settings.RendezvousLimits` exceeded, a
  registered peer lost: ``permanent`` false, a new attempt may form a group), or the
  ``roster`` once the group is complete: two frames, the peer's own part (rank, group id,
  secret) and the group's endpoints and hosts, one buffer shared by every member's reply
  (it is sent again to a peer that asks again, in case it was lost). A join from the same
  process (its ``token``, random, made once per process: host and pid do not tell processes
  apart, two containers on the host network both run pid 1) for the rank an earlier
  registration of it holds replaces that one: it is the same peer trying again.
- ``leave``: a client gives up (its join was cancelled or timed out).
- ``waiting``: how many peers of a job are waiting for its next group (the elastic training
  layer asks this at round boundaries). With ``expect``, the elastic group forming lowers
  what it expects to that (as a join's ``expect``): members joining after an admission
  that learn one of them was lost on the way say so, and the group forms without it.

Each job (a job id, ``P2PCOLL_JOB_ID``, empty by default) has at most one group forming at a
time; once it has formed, the next requests of that job start the next group. A group of
fixed size forms when every rank is there. An elastic group (world size None, ``min``
given) forms when ``max`` peers are there, or at least ``min`` are and nobody new arrived
for :data:`SETTLE` seconds, or as many as a join expects (``expect``, the fewest any asked
for: the survivors of a loss know who is coming, and one that counted another survivor
among the waiting expects one too many). Ranks go to the requested ones first,
then by ``order`` (lower first), then by arrival. A registered peer that has not re-sent
its request for its heartbeat timeout is lost: the others of a fixed-size group fail at
once naming it (an elastic group just goes on without it). A malformed request is
counted and dropped.

A peer that cannot accept connections is named by a relay endpoint in the roster, as it
asked or as the server found (:mod:`.reach`).

A refused join that a member of the job made (it passed the job key's handshake, or there
is no key) and that means the fixed-size group cannot form as asked (its world size or rank
disagrees with the group's, or two peers asked for one rank) fails the peers already
registered at once, naming the refused peer and why: they would otherwise wait out their
join timeout for a peer that will not come back. A refusal that says nothing about the job
(over a bound, too many requests, a malformed request) fails nobody else: anyone who can
reach the port could send one.

What anyone who can reach the port may cost is bounded (the limits): the world size and
heartbeat a join may ask for, the registrations and jobs held at once, the requests per
second of one connection (:mod:`.admission`: a client that repeats itself is never over
it). Every request costs O(1) (the status goes to the asking peer only; forming a group of
n costs O(n log n), once); registrations expire after their heartbeat, a job with none left
is forgotten, rosters are kept for :data:`FORMED_TTL` seconds.
"""

from __future__ import annotations

import heapq
import logging
import secrets
import uuid
from bisect import bisect_left, insort
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgpack

from ..wire import WIRE_VERSION
from .admission import Admission
from .protocol import RESEND
from .reach import named
from .registrations import JOINED_SHOWN, MISSING_SHOWN, readable
from .registrations import Entry as _Entry
from .registrations import Forming as _Forming
from .registrations import Roster as _Roster

if TYPE_CHECKING:  # settings imports the security package, which needs zmq
    from ..settings import RendezvousLimits

log = logging.getLogger("p2pcoll.rendezvous")

SETTLE = 1.0  # an elastic group with enough peers forms after this long without arrivals
FORMED_KEPT = 4096  # rosters kept to answer peers that ask again...
FORMED_TTL = 30.0  # ...for this many seconds after their group formed
# What to do about two processes asking for one rank (the end of that error).
DUPLICATE_HINT = ("give each process its own rank (rank= or $RANK), or none to have the "
                  "rendezvous number them")
MIN_HEARTBEAT = 2 * RESEND  # a shorter heartbeat would lose a peer between its re-sends


@dataclass(frozen=True, slots=True)
class Reply:
    """A message to one client: ``to`` its routing identity, ``frames`` msgpack maps (a
    roster's two frames: the peer's own part, then the group's, one object shared by every
    member's reply)."""

    to: bytes
    frames: tuple[bytes, ...]



class _Rejected(Exception):
    """A request that gets an error reply."""


class _Misfit(_Rejected):
    """A join that cannot fit the group that is forming (world size, bounds or rank): a
    member's mistake, which fails the peers of a fixed-size group already registered."""


def _int(msg: dict[str, Any], name: str, low: int, high: int | None = None,
         bound: str = "") -> int | None:
    value = msg.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise _Rejected(f"{name} must be an integer >= {low}, got {value!r}")
    if high is not None and value > high:
        raise _Rejected(f"{name} {value} is over this rendezvous's bound of {high} ({bound})")
    return value


class Jobs:
    """The groups forming at one rendezvous; see the module docstring.

    Args:
        limits: what it accepts and holds (:class:`~p2pcoll.settings.RendezvousLimits`).

    Its counters: ``groups_formed``, ``requests`` read, ``dropped`` (over a connection's
    rate, or malformed), ``resends`` (copies of a connection's last request over its rate,
    not handled, not refused), and ``refused_joins`` (the last few member joins refused,
    described).
    """

    def __init__(self, limits: RendezvousLimits,
                 relay: Callable[[], int | None] = lambda: None,
                 reach: Callable[[bytes, list[str]], bool | None] = lambda i, e: True) -> None:
        self.limits = limits
        self.relay = relay  # the port of the rendezvous host's relay (see .reach)
        self.reach = reach  # whether the server could connect back to a peer (see .reach)
        self._forming: dict[str, _Forming] = {}
        self._peers = 0  # registrations, over every job
        self._expiry: list[tuple[float, int, str, bytes]] = []  # (deadline, arrival, job, id)
        self._settling: set[str] = set()  # elastic jobs with at least their minimum
        self._formed: OrderedDict[bytes, _Roster] = OrderedDict()  # identity -> roster
        self._admission = Admission(self.limits.rate,
                                    self.limits.max_peers + self.limits.max_jobs)
        self._arrivals = 0
        self._out: list[Reply] = []
        self.groups_formed = 0
        self.requests = 0
        self.dropped = 0
        self.resends = 0
        self.refused_joins: list[str] = []

    def stats(self) -> dict[str, int]:
        """``peers`` registered, ``jobs`` forming, ``rosters`` kept, and the counters."""
        return {"peers": self._peers, "jobs": len(self._forming), "rosters": len(self._formed),
                "groups_formed": self.groups_formed, "requests": self.requests,
                "dropped": self.dropped, "resends": self.resends}

    def request(self, frames: Sequence[bytes], now: float) -> list[Reply]:
        """A request read at ``now``: ``frames`` as a ROUTER reads them (the client's
        routing identity, then the request). Returns the replies it calls for (to this
        client, and to others its join concerns). Never raises for what the request holds:
        a malformed one is counted (``dropped``) and dropped."""
        self.requests += 1
        try:
            if len(frames) != 2:
                raise ValueError(f"{len(frames) - 1} frames, expected 1")
            identity, raw = frames
            if not self._admit(identity, raw, now):
                return self._flush()
            msg = msgpack.unpackb(raw, raw=False, max_bin_len=0, max_ext_len=0)
            if not isinstance(msg, dict):
                raise ValueError("not a map")
        except Exception as exc:
            self.dropped += 1
            log.debug("rendezvous: dropped a malformed request: %s", exc)
            return self._flush()
        try:
            self._handle(identity, msg, now)
        except _Rejected as exc:
            self._reply(identity, op="error", reason=str(exc))
        except Exception:  # a bug here must not stop the server: it serves the others
            log.exception("rendezvous: failed to handle a request")
        return self._flush()

    def tick(self, now: float, heard_until: float) -> list[Reply]:
        """The clock moved to ``now``; every request sent before ``heard_until`` has been
        read (the server may be behind). Loses the peers whose heartbeat ran out by then,
        forms the elastic groups that settled, forgets old rosters; returns the replies.
        The work is what is due, not what is held."""
        self._expire(heard_until, now)
        for job in list(self._settling):
            forming = self._forming.get(job)
            if forming is not None:
                self._progress(forming, now)
        while self._formed:
            roster = next(iter(self._formed.values()))
            if now - roster.formed < FORMED_TTL and len(self._formed) <= FORMED_KEPT:
                break
            self._formed.popitem(last=False)
        return self._flush()

    def _flush(self) -> list[Reply]:
        out, self._out = self._out, []
        return out

    def _reply(self, identity: bytes, **msg: Any) -> None:
        self._out.append(Reply(identity, (msgpack.packb(msg),)))

    def _admit(self, identity: bytes, raw: bytes, now: float) -> bool:
        """Whether to handle a request, before it is decoded (see :mod:`.admission`)."""
        verdict = self._admission.admit(identity, raw, now)
        if verdict == "resend":
            self.resends += 1
        elif verdict != "handle":
            self.dropped += 1
            if verdict == "over-told":
                self._reply(identity, op="error", reason=(
                    f"more than {self.limits.rate:g} requests per second from this "
                    f"connection, this rendezvous's bound (P2PCOLL_RENDEZVOUS_RATE): the rest "
                    f"are dropped"))
        return verdict == "handle"

    def _handle(self, identity: bytes, msg: dict[str, Any], now: float) -> None:
        op = msg.get("op")
        if msg.get("v") != WIRE_VERSION:
            raise _Rejected(f"wire version {msg.get('v')!r}, the rendezvous speaks {WIRE_VERSION}")
        job = msg.get("job", "")
        if not isinstance(job, str) or len(job) > 128:
            raise _Rejected("malformed job id")
        if op == "waiting":
            forming = self._forming.get(job)
            expect = _int(msg, "expect", 1, self.limits.max_world_size,
                          "P2PCOLL_RENDEZVOUS_MAX_WORLD_SIZE")
            count = len(forming.entries) if forming else 0
            if forming is not None and forming.elastic and expect is not None:
                forming.expect = min(forming.expect or expect, expect)
                self._progress(forming, now)  # (its members get their rosters)
            self._reply(identity, op="waiting", count=count)
        elif op == "leave":
            forming = self._forming.get(job)
            entry = forming.entries.get(identity) if forming is not None else None
            if forming is not None and entry is not None:
                self._remove(forming, entry)
        elif op == "join":
            self._join(identity, job, msg, now)
        else:
            raise _Rejected(f"unknown request {op!r}")

    def _join(self, identity: bytes, job: str, msg: dict[str, Any], now: float) -> None:
        formed = self._formed.get(identity)
        if formed is not None and formed.job == job:  # it asked again: its roster was lost
            self._out.append(Reply(identity, (formed.head, formed.body)))
            return
        limits = self.limits
        bound = "P2PCOLL_RENDEZVOUS_MAX_WORLD_SIZE"
        size = _int(msg, "world_size", 1, limits.max_world_size, bound)
        rank = _int(msg, "rank", 0, limits.max_world_size - 1, bound)
        low = _int(msg, "min", 1, limits.max_world_size, bound)
        high = _int(msg, "max", 1, limits.max_world_size, bound)
        order, pid = _int(msg, "order", 0), _int(msg, "pid", 0) or 0
        expect = _int(msg, "expect", 1, limits.max_world_size, bound)
        endpoints, host, heartbeat = msg.get("endpoints"), msg.get("host"), msg.get("heartbeat")
        token = msg.get("token")
        if (not isinstance(endpoints, list) or not 0 < len(endpoints) <= 8
                or not (token is None or (isinstance(token, str) and len(token) <= 64))
                or not all(isinstance(e, str) and len(e) <= 256 for e in endpoints)
                or not isinstance(host, str) or len(host) > 256
                or not isinstance(heartbeat, (int, float)) or isinstance(heartbeat, bool)
                or not heartbeat > 0):
            raise _Rejected("malformed join request")
        try:
            endpoints = named(identity, endpoints, msg, self.reach, self.relay)
        except ValueError as exc:
            raise _Rejected(str(exc)) from None
        if endpoints is None:
            return  # held until the server knows whether it reaches the peer (see .reach)
        if heartbeat > limits.max_heartbeat:
            raise _Rejected(f"heartbeat {heartbeat:g}s is over this rendezvous's bound of "
                            f"{limits.max_heartbeat:g}s (P2PCOLL_RENDEZVOUS_MAX_HEARTBEAT)")
        forming = self._forming.get(job)
        entry = forming.entries.get(identity) if forming is not None else None
        if forming is not None and entry is not None:  # a re-sent request: it is alive
            entry.seen = now
            self._status(forming, entry)
            return
        if forming is None:
            if len(self._forming) >= limits.max_jobs:
                raise _Rejected(f"groups of {len(self._forming)} jobs are forming, this "
                                f"rendezvous's bound (P2PCOLL_RENDEZVOUS_MAX_JOBS)")
            forming = _Forming(job)
        stale = None
        if rank is not None:
            other = forming.by_rank.get(rank)
            if other is not None and token is not None and other.token == token:
                stale = other  # the same process asking again: it gave up on that one
        if self._peers - (stale is not None) >= limits.max_peers:
            raise _Rejected(f"{self._peers} peers are waiting at this rendezvous, its bound "
                            f"(P2PCOLL_RENDEZVOUS_MAX_PEERS)")
        try:
            self._check_fit(forming, rank, size, low, high, host, pid, stale)
        except _Misfit as exc:
            asked = f", asking for rank {rank}" if rank is not None else ""
            self._refuse_member(forming, f"the peer on {readable(host)} (pid {pid}{asked}) "
                                         f"was refused: {exc}")
            raise
        if stale is not None:
            log.info("rendezvous: job %r: %s registered again: the old registration is "
                     "replaced", job, stale.describe())
            self._remove(forming, stale)
            self._reply(stale.identity, op="error", reason=(
                f"a newer request of this process (pid {pid}) for rank {rank} replaced this "
                f"one"))
        if not forming.entries:
            self._forming[job] = forming
            if size is not None:
                forming.world_size = size
            elif low is not None:
                forming.low, forming.high = low, high
        self._arrivals += 1
        entry = _Entry(identity, rank, endpoints, host, pid, token,
                       float("inf") if order is None else order, self._arrivals,
                       max(float(heartbeat), MIN_HEARTBEAT), now)
        forming.entries[identity] = entry
        forming.shown = None
        self._peers += 1
        if rank is not None:
            forming.by_rank[rank] = entry
            insort(forming.taken, rank)
        self._expire_at(now + entry.heartbeat, entry, job)
        forming.last_arrival = now
        if expect is not None:
            forming.expect = min(forming.expect or expect, expect)
        if not self._progress(forming, now):
            self._status(forming, entry)

    def _check_fit(self, forming: _Forming, rank: int | None,
                   size: int | None, low: int | None, high: int | None, host: str, pid: int,
                   stale: _Entry | None) -> None:
        """Raises _Misfit if a new peer asking for this does not fit the forming group
        (a duplicate rank fails the peer that held it too)."""
        others = len(forming.entries) - (stale is not None)
        if size is not None:
            if forming.world_size is None and others and forming.elastic:
                raise _Misfit(f"world_size {size} disagrees with an elastic group of the "
                              f"{others} peer(s) already at the rendezvous")
            if forming.world_size is None and others:  # peers that gave no size came first
                self._adopt_size(forming, size)
            elif forming.world_size is not None and others and size != forming.world_size:
                raise _Misfit(f"world_size {size} disagrees with world_size "
                              f"{forming.world_size} of the {others} peer(s) already at "
                              f"the rendezvous")
        elif low is not None:
            if others and (forming.world_size is not None
                           or (low, high) != (forming.low, forming.high)):
                raise _Misfit(f"elastic bounds {low}..{high} disagree with those of the "
                              f"{others} peer(s) already at the rendezvous")
            if rank is not None:
                raise _Misfit("an elastic group assigns every rank: do not ask for one")
        if rank is None:
            return
        world = forming.world_size if others else size  # a first peer sets the size
        if world is not None and rank >= world:
            raise _Misfit(f"rank {rank} is out of range for world_size {world}")
        other = forming.by_rank.get(rank)
        if other is not None and other is not stale:
            # Host and pid tell the two processes apart for whoever reads it (the token,
            # which tells them apart here, means nothing to a reader).
            reason = (f"rank {rank} was requested by two peers: {readable(other.host)} pid "
                      f"{other.pid} and {readable(host)} pid {pid}; {DUPLICATE_HINT}")
            self._remove(forming, other)
            self._reply(other.identity, op="error", reason=reason)
            raise _Misfit(reason)

    def _refuse_member(self, forming: _Forming, what: str) -> None:
        """A member's join was refused: log it, and fail the peers of a fixed-size group
        already registered (the group cannot form as asked; an elastic one goes on)."""
        self.refused_joins = [*self.refused_joins[-7:], what]
        log.warning("rendezvous: job %r: %s", forming.job, what)
        if forming.elastic or not forming.entries or self._forming.get(forming.job) is not forming:
            return
        for e in list(forming.entries.values()):
            self._reply(e.identity, op="error", about="other", reason=(
                f"{what}; the group of world_size {forming.world_size} cannot form as asked"))
            self._remove(forming, e)

    def _adopt_size(self, forming: _Forming, size: int) -> None:
        """The first world size given for a group whose first peers gave none: those that
        asked for a rank out of its range are told so (once per group: O(n))."""
        forming.world_size = size
        for rank in [r for r in forming.taken if r >= size]:
            entry = forming.by_rank[rank]
            self._remove(forming, entry, keep=True)
            self._reply(entry.identity, op="error",
                        reason=f"rank {rank} is out of range for world_size {size}")

    def _remove(self, forming: _Forming, entry: _Entry, keep: bool = False) -> None:
        """Drop a registration; a job with none left is forgotten (unless ``keep``)."""
        del forming.entries[entry.identity]
        forming.shown = None
        self._peers -= 1
        if entry.rank is not None:
            del forming.by_rank[entry.rank]
            forming.taken.pop(bisect_left(forming.taken, entry.rank))
        if not forming.entries and not keep:
            self._forming.pop(forming.job, None)
            self._settling.discard(forming.job)

    def _status(self, forming: _Forming, entry: _Entry) -> None:
        count, shown = forming.missing()
        self._reply(entry.identity, op="status", arrived=len(forming.entries),
                    world_size=forming.world_size or forming.low, missing=shown,
                    missing_count=count, joined=forming.joined())

    def _expire_at(self, deadline: float, entry: _Entry, job: str) -> None:
        """Look at ``entry`` again at ``deadline``. The heap keeps the items of entries that
        formed or left until their deadline; when they outnumber the entries held, it is
        rebuilt from those (O(n) after n pushes: O(1) a push)."""
        heapq.heappush(self._expiry, (deadline, entry.arrival, job, entry.identity))
        if len(self._expiry) > 2 * (self._peers + self.limits.max_jobs):
            self._expiry = [(e.seen + e.heartbeat, e.arrival, f.job, e.identity)
                            for f in self._forming.values() for e in f.entries.values()]
            heapq.heapify(self._expiry)

    def _expire(self, read: float, now: float) -> None:
        """Peers that stopped re-sending their request are lost: the registrations whose
        deadline passed before ``read`` (every request up to then has been read), from a
        heap, so O(those) per tick, grouped by job."""
        lost: dict[str, dict[bytes, _Entry]] = {}
        while self._expiry and self._expiry[0][0] <= read:
            _, _, job, identity = heapq.heappop(self._expiry)
            forming = self._forming.get(job)
            entry = forming.entries.get(identity) if forming is not None else None
            if entry is None:
                continue  # it formed, left or was replaced
            if entry.seen + entry.heartbeat > read:  # heard since: check again then
                self._expire_at(entry.seen + entry.heartbeat, entry, job)
                continue
            lost.setdefault(job, {})[identity] = entry
        for job, by_identity in lost.items():
            forming, entries = self._forming[job], list(by_identity.values())
            for e in entries:
                self._remove(forming, e, keep=True)
            names = "; ".join(f"{e.describe()} registered and then stopped answering for "
                              f"{now - e.seen:.1f}s" for e in entries[:4])
            if len(entries) > 4:
                names += f"; and {len(entries) - 4} more"
            log.warning("rendezvous: job %r: %s", job, names)
            if not forming.elastic:
                for e in forming.entries.values():
                    self._reply(e.identity, op="error", reason=f"{names}: it was lost while "
                                f"the group formed", permanent=False)
                for e in list(forming.entries.values()):
                    self._remove(forming, e, keep=True)
            if not forming.entries:
                del self._forming[job]
                self._settling.discard(job)
            elif forming.elastic and len(forming.entries) < (forming.low or 1):
                self._settling.discard(job)

    def _progress(self, forming: _Forming, now: float) -> bool:
        """Form the group if it is complete; returns whether it formed. O(1) unless it
        forms (then O(n log n), once)."""
        count = len(forming.entries)
        if forming.elastic:
            assert forming.low is not None
            full = forming.high is not None and count >= forming.high
            if count >= forming.low:
                self._settling.add(forming.job)
            settled = count >= forming.low and (now - forming.last_arrival >= SETTLE
                                                or count >= forming.expect > 0)
            if not (full or settled):
                return False
            entries = sorted(forming.entries.values(),
                             key=lambda e: (e.order, e.arrival))[:forming.high]
            size = len(entries)
        else:
            if forming.world_size is None or count < forming.world_size:
                return False
            size = forming.world_size
            entries = sorted(forming.entries.values(), key=lambda e: (e.order, e.arrival))
        free = iter(r for r in range(size) if r not in forming.by_rank)
        ranks = {e.identity: e.rank if e.rank is not None else next(free) for e in entries}
        by_rank = sorted(entries, key=lambda e: ranks[e.identity])
        group_id = uuid.uuid4().hex[:16]
        group = {"op": "roster", "group": group_id, "secret": secrets.token_hex(16),
                 "epoch": 0, "world_size": size}
        body = msgpack.packb({"endpoints": [e.endpoints for e in by_rank],
                              "hosts": [e.host for e in by_rank]})
        for e in by_rank:
            roster = _Roster(forming.job, now, msgpack.packb({**group, "rank": ranks[e.identity]}),
                             body)
            self._formed[e.identity] = roster
            self._formed.move_to_end(e.identity)
            self._out.append(Reply(e.identity, (roster.head, body)))
            self._remove(forming, e, keep=True)
        while len(self._formed) > FORMED_KEPT:
            self._formed.popitem(last=False)
        self.groups_formed += 1
        log.info("rendezvous: job %r: formed group %s of %d", forming.job, group_id, size)
        forming.expect = 0  # what was expected has come
        if not forming.entries:  # peers left over from an elastic group start the next
            del self._forming[forming.job]
            self._settling.discard(forming.job)
        return True


__all__ = ["FORMED_KEPT", "FORMED_TTL", "JOINED_SHOWN", "MIN_HEARTBEAT", "MISSING_SHOWN",
           "SETTLE", "Jobs", "Reply"]
