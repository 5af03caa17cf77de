"""What a peer knows of its connections to the others, from its transport's link events.

The transport only reports facts (:class:`~p2pcoll.transport.base.LinkEvent`: a link to a
peer opened, was closed for the link budget, drained; a peer's link to this one is read);
this keeps what follows from them, for the departures machine's goodbyes and aborts:

- :meth:`Contacts.unread`: the peers that may not have read everything this one sent them
  (an open link, or one closed for the budget that has not drained): an abort or a
  goodbye goes to them directly, after that data on the same link;
- :meth:`Contacts.linked`: those it has an open link to (all a leaving peer can reach);
- :meth:`Contacts.senders`: the peers whose link to this one has been read (an answer
  reaches them, on that connection);
- :meth:`Contacts.probes_known`: those whose probe of this one a goodbye reaches, if they
  watch it;
- :meth:`Contacts.drained`: wait until no closed link still drains.
"""

from __future__ import annotations

import asyncio

from ..transport.base import LinkEvent

__all__ = ["Contacts"]


class Contacts:
    """One peer's link facts (see the module docstring)."""

    def __init__(self) -> None:
        self._linked: set[int] = set()
        self._draining: set[int] = set()
        self._heard: set[int] = set()
        self._probes: set[int] = set()
        self._none_draining = asyncio.Event()
        self._none_draining.set()

    def on_link(self, peer: int, event: LinkEvent) -> None:
        """Take one event (``DOWN`` is the departures machine's, and changes nothing here:
        what this peer sent on a link that went down may have been read)."""
        if event is LinkEvent.OPENED:
            self._linked.add(peer)
        elif event is LinkEvent.CLOSED:
            self._linked.discard(peer)
            self._draining.add(peer)
            self._none_draining.clear()
        elif event is LinkEvent.DRAINED:
            self._draining.discard(peer)
            if not self._draining:
                self._none_draining.set()
        elif event is LinkEvent.HEARD:
            self._heard.add(peer)
        elif event is LinkEvent.PROBE_KNOWN:
            self._probes.add(peer)

    def forget(self, peer: int) -> None:
        """``peer`` has gone: nothing of it is waited for (its links close undrained)."""
        self.on_link(peer, LinkEvent.DRAINED)

    def unread(self) -> set[int]:
        return self._linked | self._draining

    def linked(self) -> set[int]:
        return set(self._linked)

    def draining(self) -> set[int]:
        return set(self._draining)

    def senders(self) -> set[int]:
        return set(self._heard)

    def probes_known(self) -> set[int]:
        return set(self._probes)

    async def drained(self) -> None:
        """Wait until no link this peer closed still drains; the caller bounds the wait.
        Cancellation: nothing is lost."""
        await self._none_draining.wait()
