"""The group API: join a group, then run collectives on it.

Every collective is a coroutine that takes the next sequence number of the group *before its
first await*, so collectives started in the same order on every rank (one after the other,
or together with ``asyncio.gather``) are matched correctly even while several are in flight.

Failure model. A collective that fails part-way (timeout, mismatch, lost peer, cancellation)
leaves the peers in unknown states, so the rank that saw the failure tells the others (an
abort message, which makes them fail fast with the same error) and the group becomes
*broken*: every later call raises :class:`~p2pcoll.GroupBroken`. Close it and join anew.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import socket
from collections.abc import Awaitable, Callable, Generator, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np
import zmq

from . import env
from .errors import (
    REMOTE_ERRORS,
    CollectiveMismatch,
    CollectiveTimeout,
    GroupBroken,
    P2PCollError,
    PeerLost,
    PluginValidationError,
    ProtocolError,
    RendezvousError,
)
from .executor import Executor
from .layout import Layout
from .registry import registry
from .rendezvous import RendezvousServer, advertised_host, parse_url, rendezvous
from .strategy import COLLECTIVES, Context, Strategy
from .transport import Transport, get_transport, host_identity
from .transport.mailbox import Mailbox
from .transport.mesh import Mesh
from .types import (
    UFUNCS,
    Membership,
    Pytree,
    ReduceOp,
    TreeDef,
    as_op,
    check_dtype,
    check_op_dtype,
    flatten,
    unflatten,
)
from .wire import Header

log = logging.getLogger("p2pcoll")
T = TypeVar("T")


def _env_float(name: str, default: float) -> float:
    value = os.environ.get(name)
    return float(value) if value else default


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value else default


DEFAULT_JOIN_TIMEOUT = 60.0
DEFAULT_COLLECTIVE_TIMEOUT = 300.0
LINK_LOSS_GRACE = 0.3  # seconds between a link's disconnect and declaring its peer lost


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
    """A set of peers that run collectives together. Made by :func:`join`.

    Attributes:
        rank: this peer's rank, 0..world_size-1.
        world_size: the number of peers.
        membership: the roster this group was formed with (a frozen value).
        endpoint: the address this peer receives on.
    """

    def __init__(
        self,
        transport: Transport,
        host: str,
        *,
        strategies: Mapping[str, str] | None = None,
        collective_timeout: float | None = None,
    ) -> None:
        for coll, name in (strategies or {}).items():
            if coll not in COLLECTIVES:
                raise ValueError(f"strategies: unknown collective {coll!r}; one of {COLLECTIVES}")
            if name != "auto":
                registry.get(coll, name)  # raises UnknownStrategy early
        self._strategies = dict(strategies or {})
        self.timeout = collective_timeout or _env_float(
            "P2PCOLL_TIMEOUT", DEFAULT_COLLECTIVE_TIMEOUT
        )
        self._mailbox = Mailbox()
        self._mesh = Mesh(
            transport,
            host,
            max_message_bytes=_env_int("P2PCOLL_MAX_MESSAGE_BYTES", 256 << 20),
            on_message=self._on_message,
            on_link_down=self._on_link_down,
        )
        self._executor = Executor(
            self._mesh,
            self._mailbox,
            segment_bytes=_env_int("P2PCOLL_SEGMENT_BYTES", 1 << 20),
            depth=_env_int("P2PCOLL_PIPELINE_DEPTH", 4),
        )
        self._server: RendezvousServer | None = None
        self.membership = Membership("", 0, 0, 1, ())
        self._seq = 0
        self._active: set[int] = set()
        self._broken: P2PCollError | None = None
        self._closed = False
        self._hellos: set[int] = set()
        self._all_hello = asyncio.Event()
        self._left: set[int] = set()

    # --- forming the group ------------------------------------------------------------

    @property
    def rank(self) -> int:
        return self.membership.rank

    @property
    def world_size(self) -> int:
        return self.membership.size

    @property
    def endpoint(self) -> str:
        return self._mesh.endpoint

    async def _form(
        self, url: str | None, world_size: int | None, rank: int | None, timeout: float
    ) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        endpoints = await self._mesh.bind()
        if url is None:
            self.membership = Membership(os.urandom(8).hex(), 0, 0, 1, (endpoints[0],))
        else:
            host, port = parse_url(url)
            ip = (await loop.getaddrinfo(host, port, family=socket.AF_INET))[0][4][0]
            if rank in (None, 0):
                server = RendezvousServer(f"tcp://{ip}:{port}")
                try:
                    server.bind()
                    self._server = server
                except zmq.ZMQError:
                    pass  # another peer (or a standalone server) hosts it
            me = host_identity()
            transport = self._mesh.transport
            self.membership = await rendezvous(
                f"tcp://{ip}:{port}", endpoints=endpoints, world_size=world_size, rank=rank,
                timeout=timeout, host_id=me,
                choose=lambda host, addresses: transport.choose(me, host, addresses),
            )
        m = self.membership
        self._mesh.connect(m.group_id, m.rank, m.endpoints)
        if m.size == 1:
            return
        # Make sure every link works before the first collective: hello to all, wait for all.
        self._mesh.greet(Header("hello", m.group_id, m.rank))
        try:
            await asyncio.wait_for(self._all_hello.wait(), max(0.0, deadline - loop.time()))
        except TimeoutError:
            missing = sorted(set(range(m.size)) - self._hellos - {m.rank})
            raise RendezvousError(
                f"rank {m.rank} could not reach ranks {missing} of the group within {timeout:g}s "
                f"(endpoints {[m.endpoints[r] for r in missing]})"
            ) from None

    # --- incoming control traffic -----------------------------------------------------

    def _on_message(self, header: Header, frames: list[zmq.Frame]) -> None:
        kind = header.kind
        if not (0 <= header.src < self.world_size) or header.src == self.rank:
            raise ProtocolError(f"message from invalid source rank {header.src}")
        if kind == "data":
            if not self._mailbox.put(header, frames) and self._broken is None:
                # Every message of a collective is received before it finishes, so a
                # message for a finished collective means the ranks disagreed about it.
                err = CollectiveMismatch(
                    f"rank {header.src} sent a message for collective #{header.seq} "
                    f"({header.sig[:2]}) that rank {self.rank} did not expect"
                )
                self._fail(header.seq, err)
        elif kind == "abort":
            assert header.err is not None
            cls = REMOTE_ERRORS.get(header.err[0], P2PCollError)
            message = f"rank {header.src} failed collective #{header.seq}: {header.err[1]}"
            meta = header.meta or {}
            if cls is CollectiveTimeout:
                exc: P2PCollError = CollectiveTimeout(
                    message, collective=str(meta.get("collective", "")), seq=header.seq,
                    waiting_on=[r for r in meta.get("waiting_on", []) if isinstance(r, int)],
                )
            else:
                exc = cls(message)
            exc.remote = True  # type: ignore[attr-defined]
            if not self._mailbox.fail(header.seq, exc) and self._broken is None:
                self._broken = exc  # it had finished here: the next call must not go on
        elif kind == "hello":
            self._hellos.add(header.src)
            if len(self._hellos) == self.world_size - 1:
                self._all_hello.set()
        elif kind == "bye":
            self._left.add(header.src)
            self._peer_gone(PeerLost(f"rank {header.src} left the group", header.src))

    def _on_link_down(self, peer: int) -> None:
        if self._closed or peer in self._left:
            return

        def declare() -> None:
            if self._closed or peer in self._left:
                return
            log.warning("rank %d: lost the connection to rank %d", self.rank, peer)
            self._peer_gone(PeerLost(
                f"rank {self.rank} lost the connection to rank {peer} "
                f"({self.membership.endpoints[peer]}): it closed or stopped answering",
                peer,
            ))

        asyncio.get_running_loop().call_later(LINK_LOSS_GRACE, declare)

    def _peer_gone(self, exc: PeerLost) -> None:
        """Every receive from and send to ``exc.rank`` fails with ``exc`` from now on."""
        assert exc.rank is not None
        self._mailbox.fail_source(exc.rank, exc)
        self._mesh.mark_gone(exc.rank, exc)

    # --- running collectives ------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._closed:
            raise GroupBroken("the group is closed")
        if self._broken is not None:
            raise GroupBroken(
                f"the group is unusable after an earlier failure: {self._broken}"
            ) from self._broken

    def _choose(self, collective: str, requested: str | None, nbytes: int) -> Strategy:
        return registry.choose(
            collective, requested, self._strategies.get(collective), nbytes, self.world_size
        )

    def _start(self) -> int:
        self._check_usable()
        seq = self._seq
        self._seq += 1
        return seq

    async def _guard(
        self, seq: int, collective: str, timeout: float | None, body: Callable[[], Awaitable[T]]
    ) -> T:
        """Run one collective under its deadline and turn every failure into a broken group."""
        limit = self.timeout if timeout is None else timeout
        self._active.add(seq)
        try:
            async with asyncio.timeout(limit):
                result = await body()
            failure = self._mailbox.failure(seq)
            if failure is not None:
                raise failure
            stray = self._mailbox.leftover(seq)
            if stray:
                raise CollectiveMismatch(
                    f"{collective} #{seq}: ranks {stray} sent messages that rank {self.rank} "
                    f"did not expect; the ranks disagree about this collective"
                )
            return result
        except TimeoutError:
            waiting = self._mailbox.waiting_on(seq)
            err = CollectiveTimeout(
                f"{collective} #{seq} timed out after {limit:g}s on rank {self.rank}; "
                f"still waiting for ranks {waiting}",
                collective=collective, seq=seq, waiting_on=waiting,
            )
            self._fail(seq, err)
            raise err from None
        except P2PCollError as err:
            # A failure a peer reported for this collective is the root cause; a lost link
            # or a refused send that followed it is only a symptom.
            if isinstance(err, CollectiveTimeout) and getattr(err, "remote", False):
                # Another rank's deadline passed first: say whom this rank was waiting for
                # too, which is closer to the rank that never came.
                mine = self._mailbox.waiting_on(seq)
                err = CollectiveTimeout(
                    f"{err}; rank {self.rank} was still waiting for ranks {mine}",
                    collective=collective, seq=seq, waiting_on=mine or err.waiting_on,
                )
                err.remote = True  # type: ignore[attr-defined]
                self._fail(seq, err)
                raise err from None
            cause = self._mailbox.failure(seq)
            if isinstance(err, (PeerLost, GroupBroken)) and cause is not None and cause is not err:
                self._fail(seq, cause)
                raise cause from err
            self._fail(seq, err)
            raise
        except BaseException as exc:
            self._fail(seq, GroupBroken(f"{collective} #{seq} was interrupted: {exc!r}"))
            raise
        finally:
            self._active.discard(seq)
            self._mailbox.finish(seq)

    def _fail(self, seq: int, err: P2PCollError) -> None:
        if self._broken is None:
            self._broken = err
        if not getattr(err, "remote", False) and not self._closed:
            meta = None
            if isinstance(err, CollectiveTimeout):
                meta = {"collective": err.collective, "waiting_on": err.waiting_on}
            self._mesh.broadcast_control(
                Header("abort", self.membership.group_id, self.rank, seq,
                       err=[type(err).__name__, str(err)], meta=meta)
            )
        for other in self._active - {seq}:
            self._mailbox.fail(other, GroupBroken(f"collective #{seq} failed: {err}"))

    async def _execute(
        self, collective: str, strategy: Strategy, root: int, layout: Layout,
        ufunc: Callable[..., Any] | None, sig: list[Any], timeout: float | None,
        meta: dict[str, Any] | None = None,
    ) -> None:
        """Run one collective whose data this rank already knows, under the group's rules.

        The sequence number is taken before the first await, so collectives started in
        the same order on every rank match up even when several are in flight.
        """
        seq = self._start()

        async def body() -> None:
            await self._executor.run(seq=seq, strategy=strategy, ctx=self._ctx(root),
                                     layout=layout, ufunc=ufunc, sig=sig, meta=meta)

        await self._guard(seq, collective, timeout, body)

    def _sig(self, collective: str, strategy: Strategy, op: ReduceOp | None, root: int | None,
             data: str) -> list[Any]:
        return [collective, strategy.name, op.value if op else "", -1 if root is None else root,
                data]

    def _check_root(self, root: int) -> None:
        if not isinstance(root, int) or not 0 <= root < self.world_size:
            raise ValueError(f"root {root!r} is not a rank of this group of {self.world_size}")

    def _ctx(self, root: int = 0) -> Context:
        return Context(self.rank, self.world_size, root)

    # --- reductions -------------------------------------------------------------------

    async def _reduction(
        self, collective: str, value: Pytree, op: str | ReduceOp, root: int | None,
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
        layout = Layout.split(flat, strat.chunks(self.world_size))
        sig = self._sig(collective, strat, red, root, describe_data(work, treedef))
        await self._execute(collective, strat, root or 0, layout, UFUNCS[red], sig, timeout)
        if red is ReduceOp.AVG and (root is None or root == self.rank):
            for w in flat:
                np.divide(w, self.world_size, out=w)
        return work, treedef

    async def allreduce(
        self, value: Pytree, op: str | ReduceOp = "sum", *,
        strategy: str | None = None, timeout: float | None = None, out: Pytree | None = None,
    ) -> Pytree:
        """Reduce ``value`` over all ranks and return the result on every rank.

        Args:
            value: an ndarray (any shape, 0-d included) or a pytree of them.
            op: "sum", "prod", "min", "max" or "avg" (floating dtypes only).
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
        self, value: Pytree, root: int = 0, op: str | ReduceOp = "sum", *,
        strategy: str | None = None, timeout: float | None = None,
    ) -> Pytree | None:
        """Reduce ``value`` over all ranks; the result on ``root``, None elsewhere."""
        self._check_root(root)
        work, treedef = await self._reduction("reduce", value, op, root, strategy, timeout)
        return unflatten(treedef, work) if self.rank == root else None

    async def reduce_scatter(
        self, array: np.ndarray, op: str | ReduceOp = "sum", *,
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
        await self._execute("reduce_scatter", strat, 0, layout, UFUNCS[red], sig, timeout)
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
        seq = self._start()

        async def receive() -> Pytree:
            header = await self._mailbox.first(seq, root)
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
            await self._executor.run(seq=seq, strategy=strat, ctx=self._ctx(root),
                                     layout=layout, ufunc=None, sig=sig, meta=header.meta)
            return unflatten(treedef, out)

        return await self._guard(seq, "broadcast", timeout, receive)

    def _read_meta(
        self, header: Header, requested: str | None, collective: str
    ) -> tuple[TreeDef, list[tuple[str, list[int]]], Strategy]:
        meta = header.meta or {}
        name, specs = meta.get("strategy"), meta.get("leaves")
        if not isinstance(name, str) or not isinstance(specs, list):
            raise ProtocolError(f"{collective} message from rank {header.src} lacks its layout")
        for spec in specs:
            ok = (isinstance(spec, list) and len(spec) == 2 and isinstance(spec[0], str)
                  and isinstance(spec[1], list) and all(isinstance(n, int) and n >= 0
                                                        for n in spec[1]))
            if not ok:
                raise ProtocolError(f"{collective} message from rank {header.src}: bad layout")
            try:
                check_dtype(np.dtype(spec[0]))
            except TypeError as exc:
                raise ProtocolError(str(exc)) from None
        strat = registry.get(collective, requested if requested not in (None, "auto")
                             else name)
        return meta.get("tree"), specs, strat

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

        seq = self._start()

        async def receive() -> np.ndarray:
            header = await self._mailbox.first(seq, root)
            _, specs, strat = self._read_meta(header, strategy, "scatter")
            # Only this rank's part is ever written; np.empty of the rest touches no memory.
            out = [np.empty(s, d) for d, s in specs]
            layout = Layout.parts([a.reshape(-1) for a in out])
            sig = self._sig("scatter", strat, None, root, describe_data(out))
            await self._executor.run(seq=seq, strategy=strat, ctx=self._ctx(root),
                                     layout=layout, ufunc=None, sig=sig, meta=header.meta)
            return out[self.rank]

        return await self._guard(seq, "scatter", timeout, receive)

    async def barrier(self, *, strategy: str | None = None, timeout: float | None = None) -> None:
        """Return once every rank has entered the barrier."""
        strat = self._choose("barrier", strategy, 0)
        layout = Layout([], [[]])
        sig = self._sig("barrier", strat, None, None, "")
        await self._execute("barrier", strat, 0, layout, None, sig, timeout)

    # --- the rest -----------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """Traffic since join: payload bytes and data messages sent and received, messages
        dropped as malformed or stale, the part of ``bytes_sent`` that went through shared
        memory, and collectives started."""
        c = self._mesh.counters
        return {
            "bytes_sent": c.bytes_sent,
            "bytes_received": c.bytes_received,
            "messages_sent": c.messages_sent,
            "messages_received": c.messages_received,
            "messages_dropped": c.messages_dropped,
            "bytes_sent_shm": c.bytes_sent_shm,
            "collectives": self._seq,
        }

    async def close(self) -> None:
        """Leave the group: tell the peers, then close every socket. Idempotent."""
        if self._closed:
            return
        if self.membership.group_id:
            self._mesh.broadcast_control(Header("bye", self.membership.group_id, self.rank))
        self._closed = True
        self._mailbox.close(GroupBroken("the group was closed"))
        await self._mesh.aclose()
        if self._server is not None:
            await self._server.aclose()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "broken" if self._broken else "ok"
        return f"<Group rank {self.rank}/{self.world_size} {self.endpoint} {state}>"


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


async def _join(
    rendezvous_url: str | None, world_size: int | None, rank: int | None, timeout: float,
    strategies: Mapping[str, str] | None, collective_timeout: float | None,
    transport: str | None,
) -> Group:
    url = rendezvous_url or env.rendezvous_url()
    world_size = world_size if world_size is not None else env.world_size()
    rank = rank if rank is not None else env.rank()
    if world_size is not None and world_size < 1:
        raise RendezvousError(f"world_size must be at least 1, got {world_size}")
    if rank is not None and (rank < 0 or (world_size is not None and rank >= world_size)):
        raise RendezvousError(f"rank {rank} is out of range for world_size {world_size}")
    if url is None and (world_size or 1) > 1:
        raise RendezvousError(
            "no rendezvous address: pass rendezvous='tcp://HOST:PORT' or set "
            "P2PCOLL_RENDEZVOUS (or MASTER_ADDR and MASTER_PORT)"
        )
    if url is None:
        host = "127.0.0.1"
    else:
        host = os.environ.get("P2PCOLL_HOST") or await advertised_host(parse_url(url)[0])
    group = Group(get_transport(transport), host, strategies=strategies,
                  collective_timeout=collective_timeout)
    try:
        await group._form(url, world_size, rank, timeout)
    except BaseException:
        await group.close()
        raise
    return group


class _Join:
    """What :func:`join` returns: await it for a Group, or use it with ``async with``."""

    def __init__(self, coro_args: tuple[Any, ...]) -> None:
        self._args = coro_args
        self._group: Group | None = None

    def __await__(self) -> Generator[Any, None, Group]:
        return _join(*self._args).__await__()

    async def __aenter__(self) -> Group:
        self._group = await _join(*self._args)
        return self._group

    async def __aexit__(self, *exc: object) -> None:
        if self._group is not None:
            await self._group.close()


def join(
    rendezvous: str | None = None,
    *,
    world_size: int | None = None,
    rank: int | None = None,
    timeout: float = DEFAULT_JOIN_TIMEOUT,
    strategies: Mapping[str, str] | None = None,
    collective_timeout: float | None = None,
    transport: str | None = None,
) -> _Join:
    """Join a group of peers.

    ``g = await join(...)`` or ``async with join(...) as g:``.

    Args:
        rendezvous: ``"tcp://HOST:PORT"``; None reads ``$P2PCOLL_RENDEZVOUS``, else
            ``$MASTER_ADDR``/``$MASTER_PORT``. May be None when world_size is 1.
        world_size: number of peers; None reads ``$WORLD_SIZE``, ``$SLURM_NTASKS`` or
            ``$OMPI_COMM_WORLD_SIZE`` (some peer must give it).
        rank: this peer's rank; None reads ``$RANK``, ``$SLURM_PROCID`` or
            ``$OMPI_COMM_WORLD_RANK``, else the rendezvous assigns one in arrival order.
        timeout: seconds to wait for the whole group to form.
        strategies: per-group strategy choice, e.g. ``{"allreduce": "ring"}``.
        collective_timeout: default deadline of each collective (``$P2PCOLL_TIMEOUT``, 300 s).
        transport: "auto" (ipc to peers on this host, tcp to the others), "tcp", "ipc" or
            "inproc" (``$P2PCOLL_TRANSPORT``, default auto).

    Raises:
        RendezvousError: the group did not form in time (naming how many peers arrived and
            which ranks are missing), or this peer's rank/world size was rejected.
        UnknownStrategy: ``strategies`` names a strategy that is not installed.
    """
    return _Join((rendezvous, world_size, rank, timeout, strategies, collective_timeout,
                  transport))
