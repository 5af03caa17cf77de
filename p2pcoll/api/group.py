"""The group API: the collectives a formed group runs.

Every collective is a coroutine that takes the next sequence number of the group's session
*before its first await*, so collectives started in the same order on every rank (one after
the other, or together with ``asyncio.gather``) are matched correctly even while several
are in flight. The one exception keeps that promise: a coded reduction with scales (int8)
is two collectives, the second started when the first has finished, so while it waits,
collectives started after it wait their turn and start in the order they were started
(:mod:`p2pcoll.session.turns`, kept by the session's runner). Forming lives in
:mod:`p2pcoll.session.forming`, the failure model and the group's state in
:mod:`p2pcoll.session.failure`, everything of one roster in
:class:`~p2pcoll.session.Session`; this module only turns calls into plans for the engine.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from .. import tensors
from ..engine.costs import CostModel
from ..errors import GroupBroken
from ..pytree import unflatten
from ..session.calls import Call
from ..session.failure import USABLE, GroupState
from ..session.flight import flight_record as _flight_record
from ..session.session import Session
from ..session.turns import Turns
from ..transport.sockets import SocketFactory
from ..types import ROBUST, CustomOp, Membership, Pytree, ReduceOp, as_op
from .arguments import (as_given, finish, flatten_leaves, learner, native,
                        no_codec_for_bfloat16, out_leaves, plain_op, reduction_call)
from .point_to_point import PointToPoint

if TYPE_CHECKING:  # what a plain group does not use is imported where it is used
    from ..rendezvous.server import RendezvousServer
    from .topology import Topology

T = TypeVar("T")


class Group(PointToPoint):
    """A set of peers that run collectives together. Made by :func:`p2pcoll.join`.

    Attributes:
        settings: what this group runs with (a frozen, validated value).
        state: :class:`GroupState`: ``forming``, ``ready``, ``degraded`` (a member has left
            or been lost, noticed between collectives too), ``broken`` (see ``cause``) or
            ``closed``. A health check may read it at any time.
        cause: the failure that broke the group, or None.
    """

    def __init__(self, session: Session, *,
                 server: RendezvousServer | None = None,
                 sockets: SocketFactory | None = None) -> None:
        """A group over a formed ``session``; made by :func:`p2pcoll.api.form_group`
        (which :func:`p2pcoll.join`, the torch backend and :mod:`p2pcoll.testing` use)."""
        self.settings = session.settings
        self._session: Session | None = session
        self._failures = session.failures  # its state outlives the session (close)
        self._server = server
        self._sockets = sockets
        self._extensions: dict[str, Any] = {}
        self._activity = session.activity  # the record of its collectives
        self._topology: Topology | None = None  # measured at join, if it probed (_probe)

    # --- what a group is ----------------------------------------------------------------

    @property
    def state(self) -> GroupState:
        return self._failures.state

    @property
    def cause(self) -> BaseException | None:
        return self._failures.cause

    @property
    def membership(self) -> Membership:
        """The roster this group was formed with (a frozen value)."""
        session = self._session  # read directly: rank and world_size are on the fast path
        return (session if session is not None else self.session).membership

    @property
    def rank(self) -> int:
        """This peer's rank, 0..world_size-1."""
        return self.membership.rank

    @property
    def world_size(self) -> int:
        """The number of peers."""
        return self.membership.world_size

    @property
    def endpoint(self) -> str:
        """The first address this peer receives on."""
        return self.session.transport.endpoints[0]

    @property
    def timeout(self) -> float:
        """The default deadline of each collective, seconds."""
        return self.settings.collective_timeout

    @property
    def turns(self) -> Turns:
        """The order in which this group's calls start while a coded reduction waits for
        its scales (:mod:`p2pcoll.session.turns`; :func:`p2pcoll.codecs.reduce_coded`
        takes a turn)."""
        return self.session.runner.turns

    @property
    def session(self) -> Session:
        """The current membership epoch (raises GroupBroken before forming or after close)."""
        if self._session is None:
            closed = self._failures.state is GroupState.CLOSED
            raise GroupBroken("the group is closed" if closed else "the group has not formed")
        return self._session

    def extension(self, key: str, factory: Callable[[], T]) -> T:
        """The state a layer built on this group keeps with it (``p2pcoll.training`` keeps its
        round counter here), made by ``factory()`` on first use and gone with the group.

        ``key`` names the layer, e.g. its module name.
        """
        if key not in self._extensions:
            self._extensions[key] = factory()
        return self._extensions[key]  # type: ignore[no-any-return]

    # --- turning arguments into calls -------------------------------------------------

    def _check_root(self, root: int) -> None:
        if not isinstance(root, int) or isinstance(root, bool) or not 0 <= root < self.world_size:
            raise ValueError(f"root {root!r} is not a rank of this group of {self.world_size}")

    def _costs(self) -> CostModel:
        """auto's cost model (:meth:`CostModel.for_group`: the one ``p2pcoll simulate`` uses)."""
        return self.session.runner.costs()

    # --- reductions -------------------------------------------------------------------

    async def allreduce(
        self, value: Pytree, op: str | ReduceOp | CustomOp = "sum", *,
        strategy: str | None = None, timeout: float | None = None, out: Pytree | None = None,
        codec: str | None = None, trim: int | None = None,
    ) -> Pytree:
        """Reduce ``value`` over all ranks and return the result on every rank.

        Args:
            value: an ndarray (any shape, 0-d included) or a CPU torch tensor, or a pytree
                of them. bfloat16 tensors are reduced exactly on their bfloat16 bits,
                rounded at every step as torch's backends do (:mod:`p2pcoll.tensors`),
                never in one call with leaves of other dtypes (TypeError).
            op: "sum", "prod", "min", "max" or "avg" (floating dtypes only), a
                :class:`~p2pcoll.CustomOp` of the caller's own, or the robust "median" and
                "trimmed_mean" with ``trim=k`` (k largest and smallest values dropped,
                ``0 <= 2k < world_size``; :mod:`p2pcoll.api.robust`).
            strategy: a strategy name (``p2pcoll.available_strategies()["allreduce"]``);
                None means the group's choice, ``$P2PCOLL_ALLREDUCE``, or "auto" (which,
                when every peer shares this host and the data fits a slot, 64 KiB, runs
                on the shared-memory board: strategy "shm" in ``stats()``).
            timeout: seconds for the whole collective (default: the group's).
            out: where to put the result: arrays of the same structure, shapes and dtypes,
                C-contiguous and writable; ``out=value`` reduces in place.
            codec: send the data compressed (floating-point data only): ``"fp16"``,
                ``"bf16"``, ``"int8"`` or a plugin's (:mod:`p2pcoll.codecs`: bytes per
                element, precision, ops), as one collective of the codec's wire dtype (int8
                first agrees on its scales); ``stats()`` counts the compressed bytes.

        Returns:
            ``out`` if given, else new arrays of the same structure (a tensor leaf's result
            is a tensor of its dtype, as from every collective); ``value`` is not modified
            unless it is ``out``. Every rank gets the same bits.

        Raises:
            ValueError, TypeError: ``out`` does not match, a dtype is not allowed or the op
                is not defined for it (median of integers), a bad ``trim``; a codec on data
                that is not floating point, an op the codec cannot carry (int8: min, max,
                prod), an unknown codec (:class:`~p2pcoll.codecs.UnknownCodec`). Raised
                before anything is sent; the group stays usable.
            NonFiniteInput: int8 found NaN or Inf in some rank's data (a FloatingPointError;
                every rank raises it, only the scales have moved; the group stays usable).
            CollectiveTimeout, CollectiveMismatch, PeerLost, GroupBroken (a rank that
                uses another codec, op or trim is a CollectiveMismatch naming it).
        Cancellation: breaks the group (the other ranks get an abort).

        Example::

            total = await g.allreduce(np.array([g.rank]))   # every rank -> [0 + 1 + ... ]
            mean = await g.allreduce(grad, "avg", codec="int8")   # about 1/4 of the bytes
        """
        if trim is not None or op in ROBUST:
            from .robust import robust_allreduce
            return await robust_allreduce(self, value, as_op(op), trim, strategy, timeout, out,
                                          codec)
        if codec is not None:
            return await self._coded("allreduce", value, op, 0, strategy, timeout, out, codec)
        call, given, average = reduction_call("allreduce", value, op, None, strategy,
                                              timeout, out)
        if self._topology is not None:  # along the measured ring, if it pays
            from .topology import ordered
            ordered(self, self._topology, call)
        await self.session.run(call)
        results = finish(call, average, self.world_size) if average else call.leaves
        if out is not None:
            return out
        return unflatten(call.treedef, results if given is None else as_given(given, results))

    async def reduce(
        self, value: Pytree, root: int = 0, op: str | ReduceOp | CustomOp = "sum", *,
        strategy: str | None = None, timeout: float | None = None, codec: str | None = None,
    ) -> Pytree | None:
        """Reduce ``value`` over all ranks; the result on ``root``, None elsewhere.

        Args and errors as :meth:`allreduce` (no robust op); ``root`` must be a rank.
        Cancellation: breaks the group.
        """
        self._check_root(root)
        if codec is not None:
            return await self._coded("reduce", value, op, root, strategy, timeout, None, codec)
        call, given, average = reduction_call("reduce", value, op, root, strategy, timeout)
        await self.session.run(call)
        if self.rank != root:
            return None
        return unflatten(call.treedef, as_given(given, finish(call, average, self.world_size)))

    async def reduce_scatter(
        self, array: np.ndarray, op: str | ReduceOp | CustomOp = "sum", *,
        strategy: str | None = None, timeout: float | None = None, codec: str | None = None,
    ) -> np.ndarray:
        """Reduce ``array`` over all ranks and give rank r part r of the result.

        The parts are ``numpy.array_split(result, world_size, axis=0)``. ``codec`` as for
        :meth:`allreduce`.

        Raises:
            ValueError: a 0-d array; otherwise as :meth:`allreduce`.
        Cancellation: breaks the group.
        """
        arr = tensors.as_array(array, bits=True)
        if arr.ndim == 0:
            raise ValueError("reduce_scatter needs an array with at least one dimension")
        if codec is not None:
            no_codec_for_bfloat16([array], codec)
            from ..codecs import reduce_coded
            parts = await reduce_coded(self, codec, [arr], plain_op(op),
                                       collective="reduce_scatter", strategy=strategy,
                                       timeout=timeout)
            assert parts is not None  # every rank gets its part
            return parts[0]
        call, _, average = reduction_call("reduce_scatter", array if tensors.is_tensor(array)
                                           else arr, op, None, strategy, timeout)
        work = call.leaves[0]
        call.rows = int(np.prod(work.shape[1:], dtype=np.int64))
        await self.session.run(call)
        part = np.array_split(work, self.world_size, axis=0)[self.rank].copy()
        if average:
            tensors.divide(part, self.world_size)
        return tensors.like(array, part)  # type: ignore[no-any-return]

    async def _coded(
        self, collective: str, value: Pytree, op: str | ReduceOp | CustomOp, root: int,
        strategy: str | None, timeout: float | None, out: Pytree | None, codec: str,
    ) -> Pytree:
        """An allreduce or reduce of ``value`` through ``codec`` (see :mod:`p2pcoll.codecs`)."""
        given, arrays, treedef = flatten_leaves(value)
        no_codec_for_bfloat16(given, codec)
        targets = out_leaves(out, treedef, arrays) if out is not None else None
        from ..codecs import reduce_coded
        results = await reduce_coded(self, codec, arrays, plain_op(op),
                                     collective="reduce" if collective == "reduce"
                                     else "allreduce", root=root, strategy=strategy,
                                     timeout=timeout, out=targets)
        if results is None:
            return None
        return out if out is not None else unflatten(treedef, as_given(given, results))

    # --- data movement ----------------------------------------------------------------

    async def broadcast(
        self, value: Pytree | None, root: int = 0, *,
        strategy: str | None = None, timeout: float | None = None,
    ) -> Pytree:
        """Give every rank the root's ``value``.

        Args:
            value: on the root, an ndarray or pytree. Elsewhere None, or a buffer of the same
                structure, which is filled in place when it is C-contiguous and writable.
            root: the rank whose value it is.
            strategy, timeout: as for :meth:`allreduce` (the board takes broadcasts of up
                to 64 KiB when no strategy is asked for).

        Returns:
            The root's value (on the root, ``value`` itself).

        Raises:
            ValueError, TypeError: ``root`` is not a rank, a dtype is not allowed.
            CollectiveMismatch: a buffer that does not match the root's value, or the root
                called another collective.
            CollectiveTimeout, PeerLost, GroupBroken.
        Cancellation: breaks the group.
        """
        self._check_root(root)
        if self.rank == root:
            _, leaves, treedef = flatten_leaves(value)
            send = [native(leaf) for leaf in leaves]
            call = Call("broadcast", send, treedef, None, root, strategy, timeout,
                        flat=[a.reshape(-1) for a in send])
            await self.session.run(call)
            return value
        call = Call("broadcast", [], None, None, root, strategy, timeout)
        given = learner(call, value, f"broadcast from root {root}", self.rank)
        await self.session.run(call)
        return unflatten(call.treedef, call.leaves if given is None
                         else as_given(given, call.leaves))

    async def allgather(
        self, array: np.ndarray, *, strategy: str | None = None, timeout: float | None = None,
    ) -> list[np.ndarray]:
        """Every rank's ``array``, in rank order, on every rank (same shape and dtype on all).

        Raises:
            TypeError: a dtype that is not allowed.
            CollectiveMismatch: ranks passed other shapes or dtypes.
            CollectiveTimeout, PeerLost, GroupBroken.
        Cancellation: breaks the group.
        """
        mine = native(array)
        parts = [mine if r == self.rank else np.empty_like(mine) for r in range(self.world_size)]
        call = Call("allgather", parts, None, None, None, strategy, timeout,
                    flat=[p.reshape(-1) for p in parts])
        if self._topology is not None:  # along the measured ring, if it pays
            from .topology import ordered
            ordered(self, self._topology, call)
        await self.session.run(call)
        parts[self.rank] = mine.copy()
        return [tensors.like(array, p) for p in parts]

    async def alltoall(
        self, parts: Sequence[np.ndarray], *, strategy: str | None = None,
        timeout: float | None = None, out: Sequence[np.ndarray] | None = None,
    ) -> list[np.ndarray]:
        """Send ``parts[j]`` to rank j; return the list received, ``[i]`` from rank i.
        Lengths (first axis) may differ per pair, zero included; one dtype and row shape.
        ``out=``: p buffers of the lengths expected. See :mod:`p2pcoll.api.alltoall`.

        Raises:
            TypeError, ValueError: bad ``parts`` or ``out`` (nothing sent).
            CollectiveMismatch: on every rank, naming the ranks, the group usable after: a
                rank passed other than world_size parts, dtypes or row shapes differ, or an
                ``out`` length disagrees with its sender's.
            CollectiveTimeout, PeerLost, GroupBroken.
        Cancellation: breaks the group.
        """
        return await _alltoall()(self, parts, out, strategy, timeout)

    async def gather(
        self, array: np.ndarray, root: int = 0, *,
        strategy: str | None = None, timeout: float | None = None,
    ) -> list[np.ndarray] | None:
        """Every rank's ``array`` in rank order on ``root``; None elsewhere.

        Raises as :meth:`allgather`, and ValueError for a ``root`` that is no rank.
        Cancellation: breaks the group.
        """
        self._check_root(root)
        mine = native(array)
        parts = [mine if r == self.rank else np.empty_like(mine) for r in range(self.world_size)]
        await self.session.run(Call("gather", parts, None, None, root, strategy, timeout,
                                    flat=[p.reshape(-1) for p in parts]))
        if self.rank != root:
            return None
        parts[self.rank] = mine.copy()
        return [tensors.like(array, p) for p in parts]

    async def scatter(
        self, parts: Sequence[np.ndarray] | None, root: int = 0, *,
        strategy: str | None = None, timeout: float | None = None,
    ) -> np.ndarray:
        """Rank r gets ``parts[r]`` of the root's list (shapes may differ; ignored elsewhere).

        Raises:
            ValueError: the root's ``parts`` is not a list of world_size arrays, or ``root``
                is no rank.
            CollectiveMismatch, CollectiveTimeout, PeerLost, GroupBroken.
        Cancellation: breaks the group.
        """
        self._check_root(root)
        p = self.world_size
        if self.rank == root:
            if parts is None or len(parts) != p:
                got = "None" if parts is None else f"{len(parts)} parts"
                raise ValueError(f"scatter root needs a list of {p} arrays, got {got}")
            send = [native(a) for a in parts]
            await self.session.run(Call("scatter", send, None, None, root, strategy, timeout,
                                        flat=[a.reshape(-1) for a in send]))
            return tensors.like(parts[self.rank], send[self.rank].copy())  # type: ignore[no-any-return]
        call = Call("scatter", [], None, None, root, strategy, timeout)
        learner(call, None, f"scatter from root {root}", self.rank)
        await self.session.run(call)
        return call.leaves[self.rank]

    async def barrier(self, *, strategy: str | None = None, timeout: float | None = None) -> None:
        """Return once every rank has entered the barrier.

        Raises:
            CollectiveTimeout, CollectiveMismatch, PeerLost, GroupBroken.
        Cancellation: breaks the group.
        """
        await self.session.run(Call("barrier", [], None, None, None, strategy, timeout))

    # --- the rest -----------------------------------------------------------------------

    def topology(self) -> dict[str, Any]:
        """The links measured at join and the ring chosen from them
        (:mod:`p2pcoll.api.topology`): ``{"ranks": [...], "rtt_s": matrix,
        "bandwidth_Bps": matrix, "ring": order, "measured_at": time}``. Matrices are
        ``[i][j]`` from rank i to rank j, None where not measured (everywhere, with
        ``P2PCOLL_PROBE=0``; ``measured_at`` is then None and the ring rank order)."""
        if self._topology is None:
            from .topology import Topology
            return Topology.unmeasured(self.world_size).as_dict()
        return self._topology.as_dict()

    async def _probe(self) -> None:
        """Measure the links if this group probes (every rank calls it after forming)."""
        from .topology import measure, price, wanted
        if wanted(self):
            self._topology = await measure(self)
            price(self, self._topology)

    def stats(self) -> dict[str, Any]:
        """Traffic since join: payload bytes and data messages sent and received, the part
        of ``bytes_sent`` that went through shared memory, and collectives started; messages
        dropped (malformed, from strangers, over the cap, ...), in all and, under
        ``messages_dropped_by_reason``, by reason (``{"stranger": 3, "malformed": 1}``: only
        reasons seen; the codes are listed in :mod:`p2pcoll.wire.validation`). Of the
        collectives: how many ran with each strategy (``collectives_by_strategy``:
        ``{"allreduce": {"ring": 3}}``), a histogram of their durations per collective
        (``collective_seconds``: ``{"allreduce": {"count", "sum", "buckets"}}``, buckets
        as ``[upper bound in seconds, cumulative count]``), and the errors they raised by
        type (``errors_by_type``); ``links_refused``: connections to this peer's mesh port
        that were no member's link (a stranger's, or an impostor's: a second connection
        claiming a member's rank, whose messages are dropped as ``impostor``; also a
        member's own link that reconnected after its connection dropped; 0 over inproc);
        ``links_opened``: links to peers this peer opened (the first time it sent to that
        peer, and again after closing it for the budget: see :mod:`p2pcoll.transport.route`);
        ``links_closed``: links it closed to stay within ``P2PCOLL_MAX_LINKS`` (so
        ``links_opened - links_closed`` are open); ``bytes_relayed``: bytes (on the wire,
        both ways) between this peer and relays, and ``peer_links``: for each other rank,
        ``"relayed"`` if what goes between the two passes a relay (either peer cannot be
        reached), else ``"direct"`` (two peers behind relays that connected directly,
        every connection between them: see docs/relay.md); ``direct_punched``: connections
        between this peer and another behind a relay that went direct, ``punch_failed``:
        those that tried and fell back to the relay; ``stripes_opened``:
        TCP connections opened beside links to spread large messages over (``P2PCOLL_STREAMS``, see
        :mod:`p2pcoll.transport.stripes`); ``socket_buffers_capped``: striped links whose
        send buffers ``net.core.wmem_max`` held below what their path needs, as measured (see
        :mod:`p2pcoll.transport.paths`). The eager window's figures (``eager_held_peak``,
        ``eager_outstanding``, ``eager_waits``, ``eager_reports``): :mod:`p2pcoll.engine.flow`.
        Counted from join, for this group only."""
        session = self.session
        c = session.transport.counters
        return {
            "bytes_sent": c.bytes_sent,
            "bytes_received": c.bytes_received,
            "messages_sent": c.messages_sent,
            "messages_received": c.messages_received,
            "messages_dropped": c.messages_dropped,
            "messages_dropped_by_reason": dict(c.dropped_by_reason),
            "bytes_sent_shm": c.bytes_sent_shm,
            "messages_sent_lane": c.messages_sent_lane,
            "links_refused": c.links_refused,
            "links_opened": c.links_opened,
            "links_closed": c.links_closed,
            "bytes_relayed": c.bytes_relayed,
            "peer_links": {r: "relayed" if r in c.relayed and r not in c.punched
                           else "direct" for r in range(session.membership.world_size)
                           if r != session.membership.rank},
            "direct_punched": c.direct_punched,
            "punch_failed": c.punch_failed,
            "stripes_opened": c.stripes_opened,
            "socket_buffers_capped": c.socket_buffers_capped,
            "collectives": session.seq,
            **session.matcher.flow_stats(),
            **self._activity.report(),
        }
    flight_record = _flight_record  # this rank's last calls (see p2pcoll.session.flight)

    async def close(self, reason: str = "", *, wait: bool = True) -> None:
        """Leave the group: tell the peers, then close every socket. Idempotent.

        It waits until every peer still there has read the goodbye, and so everything this
        peer sent before it (a millisecond when they are responsive; at most the heartbeat
        timeout for one that is busy), so a rank that returns from its last send and closes
        loses nothing in flight. A broken group closes at once.

        Closing while collectives of this group are in flight (a service told to stop,
        say) aborts them: here they raise :class:`GroupBroken`, and the peers'
        :class:`PeerLost` naming this rank and ``reason``, at once rather than at a
        deadline. ``wait=False`` (an abort) closes without waiting for the goodbye to be
        read: what this peer sent last may be lost.

        Cancellation: the sockets may stay open until the process exits.
        """
        await self._leave(reason, None, wait)

    async def _leave(self, reason: str, crash: BaseException | None, wait: bool = True
                     ) -> None:
        """:meth:`close`; ``crash``: the error that made this rank's program close it
        (``async with join(...)`` left by an exception), which the peers' PeerLost names."""
        if self._failures.state is GroupState.CLOSED and self._session is None:
            return
        session, self._session = self._session, None
        healthy = wait and self._failures.state in USABLE  # (degraded: a member has gone)
        if session is not None:
            session.leaving()  # the aborts of what it leaves running open no link either
        self._failures.leave(reason, crash, session.seq if session is not None else 0)
        self._failures.close()
        if session is not None:
            # Wait for the peers to read the goodbye (and so all before it), at most as
            # long as a silent peer takes to count as lost; a broken group's data in
            # flight is of no use to anyone, so it does not wait.
            await session.close(self.settings.heartbeat_timeout if healthy else 0.0)
            await session.transport.aclose()
        if self._server is not None:
            server, self._server = self._server, None
            await server.aclose()
        if self._sockets is not None:
            self._sockets.close()

    async def shrink(self, exclude: Sequence[int], *, timeout: float | None = None,
                     strategies: Mapping[str, str] | None = None, abort: bool = False
                     ) -> Group:
        """A new group of the ranks not in ``exclude`` (lost or alive), renumbered in the
        order of their ranks here; every one of them calls it, no rendezvous or store is
        used (:mod:`p2pcoll.session.shrink`). This group stays as it is (close it).

        ``strategies``: the new group's, by collective (default: this group's settings).
        Its collectives give the bits of a group formed fresh by the same peers. ``abort``:
        first end this group's calls in flight with GroupBroken (which breaks it).

        Raises:
            ValueError, TypeError: ``exclude`` is empty, repeats a rank, names one out of
                range or every rank, or holds no ints.
            RuntimeError: this rank is in ``exclude``.
            PeerLost: a survivor was lost meanwhile (on every survivor, within the heartbeat).
            CollectiveMismatch: the survivors exclude different ranks.
            CollectiveTimeout: not every survivor shrank within ``timeout`` (default: the
                group's collective timeout); it names them. GroupBroken: this is closed.
        Cancellation: nothing of the new group is left open.
        """
        settings = self.settings if strategies is None else replace(
            self.settings, strategies=dict(strategies))
        from ..session.shrink import shrink
        session, sockets = await shrink(self.session, exclude, settings, timeout, abort)
        # The rendezvous this peer hosts goes on with the survivors (newcomers register
        # there); closing this group would stop it.
        server, self._server = self._server, None
        group = Group(session, server=server, sockets=sockets)
        await group._probe()
        return group

    def __repr__(self) -> str:
        if self._session is None:
            return f"<Group {self.state}>"
        return f"<Group rank {self.rank}/{self.world_size} {self.endpoint} {self.state}>"


@functools.cache
def _alltoall() -> Callable[..., Awaitable[list[Any]]]:
    """:func:`.alltoall.alltoall`, imported on first use (most programs never call it)
    and kept: an import statement in the method would cost every call 2 us."""
    from .alltoall import alltoall
    return alltoall
