"""Shrinking a group: the survivors form a new group from the old one's roster, in-process,
with no rendezvous and no store.

Every survivor (the members not excluded) does the same three steps:

1. Bind a new transport of the old one's kind (new sockets: the old group stays as it is,
   its caller's to close).
2. Tell every other survivor, over the old group's links, where that new transport is and
   which ranks it excludes, and hear the same from each of them: one small message each
   way per pair, a transfer with the reserved tag :data:`SHRINK_TAG` that goes below the
   old group's failure rules (its group may be broken by the loss that called for the
   shrink). A survivor that is lost meanwhile fails the receive that waits for it, as
   any receive, so every survivor raises its :class:`PeerLost` within the heartbeat.
3. Start the new session over the agreed roster: the survivors in the order of their old
   ranks, renumbered from 0, the hosts as they were, and wait for its hellos. A survivor
   lost meanwhile ends that wait as soon as the old group (or the new one's links) knows
   it, not when the wait runs out: for a killed process, just after nothing listens at
   its address any more (:data:`~p2pcoll.departures.KILLED_WAIT`). Nothing else differs
   from a group formed fresh by the same peers, so collectives give the same bits.

The new group's id and link secret are derived from the old ones and the survivors, so
every survivor computes the same without sending the secret anywhere.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import Any

import msgpack
import numpy as np

from ..departures.words import GONE_HOW
from ..errors import (CLOSED, CollectiveMismatch, CollectiveTimeout, GroupBroken,
                      PeerLost, ProtocolError, RendezvousError)
from ..settings import Settings
from ..transport.base import Transport
from ..transport.endpoints import host_identity
from ..transport.memory import MemoryTransport
from ..transport.sockets import SocketFactory
from ..transport.zmq_mesh import ZmqMesh
from ..types import Membership, OpKey
from ..wire import MAX_TAG, Header, Signature
from .failure import GroupState
from .forming import handshake
from .session import Session

SHRINK_TAG = MAX_TAG - 1  # the tag of the survivors' exchange over the old group's links
_SIGNATURE = Signature.of("send", "shrink", "", -1, "shrink")
Choose = Callable[[str, str, list[str]], str]  # (my host, theirs, their endpoints) -> one
_MAX_OFFER = 64 << 10  # bytes: an offer is a few endpoints; anything longer is refused


def survivors(membership: Membership, exclude: Iterable[int]) -> tuple[list[int], list[int]]:
    """``(excluded, survivors)`` of a shrink, both sorted, checked as the API documents.

    Raises:
        TypeError: ``exclude`` is not an iterable of ints.
        ValueError: it is empty, repeats a rank, names one out of range, or every rank.
        RuntimeError: this rank is excluded.
    """
    if isinstance(exclude, (str, bytes)) or not isinstance(exclude, Iterable):
        raise TypeError(f"exclude must be a list of ranks, got {type(exclude).__name__}")
    ranks = list(exclude)
    n = membership.world_size
    for r in ranks:
        if not isinstance(r, (int, np.integer)) or isinstance(r, bool):
            raise TypeError(f"exclude must hold ranks (ints), got {r!r}")
    if not ranks:
        raise ValueError("exclude is empty: name at least one rank to leave out")
    bad = [int(r) for r in ranks if not 0 <= r < n]
    if bad:
        raise ValueError(f"ranks {bad} are out of range for a group of {n}")
    if len(set(ranks)) != len(ranks):
        twice = sorted({int(r) for r in ranks if ranks.count(r) > 1})
        raise ValueError(f"exclude names ranks {twice} more than once")
    excluded = sorted(int(r) for r in ranks)
    if len(excluded) == n:
        raise ValueError(f"exclude names every rank of the group of {n}: none would remain")
    if membership.rank in excluded:
        raise RuntimeError(f"rank {membership.rank} is excluded: only the survivors shrink "
                           f"the group")
    return excluded, [r for r in range(n) if r not in excluded]


async def shrink(old: Session, exclude: Iterable[int], settings: Settings,
                 timeout: float | None, abort: bool = False
                 ) -> tuple[Session, SocketFactory | None]:
    """:meth:`p2pcoll.Group.shrink` of the group whose session is ``old`` (see there):
    the new group's session and the sockets it owns. ``settings``: the new group's
    (with the new rank and size once shrunk)."""
    if old.failures.state is GroupState.CLOSED:
        raise GroupBroken("the group is closed")
    m = old.membership
    excluded, kept = survivors(m, exclude)
    if abort:
        old.failures.abort(GroupBroken(f"aborted: rank {m.rank} shrinks the group "
                                       f"without ranks {excluded}"))
    new_settings = replace(settings, rank=kept.index(m.rank), world_size=len(kept))
    limit = settings.collective_timeout if timeout is None else timeout
    transport, sockets, choose = _sibling(old.transport, new_settings)
    heard = {m.rank}  # whose offers have come
    try:
        async with asyncio.timeout(None if math.isinf(limit) else limit):
            offers = await _exchange(old, excluded, kept, await transport.bind(), heard)
            membership = _roster(m, kept, offers, choose)
            session = Session(membership, transport, new_settings, old.constants)
            session.start()
            try:
                await _form(old, session, kept, new_settings.heartbeat_timeout)
            except BaseException as exc:
                # The survivors not heard from, by their old ranks (the new group's
                # numbers mean nothing to the caller).
                silent = [kept[r] for r in sorted(session.transport.hello_peers
                                                  - session.hellos)]
                await session.close(0.0)
                if isinstance(exc, RendezvousError):
                    raise _lost_while_forming(old, kept, silent, exc) from exc
                raise
    except TimeoutError:
        await _discard(transport, sockets)
        missing = sorted(set(kept) - heard)
        raise CollectiveTimeout(
            f"shrink: rank {m.rank} waited {limit:g}s for ranks {missing} (all survivors "
            f"must shrink, excluding {excluded})" if missing else
            f"shrink: rank {m.rank} heard every survivor, but the new group did not form "
            f"within {limit:g}s", collective="shrink", waiting_on=missing) from None
    except BaseException:
        await _discard(transport, sockets)
        raise
    return session, sockets


def _sibling(transport: Transport, settings: Settings
             ) -> tuple[Transport, SocketFactory | None, Choose]:
    """A new, unbound transport of ``transport``'s kind (with its own sockets), and how a
    peer's endpoint is chosen among those it binds."""
    if isinstance(transport, ZmqMesh):
        sockets = SocketFactory.for_settings(settings)
        return (ZmqMesh(transport.policy, transport.host, settings, sockets), sockets,
                transport.policy.choose)
    if isinstance(transport, MemoryTransport):
        return (transport.network.transport(heartbeat_s=settings.heartbeat_timeout), None,
                lambda mine, theirs, endpoints: endpoints[0])
    raise TypeError(f"cannot shrink a group over a {type(transport).__name__}")


async def _discard(transport: Transport, sockets: SocketFactory | None) -> None:
    await transport.aclose()
    if sockets is not None:
        sockets.close()


async def _exchange(old: Session, excluded: list[int], kept: list[int],
                    endpoints: list[str], heard: set[int]) -> dict[int, dict[str, Any]]:
    """Send this rank's offer (its new endpoints, its host, whom it excludes) to every
    other survivor over the old group's links, and return theirs, by old rank (this
    rank's own included); ``heard`` gets the rank of each offer as it comes.

    Raises:
        PeerLost: a survivor was lost before its offer came (the old group's record).
        CollectiveMismatch: a survivor excludes other ranks than this one does.
    """
    m = old.membership
    me = m.rank
    host = m.hosts[me] if m.hosts else host_identity(old.settings.host_id)
    mine = {"x": excluded, "e": endpoints, "h": host}
    payload = np.frombuffer(msgpack.packb(mine), dtype=np.uint8)
    others = [r for r in kept if r != me]
    sends: list[Any] = []
    keys: dict[int, OpKey] = {}
    for r in others:
        # Both ends count each channel alike (see Session.transfers), failed attempts too.
        out, back = (me, r, SHRINK_TAG), (r, me, SHRINK_TAG)
        header = Header("data", m.group_id, me, old.transfers[out], nbytes=[payload.nbytes],
                        sig=_SIGNATURE.digest, tag=SHRINK_TAG, collective="send")
        old.transfers[out] += 1
        keys[r] = OpKey.transfer(r, me, SHRINK_TAG, old.transfers[back])
        old.transfers[back] += 1
        sends.append(old.transport.send_many([r], [header], [payload], copy=True))
    await asyncio.gather(*sends)

    async def receive(r: int) -> dict[str, Any]:
        try:
            _, pieces = await old.matcher.get((keys[r], 0, r, 0))
        finally:
            old.matcher.finish(keys[r])
        heard.add(r)
        return _offer(r, b"".join(bytes(p.buffer) for p in pieces), excluded, me)

    offers = await asyncio.gather(*(receive(r) for r in others))
    return {me: mine, **dict(zip(others, offers, strict=True))}


def _offer(src: int, raw: bytes, excluded: list[int], me: int) -> dict[str, Any]:
    """Rank ``src``'s offer, checked (a member's, but read as untrusted bytes)."""
    if len(raw) > _MAX_OFFER:
        raise ProtocolError(f"rank {src}'s shrink offer is {len(raw)} bytes", reason="malformed")
    try:
        offer = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except (ValueError, msgpack.UnpackException) as exc:
        raise ProtocolError(f"rank {src}'s shrink offer is unreadable: {exc}",
                            reason="malformed") from None
    if not (isinstance(offer, dict)
            and isinstance(offer.get("x"), list) and all(type(r) is int for r in offer["x"])
            and isinstance(offer.get("e"), list) and offer["e"]
            and all(isinstance(e, str) for e in offer["e"])
            and isinstance(offer.get("h"), str)):
        raise ProtocolError(f"rank {src}'s shrink offer is malformed", reason="malformed")
    if offer["x"] != excluded:
        a, b = sorted([(src, offer["x"]), (me, excluded)])
        raise CollectiveMismatch(f"shrink: the survivors disagree: rank {a[0]} excludes "
                                 f"ranks {a[1]}, rank {b[0]} excludes ranks {b[1]}")
    return offer


def _roster(old: Membership, kept: Sequence[int], offers: dict[int, dict[str, Any]],
            choose: Choose) -> Membership:
    """The new group's membership, the same on every survivor (but ``rank``): each
    survivor's endpoint as ``choose`` picks it, as forming does."""
    me = old.rank
    ident = hashlib.blake2b(f"{old.group_id}/{old.epoch}/shrink/{list(kept)}".encode(),
                            digest_size=8).hexdigest()
    secret = ""
    if old.secret:
        secret = hashlib.blake2b(ident.encode(), key=old.secret.encode()[:64],
                                 digest_size=16).hexdigest()
    mine = offers[me]["h"]
    endpoints = tuple(choose(mine, offers[r]["h"], offers[r]["e"]) for r in kept)
    hosts = tuple(old.hosts[r] for r in kept) if old.hosts else ()
    return Membership(ident, old.epoch + 1, kept.index(me), len(kept), endpoints, hosts,
                      secret)


async def _form(old: Session, new: Session, kept: list[int], left: float) -> None:
    """The new group's handshake (see :func:`.forming.handshake`), ended as soon as the old
    group or the new one knows that a survivor was lost: the old group's links and probes
    find a death in a fraction of the heartbeat, while the hellos would wait all of it.

    Raises:
        PeerLost: a survivor was lost (named by its old rank; the old group's record of it
            if it has one).
        RendezvousError: as :func:`.forming.handshake`.
    """
    others = [r for r in kept if r != old.rank]
    formed = asyncio.create_task(handshake(new, left))
    in_old = asyncio.create_task(old.peers.first_lost(others))
    in_new = asyncio.create_task(new.peers.first_lost(
        [kept.index(r) for r in others]))
    waits = (formed, in_old, in_new)
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
        await asyncio.gather(*waits, return_exceptions=True)
    if formed.done() and not formed.cancelled():
        formed.result()  # formed, or its own error
        return
    if in_old.done() and not in_old.cancelled():
        raise in_old.result()[1]
    new_rank, lost = in_new.result()  # a new rank means nothing to the caller
    rank = kept[new_rank]
    raise PeerLost(f"rank {rank} was lost while the shrunk group formed: the new group's "
                   f"link to it went down ({lost.how or GONE_HOW})", rank, how=lost.how)


def _lost_while_forming(old: Session, kept: list[int], silent: list[int],
                        exc: RendezvousError) -> PeerLost:
    """The error of a survivor lost after its offer came, ``silent``: those whose hellos
    did not come to the new group (old ranks). The old group's record of one of them if
    it has seen it go, else of another survivor it has seen lost; a survivor that closed
    the old group normally is not blamed (it may have given up on this very shrink). Else
    the first silent survivor, by the new group's hellos."""
    ranks = silent + [r for r in kept if r not in silent]
    for r in ranks:
        lost = old.departures.lost(r)
        if lost is not None and lost.how != CLOSED:
            return lost
    if silent:
        return PeerLost(f"rank {silent[0]} was lost while the shrunk group formed: no hello "
                        f"from ranks {silent} ({exc})", silent[0])
    for r in ranks:
        lost = old.departures.lost(r)
        if lost is not None:
            return lost
    return PeerLost(f"a survivor was lost while the shrunk group formed: {exc}")
