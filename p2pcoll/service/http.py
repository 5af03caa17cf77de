"""The peer's HTTP server: ``/healthz`` and ``/metrics`` (aiohttp, on the peer's loop).

``GET /healthz``: 200 with a JSON report (``{"state": "ready", "rank": 0, "world_size": 4,
"group": ...}``) while the group can run collectives; 503 with the same report otherwise
(``starting``, ``forming``, ``broken`` with its ``cause``, ``closed``), which is what a
container's health check and a Kubernetes readiness probe want. ``GET /metrics``: see
:mod:`p2pcoll.service.metrics`. Nothing else is served.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from .metrics import registry_for, render

if TYPE_CHECKING:
    from .peer import Peer


class HealthServer:
    """Serves one peer's health and metrics until :meth:`stop`."""

    def __init__(self, peer: Peer) -> None:
        self.peer = peer
        self.registry = registry_for(peer)
        self.address: tuple[str, int] = ("", 0)
        app = web.Application()
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)

    async def start(self, host: str, port: int) -> None:
        """Listen on ``host``:``port`` (0: a free port; :attr:`address` says which).

        Raises:
            OSError: the address cannot be bound (in use, not an address of this host).
        """
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, reuse_address=True)
        try:
            await site.start()
        except BaseException:
            await self._runner.cleanup()
            raise
        bound = self._runner.addresses[0]
        self.address = (str(bound[0]), int(bound[1]))

    async def stop(self) -> None:
        await self._runner.cleanup()

    async def _healthz(self, request: web.Request) -> web.Response:
        ready, report = self.peer.health()
        return web.json_response(report, status=200 if ready else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        body = render(self.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
