"""The one record of which peers of a session have gone, and how.

A peer goes by saying goodbye (a ``bye`` message: it closed after finishing its part) or is
lost (its link went down, or its heartbeats stopped, and it did not come back within a
short grace period). When a peer goes, the session's failure model ends every running
operation that needs it (see :mod:`p2pcoll.session.failure`): a collective that peer was
lost in or said goodbye before starting, a send to it (a goodbye ends only sends that
start after it), and the matcher ends the receives whose message can no longer come. A
broadcast whose root has said goodbye after starting it goes on as long as the rank it
actually receives from is there.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import CLOSED, PeerLost
from ..types import Membership

log = logging.getLogger("p2pcoll")

LINK_LOSS_GRACE = 0.3  # seconds between a link's disconnect and declaring its peer lost
# What a lost link says of its peer (the transport does not yet tell which it was).
GONE_HOW = ("its process was killed or crashed, or it stopped answering (frozen, overloaded "
            "or cut off)")


@dataclass(frozen=True)
class Departure:
    error: PeerLost
    graceful: bool  # said goodbye, as opposed to lost
    started: int = 0  # with a goodbye: how many collectives the peer had started
    # with a goodbye: the peers it went to, on the links that carried all the peer sent
    # them (the others were never sent anything by it; see Session.gone_from)
    told: frozenset[int] = frozenset()


class Peers:
    """Who of a session's peers has gone. ``on_departure(rank)`` is called once per peer."""

    def __init__(self, membership: Membership, on_departure: Callable[[int], None]) -> None:
        self.membership = membership
        self.on_departure = on_departure
        self._gone: dict[int, Departure] = {}
        self._closed = False

    def lost(self, rank: int) -> PeerLost | None:
        gone = self._gone.get(rank)
        return gone.error if gone else None

    def abandoned(self, rank: int, seq: int) -> bool:
        """Whether ``rank`` is gone without having taken its part in collective ``seq``:
        lost, or said goodbye before it started that collective."""
        gone = self._gone.get(rank)
        return gone is not None and (not gone.graceful or gone.started <= seq)

    def gone(self) -> dict[int, Departure]:
        return dict(self._gone)

    def said_goodbye(self, rank: int) -> bool:
        gone = self._gone.get(rank)
        return gone is not None and gone.graceful

    def left(self, rank: int, started: int, told: frozenset[int] = frozenset()) -> None:
        """``rank`` said goodbye, having started ``started`` collectives, to ``told``."""
        self._record(rank, Departure(PeerLost(
            f"rank {rank} left the group: it closed it normally", rank, how=CLOSED,
        ), True, started, told))

    def link_down(self, rank: int) -> None:
        """The link to ``rank`` went down: declare it lost unless it says goodbye meanwhile."""
        if self._closed or rank in self._gone:
            return

        def declare() -> None:
            if self._closed or rank in self._gone:
                return
            me = self.membership.rank
            log.warning("rank %d: lost the connection to rank %d", me, rank)
            self._record(rank, Departure(PeerLost(
                f"rank {rank} ({self.membership.endpoints[rank]}) is gone without closing "
                f"the group: {GONE_HOW}; rank {me} lost the connection to rank {rank}", rank,
            ), False))

        asyncio.get_running_loop().call_later(LINK_LOSS_GRACE, declare)

    def reported_lost(self, rank: int, by: int) -> None:
        """Peer ``by`` says it lost ``rank`` (its link or probe went down: see
        :mod:`p2pcoll.transport.overlay`): lost here too, unless gone already."""
        if self._closed or rank in self._gone:
            return
        me = self.membership.rank
        log.warning("rank %d: rank %d reports that it lost rank %d", me, by, rank)
        self._record(rank, Departure(PeerLost(
            f"rank {rank} ({self.membership.endpoints[rank]}) is gone without closing "
            f"the group: {GONE_HOW}; rank {by} lost the connection to rank {rank} "
            f"(reported to rank {me})",
            rank,
        ), False))

    def close(self) -> None:
        self._closed = True

    def _record(self, rank: int, departure: Departure) -> None:
        if self._closed or rank in self._gone:
            return
        self._gone[rank] = departure
        self.on_departure(rank)
