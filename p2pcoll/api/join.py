"""``join()``: form a group, awaited or as an async context manager."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Generator, Mapping
from typing import Any

from ..registry import registry
from ..settings import Settings
from .group import Group


async def _join(settings: Settings) -> Group:
    if not registry.loaded:  # now rather than in the first collective, the peers waiting
        await asyncio.to_thread(registry.load)
    group = Group(settings)
    try:
        await group._form()
    except BaseException:
        await group.close()
        raise
    return group


class Join:
    """What :func:`join` returns: await it for a Group, or use it with ``async with``."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._group: Group | None = None

    def __await__(self) -> Generator[Any, None, Group]:
        return _join(self.settings).__await__()

    async def __aenter__(self) -> Group:
        self._group = await _join(self.settings)
        return self._group

    async def __aexit__(self, *exc: object) -> None:
        if self._group is not None:
            await self._group.close()


def join(
    rendezvous: str | None = None,
    *,
    world_size: int | None = None,
    rank: int | None = None,
    timeout: float | None = None,
    strategies: Mapping[str, str] | None = None,
    collective_timeout: float | None = None,
    transport: str | None = None,
    key_file: str | os.PathLike[str] | None = None,
    heartbeat_timeout: float | None = None,
    job_id: str | None = None,
    min_world_size: int | None = None,
    max_world_size: int | None = None,
    order: int | None = None,
    timeline: str | os.PathLike[str] | None = None,
) -> Join:
    """Join a group of peers.

    ``g = await join(...)`` or ``async with join(...) as g:``. Every argument left None is
    read from the environment (see :mod:`p2pcoll.settings`), once, here.

    Args:
        rendezvous: ``"tcp://HOST:PORT"``; None reads ``$P2PCOLL_RENDEZVOUS``, else what
            the launcher implies: torchrun's store, ``$MASTER_ADDR``/``$MASTER_PORT``, the
            node of rank 0 under mpirun or srun (see :mod:`p2pcoll.launchers`). May be None
            when world_size is 1.
        world_size: number of peers; None reads ``$WORLD_SIZE``, ``$OMPI_COMM_WORLD_SIZE``
            or ``$SLURM_NTASKS`` (some peer must give it).
        rank: this peer's rank; None reads ``$RANK``, ``$OMPI_COMM_WORLD_RANK``,
            ``$SLURM_PROCID`` or a Kubernetes StatefulSet pod's ordinal, else the
            rendezvous assigns one in arrival order.
        timeout: seconds for the whole group to form (``$P2PCOLL_JOIN_TIMEOUT``, 60 s).
        strategies: per-group strategy choice, e.g. ``{"allreduce": "ring"}``, over the
            ``$P2PCOLL_<COLLECTIVE>`` variables.
        collective_timeout: default deadline of each collective (``$P2PCOLL_TIMEOUT``, 300 s);
            ``math.inf`` for none.
        transport: "auto" (ipc to peers on this host, tcp to the others), "tcp", "ipc" or
            "inproc" (``$P2PCOLL_TRANSPORT``, default auto).
        key_file: the job key file (``p2pcoll keygen PATH``; ``$P2PCOLL_KEY_FILE``): every
            socket of the group runs CurveZMQ with it, and only holders of the same key can
            join or be heard. None and no variable: plain sockets.
        heartbeat_timeout: seconds of silence after which a peer, or the rendezvous host,
            is lost (``$P2PCOLL_HEARTBEAT_TIMEOUT``, 5 s), while joining and after.
        job_id: the job to join at a rendezvous server that serves several
            (``$P2PCOLL_JOB_ID``).
        min_world_size, max_world_size: an elastic group (world_size None): it forms once
            ``max_world_size`` peers are there, or ``min_world_size`` are and nobody new
            arrived for a second (``$P2PCOLL_MIN_WORLD_SIZE``, ``$P2PCOLL_MAX_WORLD_SIZE``).
            Ranks are assigned by ``order`` (lower first), then arrival.
        order: this peer's place when ranks are assigned (the elastic training layer
            passes the previous rank, so survivors keep their order).
        timeline: write every collective, and each send, receive and reduction in it, as
            Chrome trace events (``$P2PCOLL_TIMELINE``): this rank's file is
            ``STEM-GROUP-rankR.json`` beside the path, ``p2pcoll launch`` (or
            ``p2pcoll timeline PATH``) merges the ranks' files into the path itself; see
            :mod:`p2pcoll.engine.timeline`.

    Raises:
        SettingsError: an argument or environment variable has a bad value (a timeline
            in a directory that does not exist or cannot be written, too), or the
            launcher's environment cannot say where to meet (naming what to set); raised
            here, before anything is awaited.
        RendezvousError: the group did not form in time (naming how many peers arrived and
            which ranks are missing), this peer's rank/world size was rejected, a peer that
            had registered was lost, the rendezvous host went away, or the handshake with
            it failed (a different job key, or one side secured and the other not).
        UnknownStrategy: ``strategies`` names a strategy that is not installed.
    Cancellation: every socket opened so far is closed.
    """
    settings = Settings.resolve(
        rendezvous=rendezvous, world_size=world_size, rank=rank, join_timeout=timeout,
        strategies=strategies, collective_timeout=collective_timeout, transport=transport,
        key_file=key_file, heartbeat_timeout=heartbeat_timeout, job_id=job_id,
        min_world_size=min_world_size, max_world_size=max_world_size, order=order,
        timeline=timeline,
    )
    return Join(settings)
