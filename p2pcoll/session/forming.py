"""Forming a group: bind, find the others through the rendezvous, check every link.

The hosting policy: the peer that asks for rank 0 (or, with ranks assigned by arrival,
every peer) tries to host the rendezvous server at the rendezvous address; the one whose
bind succeeds hosts it, the others (and every peer, when a standalone server runs) are
only clients. Then every peer says hello to every other and waits for all the hellos, so
the first collective never waits on a link that is still connecting.

The host of a group of fixed size closes the rendezvous once every peer has said hello
(each had its roster, so nobody needs it any more): a group that runs does not keep a port
open to anyone who can reach it. An elastic group's host keeps serving it: the next
round's peers gather there, and rank 0 asks it how many wait
(:mod:`p2pcoll.training.elastic`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import zmq

from ..engine.costs import Constants
from ..errors import RendezvousError
from ..launchers import warn_alone
from ..relay.names import advertised, choosing, new_target
from ..rendezvous import advertised_host, parse_url, rendezvous
from ..settings import Settings
from ..transport.endpoints import (
    CHECKABLE,
    endpoint_policy,
    host_identity,
    inproc_prefix,
    listening,
)
from ..transport.sockets import SocketFactory
from ..transport.zmq_mesh import ZmqMesh
from ..types import Membership
from .session import Session

if TYPE_CHECKING:  # imported where it is used: only a peer that may host needs it
    from ..rendezvous.server import RendezvousServer

log = logging.getLogger("p2pcoll")


async def form(settings: Settings, sockets: SocketFactory,
               constants: Mapping[str, Constants], *,
               store: Any = None) -> tuple[Session, RendezvousServer | None]:
    """Form the group ``settings`` describe; returns its first session (with auto's
    ``constants``) and the rendezvous server this peer hosts, if it hosts one.

    With a torch ``store`` (the torch.distributed backend's), the peers meet through it
    instead of the settings' rendezvous; ``settings`` must give the rank and world size.

    Raises:
        RendezvousError: the group did not form within ``settings.join_timeout``.
    Cancellation: everything opened so far is closed.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + settings.join_timeout
    url = settings.rendezvous if store is None else None
    rank, size = settings.rank, settings.world_size
    if rank is not None and size is not None and rank >= size:
        raise RendezvousError(f"rank {rank} is out of range for world_size {size}")
    if store is not None:
        if rank is None or size is None:
            raise RendezvousError("forming through a torch store needs the rank and size")
        return await _form_through_store(settings, sockets, constants, store, rank,
                                         size, deadline)
    if url is None and settings.world_size is None:
        warn_alone()  # a group of one that nothing asked for
    if url is None and (settings.world_size or 1) > 1:
        raise RendezvousError(
            "no rendezvous address: pass rendezvous='tcp://HOST:PORT' or set "
            "P2PCOLL_RENDEZVOUS (or MASTER_ADDR and MASTER_PORT)"
        )
    policy = endpoint_policy(settings.transport)
    address = None if url is None else await _resolve(url, deadline)
    # A peer that cannot be reached listens on loopback only, and is reached through a
    # relay (see p2pcoll.transport.relayed): it advertises its relay endpoint.
    behind = (settings.reachable is False and url is not None and address is not None
              and not url.startswith("torch://"))
    # One that does not say is checked: the rendezvous connects back (see rendezvous.jobs).
    check = settings.reachable is None and not settings.host
    target = new_target() if behind or check else ""
    if address is None or behind:
        host = "127.0.0.1"
    else:
        host = settings.host or await advertised_host(parse_url(address)[0])
    transport = ZmqMesh(policy, host, settings, sockets)
    server: RendezvousServer | None = None
    session: Session | None = None
    try:
        endpoints = await transport.bind()
        if url is None:
            membership = _alone(endpoints)
        else:
            assert address is not None
            me = host_identity(settings.host_id)
            if url.startswith("torch://"):
                from ..rendezvous.torch_store import store_rendezvous  # torchrun's only
                membership = await store_rendezvous(
                    "torch" + address.removeprefix("tcp"), namespace=settings.torchrun,
                    endpoints=endpoints, world_size=settings.world_size, rank=settings.rank,
                    timeout=max(0.0, deadline - loop.time()), host_id=me,
                    choose=lambda h, addresses: policy.choose(me, h, addresses),
                )
            else:
                choose = choosing(lambda h, addresses: policy.choose(me, h, addresses),
                                  parse_url(address)[0], target)
                membership, server = await _meet(
                    settings, address,
                    advertised(endpoints, settings.relay, target) if behind else endpoints,
                    choose, sockets, me, max(0.0, deadline - loop.time()),
                    (target, settings.relay) if check else None)
        _check_reachable(policy.name, membership, me if url is not None else "")
        session = await _start(membership, transport, settings, constants, deadline)
        if server is not None and elastic(settings) is None:
            if (relay := server.take_relay()) is not None:  # it serves the group's
                transport.keep_relay(relay)                 # peers behind it
            await server.aclose()  # every peer has its roster: nothing left to serve
            server = None
        return session, server
    except BaseException:  # cancelled while the server closed, too: close the session
        if session is not None:
            await session.close(0.0)
        await transport.aclose()
        if server is not None:
            await server.aclose()
        raise


async def _form_through_store(
    settings: Settings, sockets: SocketFactory,
    constants: Mapping[str, Constants], store: Any, rank: int, size: int, deadline: float,
) -> tuple[Session, None]:
    """:func:`form` through torch's ``store``: the endpoints advertised are on the
    interface that routes to the store's host (a TCPStore's), else loopback."""
    loop = asyncio.get_running_loop()
    policy = endpoint_policy(settings.transport)
    store_host = _store_host(store)
    host = settings.host or (await advertised_host(store_host) if store_host else "127.0.0.1")
    transport = ZmqMesh(policy, host, settings, sockets)
    try:
        endpoints = await transport.bind()
        me = host_identity(settings.host_id)
        if size == 1:
            membership = _alone(endpoints)
        else:
            from ..rendezvous.torch_store import store_membership
            membership = await store_membership(
                store, endpoints=endpoints, world_size=size, rank=rank,
                timeout=max(0.0, deadline - loop.time()), host_id=me,
                choose=lambda h, addresses: policy.choose(me, h, addresses),
            )
            _check_reachable(policy.name, membership, me)
        return await _start(membership, transport, settings, constants, deadline), None
    except BaseException:
        await transport.aclose()
        raise


def _alone(endpoints: list[str]) -> Membership:
    """The membership of a group of one (no rendezvous)."""
    return Membership(os.urandom(8).hex(), 0, 0, 1, (endpoints[0],))


async def _start(membership: Membership, transport: ZmqMesh, settings: Settings,
                 constants: Mapping[str, Constants],
                 deadline: float) -> Session:
    """The session of a roster that was agreed on, started, once every peer said hello
    (the hellos bounded by the heartbeat, at least HELLO_MIN_WAIT, and the deadline).
    If that fails or is cancelled, the session is closed (the transport is the caller's)."""
    session = Session(membership, transport, settings, constants)
    try:
        session.start()
        left = deadline - asyncio.get_running_loop().time()
        await handshake(session, min(max(0.0, left),
                                     max(settings.heartbeat_timeout, HELLO_MIN_WAIT)))
    except BaseException:
        await session.close(0.0)
        raise
    return session


def _store_host(store: Any) -> str | None:
    """The host of the TCPStore under ``store`` (torch wraps it in prefix stores)."""
    for _ in range(16):
        host = getattr(store, "host", None)
        if isinstance(host, str) and host:
            return host
        store = getattr(store, "underlying_store", None)
        if store is None:
            return None
    return None


def _check_reachable(transport: str, membership: Membership, me: str) -> None:
    """inproc reaches only peers of this very process, ipc only peers of this host (as
    P2PCOLL_HOST_ID or detection says): say so rather than time out or share memory with
    a peer that counts as another host."""
    if transport == "inproc":
        others = [r for r, e in enumerate(membership.endpoints)
                  if not e.startswith(inproc_prefix())]
        if others:
            raise RendezvousError(
                f"P2PCOLL_TRANSPORT=inproc works only between peers of one process, and ranks "
                f"{others} are in other processes: use auto (the default), ipc or tcp"
            )
    elif transport == "ipc" and membership.hosts:
        others = [r for r, h in enumerate(membership.hosts) if h != me]
        if others:
            raise RendezvousError(
                f"P2PCOLL_TRANSPORT=ipc works only between peers of one host, and ranks "
                f"{others} are on other hosts (P2PCOLL_HOST_ID, or detected): use auto (the "
                f"default) or tcp", permanent=True
            )


async def _meet(settings: Settings, address: str, endpoints: list[str],
                choose: Callable[[str, list[str]], str], sockets: SocketFactory, me: str,
                left: float, check: tuple[str, str | None] | None
                ) -> tuple[Membership, RendezvousServer | None]:
    """The p2pcoll rendezvous at ``address``, hosting it if this peer may (see the module
    docstring); returns the roster and the server this peer hosts, if any."""
    hosting = (_Hosting(address, sockets, settings) if settings.rank in (None, 0)
               else None)
    try:
        membership = await rendezvous(
            address, endpoints=endpoints, world_size=settings.world_size,
            rank=settings.rank, timeout=left, host_id=me, choose=choose, sockets=sockets,
            heartbeat=settings.heartbeat_timeout, job=settings.job_id,
            elastic=elastic(settings), order=settings.order, expect=settings.expect,
            check=check,
        )
    except BaseException as exc:
        if hosting is not None and (server := await hosting.stop()) is not None:
            await server.aclose()
        if (isinstance(exc, RendezvousError) and not exc.answered and hosting is not None
                and hosting.refused):
            # Nothing answered and this peer could not host: what holds the port is the
            # cause (a standalone server there would have answered).
            raise RendezvousError(
                f"{exc}; this peer (which hosts the rendezvous) could not bind {address} "
                f"the whole time ({hosting.refused}): another program holds the port",
                permanent=exc.permanent, answered=False,
            ) from None
        raise
    return membership, await hosting.stop() if hosting is not None else None


HELLO_MIN_WAIT = 2.0  # seconds the hellos may take after the roster, at the least
# Seconds between asks of the addresses of the peers not heard from while the hellos come.
HELLO_CHECK_S = 0.2
RESOLVE_RETRY = 0.5  # seconds between attempts to resolve the rendezvous host's name


def elastic(settings: Settings) -> tuple[int, int | None] | None:
    """``(min, max)`` world size if the settings ask for an elastic group."""
    if settings.world_size is None and settings.min_world_size is not None:
        return settings.min_world_size, settings.max_world_size
    return None


async def _resolve(url: str, deadline: float) -> str:
    """``tcp://IP:PORT`` for the rendezvous URL. A name that does not resolve yet (a pod
    whose DNS record is not there yet) is tried again until the join deadline.

    Raises:
        RendezvousError: naming the URL, when the deadline passes.
    """
    loop = asyncio.get_running_loop()
    host, port = parse_url(url)
    while True:
        try:
            infos = await loop.getaddrinfo(host, port, family=socket.AF_INET,
                                           type=socket.SOCK_STREAM)
            return f"tcp://{infos[0][4][0]}:{port}"
        except OSError as exc:
            if loop.time() + RESOLVE_RETRY > deadline:
                raise RendezvousError(
                    f"cannot resolve the rendezvous host of {url} ({exc}); tried until the "
                    f"join deadline"
                ) from None
            log.info("rendezvous host of %s does not resolve yet (%s); trying again", url, exc)
            await asyncio.sleep(RESOLVE_RETRY)


class _Hosting:
    """Hosts the rendezvous if the port can be had, trying again while the group forms.

    The port may be busy for a moment (the previous group's server of this very process is
    still letting go of it) or for good (another peer, or a standalone server, hosts); a
    bind is cheap, so this tries every RETRY seconds from its making until :meth:`stop`
    (once the roster has come).
    """

    RETRY = 0.1

    def __init__(self, address: str, sockets: SocketFactory, settings: Settings) -> None:
        self.address = address
        self.sockets = sockets
        self.limits = settings.rendezvous_limits
        self.server: RendezvousServer | None = None
        self.refused = ""  # why the last bind failed, until one succeeds
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> RendezvousServer | None:
        """Stop trying; returns the server if a bind succeeded (it keeps serving)."""
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        return self.server

    async def _run(self) -> None:
        from ..rendezvous.server import RendezvousServer
        reason = ""
        while self.server is None:
            candidate = RendezvousServer(self.address, self.sockets, self.limits)
            try:
                candidate.bind()
            except zmq.ZMQError as exc:
                self.refused = str(exc)
                if str(exc) != reason:
                    reason = str(exc)
                    log.info("not hosting the rendezvous at %s (%s): another peer or a "
                             "standalone server does, or it is still being released",
                             self.address, exc)
                await asyncio.sleep(self.RETRY)
                continue
            self.server, self.refused = candidate, ""


async def handshake(session: Session, left: float) -> None:
    """Hello to the peers this one watches, then wait for the hellos of those that watch it
    (at most ``left`` seconds; every peer, in a group on a shared-memory board): see
    ``transport.hello_peers`` and :mod:`p2pcoll.departures.overlay`.

    Every peer has bound its endpoints before it registers, so once the roster is out the
    hellos take milliseconds; a peer not heard from within ``left`` (the heartbeat timeout,
    unless the join deadline is nearer) was lost after it registered. So was one at whose
    address nothing listens any more: the peers not heard from are asked every
    :data:`HELLO_CHECK_S`, so a peer killed after it registered ends the wait at once.

    Raises:
        RendezvousError: naming the ranks (and their endpoints) that were not heard from.
    """
    m = session.membership
    if m.world_size == 1:
        return
    session.transport.greet(session.header("hello"))
    try:
        killed = await asyncio.wait_for(_hellos(session), left)
    except TimeoutError:
        killed = []
    missing = killed or sorted(session.transport.hello_peers - session.hellos)
    if not missing:  # every hello came (the last while the wait was being cancelled)
        return
    for rank in missing:  # the others hear of it from this peer (p2pcoll.departures)
        session.peers.reported_lost(rank, by=m.rank)
    why = ("nothing listens at their addresses any more" if killed
           else f"not heard from within {left:.3g}s of the roster")
    raise RendezvousError(
        f"rank {m.rank} could not reach ranks {missing} of the group ({why}; endpoints "
        f"{[m.endpoints[r] for r in missing]}): lost while the group formed"
    ) from None


async def _hellos(session: Session) -> list[int]:
    """Wait for the hellos; returns early with the peers not heard from at whose address
    nothing listens any more (killed after they registered), if any."""
    m = session.membership
    while True:
        try:
            await asyncio.wait_for(session.all_hello.wait(), HELLO_CHECK_S)
            return []
        except TimeoutError:
            pass
        silent = [r for r in sorted(session.transport.hello_peers - session.hellos)
                  if m.endpoints[r].startswith(CHECKABLE)]
        found = await asyncio.gather(*(listening(m.endpoints[r], HELLO_CHECK_S)
                                       for r in silent), return_exceptions=True)
        killed = [r for r, there in zip(silent, found, strict=True) if there is False]
        if killed:
            return killed
