"""All-to-all with per-pair lengths (alltoallv): agree on every block, then exchange.

An all-to-all is two collectives. First every rank learns what every other one passed
(the number of parts, the dtype, the elements per row, the rows of each part and, with
``out=``, the rows it expects from each rank): a small allreduce of a p x (2p + 4) table
in which each rank fills its own row, so on one host it goes on the board. Every rank then
checks the same table the same way, so a disagreement is the same
:class:`~p2pcoll.CollectiveMismatch`, naming the ranks, on every rank, raised before any
data moves: the group stays usable. Only then does the exchange run, with the strategy
chosen from the agreed lengths (which every rank knows, so a strategy may forward others'
blocks: Bruck, a host's leader).

The two collectives hold one turn of the group (:mod:`p2pcoll.session.turns`), so calls
started after an all-to-all take their sequence numbers after its exchange on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from .. import tensors
from ..errors import CollectiveMismatch
from ..session.calls import Call
from ..session.session import Session
from ..session.turns import Turns
from .arguments import native

HEAD = 4  # the table's first columns: parts, dtype, elements per row, expects (0 or 1)


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
    p, rank = group.world_size, group.rank
    if isinstance(parts, (str, bytes, np.ndarray)) or not isinstance(parts, Sequence):
        raise TypeError(f"alltoall takes a sequence of {p} arrays (one per rank), got "
                        f"{type(parts).__name__}")
    send = [native(a) for a in parts]
    dtype, rest = _common(send, "parts")
    recv = _buffers(out, p, dtype, rest) if out is not None else None
    row = int(np.prod(rest, dtype=np.int64))
    table = np.zeros((p, 2 * p + HEAD), np.int64)
    mine = table[rank]
    mine[:HEAD] = len(send), _word(dtype), row, recv is not None
    mine[HEAD:HEAD + min(len(send), p)] = [a.shape[0] for a in send[:p]]
    if recv is not None:
        mine[HEAD + p:] = [a.shape[0] for a in recv]
    async with group.turns.hold() as turn:  # taken before the first await
        agreed = await group.allreduce(table, timeout=timeout)
        rows = _check(agreed, p)
        counts = tuple(int(n) * row for n in rows.reshape(-1))
        if recv is None:
            recv = [np.empty((int(rows[i, rank]), *rest), dtype) for i in range(p)]
        call = Call("alltoall", [a.reshape(-1) for a in send]
                    + [a.reshape(-1) for a in recv], strategy=strategy,
                    timeout=timeout, counts=counts)
        turn.release()  # the exchange below takes its number before any await
        await group.session.run(call)
    np.copyto(recv[rank], send[rank])
    if out is not None:
        return list(out)
    like = parts[0] if parts else None
    return [tensors.like(like, a) if like is not None else a for a in recv]


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


def _buffers(out: Sequence[Any], p: int, dtype: np.dtype[Any],
             rest: tuple[int, ...]) -> list[np.ndarray]:
    """``out=`` checked: p writable C-contiguous arrays of the parts' dtype and row shape."""
    if len(out) != p:
        raise ValueError(f"alltoall out= needs {p} arrays (one per rank), got {len(out)}")
    arrays = [native(a) for a in out]
    for i, (given, a) in enumerate(zip(out, arrays, strict=True)):
        if (a.dtype != dtype or a.ndim == 0 or a.shape[1:] != rest
                or not a.flags.writeable or (a.size and not np.shares_memory(
                    a, given if isinstance(given, np.ndarray)
                    else tensors.as_array(given, bits=True)))):
            raise ValueError(f"alltoall out[{i}] must be a writable C-contiguous array of "
                             f"{dtype} with rows of shape {list(rest)}, got {a.dtype}"
                             f"{list(a.shape)}")
    return arrays


def _word(dtype: np.dtype[Any]) -> int:
    """A dtype as one int64 (its ``str``, at most 8 bytes: ``<f4``)."""
    return int.from_bytes(dtype.str.encode()[:8].ljust(8, b"\0"), "little", signed=True)


def _dtype_name(word: int) -> str:
    text = int(word).to_bytes(8, "little", signed=True).rstrip(b"\0").decode(errors="replace")
    try:
        return str(np.dtype(text))
    except TypeError:
        return text


def _check(table: np.ndarray, p: int) -> np.ndarray:
    """Every rank's part of the agreed ``table`` checked alike; the rows of each block
    (``rows[i, j]``: rank i to rank j).

    Raises:
        CollectiveMismatch: naming the ranks that disagree (the same on every rank).
    """
    head, sent, expected = table[:, :HEAD], table[:, HEAD:HEAD + p], table[:, HEAD + p:]
    for i in range(p):
        if head[i, 0] != p:
            raise CollectiveMismatch(f"alltoall: rank {i} passed {head[i, 0]} parts; a group "
                                     f"of {p} needs {p} (one per rank)")
    for i in range(1, p):
        if head[i, 1] != head[0, 1]:
            raise CollectiveMismatch(
                f"alltoall: rank 0 sends {_dtype_name(head[0, 1])}, rank {i} sends "
                f"{_dtype_name(head[i, 1])}: the ranks' dtypes must be the same")
        if head[i, 2] != head[0, 2]:
            raise CollectiveMismatch(
                f"alltoall: rank 0's rows have {head[0, 2]} elements, rank {i}'s "
                f"{head[i, 2]}: the ranks' shapes after the first axis must match")
    for j in range(p):
        if head[j, 3]:
            for i in range(p):
                if sent[i, j] != expected[j, i]:
                    raise CollectiveMismatch(
                        f"alltoall: rank {i} sends rank {j} {sent[i, j]} rows, rank {j} "
                        f"expects {expected[j, i]} from rank {i}")
    return sent
