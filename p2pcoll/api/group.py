"""The group API: the collectives a formed group runs.

Every collective is a coroutine that takes the next sequence number of the group's session
*before its first await*, so collectives started in the same order on every rank (one after
the other, or together with ``asyncio.gather``) are matched correctly even while several
are in flight. Forming lives in :mod:`p2pcoll.session.forming`, the failure model and the
group's state in :mod:`p2pcoll.session.failure`, everything of one roster in
:class:`~p2pcoll.session.Session`; this module only turns calls into plans for the engine.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from ..engine.costs import DEFAULT_CONSTANTS, CostModel, load_constants
from ..engine.layout import Layout
from ..engine.p2p import RECV, SEND
from ..errors import (
    CollectiveMismatch,
    CollectiveTimeout,
    GroupBroken,
    P2PCollError,
    PluginValidationError,
    ProtocolError,
)
from ..registry import registry
from ..rendezvous import RendezvousServer
from ..session.failure import USABLE, FailureModel, GroupState
from ..session.forming import form
from ..session.session import Session
from ..settings import Settings, check_seconds
from ..strategy import Context, Strategy
from ..transport.sockets import SocketFactory
from ..types import (
    CustomOp,
    Membership,
    Pytree,
    ReduceOp,
    TreeDef,
    as_op,
    check_dtype,
    check_op_dtype,
    flatten,
    fold_of,
    unflatten,
)
from ..wire import MAX_TAG, Header, Signature
from .activity import Activity

T = TypeVar("T")


def describe_data(arrays: Sequence[np.ndarray], treedef: TreeDef = None) -> str:
    """A short string that equals on two ranks iff their data has the same layout."""
    text = f"{treedef}|" + ",".join(f"{a.dtype.str}{tuple(a.shape)}" for a in arrays)
    if len(text) > 200:
        digest = hashlib.blake2b(text.encode(), digest_size=8).hexdigest()
        return f"{len(arrays)} arrays, layout digest {digest}"
    return text


def _native(a: Any) -> np.ndarray:
    """Validate a leaf and return it C-contiguous in native byte order (no copy if it is)."""
    arr = a if isinstance(a, np.ndarray) else np.asarray(a)
    dtype = check_dtype(arr.dtype)
    # ascontiguousarray turns 0-d arrays into 1-d ones; keep the caller's shape.
    return np.ascontiguousarray(arr, dtype=dtype).reshape(arr.shape)


class Group:
    """A set of peers that run collectives together. Made by :func:`p2pcoll.join`.

    Attributes:
        settings: what this group runs with (a frozen, validated value).
        state: :class:`GroupState`: ``forming``, ``ready``, ``degraded`` (a member has left
            or been lost, noticed between collectives too), ``broken`` (see ``cause``) or
            ``closed``. A health check may read it at any time.
        cause: the failure that broke the group, or None.
    """

    def __init__(self, settings: Settings, sockets: SocketFactory | None = None) -> None:
        for coll, name in settings.strategies.items():
            if name != "auto":
                registry.get(coll, name)  # raises UnknownStrategy early
        self.settings = settings
        self._sockets = sockets or SocketFactory.for_settings(settings)
        self._failures = FailureModel()
        self._session: Session | None = None
        self._server: RendezvousServer | None = None
        self._extensions: dict[str, Any] = {}
        self._activity = Activity()
        # "auto"'s constants: checked now, before any socket (a bad file is a SettingsError).
        self._constants = (load_constants(settings.cost_model) if settings.cost_model
                           else DEFAULT_CONSTANTS)
        self._cost_model: CostModel | None = None

    async def _form(self, store: Any = None) -> None:
        """Form the group (through torch's ``store``, for the torch.distributed backend)."""
        try:
            self._session, self._server = await form(self.settings, self._failures,
                                                     self._sockets, store=store)
        except BaseException:
            self._failures.close()
            raise

    def _adopt(self, session: Session) -> None:
        """Run on an already formed session (p2pcoll.testing's in-memory groups)."""
        self._session = session

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

    # --- running collectives ------------------------------------------------------------

    def _choose(self, collective: str, requested: str | None, nbytes: int) -> Strategy:
        return registry.choose(
            collective, requested, self.settings.strategies.get(collective), nbytes,
            self.world_size, self._costs(),
        )

    def _costs(self) -> CostModel:
        """auto's cost model (:meth:`CostModel.for_group`: the one ``p2pcoll simulate`` uses)."""
        if self._cost_model is None:
            self._cost_model = CostModel.for_group(
                self.settings, self.membership.endpoints, self.rank, self._constants)
        return self._cost_model

    def _limit(self, timeout: float | None) -> float:
        return self.timeout if timeout is None else check_seconds(timeout, "timeout=")

    async def _execute(
        self, collective: str, strategy: Strategy, root: int, layout: Layout,
        ufunc: Callable[..., Any] | None, sig: Signature, timeout: float | None,
        meta: dict[str, Any] | None = None,
    ) -> None:
        """Run one collective whose data this rank already knows, under the group's rules.

        The sequence number is taken before the first await, so collectives started in
        the same order on every rank match up even when several are in flight.
        """
        session = self.session
        limit = self._limit(timeout)
        seq = session.next_seq()
        started, error = time.perf_counter(), None
        try:
            async with self._failures.collective(seq, collective, limit):
                await session.executor.run(seq=seq, strategy=strategy, ctx=self._ctx(root),
                                           layout=layout, ufunc=ufunc, sig=sig, meta=meta)
        except P2PCollError as exc:
            error = exc
            raise
        finally:
            self._activity.record(collective, strategy.name, time.perf_counter() - started,
                                  error)

    def _sig(self, collective: str, strategy: Strategy, op: ReduceOp | CustomOp | None,
             root: int | None, data: str) -> Signature:
        return Signature.of(collective, strategy.name, op.value if op else "",
                            -1 if root is None else root, data)

    def _check_root(self, root: int) -> None:
        if not isinstance(root, int) or isinstance(root, bool) or not 0 <= root < self.world_size:
            raise ValueError(f"root {root!r} is not a rank of this group of {self.world_size}")

    def _ctx(self, root: int = 0) -> Context:
        return Context(self.rank, self.world_size, root)

    # --- reductions -------------------------------------------------------------------

    async def _reduction(
        self, collective: str, value: Pytree, op: str | ReduceOp | CustomOp, root: int | None,
        strategy: str | None, timeout: float | None, out: Pytree | None = None,
    ) -> tuple[list[np.ndarray], TreeDef]:
        red = as_op(op)
        leaves, treedef = flatten(value)
        targets = _out_leaves(out, treedef, leaves) if out is not None else None
        work = []
        for i, leaf in enumerate(leaves):
            arr = leaf if isinstance(leaf, np.ndarray) else np.asarray(leaf)
            dtype = check_dtype(arr.dtype)
            check_op_dtype(red, dtype)
            if targets is None:
                work.append(np.array(arr, dtype=dtype, order="C", copy=True))
            else:
                if targets[i] is not arr:
                    np.copyto(targets[i], arr)
                work.append(targets[i])
        flat = [w.reshape(-1) for w in work]
        nbytes = sum(w.nbytes for w in work)
        strat = self._choose(collective, strategy, nbytes)
        itemsize = flat[0].itemsize if flat else 1
        nchunks = strat.chunks(self.world_size)
        cuts = strat.cuts(self.world_size, sum(w.size for w in flat), itemsize)
        if cuts is not None and len(cuts) != nchunks + 1:
            raise PluginValidationError(
                f"{collective} strategy {strat.name!r} gave {len(cuts)} cuts for "
                f"{nchunks} chunks (chunks + 1 offsets are needed)")
        layout = (Layout.split(flat, nchunks) if cuts is None else Layout.cut(flat, cuts))
        sig = self._sig(collective, strat, red, root, describe_data(work, treedef))
        await self._execute(collective, strat, root or 0, layout, fold_of(red), sig, timeout)
        if red is ReduceOp.AVG and (root is None or root == self.rank):
            for w in flat:
                np.divide(w, self.world_size, out=w)
        return work, treedef

    async def allreduce(
        self, value: Pytree, op: str | ReduceOp | CustomOp = "sum", *,
        strategy: str | None = None, timeout: float | None = None, out: Pytree | None = None,
    ) -> Pytree:
        """Reduce ``value`` over all ranks and return the result on every rank.

        Args:
            value: an ndarray (any shape, 0-d included) or a pytree of them.
            op: "sum", "prod", "min", "max" or "avg" (floating dtypes only), or a
                :class:`~p2pcoll.CustomOp` of the caller's own.
            strategy: a strategy name (``p2pcoll.available_strategies()["allreduce"]``);
                None means the group's choice, ``$P2PCOLL_ALLREDUCE``, or "auto".
            timeout: seconds for the whole collective (default: the group's).
            out: where to put the result: arrays of the same structure, shapes and dtypes,
                C-contiguous and writable; ``out=value`` reduces in place. Reusing ``out``
                across calls saves allocating (and page-faulting) a result every time.

        Returns:
            ``out`` if given, else new arrays of the same structure; ``value`` is not
            modified unless it is ``out``. Every rank gets the same bits.

        Raises:
            CollectiveTimeout, CollectiveMismatch, PeerLost, GroupBroken.
        Cancellation: breaks the group (the other ranks get an abort).

        Example::

            total = await g.allreduce(np.array([g.rank]))   # every rank -> [0 + 1 + ... ]
        """
        work, treedef = await self._reduction("allreduce", value, op, None, strategy, timeout,
                                              out)
        return out if out is not None else unflatten(treedef, work)

    async def reduce(
        self, value: Pytree, root: int = 0, op: str | ReduceOp | CustomOp = "sum", *,
        strategy: str | None = None, timeout: float | None = None,
    ) -> Pytree | None:
        """Reduce ``value`` over all ranks; the result on ``root``, None elsewhere."""
        self._check_root(root)
        work, treedef = await self._reduction("reduce", value, op, root, strategy, timeout)
        return unflatten(treedef, work) if self.rank == root else None

    async def reduce_scatter(
        self, array: np.ndarray, op: str | ReduceOp | CustomOp = "sum", *,
        strategy: str | None = None, timeout: float | None = None,
    ) -> np.ndarray:
        """Reduce ``array`` over all ranks and give rank r part r of the result.

        The parts are ``numpy.array_split(result, world_size, axis=0)``.
        """
        red = as_op(op)
        arr = np.asarray(array)
        if arr.ndim == 0:
            raise ValueError("reduce_scatter needs an array with at least one dimension")
        dtype = check_dtype(arr.dtype)
        check_op_dtype(red, dtype)
        work = np.array(arr, dtype=dtype, order="C", copy=True)
        p = self.world_size
        strat = self._choose("reduce_scatter", strategy, work.nbytes)
        if strat.chunks(p) != p:
            raise PluginValidationError(
                f"reduce_scatter strategy {strat.name!r} must cut the data into {p} chunks"
            )
        row = int(np.prod(work.shape[1:], dtype=np.int64))
        layout = Layout.split([work.reshape(-1)], p, row_sizes=[row])
        sig = self._sig("reduce_scatter", strat, red, None, describe_data([work]))
        await self._execute("reduce_scatter", strat, 0, layout, fold_of(red), sig, timeout)
        part = np.array_split(work, p, axis=0)[self.rank].copy()
        if red is ReduceOp.AVG:
            np.divide(part, p, out=part)
        return part

    # --- data movement ----------------------------------------------------------------

    async def broadcast(
        self, value: Pytree | None, root: int = 0, *,
        strategy: str | None = None, timeout: float | None = None,
    ) -> Pytree:
        """Give every rank the root's ``value``.

        Args:
            value: on the root, an ndarray or pytree. Elsewhere None, or a buffer of the same
                structure, which is filled in place when it is C-contiguous and writable.

        Returns:
            The root's value (on the root, ``value`` itself).
        """
        self._check_root(root)
        if self.rank == root:
            leaves, treedef = flatten(value)
            send = [_native(leaf) for leaf in leaves]
            strat = self._choose("broadcast", strategy, sum(a.nbytes for a in send))
            meta = {"strategy": strat.name, "tree": treedef,
                    "leaves": [[a.dtype.str, list(a.shape)] for a in send]}
            layout = Layout.split([a.reshape(-1) for a in send], strat.chunks(self.world_size))
            sig = self._sig("broadcast", strat, None, root, describe_data(send, treedef))
            await self._execute("broadcast", strat, root, layout, None, sig, timeout, meta=meta)
            return value

        mine = flatten(value) if value is not None else None
        session = self.session
        limit = self._limit(timeout)
        seq = session.next_seq()

        async with self._failures.collective(seq, "broadcast", limit):
            header = await session.matcher.first(seq, root)
            treedef, specs, strat = self._read_meta(header, strategy, "broadcast")
            shapes = [(np.dtype(d), tuple(s)) for d, s in specs]
            if mine is not None:
                have = [(leaf.dtype, leaf.shape) for leaf in mine[0]]
                if mine[1] != treedef or have != shapes:
                    raise CollectiveMismatch(
                        f"broadcast #{seq}: root {root} sends {describe_data_specs(shapes)}, "
                        f"rank {self.rank} passed a buffer of {describe_data_specs(have)}"
                    )
                out = [
                    leaf if isinstance(leaf, np.ndarray) and leaf.flags.c_contiguous
                    and leaf.flags.writeable and leaf.dtype.isnative else np.empty(s, d)
                    for leaf, (d, s) in zip(mine[0], shapes, strict=True)
                ]
            else:
                out = [np.empty(s, d) for d, s in shapes]
            layout = Layout.split([a.reshape(-1) for a in out], strat.chunks(self.world_size))
            sig = self._sig("broadcast", strat, None, root, describe_data(out, treedef))
            # Forward the layout too: in a tree, this rank may be someone's first sender.
            await session.executor.run(seq=seq, strategy=strat, ctx=self._ctx(root),
                                       layout=layout, ufunc=None, sig=sig, meta=header.meta)
        return unflatten(treedef, out)

    def _read_meta(
        self, header: Header, requested: str | None, collective: str
    ) -> tuple[TreeDef, list[tuple[str, list[int]]], Strategy]:
        """The root's layout; :func:`p2pcoll.wire.validate` has checked its schema (a data
        meta always names the strategy and the leaves)."""
        meta = header.meta
        if meta is None:
            raise ProtocolError(f"{collective} message from rank {header.src} lacks its layout")
        strat = registry.get(collective, requested if requested not in (None, "auto")
                             else meta["strategy"])
        return meta.get("tree"), meta["leaves"], strat

    async def allgather(
        self, array: np.ndarray, *, strategy: str | None = None, timeout: float | None = None,
    ) -> list[np.ndarray]:
        """Every rank's ``array``, in rank order, on every rank (same shape and dtype on all)."""
        mine = _native(array)
        parts = [mine if r == self.rank else np.empty_like(mine) for r in range(self.world_size)]
        strat = self._choose("allgather", strategy, mine.nbytes * self.world_size)
        layout = Layout.parts([p.reshape(-1) for p in parts])
        sig = self._sig("allgather", strat, None, None, describe_data([mine]))
        await self._execute("allgather", strat, 0, layout, None, sig, timeout)
        parts[self.rank] = mine.copy()
        return parts

    async def gather(
        self, array: np.ndarray, root: int = 0, *,
        strategy: str | None = None, timeout: float | None = None,
    ) -> list[np.ndarray] | None:
        """Every rank's ``array`` in rank order on ``root``; None elsewhere."""
        self._check_root(root)
        mine = _native(array)
        parts = [mine if r == self.rank else np.empty_like(mine) for r in range(self.world_size)]
        strat = self._choose("gather", strategy, mine.nbytes * self.world_size)
        layout = Layout.parts([p.reshape(-1) for p in parts])
        sig = self._sig("gather", strat, None, root, describe_data([mine]))
        await self._execute("gather", strat, root, layout, None, sig, timeout)
        if self.rank != root:
            return None
        parts[self.rank] = mine.copy()
        return parts

    async def scatter(
        self, parts: Sequence[np.ndarray] | None, root: int = 0, *,
        strategy: str | None = None, timeout: float | None = None,
    ) -> np.ndarray:
        """Rank r gets ``parts[r]`` of the root's list (shapes may differ; ignored elsewhere)."""
        self._check_root(root)
        p = self.world_size
        if self.rank == root:
            if parts is None or len(parts) != p:
                got = "None" if parts is None else f"{len(parts)} parts"
                raise ValueError(f"scatter root needs a list of {p} arrays, got {got}")
            send = [_native(a) for a in parts]
            strat = self._choose("scatter", strategy, sum(a.nbytes for a in send))
            meta = {"strategy": strat.name, "leaves": [[a.dtype.str, list(a.shape)] for a in send]}
            layout = Layout.parts([a.reshape(-1) for a in send])
            sig = self._sig("scatter", strat, None, root, describe_data(send))
            await self._execute("scatter", strat, root, layout, None, sig, timeout, meta=meta)
            return send[self.rank].copy()

        session = self.session
        limit = self._limit(timeout)
        seq = session.next_seq()

        async with self._failures.collective(seq, "scatter", limit):
            header = await session.matcher.first(seq, root)
            _, specs, strat = self._read_meta(header, strategy, "scatter")
            # Only this rank's part is ever written; np.empty of the rest touches no memory.
            out = [np.empty(s, d) for d, s in specs]
            layout = Layout.parts([a.reshape(-1) for a in out])
            sig = self._sig("scatter", strat, None, root, describe_data(out))
            await session.executor.run(seq=seq, strategy=strat, ctx=self._ctx(root),
                                       layout=layout, ufunc=None, sig=sig, meta=header.meta)
        return out[self.rank]

    async def barrier(self, *, strategy: str | None = None, timeout: float | None = None) -> None:
        """Return once every rank has entered the barrier."""
        strat = self._choose("barrier", strategy, 0)
        layout = Layout([], [[]])
        sig = self._sig("barrier", strat, None, None, "")
        await self._execute("barrier", strat, 0, layout, None, sig, timeout)

    # --- point to point ----------------------------------------------------------------

    def _check_transfer(self, peer: int, what: str, tag: int) -> None:
        if not isinstance(peer, int) or isinstance(peer, bool) or not (
                0 <= peer < self.world_size) or peer == self.rank:
            raise ValueError(f"{what} {peer!r} is not another rank of this group of "
                             f"{self.world_size} (this is rank {self.rank})")
        if not isinstance(tag, int) or isinstance(tag, bool) or not 0 <= tag <= MAX_TAG:
            raise ValueError(f"tag {tag!r} is not an integer from 0 to {MAX_TAG}")

    async def send(
        self, value: Pytree, dst: int, *, tag: int = 0, timeout: float | None = None,
    ) -> None:
        """Send ``value`` to rank ``dst``, whose ``recv(src=<this rank>, tag=tag)`` gets it.

        Only the two ranks take part. Messages from one rank to another with the same tag
        are received in the order they were sent; other tags are independent of them. It
        returns once the data is handed to the transport (``value`` may then be changed);
        it does not wait for the receive to be posted: the message waits at the receiver.

        Args:
            value: an ndarray (any shape) or a pytree of them.
            dst: the receiving rank, not this one.
            tag: an integer from 0 to 2**32 - 1 that keeps independent streams apart.
            timeout: seconds for the whole send (default: the group's).

        Raises:
            ValueError, TypeError: ``dst`` or ``tag`` is out of range, or a dtype is not
                allowed (raised before anything is sent; the group stays usable).
            PeerLost: ``dst`` has gone.
            CollectiveTimeout: the data could not be handed over in time.
            GroupBroken: an earlier failure.
        Cancellation: breaks the group (the ranks' counts of messages would disagree).

        Example::

            if g.rank == 0:
                await g.send(np.arange(3), dst=1, tag=7)    # rank 0 -> rank 1
            elif g.rank == 1:
                x = await g.recv(src=0, tag=7)              # rank 1: array([0, 1, 2])
        """
        self._check_transfer(dst, "dst", tag)
        leaves, treedef = flatten(value)
        data = [_native(leaf) for leaf in leaves]
        meta = {"strategy": SEND.name, "tree": treedef,
                "leaves": [[a.dtype.str, list(a.shape)] for a in data]}
        layout = Layout.split([a.reshape(-1) for a in data], 1)
        sig = Signature.of("p2p", "", "", -1, describe_data(data, treedef))
        session = self.session
        limit = self._limit(timeout)
        op = session.next_transfer(self.rank, dst, tag)
        async with self._failures.collective(op, "send", limit):
            await session.executor.run(
                seq=op[3], strategy=SEND, ctx=self._ctx(dst), layout=layout, ufunc=None,
                sig=sig, meta=meta, tag=tag,
            )

    async def recv(
        self, src: int, *, tag: int = 0, out: Pytree | None = None,
        timeout: float | None = None,
    ) -> Pytree:
        """Receive the next value rank ``src`` sends this rank with ``tag`` (see :meth:`send`).

        Args:
            src: the sending rank, not this one.
            tag: the sender's tag.
            out: where to put it: arrays of the structure, shapes and dtypes the sender
                sends, C-contiguous and writable. None: new arrays.
            timeout: seconds to wait for it (default: the group's).

        Returns:
            ``out`` if given, else the sender's value as new arrays.

        Raises:
            ValueError: ``src`` or ``tag`` is out of range, or ``out`` is not writable
                C-contiguous arrays (the group stays usable).
            CollectiveMismatch: ``out`` does not have the structure, shapes or dtypes sent.
            CollectiveTimeout: nothing came in time (``waiting_on`` is ``[src]``).
            PeerLost: ``src`` has gone without sending it.
            GroupBroken: an earlier failure.
        Cancellation: breaks the group (a message that comes later would be taken by the
        next receive).
        """
        self._check_transfer(src, "src", tag)
        mine = flatten(out) if out is not None else None
        if mine is not None and not all(
                isinstance(a, np.ndarray) and a.flags.c_contiguous and a.flags.writeable
                and a.dtype.isnative for a in mine[0]):
            raise ValueError("out= arrays must be C-contiguous, writable and in native "
                             "byte order")
        session = self.session
        limit = self._limit(timeout)
        op = session.next_transfer(src, self.rank, tag)
        async with self._failures.collective(op, "recv", limit):
            header = await session.matcher.first(op, src)
            if header.meta is None:
                raise ProtocolError(f"message from rank {src} with tag {tag} lacks its layout")
            treedef = header.meta.get("tree")
            shapes = [(np.dtype(d), tuple(s)) for d, s in header.meta["leaves"]]
            if mine is not None:
                have = [(leaf.dtype, leaf.shape) for leaf in mine[0]]
                if mine[1] != treedef or have != shapes:
                    raise CollectiveMismatch(
                        f"recv #{op[3]} from rank {src} with tag {tag}: rank {src} sends "
                        f"{describe_data_specs(shapes)}, rank {self.rank} passed out= "
                        f"{describe_data_specs(have)}"
                    )
                data = list(mine[0])
            else:
                data = [np.empty(s, d) for d, s in shapes]
            layout = Layout.split([a.reshape(-1) for a in data], 1)
            sig = Signature.of("p2p", "", "", -1, describe_data(data, treedef))
            await session.executor.run(
                seq=op[3], strategy=RECV, ctx=self._ctx(src), layout=layout, ufunc=None,
                sig=sig, tag=tag,
            )
        return out if out is not None else unflatten(treedef, data)

    async def recv_any(
        self, *, tag: int = 0, out: Pytree | None = None, timeout: float | None = None,
    ) -> tuple[int, Pytree]:
        """Receive the next value any other rank sends this rank with ``tag``: MPI's
        ``MPI_ANY_SOURCE``, torch's ``recv(src=None)``.

        Each sender's messages still arrive in the order it sent them; which sender's comes
        first when several have is up to the transport (here: the lowest rank whose
        message has come).

        Args:
            tag: the sender's tag.
            out: as for :meth:`recv`.
            timeout: seconds to wait for it (default: the group's).

        Returns:
            ``(src, value)``: the sending rank, and ``out`` if given, else the value as new
            arrays.

        Raises:
            ValueError: ``tag`` is out of range, or this rank is alone in the group.
            CollectiveMismatch: ``out`` does not have the structure, shapes or dtypes sent.
            CollectiveTimeout: nothing came in time (``waiting_on`` names every other rank);
                nothing was taken, so the group stays usable and a message that comes later
                is there for the next receive.
            PeerLost: every other rank has gone without sending.
            GroupBroken: an earlier failure.
        Cancellation: consumes nothing while no message has been chosen; once one has, as
        for :meth:`recv`.
        """
        others = [r for r in range(self.world_size) if r != self.rank]
        if not others:
            raise ValueError("recv_any() in a group of one: no other rank can send")
        self._check_transfer(others[0], "src", tag)
        session = self.session
        session.failures.check_usable()
        limit = self._limit(timeout)
        started = time.monotonic()
        candidates = {r: (r, self.rank, tag, session.transfers[(r, self.rank, tag)])
                      for r in others}
        try:
            async with asyncio.timeout(limit):
                src = await session.matcher.first_of_any(candidates)
        except TimeoutError:
            raise CollectiveTimeout(
                f"recv_any with tag {tag}: nothing came from any rank in {limit:g}s",
                collective="recv", waiting_on=others) from None
        # No await between the choice and recv() taking that transfer's number.
        left = max(limit - (time.monotonic() - started), 1e-3)
        return src, await self.recv(src, tag=tag, out=out, timeout=left)

    # --- the rest -----------------------------------------------------------------------

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
        member's own link that reconnected after its connection dropped; 0 over inproc).
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
            "collectives": session.seq,
            **self._activity.report(),
        }

    async def close(self, reason: str = "") -> None:
        """Leave the group: tell the peers, then close every socket. Idempotent.

        It waits until every peer still there has read the goodbye, and so everything this
        peer sent before it (a millisecond when they are responsive; at most the heartbeat
        timeout for one that is busy), so a rank that returns from its last send and closes
        loses nothing in flight. A broken group closes at once.

        Closing while collectives of this group are in flight (a service told to stop,
        say) aborts them: here they raise :class:`GroupBroken`, and the peers'
        :class:`PeerLost` naming this rank and ``reason``, at once rather than at a
        deadline.

        Cancellation: the sockets may stay open until the process exits.
        """
        if self._failures.state is GroupState.CLOSED and self._session is None:
            return
        session, self._session = self._session, None
        healthy = self._failures.state in USABLE  # ready, or degraded: a member has gone
        self._failures.leave(reason)
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
        self._sockets.close()

    def __repr__(self) -> str:
        if self._session is None:
            return f"<Group {self.state}>"
        return f"<Group rank {self.rank}/{self.world_size} {self.endpoint} {self.state}>"


def _out_leaves(out: Pytree, treedef: TreeDef, leaves: list[np.ndarray]) -> list[np.ndarray]:
    """Validate an ``out=`` argument against the input and return its leaves."""
    targets, out_def = flatten(out)
    if out_def != treedef:
        raise ValueError("out= must have the same pytree structure as the input")
    for target, leaf in zip(targets, leaves, strict=True):
        want = (np.asarray(leaf).shape, check_dtype(np.asarray(leaf).dtype))
        if (target.shape, target.dtype) != want:
            raise ValueError(
                f"out= array {target.dtype}{list(target.shape)} does not match the input "
                f"{want[1]}{list(want[0])}"
            )
        if not (target.flags.c_contiguous and target.flags.writeable):
            raise ValueError("out= arrays must be C-contiguous and writable")
    return targets


def describe_data_specs(specs: Sequence[tuple[np.dtype[Any], tuple[int, ...]]]) -> str:
    return ", ".join(f"{d}{list(s)}" for d, s in specs) or "nothing"
