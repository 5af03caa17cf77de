"""The strategy API: what a collective algorithm is written against.

A strategy is a *schedule*: for one rank of a group, the ordered steps it takes. Steps name
chunks of the data, never buffers or sockets::

    Send(to, chunk)      send my copy of ``chunk`` to rank ``to``
    Recv(frm, chunk)     receive ``chunk`` from rank ``frm`` and overwrite mine
    Reduce(frm, chunk)   receive ``chunk`` from rank ``frm`` and fold it into mine with the op

A step may also be a list of those, run together (for example a send and a receive with the
same partner, so that neither waits for the other). The data is cut into ``chunks(size)``
equal-as-possible chunks (``numpy.array_split`` convention); for allgather, gather and
scatter there is always one chunk per rank, chunk r being rank r's part. ``ALL`` means the
whole data; ``range(a, b)`` means chunks a..b-1.

The k-th message rank a sends to rank b in one collective is the k-th one b receives from a
(MPI's non-overtaking rule), so schedules only need a consistent order per pair of ranks.
Everything else (buffers, message keys, zero-copy frames, reductions into preallocated
memory, pipelining of large data in segments, deadlines and error checks) is done by the
executor for every strategy alike.

Example, the ring allreduce::

    class RingAllreduce(Strategy):
        name, collective = "ring", "allreduce"

        def chunks(self, size): return size

        def schedule(self, ctx):
            right, left = (ctx.rank + 1) % ctx.size, (ctx.rank - 1) % ctx.size
            for s in range(ctx.size - 1):     # reduce-scatter
                yield [Send(right, (ctx.rank - s) % ctx.size),
                       Reduce(left, (ctx.rank - s - 1) % ctx.size)]
            ...

Strategies are registered under the entry-point group ``p2pcoll.strategies``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar, Union

__all__ = [
    "ALL",
    "COLLECTIVES",
    "Context",
    "Reduce",
    "Recv",
    "Schedule",
    "Send",
    "Step",
    "Strategy",
]


class _All:
    """The whole data (every chunk)."""

    _instance: ClassVar[_All | None] = None

    def __new__(cls) -> _All:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "ALL"


ALL = _All()
Chunk = Union[int, range, _All]


@dataclass(frozen=True, slots=True)
class Send:
    """Send my copy of ``chunk`` to rank ``to``."""

    to: int
    chunk: Chunk = ALL


@dataclass(frozen=True, slots=True)
class Recv:
    """Receive ``chunk`` from rank ``frm``, overwriting mine."""

    frm: int
    chunk: Chunk = ALL


@dataclass(frozen=True, slots=True)
class Reduce:
    """Receive ``chunk`` from rank ``frm`` and combine it into mine with the collective's op."""

    frm: int
    chunk: Chunk = ALL


Op = Union[Send, Recv, Reduce]
Step = Union[Op, Sequence[Op]]
Schedule = Iterable[Step]

COLLECTIVES = (
    "broadcast",
    "reduce",
    "allreduce",
    "allgather",
    "reduce_scatter",
    "gather",
    "scatter",
    "barrier",
)


@dataclass(frozen=True, slots=True)
class Context:
    """What a schedule may depend on: who I am, how many we are, and the root."""

    rank: int
    size: int
    root: int = 0


class Strategy:
    """Base class of collective algorithms. Subclass, set the class variables, write schedule().

    Class variables:
        name: the name users select it by (``strategy="ring"``).
        collective: one of :data:`COLLECTIVES`.
        description: one line for ``p2pcoll strategies``.

    Contract by collective (what the data holds when the schedule ends):
        broadcast: every rank holds the root's data.
        reduce: the root holds the reduction; others anything.
        allreduce: every rank holds the reduction.
        reduce_scatter: rank r holds the reduction of chunk r (``chunks(size)`` must be size).
        allgather: every rank holds every part (part r starts on rank r).
        gather: the root holds every part.  scatter: rank r holds part r (all start on root).
        barrier: no data; every rank must hear, directly or not, from every other.
    """

    name: ClassVar[str]
    collective: ClassVar[str]
    description: ClassVar[str] = ""

    def chunks(self, size: int) -> int:
        """How many chunks to cut the data into for a group of ``size`` ranks."""
        return 1

    def schedule(self, ctx: Context) -> Schedule:
        """Yield this rank's steps, in order."""
        raise NotImplementedError
