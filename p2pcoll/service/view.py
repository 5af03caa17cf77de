"""What the service's HTTP server, metrics and log lines read from a peer: :class:`PeerView`.

They are handed a :class:`~p2pcoll.service.Peer` but see it through this protocol, so that
none of them imports the peer module, which starts them (no import circle).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ..settings import ServiceSettings


class PeerView(Protocol):
    """A peer as its HTTP server, metrics collector and log filter read it."""

    service: ServiceSettings  # its HTTP limits
    identity: tuple[int, str] | None  # (rank, group id) of its last group
    errors: dict[str, int]  # errors outside collectives (joins), by type

    @property
    def state(self) -> str:
        """``starting``, ``forming``, ``ready``, ``degraded``, ``broken`` or ``closed``;
        read from the HTTP server's thread too (it reads two attributes)."""
        ...

    def health(self) -> tuple[bool, dict[str, Any]]:
        """Whether it is ready, and the report of ``/healthz`` and ``/readyz``."""
        ...

    def stats(self) -> dict[str, Any]:
        """Its group's :meth:`~p2pcoll.Group.stats`."""
        ...
