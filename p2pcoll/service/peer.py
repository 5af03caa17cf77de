"""A peer as a long-lived service: :class:`Peer`, embedded in an asyncio application.

    async with Peer(metrics_port=9100) as peer:      # HTTP /healthz and /metrics, if asked
        group = await peer.join()                   # join() with these options
        result = await peer.run(job)                # await job(group); stop() cancels it

Lifecycle: ``starting`` (made, HTTP up) -> ``forming`` (joining) -> the group's own states
(``ready``; ``degraded`` once a member has left or been lost, noticed even between
collectives; ``broken``) -> ``closed`` (left, or the join failed). :meth:`Peer.stop` (and
leaving the ``async with`` block) aborts whatever runs, leaves the group so that the peers
see :class:`~p2pcoll.PeerLost` naming this rank at once, and stops the HTTP server: the peer
owns no thread or task after it. :func:`serve` is the whole of ``p2pcoll peer``: the same,
with SIGTERM and SIGINT wired to ``stop()`` and an exit code.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Self

from ..api import Group, join
from ..errors import GroupBroken, P2PCollError, ServiceStopped
from ..extras import needs
from ..settings import ServiceSettings
from .logs import PeerContext

log = logging.getLogger("p2pcoll.service")

Job = Callable[[Group], Awaitable[Any]]

STARTING, FORMING, CLOSED = "starting", "forming", "closed"


class Peer:
    """One peer of a group, run as a service next to the application's other work.

    Args:
        service: the HTTP and logging settings; None reads them from the environment
            (``$P2PCOLL_METRICS_PORT``, ...), as do ``metrics_port`` and ``metrics_host``
            when given (they win).
        **join_options: the arguments of :func:`p2pcoll.join` (``rendezvous``,
            ``world_size``, ``rank``, ``key_file``, ...), for every :meth:`join`.

    Raises:
        SettingsError: a bad service setting (at construction).
    """

    def __init__(self, *, service: ServiceSettings | None = None,
                 metrics_port: int | None = None, metrics_host: str | None = None,
                 **join_options: Any) -> None:
        base = service or ServiceSettings.resolve()  # the environment's, limits included
        if metrics_port is not None or metrics_host is not None:
            given = ServiceSettings.resolve(  # only to check the arguments
                {}, metrics_port=metrics_port if metrics_port is not None else
                base.metrics_port, metrics_host=metrics_host or base.metrics_host)
            base = dataclasses.replace(base, metrics_port=given.metrics_port,
                                       metrics_host=given.metrics_host)
        service = base
        self.service = service
        self.join_options = join_options
        self.group: Group | None = None
        self.cause: BaseException | None = None  # why the last join or job failed
        self.errors: dict[str, int] = {}  # errors outside collectives (joins), by type
        self.identity: tuple[int, str] | None = None  # (rank, group id) of the last group
        self._phase = STARTING
        self._last_stats: dict[str, Any] = {}
        self._work: asyncio.Task[Any] | None = None
        self._stop_reason: str | None = None
        self._stopper: asyncio.Future[None] | None = None  # the one stop() in progress
        self._closing: asyncio.Future[None] | None = None  # the one group.close() in progress
        self._http: Any = None  # a HealthServer, made on start() when a port is set

    # --- what it is ---------------------------------------------------------------------

    @property
    def state(self) -> str:
        """``starting``, ``forming``, ``ready``, ``degraded``, ``broken`` or ``closed``."""
        if self.group is not None and self._phase not in (FORMING, CLOSED):
            return str(self.group.state)
        return self._phase

    @property
    def stopping(self) -> bool:
        """Whether :meth:`stop` was called (a job may check it between rounds)."""
        return self._stop_reason is not None

    @property
    def metrics_address(self) -> tuple[str, int] | None:
        """(host, port) the HTTP server listens on, once started; None without one."""
        return None if self._http is None else self._http.address

    def health(self) -> tuple[bool, dict[str, Any]]:
        """Whether the peer is ready to take part in collectives (its state is ``ready``:
        formed, and every member still there), and what ``/healthz`` and ``/readyz``
        report: its state, rank and world size, how many members have gone (``gone``, once
        one has), and why it is broken or closed (the error's type, say ``"PeerLost"``).
        Nothing that helps an outsider reach or pass for a member: no group id, link
        secret, endpoint, host or key, and no error message (one may name endpoints or the
        rendezvous URL; the log has it whole)."""
        state = self.state
        report: dict[str, Any] = {"state": state}
        group = self.group
        if group is not None and state != CLOSED and self._phase != FORMING:
            report.update(rank=group.rank, world_size=group.world_size)
            gone = len(group.session.peers.gone())
            if gone:
                report["gone"] = gone
        cause = self.cause if group is None or group.cause is None else group.cause
        if cause is not None and state in ("broken", CLOSED):
            report["cause"] = type(cause).__name__
        if self._stop_reason is not None:
            report["stopping"] = self._stop_reason
        return state == "ready", report

    def stats(self) -> dict[str, Any]:
        """The group's :meth:`~p2pcoll.Group.stats` (the last group's, once it is closed;
        empty before the first join)."""
        group = self.group
        if group is not None and self._phase not in (FORMING, CLOSED):
            try:
                return group.stats()
            except GroupBroken:
                pass
        return dict(self._last_stats)

    # --- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        """Start the HTTP server if a metrics port is set. Idempotent.

        Raises:
            OSError: the port cannot be bound.
            MissingExtra: aiohttp or prometheus_client (the ``service`` extra) is missing.
        """
        if self._http is None and self.service.metrics_port is not None:
            # aiohttp and prometheus_client (the service extra) only when HTTP is asked for
            with needs("p2pcoll.service.Peer's metrics port (metrics_port=)"):
                from .http import HealthServer

            http = HealthServer(self)
            await http.start(self.service.metrics_host, self.service.metrics_port)
            self._http = http
            log.info("health and metrics on http://%s:%d", *http.address)

    async def join(self) -> Group:
        """Join the group (leaving the previous one first). Returns it.

        Raises:
            ServiceStopped: :meth:`stop` was called meanwhile.
            RendezvousError, SettingsError, ...: as :func:`p2pcoll.join`.
        """
        self._check_not_stopped()
        await self.start()
        await self.leave()
        self.group, self._phase, self._closing, self.identity = None, FORMING, None, None
        options = self.join_options
        log.info("joining%s", f" {options['rendezvous']}" if options.get("rendezvous") else "")
        try:
            group: Group = await self._guard(join(**options))
        except BaseException as exc:
            self._phase = CLOSED
            self._failed(exc)
            raise
        self.group, self._phase = group, "group"
        self.identity = (group.rank, group.membership.group_id)
        log.info("joined %s: rank %d of %d, at %s", group.settings.rendezvous or "alone",
                 group.rank, group.world_size, group.endpoint)
        return group

    async def run(self, job: Job) -> Any:
        """Await ``job(group)`` on the joined group and return what it returns.

        Raises:
            ServiceStopped: :meth:`stop` was called while it ran (the job was cancelled).
            GroupBroken: no group is joined, or it is unusable.
            Whatever the job raises.
        """
        self._check_not_stopped()
        group = self.group
        if group is None or self._phase in (FORMING, CLOSED):
            raise GroupBroken("Peer.run() needs a joined group: call join() first")
        try:
            return await self._guard(job(group))
        except BaseException as exc:
            self._failed(exc)
            raise

    async def leave(self, reason: str = "") -> None:
        """Leave the current group, if any (collectives in flight are aborted; the peers
        see PeerLost naming this rank). The HTTP server stays up. Idempotent."""
        if self._closing is None:
            group = self.group
            if group is None or self._phase == CLOSED:
                return
            self._last_stats = self.stats()
            self._phase = CLOSED
            self._closing = asyncio.ensure_future(group.close(reason))
            self._closing.add_done_callback(
                lambda _: log.info("left the group%s", f" ({reason})" if reason else ""))
        await asyncio.shield(self._closing)

    async def stop(self, reason: str = "stopped") -> None:
        """Abort what runs (the join or the job, which then raises ServiceStopped), leave
        the group and stop the HTTP server. Idempotent; safe to call from a task other
        than the one running the job."""
        if self._stopper is None:
            self._stop_reason = reason
            if self._work is not None or (self.group is not None and self._phase != CLOSED):
                log.info("stopping: %s", reason)
            self._stopper = asyncio.ensure_future(self._stop(reason))
        await asyncio.shield(self._stopper)

    async def _stop(self, reason: str) -> None:
        # Leave first: the collectives in flight fail at once on every rank (the peers'
        # PeerLost name this one), then the job, if still running, is cancelled.
        await self.leave(reason)
        work = self._work
        if work is not None and not work.done():
            work.cancel()
            await asyncio.wait([work])
        if self._http is not None:
            http, self._http = self._http, None
            await http.stop()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop("the service is shutting down")

    def __repr__(self) -> str:
        return f"<Peer {self.state}>"

    # --- internals ----------------------------------------------------------------------

    async def _guard(self, work: Awaitable[Any]) -> Any:
        """Run ``work`` as the one task that stop() cancels."""
        task = asyncio.ensure_future(work)
        self._work = task
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.done():  # our caller was cancelled, not the work: cancel it too
                task.cancel()
                await asyncio.wait([task])
                raise
            if self._stop_reason is not None:
                raise ServiceStopped(f"the peer was stopped ({self._stop_reason})",
                                     reason=self._stop_reason) from None
            raise
        except P2PCollError as exc:
            if self._stop_reason is not None and not isinstance(exc, ServiceStopped):
                raise ServiceStopped(f"the peer was stopped ({self._stop_reason})",
                                     reason=self._stop_reason) from exc
            raise
        finally:
            self._work = None

    def _check_not_stopped(self) -> None:
        if self._stop_reason is not None:
            raise ServiceStopped(f"the peer was stopped ({self._stop_reason})",
                                 reason=self._stop_reason)

    def _failed(self, exc: BaseException) -> None:
        if isinstance(exc, (asyncio.CancelledError, ServiceStopped)):
            return
        self.cause = exc
        if self.group is None or self._phase == CLOSED:  # not a collective's (those the
            name = type(exc).__name__                   # group counts itself)
            self.errors[name] = self.errors.get(name, 0) + 1


def exit_code(result: object) -> int:
    """A job's result as a process exit code: None (or True) is 0, an int is itself."""
    if result is None or result is True:
        return 0
    if isinstance(result, int) and not isinstance(result, bool):
        return result & 0xFF
    if result is False:
        return 1
    return 0


async def serve(job: Job, *, service: ServiceSettings | None = None,
                join_options: Mapping[str, Any] | None = None, name: str = "job",
                logs: PeerContext | None = None) -> int:
    """Run one peer as a service until its job ends: join, await ``job(group)``, leave.
    SIGTERM and SIGINT stop it (a second one exits at once). Returns the exit code: the
    job's (see :func:`exit_code`), 1 for an error, 128 + the signal's number when stopped
    by a signal. ``logs``: the log filter to point at this peer (rank and group on every
    line)."""
    loop = asyncio.get_running_loop()
    peer = Peer(service=service, **dict(join_options or {}))
    if logs is not None:
        logs.peer = peer
    received: list[signal.Signals] = []
    stopping: set[asyncio.Task[None]] = set()

    def on_signal(sig: signal.Signals) -> None:
        received.append(sig)
        if len(received) == 1:
            task = loop.create_task(peer.stop(sig.name))
            stopping.add(task)  # a reference until it ends (the loop holds tasks weakly)
            task.add_done_callback(stopping.discard)
        else:  # a second signal: the user means it
            log.warning("%s again: exiting now", sig.name)
            raise SystemExit(128 + sig)

    handled = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, on_signal, sig)
            handled.append(sig)
        except (NotImplementedError, RuntimeError):  # not the main thread, or Windows
            pass
    try:
        async with peer:
            try:
                await peer.join()
                log.info("%s started", name)
                result = await peer.run(job)
            except ServiceStopped:
                code = 128 + received[0] if received else 1
                log.warning("stopped by %s: exit %d", peer._stop_reason, code)
                return code
            except P2PCollError as exc:
                log.error("%s failed: %s: %s", name, type(exc).__name__, exc)
                code = 1
            except Exception:
                log.exception("%s raised", name)
                code = 1
            else:
                code = exit_code(result)
                log.info("%s finished: %r (exit %d)", name, result, code)
            await peer.leave()
            return code
    finally:
        for sig in handled:
            loop.remove_signal_handler(sig)
