"""A peer service's log lines: standard :mod:`logging`, one line per event, each naming
the rank and group of the peer it comes from."""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .view import PeerView

FORMAT = "%(asctime)s %(levelname)s rank=%(rank)s group=%(group)s %(name)s: %(message)s"


class PeerContext(logging.Filter):
    """Adds ``rank`` and ``group`` (``-`` until the peer has joined) to every record."""

    def __init__(self, peer: PeerView | None = None) -> None:
        super().__init__()
        self.peer = peer

    def filter(self, record: logging.LogRecord) -> bool:
        identity = None if self.peer is None else self.peer.identity
        record.rank, record.group = identity if identity is not None else ("-", "-")
        return True


def configure_logging(level: str = "INFO", peer: PeerView | None = None) -> PeerContext:
    """Log to stderr at ``level`` with :data:`FORMAT`, for a process that runs one peer
    (``p2pcoll peer``). Returns the filter, whose ``peer`` may be set later."""
    context = PeerContext(peer)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT))
    handler.addFilter(context)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    return context
