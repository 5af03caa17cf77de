"""Point-to-point transfers of a group: :meth:`send`, :meth:`recv` and :meth:`recv_any`.

Only the two ranks of a transfer take part; transfers are matched per (source, destination,
tag) channel in the order they were sent (:meth:`p2pcoll.types.OpKey.transfer`), apart from
the collectives' sequence. :class:`~p2pcoll.api.group.Group` inherits these methods.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Protocol

from ..errors import CollectiveTimeout
from ..pytree import unflatten
from ..session.calls import Call
from ..settings import check_seconds
from ..types import OpKey, Pytree
from ..wire import MAX_TAG
from .arguments import flatten_leaves, learner, native

if TYPE_CHECKING:
    from ..session.session import Session


class _Group(Protocol):
    """What these methods read of the group they belong to."""

    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def timeout(self) -> float: ...
    @property
    def session(self) -> Session: ...
    def _check_transfer(self, peer: int, what: str, tag: int) -> None: ...
    async def recv(self, src: int, *, tag: int = 0, out: Pytree | None = None,
                   timeout: float | None = None) -> Pytree: ...


class PointToPoint:
    """Transfers between two ranks of a group (a mixin of :class:`~p2pcoll.Group`)."""

    def _check_transfer(self: _Group, peer: int, what: str, tag: int) -> None:
        if not isinstance(peer, int) or isinstance(peer, bool) or not (
                0 <= peer < self.world_size) or peer == self.rank:
            raise ValueError(f"{what} {peer!r} is not another rank of this group of "
                             f"{self.world_size} (this is rank {self.rank})")
        if not isinstance(tag, int) or isinstance(tag, bool) or not 0 <= tag <= MAX_TAG:
            raise ValueError(f"tag {tag!r} is not an integer from 0 to {MAX_TAG}")

    async def send(
        self: _Group, value: Pytree, dst: int, *, tag: int = 0, timeout: float | None = None,
    ) -> None:
        """Send ``value`` to rank ``dst``, whose ``recv(src=<this rank>, tag=tag)`` gets it.

        Only the two ranks take part. Messages from one rank to another with the same tag
        are received in the order they were sent; other tags are independent of them. It
        returns once the data is handed to the transport (``value`` may then be changed);
        it does not wait for the receive to be posted: the message waits at the receiver.
        As MPI's standard-mode send, it may wait until ``dst`` has received enough of what
        this rank sent it before (in earlier sends, any tag): at most the eager window
        (``P2PCOLL_EAGER_WINDOW``, 64 MiB; :mod:`p2pcoll.engine.credit`) waits unreceived.
        So two ranks that each send the other more than that before either receives wait
        until their deadline: post the receives first, or concurrently.

        Args:
            value: an ndarray (any shape) or a pytree of them.
            dst: the receiving rank, not this one.
            tag: an integer from 0 to 2**32 - 1 that keeps independent streams apart.
            timeout: seconds for the whole send (default: the group's).

        Raises:
            ValueError, TypeError: ``dst`` or ``tag`` is out of range, or a dtype is not
                allowed (raised before anything is sent; the group stays usable).
            PeerLost: ``dst`` has gone.
            CollectiveTimeout: the data could not be handed over in time (or ``dst``
                did not receive enough of this rank's earlier sends in time).
            GroupBroken: an earlier failure.
        Cancellation: breaks the group (the ranks' counts of messages would disagree).

        Example::

            if g.rank == 0:
                await g.send(np.arange(3), dst=1, tag=7)    # rank 0 -> rank 1
            elif g.rank == 1:
                x = await g.recv(src=0, tag=7)              # rank 1: array([0, 1, 2])
        """
        self._check_transfer(dst, "dst", tag)
        _, leaves, treedef = flatten_leaves(value)
        data = [native(leaf) for leaf in leaves]
        await self.session.run(Call("send", data, treedef, None, dst, None, timeout, tag,
                                    flat=[a.reshape(-1) for a in data]))

    async def recv(
        self: _Group, src: int, *, tag: int = 0, out: Pytree | None = None,
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
        mine = flatten_leaves(out) if out is not None else None
        if mine is not None and not all(
                a.flags.c_contiguous and a.flags.writeable and a.dtype.isnative
                for a in mine[1]):
            raise ValueError("out= arrays must be C-contiguous, writable and in native "
                             "byte order")
        call = Call("recv", [], None, None, src, None, timeout, tag)
        learner(call, out, f"recv from rank {src} with tag {tag}", self.rank)
        await self.session.run(call)
        return out if out is not None else unflatten(call.treedef, call.leaves)

    async def recv_any(
        self: _Group, *, tag: int = 0, out: Pytree | None = None, timeout: float | None = None,
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
        limit = self.timeout if timeout is None else check_seconds(timeout, "timeout=")
        loop = asyncio.get_running_loop()  # its clock: the one asyncio.timeout reads
        started = loop.time()
        candidates = {r: OpKey.transfer(r, self.rank, tag, session.transfers[(r, self.rank, tag)])
                      for r in others}
        try:
            async with asyncio.timeout(limit):
                src = await session.matcher.first_of_any(candidates)
        except TimeoutError:
            raise CollectiveTimeout(
                f"recv_any with tag {tag}: nothing came from any rank in {limit:g}s",
                collective="recv", waiting_on=others) from None
        # No await between the choice and recv() taking that transfer's number.
        left = max(limit - (loop.time() - started), 1e-3)
        return src, await self.recv(src, tag=tag, out=out, timeout=left)
