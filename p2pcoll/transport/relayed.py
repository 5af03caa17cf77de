"""The mesh's paths through a relay (see :mod:`p2pcoll.relay` and docs/relay.md).

A peer that cannot accept connections advertises ``relay://HOST:PORT/TARGET`` (its
ipc endpoints besides, for the peers of its host). Another peer reaches it through an
:class:`~p2pcoll.relay.Entrance`, a Unix socket of its own that forwards each connection
to the relay: its links and probes connect there as to any ipc endpoint. (libzmq's own
SOCKS client, ``ZMQ_SOCKS_PROXY``, would need no entrance, but libzmq 4.3.5 aborts the
process when such a socket closes within its reconnect interval after a failed attempt:
``socks_connecter_t::error`` leaves a stale poller handle.) The peer behind the relay
keeps an :class:`~p2pcoll.relay.Attachment` that splices each forward to its own socket's
local endpoint. Its own links to the others are direct (outbound: a NAT lets them out),
except to other peers behind relays: those it dials, trying a direct connection first (TCP
simultaneous open, coordinated by the relay: :mod:`p2pcoll.relay.punch`), and through the
relay if that fails. :class:`RelayPaths` starts and stops both, and keeps the tally of
which connections to which peer went direct (``peer_links`` in ``stats()``).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable

from ..relay.attach import Attachment, Entrance
from ..relay.names import is_relay, parse_endpoint, tag_of
from ..types import Membership
from .base import Counters
from .endpoints import ipc_address
from .router import Router

log = logging.getLogger("p2pcoll.transport")

__all__ = ["RelayPaths", "tally"]

# A dial tries a direct connection for this share of the heartbeat timeout at most: the
# mesh's connection waits for it, and gives up on a handshake after the heartbeat timeout.
DIAL_SHARE = 0.4


class RelayPaths:
    """Which peers of a group this one reaches through a relay, and this peer's own
    registration at its relay, if it is behind one.

    Args:
        membership: the group (each rank's chosen endpoint).
        router: this peer's ROUTER (a forward is spliced to its local endpoint; a peer
            found unreachable stops listening on the network, when it has an ipc one).
        heartbeat_s: the relay is lost after this long without a word.
        lost: called once, with why, if this peer's relay is lost.
        counters: ``bytes_relayed`` (on the wire, both ways, between this peer and relays)
            ``direct_punched`` (connections dialled direct) and ``punch_failed`` (dialled
            through the relay after a failed attempt) are counted there,
            ``relayed`` set (see :meth:`path`), and ``punched``: the peers behind relays
            that every open connection between the two reaches directly.

    Attributes:
        endpoints: every rank's endpoint as the mesh connects to it (a relayed peer's:
            this peer's entrance to it).
        relayed: the ranks this peer reaches through a relay.
        behind: whether this peer is itself reached through a relay (then every peer of
            another host reaches it through one).
    """

    def __init__(self, membership: Membership, router: Router, heartbeat_s: float,
                 lost: Callable[[str], None], counters: Counters) -> None:
        tag = tag_of(membership.secret or membership.group_id)
        rank = membership.rank
        self.relayed = frozenset(r for r, e in enumerate(membership.endpoints)
                                 if r != rank and is_relay(e))
        self.entrances: dict[int, Entrance] = {}
        self.counters = counters
        own = membership.endpoints[rank]
        self.behind = is_relay(own)
        mine = parse_endpoint(own)[2] if self.behind else None
        self._ranks = {parse_endpoint(membership.endpoints[r])[2]: r for r in self.relayed}
        self._open: dict[int, Counter[str]] = {r: Counter() for r in self.relayed}

        def count(n: int) -> None:
            counters.bytes_relayed += n

        for peer in sorted(self.relayed):
            host, port, target, _ = parse_endpoint(membership.endpoints[peer])
            self.entrances[peer] = Entrance(
                host, port, target, tag, ipc_address().removeprefix("ipc://"), count,
                dial_from=mine, seen=self._seer(peer), dial_s=heartbeat_s * DIAL_SHARE)
        self.endpoints = tuple(self.entrances[r].endpoint if r in self.entrances else e
                               for r, e in enumerate(membership.endpoints))
        self.attachment: Attachment | None = None
        self._task: asyncio.Task[None] | None = None
        if self.behind:
            host, port, target, _ = parse_endpoint(own)
            bound = router.endpoints
            local = next((e for e in bound if e.startswith("ipc://")), bound[0])
            if local.startswith("ipc://"):  # the rendezvous found it unreachable there
                for address in [e for e in bound if e.startswith("tcp://")
                                and not e.startswith("tcp://127.")]:
                    router.unbind(address)
            self.attachment = Attachment(
                host, port, target, tag, local, heartbeat_s, lost, count,
                seen=lambda sender, path, n: self._seen(self._ranks.get(sender), path, n),
                dial_s=heartbeat_s * DIAL_SHARE)
            self._task = asyncio.create_task(self._start(lost, heartbeat_s))
        counters.relayed = frozenset(
            r for r, e in enumerate(membership.endpoints)
            if r != rank and self.path(r, not e.startswith("ipc://")) == "relayed")

    async def _start(self, lost: Callable[[str], None], timeout: float) -> None:
        assert self.attachment is not None
        try:
            await self.attachment.start(timeout)
        except OSError as exc:
            log.error("%s: no peer of another host can reach this one", exc)
            lost(str(exc))

    def _seer(self, peer: int) -> Callable[[str, int], None]:
        return lambda path, n: self._seen(peer, path, n)

    def _seen(self, peer: int | None, path: str, n: int) -> None:
        """A dialled connection to or from ``peer`` opened (``n`` 1) or closed (-1) on
        ``path`` (on the relay loop)."""
        tally(self._open, self.counters, peer, path, n)

    def path(self, peer: int, remote: bool) -> str:
        """``relayed`` if what goes between this peer and ``peer`` passes a relay either
        way (``remote``: ``peer`` is on another host), else ``direct``."""
        return "relayed" if peer in self.relayed or (self.behind and remote) else "direct"

    async def aclose(self) -> None:
        for entrance in self.entrances.values():
            await entrance.aclose()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self.attachment is not None:
            await self.attachment.aclose()


def tally(open_: dict[int, Counter[str]], counters: Counters, peer: int | None, path: str,
          n: int) -> None:
    """Count a dialled connection to or from ``peer`` that opened (``n`` 1) or closed (-1)
    on ``path`` (``direct``, ``relayed`` after a failed attempt, ``plain`` without one) in
    ``open_`` (the dialled connections open, per peer behind a relay) and ``counters``
    (``direct_punched``, ``punch_failed``, and ``punched``: the peers that every dialled
    connection open reaches directly). A peer not in ``open_`` is ignored."""
    if peer is None or peer not in open_:
        return
    open_[peer][path] += n
    if path == "direct" and n > 0:
        counters.direct_punched += 1
    elif path == "relayed" and n > 0:
        counters.punch_failed += 1
    counters.punched = frozenset(
        r for r, t in open_.items() if t["direct"] > 0 and t["relayed"] <= 0 and t["plain"] <= 0)
