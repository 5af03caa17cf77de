"""All-to-all with per-pair lengths (alltoallv): every rank's lengths agreed, then the
exchange.

Every rank first needs what every other one passed (the number of parts, the dtype, the
elements per row, the rows of each part and, with ``out=``, the rows it expects from each
rank): the table of :mod:`p2pcoll.engine.alltoall_table`, which every rank checks the same
way, so a disagreement is the same :class:`~p2pcoll.CollectiveMismatch`, naming the
ranks, on every rank, raised before any data is read: the group stays usable.

Among the peers of one host (the board, no strategy asked for) it is one collective: the
table travels in the board round that carries the parts
(:mod:`p2pcoll.engine.board_alltoall`). Its prepared program does not depend on the
lengths (:class:`_OnBoard`): an alltoall whose lengths change every call (a
Mixture-of-Experts layer's routing) finds the one it prepared first, and leaves the
session's other programs in their cache. Otherwise it is two: a small allreduce of the
table, then the exchange, with the strategy chosen from the agreed lengths (which every
rank knows, so a strategy may forward others' blocks: Bruck, a host's leader). The two
hold one turn of the group (:mod:`p2pcoll.session.turns`), so calls started after an
all-to-all take their sequence numbers after its exchange on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from .. import tensors
from ..engine import alltoall_table as table
from ..session.calls import Call
from ..session.flight import describe
from ..session.session import Session
from ..session.turns import Turns
from ..types import ALLOWED_DTYPES, check_dtype
from .arguments import native

class Group(Protocol):
    """What an all-to-all uses of its :class:`~p2pcoll.Group`."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def turns(self) -> Turns: ...

    @property
    def session(self) -> Session: ...

    async def allreduce(self, value: Any, op: Any = "sum", *,
                        timeout: float | None = None) -> Any: ...


async def alltoall(group: Group, parts: Sequence[Any], out: Sequence[Any] | None,
                   strategy: str | None, timeout: float | None) -> list[Any]:
    """:meth:`p2pcoll.Group.alltoall` (see there)."""
    p = group.world_size
    if type(parts) not in (list, tuple) and (  # (a list or tuple: no ABC check)
            isinstance(parts, (str, bytes, np.ndarray)) or not isinstance(parts, Sequence)):
        raise TypeError(f"alltoall takes a sequence of {p} arrays (one per rank), got "
                        f"{type(parts).__name__}")
    send, dtype, rest = _arrays(parts)
    recv = _buffers(out, p, dtype, rest) if out is not None else None
    session = group.session
    runner = session.runner
    if runner.alltoall_on_board(strategy):  # one round, the lengths in it
        flat = send if not rest else [a.reshape(-1) for a in send]
        call = _OnBoard("alltoall", send + (recv or []), strategy=strategy,
                        timeout=timeout, flat=flat)
        program = runner.programs.get(call.key())
        if program is not None:  # what the flight record says of this call
            program.flight = (*program.flight[:2], *describe(flat, send))
        await session.run(call)
        if call.refused is not None:
            raise call.refused
        recv = call.leaves[p:]
    else:
        recv = await _agree_and_exchange(group, send, recv, dtype, rest, strategy, timeout)
    if out is not None:
        return list(out)
    like = parts[0] if parts else None
    if like is None or type(like) is np.ndarray:
        return recv
    return [tensors.like(like, a) for a in recv]


class _OnBoard(Call):
    """An alltoall on the board: its program is the same whatever the lengths, dtype or
    row shape (the board's round reads them from every rank's header), so its key names
    none of them. The flight record's entry, which does name them, is the program's:
    :func:`alltoall` sets it for each call just before the runner reads it, which it does
    as it starts the call, with no await before (unless a coded reduction holds the
    group's turn: a second alltoall started meanwhile may then set the entry that the
    first one records)."""

    __slots__ = ()

    def key(self) -> tuple[Any, ...]:
        return ("alltoall", self.strategy, "", None, True, 1, "board: lengths agreed in "
                "the round", (), ())


async def _agree_and_exchange(group: Group, send: list[np.ndarray],
                              recv: list[np.ndarray] | None, dtype: np.dtype[Any],
                              rest: tuple[int, ...], strategy: str | None,
                              timeout: float | None) -> list[np.ndarray]:
    """The message path: the table agreed by an allreduce, then the exchange."""
    p, rank = group.world_size, group.rank
    row = int(np.prod(rest, dtype=np.int64))
    mine = np.zeros((p, table.width(p)), np.int64)
    table.fill(mine[rank], p, [a.shape[0] for a in send], dtype, row,
               None if recv is None else [a.shape[0] for a in recv])
    async with group.turns.hold() as turn:  # taken before the first await
        agreed = await group.allreduce(mine, timeout=timeout)
        rows = table.check(agreed, p)
        counts = tuple(int(n) * row for n in rows.reshape(-1))
        if recv is None:
            recv = [np.empty((int(rows[i, rank]), *rest), dtype) for i in range(p)]
        # The parts as given (their shapes are in the program's key and the flight
        # record); flat: those sent, as they move (the runner cuts them into blocks).
        call = Call("alltoall", send + recv, strategy=strategy, timeout=timeout,
                    counts=counts, flat=[a.reshape(-1) for a in send])
        turn.release()  # the exchange below takes its number before any await
        await group.session.run(call)
    np.copyto(recv[rank], send[rank])
    return recv


def _arrays(parts: Sequence[Any]) -> tuple[list[np.ndarray], np.dtype[Any], tuple[int, ...]]:
    """``parts`` as native C-contiguous arrays (see :func:`_native`), their dtype and
    their shape after the first axis (see :func:`_common`).

    Raises:
        TypeError, ValueError: as :func:`_native` and :func:`_common`.
    """
    # The usual call, checked in one pass: numpy arrays, native and C-contiguous, of one
    # allowed dtype and one shape after the first axis, none 0-d. Anything else goes the
    # way that says what is wrong.
    send = list(parts)
    if send:
        first = send[0]
        if type(first) is np.ndarray and first.ndim:
            dtype, rest = first.dtype, first.shape[1:]
            if dtype.isnative and dtype.str in ALLOWED_DTYPES and all(
                    type(a) is np.ndarray and a.flags.c_contiguous and a.dtype == dtype
                    and a.ndim and a.shape[1:] == rest for a in send):
                return send, dtype, rest
    send = [_native(a) for a in send]
    return (send, *_common(send, "parts"))


def _common(arrays: Sequence[np.ndarray], what: str) -> tuple[np.dtype[Any], tuple[int, ...]]:
    """The dtype and the shape after the first axis that all ``arrays`` share."""
    if not arrays:
        return np.dtype(np.float32), ()
    first = arrays[0]
    for j, a in enumerate(arrays):
        if a.ndim == 0:
            raise ValueError(f"alltoall {what}[{j}] is 0-d; every part needs a first axis "
                             f"(its length may differ from part to part)")
        if a.dtype != first.dtype or a.shape[1:] != first.shape[1:]:
            raise ValueError(f"alltoall {what}[{j}] is {a.dtype}{list(a.shape)}, "
                             f"{what}[0] {first.dtype}{list(first.shape)}: every part must "
                             f"have one dtype and one shape after the first axis")
    return first.dtype, tuple(first.shape[1:])


def _native(a: Any) -> np.ndarray:
    """:func:`~.arguments.native`, without its new view of an array that is already
    native and C-contiguous (the usual part: an all-to-all passes 2p of them)."""
    if type(a) is np.ndarray and a.flags.c_contiguous and a.dtype.isnative:
        check_dtype(a.dtype)
        return a
    return native(a)


def _buffers(out: Sequence[Any], p: int, dtype: np.dtype[Any],
             rest: tuple[int, ...]) -> list[np.ndarray]:
    """``out=`` checked: p writable C-contiguous arrays of the parts' dtype and row shape."""
    if len(out) != p:
        raise ValueError(f"alltoall out= needs {p} arrays (one per rank), got {len(out)}")
    arrays = list(out)
    # The usual buffers, checked in one pass (the parts' dtype is an allowed native one).
    if all(type(a) is np.ndarray and a.dtype == dtype and a.ndim and a.shape[1:] == rest
           and a.flags.c_contiguous and a.flags.writeable for a in arrays):
        return arrays
    arrays = [_native(a) for a in arrays]
    for i, (given, a) in enumerate(zip(out, arrays, strict=True)):
        if (a.dtype != dtype or a.ndim == 0 or a.shape[1:] != rest
                or not a.flags.writeable or (a.size and a is not given and not np.shares_memory(
                    a, given if isinstance(given, np.ndarray)
                    else tensors.as_array(given, bits=True)))):
            raise ValueError(f"alltoall out[{i}] must be a writable C-contiguous array of "
                             f"{dtype} with rows of shape {list(rest)}, got {a.dtype}"
                             f"{list(a.shape)}")
    return arrays
