"""The rendezvous under torchrun: through the key-value store torchrun's agent already runs.

torchrun's agent listens on ``MASTER_PORT`` with torch's TCPStore, so no p2pcoll
rendezvous can be hosted there. Under torchrun (``TORCHELASTIC_RUN_ID`` set, and no
``P2PCOLL_RENDEZVOUS``) the settings name the store as ``torch://MASTER_ADDR:MASTER_PORT``
and every rank, knowing its rank and the world size from torchrun, puts its endpoints
under a key of its own and reads everyone else's: the same roster as the p2pcoll
rendezvous would hand out. Keys live under ``p2pcoll/<run id>/<restart>/<n>/``, where n
counts the groups this process has joined under that run (every rank joins the same
groups in the same order), so a second group of one run, or a restarted run, never reads
the keys of another.

The same exchange serves the torch.distributed backend (:mod:`p2pcoll.integrations.torch`),
through the store torch hands each process group (:func:`store_membership`): torch
prefixes it per group, so every ``new_group`` forms a p2pcoll group of its own.

The store is torch's: it neither authenticates nor encrypts, so it must be reachable by
the job's processes only. Besides every rank's endpoints it holds the group's id and link
secret (rank 0 writes ``{"id", "secret"}`` under ``<prefix>/group``): without a job key,
whoever reads the store can name a member's link (``rank@secret@nonce``) and so take a
rank's place on a peer it reaches first. With a job key the mesh itself is still secured
(the secret alone opens no connection).
"""

from __future__ import annotations

import asyncio
import secrets
import uuid
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import msgpack

from ..errors import RendezvousError
from ..types import Membership
from .url import parse_url

_joins: Counter[str] = Counter()  # groups joined by this process, per torchrun run


def _connect(host: str, port: int, timeout: float) -> Any:
    try:
        from torch.distributed import TCPStore
    except ImportError as exc:
        raise RendezvousError(
            f"running under torchrun (TORCHELASTIC_RUN_ID is set), whose agent holds "
            f"MASTER_PORT {port} with torch's store, but torch is not importable here "
            f"({exc}): install torch, or set P2PCOLL_RENDEZVOUS=tcp://{host}:PORT with a "
            f"free PORT other than {port}"
        ) from None
    try:
        return TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout),
                        wait_for_workers=False)
    except (RuntimeError, OSError) as exc:  # torch raises DistStoreError, a RuntimeError
        raise RendezvousError(f"cannot reach torchrun's store at {host}:{port}: {exc}"
                              ) from None


async def store_rendezvous(
    url: str,
    *,
    namespace: str,
    endpoints: list[str],
    world_size: int | None,
    rank: int | None,
    timeout: float,
    host_id: str,
    choose: Callable[[str, list[str]], str],
) -> Membership:
    """Exchange endpoints through torch's store at ``url`` (``torch://HOST:PORT``).

    Raises:
        RendezvousError: torch is not importable, the store cannot be reached, the rank or
            world size is unknown, or not every rank wrote its endpoints within
            ``timeout`` (naming the missing ranks).
    Cancellation: the wait goes on in its thread until ``timeout``; nothing is written
    after it.
    """
    if rank is None or world_size is None:
        raise RendezvousError("under torchrun the rank and world size come from RANK and "
                              "WORLD_SIZE, which are not set")
    host, port = parse_url(url)
    _joins[namespace] += 1
    prefix = f"p2pcoll/{namespace}/{_joins[namespace]}"
    return await _exchange(lambda: _connect(host, port, timeout), prefix,
                           f"torchrun's store at {host}:{port}", endpoints=endpoints,
                           world_size=world_size, rank=rank, timeout=timeout,
                           host_id=host_id, choose=choose)


async def store_membership(
    store: Any,
    *,
    endpoints: list[str],
    world_size: int,
    rank: int,
    timeout: float,
    host_id: str,
    choose: Callable[[str, list[str]], str],
) -> Membership:
    """Exchange endpoints through ``store``, a torch ``Store`` already connected (the
    prefix store torch gives a process group: its keys are the group's own).

    Raises:
        RendezvousError: not every rank wrote its endpoints within ``timeout`` (naming the
            missing ranks), or an entry is malformed.
    Cancellation: the wait goes on in its thread until ``timeout``.
    """
    return await _exchange(lambda: store, "p2pcoll", "torch's store", endpoints=endpoints,
                           world_size=world_size, rank=rank, timeout=timeout,
                           host_id=host_id, choose=choose)


async def _exchange(
    connect: Callable[[], Any], prefix: str, where: str, *, endpoints: list[str],
    world_size: int, rank: int, timeout: float, host_id: str,
    choose: Callable[[str, list[str]], str],
) -> Membership:
    """Every rank puts its endpoints under ``prefix/<rank>``, rank 0 the group's id and
    link secret under ``prefix/group``; each reads them all back."""

    def exchange() -> list[bytes]:
        store = connect()
        store.set(f"{prefix}/{rank}", msgpack.packb({"endpoints": endpoints, "host": host_id}))
        if rank == 0:
            store.set(f"{prefix}/group", msgpack.packb(
                {"id": uuid.uuid4().hex[:16], "secret": secrets.token_hex(16)}))
        keys = [f"{prefix}/{r}" for r in range(world_size)] + [f"{prefix}/group"]
        try:
            store.wait(keys, timedelta(seconds=timeout))
        except RuntimeError:
            missing = [r for r in range(world_size) if not store.check([f"{prefix}/{r}"])]
            raise RendezvousError(
                f"rendezvous through {where} timed out after {timeout:.3g}s: "
                f"{world_size - len(missing)} of {world_size} peers arrived; "
                f"missing ranks {missing}"
            ) from None
        return [bytes(store.get(k)) for k in keys]

    values = await asyncio.to_thread(exchange)
    try:
        peers = [msgpack.unpackb(v, raw=False) for v in values[:-1]]
        group = msgpack.unpackb(values[-1], raw=False)
        hosts = tuple(str(p["host"]) for p in peers)
        return Membership(
            group_id=str(group["id"]), epoch=0, rank=rank, world_size=world_size,
            secret=str(group["secret"]),
            endpoints=tuple(choose(h, list(map(str, p["endpoints"])))
                            for h, p in zip(hosts, peers, strict=True)),
            hosts=hosts,
        )
    except (KeyError, TypeError, ValueError, UnicodeDecodeError, msgpack.UnpackException) as exc:
        raise RendezvousError(f"{where} holds a malformed p2pcoll entry under {prefix}: "
                              f"{exc}") from None
