"""A peer as a long-lived service: :class:`Peer` for an asyncio application, :func:`serve`
for ``p2pcoll peer``, with health and Prometheus metrics over HTTP (the ``service`` extra:
aiohttp and prometheus_client, imported only when a metrics port is set)."""

from .jobs import load_job
from .logs import configure_logging
from .peer import Peer, exit_code, serve

__all__ = ["Peer", "configure_logging", "exit_code", "load_job", "serve"]
