"""The peer's HTTP server: ``/healthz``, ``/readyz`` and ``/metrics``, with bounded cost.

Both health pages serve the same JSON report (:meth:`~p2pcoll.service.Peer.health`:
``{"state": "ready", "rank": 0, "world_size": 4}``; ``gone``, the members that have left or
been lost, once one has; a broken or closed peer's ``cause``, the error's type):

- ``GET /healthz``, **liveness**: 200 whenever the peer's event loop answers, whatever its
  state. A peer whose loop is stuck gives no answer (the connection is cut at
  ``metrics_timeout``), which is what a liveness probe and a container's ``HEALTHCHECK``
  should restart. A group that forms, breaks or loses a member is not a reason to
  restart this peer: that is the other peers' doing, and readiness says it.
- ``GET /readyz``, **readiness**: 200 while the peer is ready to take part in collectives
  (state ``ready``: formed, and every member still there); 503 otherwise: ``starting``,
  ``forming``, ``degraded`` (a member has left or been lost, noticed between collectives
  too: within the heartbeat timeout for one that freezes, at once for one that exits or
  says goodbye), ``broken``, ``closed``.

``GET /metrics``: see :mod:`p2pcoll.service.metrics`. Nothing else is served (404; 405 for
other methods).

The port faces whoever can reach the host, so what it may cost the peer is bounded whatever
arrives (the limits are :class:`~p2pcoll.settings.ServiceSettings`, ``$P2PCOLL_METRICS_*``):

- **Rate.** A token bucket admits ``metrics_rate`` (20) connections a second on average, in
  bursts of as many. With the bucket empty the server accepts nothing until the next token
  is due: the connections wait in the kernel's queue (as long as ``metrics_max_connections``;
  past it the kernel drops them and their clients retry), which costs the peer nothing,
  however fast they come.
- **Connections.** At most ``metrics_max_connections`` (64) are open at once, at most
  ``metrics_client_connections`` (8) of them from one client address. One more is closed as
  soon as it is accepted: no parser, task or timer is made for it.
- **One request per connection, one deadline.** Every answer says ``Connection: close``
  (a scraper every few seconds loses nothing by it), and every connection has
  ``metrics_timeout`` (5 s) from its accept to the last byte of its answer: a request whose
  headers never end (slowloris), a body that never comes or an answer never read are cut
  there. A request line over 4 KiB, a header over 8 KiB or more than 32 headers get a 400
  from aiohttp's parser; no request body is read.
- **Work on the peer.** The answers are cached: the peer's ``health()`` (for both health
  pages) and the rendering of ``/metrics`` run at most once per ``metrics_cache`` (1 s)
  each, and again at once when the peer's state changes; the requests that come meanwhile
  share the one rendering.
- **Its own thread.** The server runs on an event loop of its own, in a thread named
  ``p2pcoll-http``, so that accepting, parsing and answering never queue with the
  collectives' callbacks on the peer's loop. The peer's counters and health are read only
  on its own loop: each rendering is a callback handed to it (``call_soon_threadsafe``), so
  a peer whose loop is stuck gets no answer, and its health check fails, as it should. The
  one read from this thread is ``peer.state``, to see whether a cached answer is still
  fresh: it reads two attributes (the peer's phase and its group's state), each read
  atomic under the GIL and each an immutable value, so a read racing a change only renders
  once more, or serves the cache a moment longer.

Nothing refused is logged line by line (one warning per reason, the first time); it is
counted in ``/metrics``: ``p2pcoll_http_closed_total{reason}``, connections closed before an
answer (``max_connections`` and ``client_connections``: at accept, over that cap;
``timeout``: at the deadline), and ``p2pcoll_http_paused_total{reason}``, the times accepting paused
(``rate``: the bucket was empty, for up to 1/rate s; ``accept_error``: out of descriptors or
memory, for 1 s, as asyncio's own servers do).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import json
import logging
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from .metrics import registry_for, render

if TYPE_CHECKING:
    from ..settings import ServiceSettings
    from .view import PeerView

log = logging.getLogger("p2pcoll.service")

CLOSED = ("max_connections", "client_connections", "timeout")  # p2pcoll_http_closed_total
PAUSED = ("rate", "accept_error")  # p2pcoll_http_paused_total
MAX_LINE_BYTES = 4096  # the request line
MAX_FIELD_BYTES = 8190  # one header (aiohttp's default; a bearer token fits)
MAX_HEADERS = 32
ACCEPTS_PER_WAKEUP = 64  # then the loop's other callbacks get their turn
ACCEPT_ERROR_PAUSE_S = 1.0  # after EMFILE and the like, as asyncio's own servers do


class TokenBucket:
    """``rate`` tokens a second, at most ``burst`` saved up; :meth:`take` spends one."""

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate, self.burst = rate, burst
        self.tokens, self.stamp = burst, now

    def take(self, now: float) -> float:
        """Spend a token: 0 if there was one, else the seconds until there will be."""
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens < 1:
            return (1 - self.tokens) / self.rate
        self.tokens -= 1
        return 0.0

    def refund(self) -> None:
        """Give back the token just taken (it was not needed after all)."""
        self.tokens += 1


class HealthServer:
    """Serves one peer's health and metrics, within its limits, until :meth:`stop`.

    Args:
        peer: the peer whose ``health()`` and ``stats()`` are served.
        settings: the limits; None: the peer's own (``peer.service``).
        thread: serve from a thread and event loop of its own (the default, see above);
            False: on the loop that calls :meth:`start` (the peer's).
    """

    def __init__(self, peer: PeerView, settings: ServiceSettings | None = None, *,
                 thread: bool = True) -> None:
        self.peer = peer
        self.thread = thread
        self.settings = settings = settings if settings is not None else peer.service
        self.address: tuple[str, int] = ("", 0)
        self.closed = dict.fromkeys(CLOSED, 0)  # connections, by reason (see above)
        self.paused = dict.fromkeys(PAUSED, 0)  # pauses of accepting, by reason
        self.registry = registry_for(peer)
        self.registry.register(_Counts(self.closed, self.paused))
        self._health = _Cached(self._render_health, settings.metrics_cache, self)
        self._metrics = _Cached(lambda: (200, render(self.registry)), settings.metrics_cache,
                                self)
        self._peer_loop: asyncio.AbstractEventLoop | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the server's own
        self._thread: threading.Thread | None = None
        self._listener: _Listener | None = None

    async def start(self, host: str, port: int) -> None:
        """Listen on ``host``:``port`` (0: a free port; :attr:`address` says which).

        Raises:
            OSError: the address cannot be bound (in use, not an address of this host).
        """
        self._peer_loop = loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                       flags=socket.AI_PASSIVE)
        family, _, _, _, address = infos[0]  # the first address the host resolves to
        sock = socket.create_server(address[:2], family=family,
                                    backlog=self.settings.metrics_max_connections)
        bound = sock.getsockname()
        self.address = (str(bound[0]), int(bound[1]))
        if self.thread:
            own = self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=own.run_forever, name="p2pcoll-http",
                                            daemon=True)
            self._thread.start()
        else:
            self._loop = loop
        try:
            await self._on(self._loop, self._listen(sock))
        except BaseException:
            sock.close()
            await self.stop()
            raise

    async def stop(self) -> None:
        """Stop listening, close every connection and end the thread. Idempotent."""
        loop, thread = self._loop, self._thread
        if loop is None:
            return
        self._loop = self._thread = None
        try:
            await self._on(loop, self._close())
        finally:
            if thread is not None:
                loop.call_soon_threadsafe(loop.stop)
                await asyncio.get_running_loop().run_in_executor(None, thread.join)
                loop.close()

    @staticmethod
    async def _on(loop: asyncio.AbstractEventLoop, work: Any) -> Any:
        """Await coroutine ``work`` run on ``loop`` (this one, or the server's thread's)."""
        if loop is asyncio.get_running_loop():
            return await work
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(work, loop))

    # --- on the server's loop ----------------------------------------------------------

    async def _listen(self, sock: socket.socket) -> None:
        self._listener = _Listener(sock, self._handle, self.settings, self.closed,
                                   self.paused)

    async def _close(self) -> None:
        if self._listener is not None:
            await self._listener.close()

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        if request.method not in ("GET", "HEAD"):
            response = web.Response(status=405, headers={"Allow": "GET, HEAD"})
        elif request.path in ("/healthz", "/readyz"):
            readiness, body = await self._health.get()  # 200 or 503
            status = readiness if request.path == "/readyz" else 200  # alive: it answered
            response = web.Response(status=status, body=body,
                                    content_type="application/json")
        elif request.path == "/metrics":
            response = web.Response(body=(await self._metrics.get())[1],
                                    headers={"Content-Type": CONTENT_TYPE_LATEST})
        else:
            response = web.Response(status=404)
        response.force_close()
        return response

    # --- on the peer's loop ------------------------------------------------------------

    def _render_health(self) -> tuple[int, bytes]:
        ready, report = self.peer.health()
        return (200 if ready else 503), json.dumps(report).encode()

    def on_peer_loop(self, render: Callable[[], tuple[int, bytes]]
                     ) -> concurrent.futures.Future[tuple[str, tuple[int, bytes]]]:
        """``render()`` and the peer's state, computed by a callback on the peer's loop."""
        done: concurrent.futures.Future[tuple[str, tuple[int, bytes]]] = \
            concurrent.futures.Future()

        def run() -> None:
            if done.set_running_or_notify_cancel():
                try:
                    done.set_result((self.peer.state, render()))
                except Exception as exc:  # reported to the request, as a 500
                    done.set_exception(exc)

        assert self._peer_loop is not None
        self._peer_loop.call_soon_threadsafe(run)
        return done


class _Cached:
    """One answer, rendered on the peer's loop at most once per ``ttl`` seconds while the
    peer's state stays the same; the requests that arrive meanwhile share that rendering."""

    def __init__(self, render: Callable[[], tuple[int, bytes]], ttl: float,
                 server: HealthServer) -> None:
        self.render = render
        self.ttl = ttl
        self.server = server
        self.value: tuple[int, bytes] | None = None
        self.state = ""
        self.expires = 0.0
        self.pending: asyncio.Future[tuple[str, tuple[int, bytes]]] | None = None

    async def get(self) -> tuple[int, bytes]:
        """The answer as (status, body)."""
        fresh = time.monotonic() < self.expires and self.server.peer.state == self.state
        if fresh and self.value is not None:
            return self.value
        if self.pending is None:
            self.pending = asyncio.wrap_future(self.server.on_peer_loop(self.render))
            self.pending.add_done_callback(self._rendered)
        _, value = await asyncio.shield(self.pending)
        return value

    def _rendered(self, future: asyncio.Future[tuple[str, tuple[int, bytes]]]) -> None:
        self.pending = None
        if not future.cancelled() and future.exception() is None:
            self.state, self.value = future.result()
            self.expires = time.monotonic() + self.ttl


class _Listener:
    """The listening socket, its accept loop and the open connections' bookkeeping, on
    the loop that made it. Each connection is one of aiohttp's ``RequestHandler``."""

    def __init__(self, sock: socket.socket, handle: Callable[..., Any],
                 settings: ServiceSettings, closed: dict[str, int],
                 paused: dict[str, int]) -> None:
        self.loop = asyncio.get_running_loop()
        self.sock = sock
        self.closed, self.paused = closed, paused
        self.settings = settings
        self.bucket = TokenBucket(settings.metrics_rate, max(1.0, settings.metrics_rate),
                                  self.loop.time())
        self.open = 0
        self.clients: Counter[str] = Counter()
        self.slots: dict[RequestHandler, _Slot] = {}
        self.starting: set[asyncio.Task[None]] = set()
        self.warned: set[str] = set()
        self.server = _Server(self, handle)
        sock.setblocking(False)
        self.loop.add_reader(sock, self._accept)

    def _accept(self) -> None:
        for _ in range(ACCEPTS_PER_WAKEUP):
            wait = self.bucket.take(self.loop.time())
            if wait:  # the connections wait in the kernel's queue meanwhile
                self._pause("rate", wait, f"metrics_rate={self.settings.metrics_rate:g}/s "
                            "spent: accepting nothing until the next token")
                return
            try:
                conn, address = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                self.bucket.refund()
                return
            except OSError as exc:
                if exc.errno == errno.ECONNABORTED:
                    continue
                # Out of descriptors or memory: wait rather than spin on the error.
                self._pause("accept_error", ACCEPT_ERROR_PAUSE_S, f"cannot accept ({exc})")
                return
            client = str(address[0])
            reason = self._admit(client)
            if reason is not None:
                conn.close()
                self._count(self.closed, reason, "closed a connection over "
                            f"metrics_{reason}={getattr(self.settings, f'metrics_{reason}')}")
                continue
            slot = _Slot(self, client)
            task = self.loop.create_task(self._connect(conn, slot))
            self.starting.add(task)
            task.add_done_callback(self.starting.discard)

    def _admit(self, client: str) -> str | None:
        """Why a connection from ``client`` is refused, or None (then its slot is taken)."""
        if self.open >= self.settings.metrics_max_connections:
            return "max_connections"
        if self.clients[client] >= self.settings.metrics_client_connections:
            return "client_connections"
        self.open += 1
        self.clients[client] += 1
        return None

    def _count(self, counts: dict[str, int], reason: str, what: str) -> None:
        counts[reason] += 1
        if reason not in self.warned:
            self.warned.add(reason)
            family = "closed" if counts is self.closed else "paused"
            log.warning("HTTP server: %s (from now on only counted, in "
                        "p2pcoll_http_%s_total{reason=%r})", what, family, reason)

    def _pause(self, reason: str, seconds: float, what: str) -> None:
        self._count(self.paused, reason, what)
        self.loop.remove_reader(self.sock)
        self.loop.call_later(seconds, self._resume)

    def _resume(self) -> None:
        if self.sock.fileno() != -1:
            self.loop.add_reader(self.sock, self._accept)

    async def _connect(self, conn: socket.socket, slot: _Slot) -> None:
        def handler() -> RequestHandler:
            protocol = self.server()
            self.slots[protocol] = slot
            return protocol

        try:
            await self.loop.connect_accepted_socket(handler, conn)
        except BaseException:
            conn.close()
            slot.release()
            raise

    def release(self, client: str) -> None:
        self.open -= 1
        self.clients[client] -= 1
        if not self.clients[client]:
            del self.clients[client]

    async def close(self) -> None:
        self.loop.remove_reader(self.sock)
        self.sock.close()
        for task in list(self.starting):
            task.cancel()
        await asyncio.gather(*self.starting, return_exceptions=True)
        await self.server.shutdown(timeout=1.0)
        for slot in list(self.slots.values()):
            slot.expire(count=False)


class _Slot:
    """One admitted connection: its client, its deadline, and its place under the caps,
    given back exactly once."""

    def __init__(self, listener: _Listener, client: str) -> None:
        self.listener = listener
        self.client = client
        self.transport: asyncio.Transport | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.released = False

    def made(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.timer = self.listener.loop.call_later(
            self.listener.settings.metrics_timeout, self.expire)

    def expire(self, count: bool = True) -> None:
        """The deadline passed: cut the connection (connection_lost releases the slot)."""
        listener = self.listener
        if self.transport is not None and not self.transport.is_closing():
            if count:
                listener._count(listener.closed, "timeout", "closed a connection still open "
                                f"after metrics_timeout={listener.settings.metrics_timeout:g} s")
            self.transport.abort()

    def release(self) -> None:
        if not self.released:
            self.released = True
            if self.timer is not None:
                self.timer.cancel()
            self.listener.release(self.client)


class _Server(web.Server):
    """aiohttp's low-level server, told of each connection's start and end."""

    def __init__(self, listener: _Listener, handle: Callable[..., Any]) -> None:
        timeout = listener.settings.metrics_timeout
        super().__init__(handle, handler_cancellation=True, access_log=None,
                         keepalive_timeout=timeout, lingering_time=0.0, tcp_keepalive=False,
                         max_line_size=MAX_LINE_BYTES, max_field_size=MAX_FIELD_BYTES,
                         max_headers=MAX_HEADERS)
        self.listener = listener

    def connection_made(self, handler: RequestHandler, transport: asyncio.Transport) -> None:
        super().connection_made(handler, transport)
        slot = self.listener.slots.get(handler)
        if slot is not None:
            slot.made(transport)

    def connection_lost(self, handler: RequestHandler,
                        exc: BaseException | None = None) -> None:
        super().connection_lost(handler, exc)
        slot = self.listener.slots.pop(handler, None)
        if slot is not None:
            slot.release()


class _Counts(Collector):
    """``p2pcoll_http_closed_total`` and ``p2pcoll_http_paused_total``, by reason."""

    def __init__(self, closed: dict[str, int], paused: dict[str, int]) -> None:
        self.closed, self.paused = closed, paused

    def collect(self) -> Iterator[Metric]:
        for name, what, counts in (
            ("p2pcoll_http_closed", ("HTTP connections closed before an answer: at accept, "
                                     "over a cap, or at the deadline; by reason."), self.closed),
            ("p2pcoll_http_paused", ("Times the HTTP server stopped accepting for a while: "
                                     "its rate spent, or accept failing; by reason."),
             self.paused),
        ):
            family = CounterMetricFamily(name, what, labels=["reason"])
            for reason, n in counts.items():
                family.add_metric([reason], n)
            yield family
