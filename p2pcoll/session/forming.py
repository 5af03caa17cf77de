"""Forming a group: bind, find the others through the rendezvous, check every link.

The hosting policy: the peer that asks for rank 0 (or, with ranks assigned by arrival,
every peer) tries to host the rendezvous server at the rendezvous address; the one whose
bind succeeds hosts it, the others (and every peer, when a standalone server runs) are
only clients. Then every peer says hello to every other and waits for all the hellos, so
the first collective never waits on a link that is still connecting.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket

import zmq

from ..errors import RendezvousError
from ..rendezvous import RendezvousServer, advertised_host, parse_url, rendezvous
from ..settings import Settings
from ..transport.endpoints import endpoint_policy, host_identity
from ..transport.sockets import SocketFactory
from ..transport.zmq_mesh import ZmqMesh
from ..types import Membership
from .failure import FailureModel
from .session import Session

log = logging.getLogger("p2pcoll")


async def form(settings: Settings, failures: FailureModel, sockets: SocketFactory
               ) -> tuple[Session, RendezvousServer | None]:
    """Form the group ``settings`` describe; returns its first session and the rendezvous
    server this peer hosts, if it hosts one.

    Raises:
        RendezvousError: the group did not form within ``settings.join_timeout``.
    Cancellation: everything opened so far is closed.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + settings.join_timeout
    url = settings.rendezvous
    rank, size = settings.rank, settings.world_size
    if rank is not None and size is not None and rank >= size:
        raise RendezvousError(f"rank {rank} is out of range for world_size {size}")
    if url is None and (settings.world_size or 1) > 1:
        raise RendezvousError(
            "no rendezvous address: pass rendezvous='tcp://HOST:PORT' or set "
            "P2PCOLL_RENDEZVOUS (or MASTER_ADDR and MASTER_PORT)"
        )
    policy = endpoint_policy(settings.transport)
    if url is None:
        host = "127.0.0.1"
    else:
        host = settings.host or await advertised_host(parse_url(url)[0])
    transport = ZmqMesh(policy, host, settings, sockets)
    server: RendezvousServer | None = None
    try:
        endpoints = await transport.bind()
        if url is None:
            membership = Membership(os.urandom(8).hex(), 0, 0, 1, (endpoints[0],))
        else:
            rhost, port = parse_url(url)
            try:
                infos = await loop.getaddrinfo(rhost, port, family=socket.AF_INET)
            except OSError as exc:
                raise RendezvousError(f"cannot resolve the rendezvous host of {url}: {exc}"
                                      ) from None
            address = f"tcp://{infos[0][4][0]}:{port}"
            if settings.rank in (None, 0):
                candidate = RendezvousServer(address, sockets)
                try:
                    candidate.bind()
                    server = candidate
                except zmq.ZMQError as exc:
                    log.info("not hosting the rendezvous at %s (%s): another peer or a "
                             "standalone server does", address, exc)
            me = host_identity()
            membership = await rendezvous(
                address, endpoints=endpoints, world_size=settings.world_size,
                rank=settings.rank, timeout=max(0.0, deadline - loop.time()), host_id=me,
                choose=lambda h, addresses: policy.choose(me, h, addresses), sockets=sockets,
            )
        session = Session(membership, transport, settings, failures)
        session.start()
        await handshake(session, max(0.0, deadline - loop.time()), settings.join_timeout)
        return session, server
    except BaseException:
        await transport.aclose()
        if server is not None:
            await server.aclose()
        raise


async def handshake(session: Session, left: float, timeout: float) -> None:
    """Hello to every peer, then wait for every peer's hello (at most ``left`` seconds).

    Raises:
        RendezvousError: naming the ranks (and their endpoints) that were not heard from.
    """
    m = session.membership
    if m.world_size == 1:
        return
    session.transport.greet(session.header("hello"))
    try:
        await asyncio.wait_for(session.all_hello.wait(), left)
    except TimeoutError:
        missing = sorted(set(range(m.world_size)) - session.hellos - {m.rank})
        raise RendezvousError(
            f"rank {m.rank} could not reach ranks {missing} of the group within {timeout:g}s "
            f"(endpoints {[m.endpoints[r] for r in missing]})"
        ) from None
