"""``join()``: form a group, awaited, as an async context manager, or wherever a coroutine goes."""

from __future__ import annotations

import asyncio
import inspect
import os
import sys
import traceback
from collections.abc import Callable, Coroutine, Generator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, ParamSpec, TypeVar, cast

from ..engine.costs import DEFAULT_CONSTANTS, load_constants
from ..errors import SettingsError
from ..registry import check_chosen, registry
from ..session.forming import form, handshake
from ..session.session import Session
from ..settings import Settings
from ..transport.base import Transport
from ..transport.sockets import SocketFactory
from ..types import Membership
from .group import Group

P = ParamSpec("P")
R = TypeVar("R")


async def form_group(settings: Settings, *, store: Any = None,
                     transport: Transport | None = None,
                     membership: Membership | None = None) -> Group:
    """Form the group ``settings`` describe and return it: the one way a :class:`Group`
    comes to be (:func:`join`, the torch.distributed backend and :mod:`p2pcoll.testing`
    all call it).

    Args:
        settings: what the group runs with (``Settings.resolve(...)``).
        store: a torch.distributed store: the peers meet through it (the backend's way);
            ``settings`` must then give the rank and world size.
        transport, membership: a bound transport and the roster to run over it, with no
            rendezvous (``p2pcoll.testing.memory_groups``: the in-memory network).

    Raises:
        UnknownStrategySetting: ``settings.strategies`` names a strategy that is not
            installed (an UnknownStrategy and a SettingsError).
        SettingsError: the cost-model file is bad.
        RendezvousError: the group did not form in time, or a peer was lost meanwhile.
    Cancellation: everything opened so far is closed.
    """
    # The installed strategies load now rather than in the first collective (the peers
    # would wait for it there), and while this peer waits for the others at the
    # rendezvous rather than before it goes there: a newcomer's scan of the packages'
    # metadata (0.2 s here, seconds on a loaded host) then no longer delays its arrival,
    # for which the members it replaces wait. A strategy chosen by name is checked before
    # any socket, so those settings load first.
    loading = None
    if not registry.loaded:
        if any(name != "auto" for name in settings.strategies.values()):
            await asyncio.to_thread(registry.load)
        else:
            loading = asyncio.ensure_future(asyncio.to_thread(registry.load))
    try:
        check_chosen(settings.strategies, os.environ)  # before any socket
        group = await _form_group(settings, store, transport, membership)
    except BaseException:
        if loading is not None:
            loading.cancel()  # (the thread finishes the load on its own)
            await asyncio.gather(loading, return_exceptions=True)
        raise
    try:
        if loading is not None:
            await loading
    except BaseException:
        await group.close("interrupted while the strategies loaded", wait=False)
        raise
    try:
        await group._probe()  # the measured topology (P2PCOLL_PROBE)
    except BaseException:
        await group.close("the link probe failed", wait=False)
        raise
    return group


async def _form_group(settings: Settings, store: Any, transport: Transport | None,
                      membership: Membership | None) -> Group:
    """The group of :func:`form_group`, before its link probe."""
    # auto's constants, read and checked once, before any socket.
    constants = load_constants(settings.cost_model) if settings.cost_model else DEFAULT_CONSTANTS
    sockets = None
    server = None
    try:
        if transport is not None:
            assert membership is not None, "a transport needs its membership"
            session = Session(membership, transport, settings, constants)
            session.start()
            await handshake(session, settings.join_timeout)
        else:
            sockets = SocketFactory.for_settings(settings)
            session, server = await form(settings, sockets, constants, store=store)
    except BaseException:
        if sockets is not None:
            sockets.close()
        raise
    return Group(session, server=server, sockets=sockets)


async def _join(settings: Settings) -> Group:
    return await form_group(settings)


class Join(Coroutine[Any, Any, Group]):
    """What :func:`join` returns: a coroutine giving a Group, that is also an async context
    manager (as aiohttp's ``session.get(...)`` is).

    So ``await join(...)``, ``async with join(...) as g``, ``asyncio.run(join(...))``,
    ``asyncio.create_task(join(...))``, ``asyncio.gather(join(...), ...)`` and
    ``asyncio.wait_for(join(...), t)`` all work. Like any coroutine it runs once: awaiting
    it a second time raises RuntimeError. Nothing starts until it is first awaited or
    sent to, so a Join that is never used leaves no "never awaited" warning. Asking it for
    a Group's attribute (``p2pcoll.join(...).rank``: the ``await`` forgotten) raises an
    AttributeError that says to await it or to use :func:`p2pcoll.blocking.join`. An
    ``async with`` block left by an exception closes the group as a crash: the peers'
    PeerLost says that this rank crashed, with the error's first line.
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._coro: Coroutine[Any, Any, Group] | None = None
        self._group: Group | None = None

    def _coroutine(self) -> Coroutine[Any, Any, Group]:
        if self._coro is None:
            self._coro = _join(self.settings)
        return self._coro

    def send(self, value: Any) -> Any:
        return self._coroutine().send(value)

    def throw(self, *args: Any) -> Any:  # (exc) or the deprecated (type, value, traceback)
        return self._coroutine().throw(*args)

    def close(self) -> None:
        if self._coro is not None:
            self._coro.close()

    def __await__(self) -> Generator[Any, None, Group]:
        return self._coroutine().__await__()

    async def __aenter__(self) -> Group:
        self._group = await self._coroutine()
        return self._group

    async def __aexit__(self, et: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self._group is not None:
            # Left by an error of the program: the peers are told this rank crashed, and
            # why (a cancellation or Ctrl-C is a close like any other).
            await self._group._leave("", exc if isinstance(exc, Exception) else None)

    def __getattr__(self, name: str) -> Any:
        # Reached only for a name a Join lacks: most likely a Group's, asked of the Join
        # that was never awaited (``g = p2pcoll.join(...); g.rank``).
        if name.startswith("__"):  # protocols (copy, pickle) probing: the plain error
            raise AttributeError(name)
        raise AttributeError(
            f"'Join' object has no attribute {name!r}: p2pcoll.join() returns a Join to "
            f"await, not a Group; write g = await p2pcoll.join(...) (or async with "
            f"p2pcoll.join(...) as g), or use p2pcoll.blocking.join() in code without "
            f"asyncio", name=name, obj=self)


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
    expect: int | None = None,
    timeline: str | os.PathLike[str] | None = None,
    host_id: str | None = None,
    max_links: int | None = None,
    reachable: bool | None = None,
    relay: str | None = None,
    streams: int | Literal["auto"] | None = None,
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
        expect: an elastic group forms as soon as this many peers are there (at least
            ``min_world_size``), not a second after the last arrival (the elastic
            training layer passes the survivors of a loss and the peers waiting).
        timeline: write every collective, and each send, receive and reduction in it, as
            Chrome trace events (``$P2PCOLL_TIMELINE``): this rank's file is
            ``STEM-GROUP-rankR.json`` beside the path, ``p2pcoll launch`` (or
            ``p2pcoll timeline PATH``) merges the ranks' files into the path itself; see
            :mod:`p2pcoll.engine.timeline`.
        host_id: the host this peer counts as on (``$P2PCOLL_HOST_ID``; default: detected
            from the machine): peers whose values differ are on different hosts, never
            joined by ipc or shared memory; host-aware strategies group ranks by it.
        max_links: the most links this peer keeps open to others (``$P2PCOLL_MAX_LINKS``;
            0, the default: no bound; else at least 4). Beyond it the least recently used
            idle link is closed, and opened again when needed (its messages keep their
            order); what bounds a peer's descriptors in a large group of rooted
            collectives. Each stripe of a link counts.
        reachable: False when this peer cannot accept connections (behind NAT or a
            firewall; ``$P2PCOLL_REACHABLE=0``): it listens on no network address, keeps
            one outbound connection to a relay, and the others reach it through that
            (see docs/relay.md). None: it can.
        relay: ``"tcp://HOST:PORT"`` of a standalone relay (``p2pcoll relay --port N``;
            ``$P2PCOLL_RELAY``) for this peer to register at when not reachable; None: the
            relay the rendezvous host runs.
        streams: the TCP connections per peer pair a large message's segments are spread
            over (``$P2PCOLL_STREAMS``): 1 to 16, or ``"auto"`` (the default): enough that
            their windows fill the path's bandwidth-delay product, from its measured round
            trip; 1 on one host (see :mod:`p2pcoll.transport.paths`).

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

    Under ``p2pcoll launch`` a SettingsError that the program leaves uncaught is printed as
    one line naming the rank, the message and the line that called join, instead of a
    traceback from every rank (see :func:`_brief_settings_errors`).
    """
    _brief_settings_errors()  # a bad setting may show now, or when the plugins load
    settings = Settings.resolve(
        rendezvous=rendezvous, world_size=world_size, rank=rank, join_timeout=timeout,
        strategies=strategies, collective_timeout=collective_timeout, transport=transport,
        key_file=key_file, heartbeat_timeout=heartbeat_timeout, job_id=job_id,
        min_world_size=min_world_size, max_world_size=max_world_size, order=order,
        expect=expect, timeline=timeline, host_id=host_id, max_links=max_links, reachable=reachable,
        relay=relay, streams=streams,
    )
    return Join(settings)


def takes_arguments_of(source: Callable[P, object]) -> Callable[[Callable[..., R]], Callable[P, R]]:
    """Give the decorated function ``source``'s arguments, so that two front ends share one
    list (:func:`p2pcoll.blocking.join` takes :func:`join`'s).

    The decorated function takes ``*args, **kwargs`` and hands them to ``source`` as they
    came. A type checker sees it with ``source``'s parameters (names, kinds, types and
    defaults, through the ParamSpec) and its own result; ``inspect.signature()`` and
    ``help()`` show the same (``__signature__``), and its docstring gains ``source``'s
    ``Args:`` section, before its own ``Raises:``.
    """
    def adopt(front: Callable[..., R]) -> Callable[P, R]:
        own = inspect.signature(front)
        front.__signature__ = inspect.signature(source).replace(  # type: ignore[attr-defined]
            return_annotation=own.return_annotation)
        if front.__doc__ and source.__doc__:  # (python -OO drops docstrings)
            front.__doc__ = _with_args(front.__doc__, source.__doc__)
        return cast(Callable[P, R], front)

    return adopt


def _with_args(doc: str, source_doc: str) -> str:
    """``doc`` with ``source_doc``'s ``Args:`` section (up to its first blank line) put
    before its ``Raises:`` line, or at its end; ``doc`` itself if there is none."""
    source_lines = inspect.cleandoc(source_doc).splitlines()
    if "Args:" not in source_lines:
        return doc
    start = source_lines.index("Args:")
    end = next((i for i in range(start, len(source_lines)) if not source_lines[i].strip()),
               len(source_lines))
    lines = inspect.cleandoc(doc).splitlines()
    at = lines.index("Raises:") if "Raises:" in lines else len(lines)
    head = "\n".join(lines[:at]).rstrip()
    return "\n\n".join(part for part in (head, "\n".join(source_lines[start:end]),
                                           "\n".join(lines[at:])) if part)


_PACKAGE = Path(__file__).resolve().parent.parent


def _brief_settings_errors() -> None:
    """Under ``p2pcoll launch`` (``$P2PCOLL_LAUNCHED``), make an uncaught SettingsError print
    as one line: ``rank R: SettingsError: MESSAGE (train.py, line 12)``.

    A bad ``P2PCOLL_*`` variable fails every rank the same way, and N tracebacks through
    asyncio say nothing the message does not. Only a SettingsError that reaches the top
    uncaught is shortened: the program may still catch it, and any other exception (one it
    raised itself, or one it raised from ours) keeps its full traceback. The hook is added
    once, and hands everything else to the hook that was there before.
    """
    if os.environ.get("P2PCOLL_LAUNCHED") != "1" or getattr(sys.excepthook, "_p2pcoll", False):
        return
    previous = sys.excepthook

    def hook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        if not isinstance(exc, SettingsError):
            previous(kind, exc, tb)
            return
        frames = [f for f in traceback.extract_tb(tb)
                  if not Path(f.filename).resolve().is_relative_to(_PACKAGE)]
        where = f" ({frames[-1].filename}, line {frames[-1].lineno})" if frames else ""
        rank = os.environ.get("RANK", "?")
        print(f"rank {rank}: SettingsError: {exc}{where}", file=sys.stderr, flush=True)

    hook._p2pcoll = True  # type: ignore[attr-defined]
    sys.excepthook = hook
