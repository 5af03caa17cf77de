"""The strategy API: what a collective algorithm is written against.

A strategy is a *schedule*: for one rank of a group, the ordered steps it takes. Steps name
chunks of the data, never buffers or sockets::

    Send(to, chunk)      send my copy of ``chunk`` to rank ``to``
    Recv(frm, chunk)     receive ``chunk`` from rank ``frm`` and overwrite mine
    Reduce(frm, chunk)   receive ``chunk`` from rank ``frm`` and fold it into mine with the op

A step may also be a list of those, run together (for example a send and a receive with the
same partner, so that neither waits for the other). The data is cut into ``chunks(size)``
equal-as-possible chunks (``numpy.array_split`` convention; a reduction's strategy may place
them with ``cuts``); for allgather, gather and
scatter there is always one chunk per rank, chunk r being rank r's part; for alltoall one
chunk per pair of ranks, ``ctx.block(i, j)`` being what rank i sends rank j. ``ALL`` means
the whole data; ``range(a, b)`` means chunks a..b-1; a tuple of chunk numbers means those
chunks, in that order, in one message.

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

Helpers for the two renumberings that textbook algorithms use, so a plugin reads like the
algorithm instead of re-deriving the index arithmetic:

``ctx.relative`` and ``ctx.real(q)``
    Rooted algorithms (binomial trees, chains, scatter-allgather) are written as if the root
    were rank 0: ``ctx.relative`` is this rank counted from the root, ``(rank - root) mod
    size``, and ``ctx.real(q)`` turns a relative rank back into a real one.

``Fold(ctx)``
    MPICH's fold of a group whose size is not a power of two. With ``pof2`` the largest power
    of two <= size and ``extra = size - pof2``: among the first ``2 * extra`` ranks each even
    rank hands its whole data to the odd rank above it (``fold_in()``: a Send there, a Reduce
    here) and sits out (``newrank`` is None); the ``pof2`` others are renumbered
    ``0 .. pof2-1`` (``newrank``; ``real(newrank)`` maps back) and run the power-of-two
    algorithm; then every odd rank below ``2 * extra`` hands the result back to its even
    neighbour (``fold_out()``). For a power of two both generators yield nothing. A schedule
    reads ``yield from fold.fold_in()``, the power-of-two core over ``fold.newrank`` and
    ``fold.real(...)`` when ``fold.newrank is not None``, then ``yield from fold.fold_out()``
    (see ``plugins/recursive_doubling.py``, the shortest such schedule).

``largest_power_of_two(n)``
    The ``pof2`` above, for ``chunks(size)``, which has no context.

Hosts. ``ctx.hosts`` gives the host of every rank as small ints (numbered in order of
first appearance by rank, from the roster; empty: not known, all on one host), with helpers
for the sub-groups of a hierarchical schedule: ``ctx.host``, ``ctx.nhosts``,
``ctx.local_ranks`` (the ranks of my host) and ``ctx.local_rank`` (my index among them),
``ctx.ranks_on(h)``, ``ctx.leaders`` (one rank per host: the root on its host, else the
host's lowest rank) and ``ctx.leader``, and ``ctx.within(ranks, root)``, a
:class:`Subgroup` whose ``ctx`` runs a textbook algorithm on those ranks and whose
``steps(...)`` maps its peers back to real ranks (see ``plugins/hierarchical.py``).

Cost models (optional): ``cost(work)`` gives a strategy's critical path in the
alpha-beta-gamma model of Thakur, Rabenseifner & Gropp (2005) as a :class:`Cost`, and
``traffic(work)`` the exact messages and payload bytes every rank sends as a
:class:`Traffic`; :class:`Workload` is what both may depend on. ``"auto"`` picks the
strategy whose cost is lowest under the host's constants; a strategy without ``cost`` is
picked only when no strategy of its collective has one.

Strategies are registered under the entry-point group ``p2pcoll.strategies``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import ClassVar

__all__ = [
    "ALL",
    "COLLECTIVES",
    "Chunk",
    "Context",
    "Cost",
    "Fold",
    "Recv",
    "Reduce",
    "Schedule",
    "Send",
    "Step",
    "Strategy",
    "Subgroup",
    "Traffic",
    "Workload",
    "chunk_indices",
    "host_numbers",
    "largest_power_of_two",
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
Chunk = int | range | tuple[int, ...] | _All


def chunk_indices(chunk: Chunk, nchunks: int) -> Sequence[int]:
    """The chunk numbers ``chunk`` stands for, in message order, out of ``nchunks``."""
    if isinstance(chunk, _All):
        return range(nchunks)
    if isinstance(chunk, int):
        return range(chunk, chunk + 1)
    return chunk


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


Op = Send | Recv | Reduce
Step = Op | Sequence[Op]
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
    "alltoall",
)


@dataclass(frozen=True, slots=True)
class Context:
    """What a schedule may depend on: who I am, how many we are, the root, and the hosts.

    ``hosts[r]`` is the host of rank r as a small int, hosts numbered in order of first
    appearance by rank (so rank 0 is on host 0, and every rank computes the same tuple from
    the roster; see :func:`host_numbers`). An empty tuple means the hosts are not known:
    every rank counts as on one host (host 0), which is what a group on one machine is.

    Raises:
        ValueError: ``hosts`` is neither empty nor ``size`` long, or is not numbered in
            order of first appearance.
    """

    rank: int
    size: int
    root: int = 0
    hosts: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        hosts = self.hosts
        if hosts and (len(hosts) != self.size or not _members(hosts)):
            raise ValueError(f"Context.hosts must be empty or {self.size} host numbers in "
                             f"order of first appearance (0, then 0 or 1, ...), got {hosts}")

    @property
    def relative(self) -> int:
        """My rank counted from the root, ``(rank - root) mod size``: the root is 0.

        Example: size 5, root 3: ranks 3, 4, 0, 1, 2 are relative ranks 0, 1, 2, 3, 4.
        """
        return (self.rank - self.root) % self.size

    def real(self, q: int) -> int:
        """The real rank of relative rank ``q`` (taken mod size, so ``q - 1`` of 0 works)."""
        return (q + self.root) % self.size

    def block(self, src: int, dst: int) -> int:
        """An alltoall's chunk that rank ``src`` sends rank ``dst`` (both taken mod size)."""
        return (src % self.size) * self.size + dst % self.size

    # --- hosts: sub-groups for hierarchical schedules -------------------------------------

    def host_of(self, rank: int) -> int:
        """The host of ``rank`` (0 when the hosts are not known)."""
        return self.hosts[rank] if self.hosts else 0

    @property
    def host(self) -> int:
        """My host."""
        return self.host_of(self.rank)

    @property
    def nhosts(self) -> int:
        """How many hosts the group spans (1 when not known)."""
        return len(_members(self.hosts)) if self.hosts else 1

    def ranks_on(self, host: int) -> tuple[int, ...]:
        """The ranks of ``host``, in rank order."""
        if not self.hosts:
            return tuple(range(self.size)) if host == 0 else ()
        members = _members(self.hosts)
        return members[host] if 0 <= host < len(members) else ()

    @property
    def local_ranks(self) -> tuple[int, ...]:
        """The ranks of my host, in rank order (me among them)."""
        return self.ranks_on(self.host)

    @property
    def local_rank(self) -> int:
        """My index among :attr:`local_ranks`."""
        return self.local_ranks.index(self.rank)

    @property
    def leaders(self) -> tuple[int, ...]:
        """One rank per host, host by host: the root on the root's host, else the host's
        lowest rank. A hierarchical schedule talks across hosts only among these."""
        root_host = self.host_of(self.root)
        return tuple(self.root if h == root_host else self.ranks_on(h)[0]
                     for h in range(self.nhosts))

    @property
    def leader(self) -> int:
        """The leader of my host (see :attr:`leaders`)."""
        return self.leaders[self.host]

    def within(self, ranks: Sequence[int], root: int | None = None) -> Subgroup:
        """The sub-group of ``ranks`` (real ranks, me among them) as a group of its own:
        rank i of it is ``ranks[i]``; its root is ``root`` (a real rank of it; default: the
        first). Raises ValueError when I or the root are not in ``ranks``."""
        ranks = tuple(ranks)
        if self.rank not in ranks:
            raise ValueError(f"rank {self.rank} is not in the sub-group {ranks}")
        at = ranks[0] if root is None else root
        if at not in ranks:
            raise ValueError(f"the root {at} is not in the sub-group {ranks}")
        return Subgroup(Context(ranks.index(self.rank), len(ranks), ranks.index(at)), ranks)


def host_numbers(hosts: Sequence[object]) -> tuple[int, ...]:
    """Host identities (any hashable values, one per rank: the roster's strings) as small
    ints, numbered in order of first appearance by rank: ``("b", "a", "b") -> (0, 1, 0)``."""
    seen: dict[object, int] = {}
    return tuple(seen.setdefault(h, len(seen)) for h in hosts)


@lru_cache(maxsize=64)
def _members(hosts: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """The ranks of each host (``members[h]``), or () when ``hosts`` is not numbered in
    order of first appearance. Cached: the helpers of every rank's context share it."""
    members: list[list[int]] = []
    for rank, host in enumerate(hosts):
        if host == len(members):
            members.append([rank])
        elif 0 <= host < len(members):
            members[host].append(rank)
        else:
            return ()
    return tuple(tuple(m) for m in members)


@dataclass(frozen=True, slots=True)
class Subgroup:
    """Some ranks of a group seen as a group of their own, to run a textbook algorithm on.

    ``ctx`` is my context in the sub-group (rank i of it is real rank ``ranks[i]``);
    ``real(i)`` maps back, and :meth:`steps` turns steps written with sub-group ranks
    into steps with real ranks, so a hierarchical schedule can say::

        host = ctx.within(ctx.local_ranks, root=ctx.leader)
        yield from host.steps(binomial_reduce(host.ctx))   # a tree inside my host
    """

    ctx: Context
    ranks: tuple[int, ...]

    def real(self, i: int) -> int:
        """The real rank of sub-group rank ``i``."""
        return self.ranks[i]

    def steps(self, schedule: Iterable[Step]) -> Iterator[Step]:
        """``schedule`` (in sub-group ranks) with every peer replaced by its real rank."""
        for step in schedule:
            if isinstance(step, (Send, Recv, Reduce)):
                yield self._op(step)
            else:
                yield [self._op(op) for op in step]

    def _op(self, op: Op) -> Op:
        if isinstance(op, Send):
            return Send(self.ranks[op.to], op.chunk)
        if isinstance(op, Recv):
            return Recv(self.ranks[op.frm], op.chunk)
        return Reduce(self.ranks[op.frm], op.chunk)


def largest_power_of_two(n: int) -> int:
    """The largest power of two <= ``n`` (``n`` >= 1): 1, 2, 2, 4, 4, 4, 4, 8, ..."""
    if n < 1:
        raise ValueError(f"largest_power_of_two needs n >= 1, got {n}")
    return 1 << (n.bit_length() - 1)


@dataclass(frozen=True, slots=True)
class Fold:
    """MPICH's fold of a group of any size onto the largest power of two below it.

    Let ``pof2`` be the largest power of two <= size and ``extra = size - pof2``. Among the
    first ``2 * extra`` ranks each even rank hands all its data to the odd rank above it and
    sits out; the ``pof2`` other ranks are renumbered ``0 .. pof2-1`` and run the
    power-of-two algorithm; then every odd rank below ``2 * extra`` hands the result back.
    With size a power of two nothing is folded: ``newrank == rank`` and ``fold_in()`` and
    ``fold_out()`` yield nothing. Used by ``recursive_doubling`` and ``rabenseifner``.

    Example, size 6 (pof2 4, extra 2)::

        rank  newrank  fold_in()  fold_out()
        0     None     Send(1)    Recv(1)
        1     0        Reduce(0)  Send(0)
        2     None     Send(3)    Recv(3)
        3     1        Reduce(2)  Send(2)
        4     2        -          -
        5     3        -          -
    """

    ctx: Context

    @property
    def pof2(self) -> int:
        """How many ranks run the power-of-two core: the largest power of two <= size."""
        return largest_power_of_two(self.ctx.size)

    @property
    def extra(self) -> int:
        """``size - pof2``: how many ranks sit out (the even ones below ``2 * extra``)."""
        return self.ctx.size - self.pof2

    @property
    def newrank(self) -> int | None:
        """My rank among the ``pof2`` ranks of the core, or None if I sit out."""
        rank, extra = self.ctx.rank, self.extra
        if rank < 2 * extra:
            return rank // 2 if rank % 2 else None
        return rank - extra

    def real(self, newrank: int) -> int:
        """The real rank of core rank ``newrank`` (the inverse of :attr:`newrank`)."""
        return 2 * newrank + 1 if newrank < self.extra else newrank + self.extra

    def fold_in(self) -> Iterator[Op]:
        """The steps before the core: an even rank below ``2 * extra`` sends its data up,
        the odd rank above it folds that in; every other rank yields nothing."""
        rank = self.ctx.rank
        if rank < 2 * self.extra:
            yield Send(rank + 1) if rank % 2 == 0 else Reduce(rank - 1)

    def fold_out(self) -> Iterator[Op]:
        """The steps after the core: each odd rank below ``2 * extra`` sends the result to
        the even rank below it, which receives it; every other rank yields nothing."""
        rank = self.ctx.rank
        if rank < 2 * self.extra:
            yield Send(rank - 1) if rank % 2 else Recv(rank + 1)


@dataclass(frozen=True, slots=True)
class Workload:
    """What a cost model may depend on: the group, the data and how the executor cuts it.

    Attributes:
        size: p, the number of ranks.
        nbytes: n, the bytes of the collective's data: each rank's tensor (broadcast,
            reduce, allreduce, reduce_scatter), or all the parts together (allgather,
            gather, scatter: p parts of n/p bytes; alltoall: the p parts each rank sends,
            part j of ``part(j, size)`` bytes).
        itemsize: the unit the data is cut at (an element; for reduce_scatter a row).
        segments: S, how many pipeline segments the executor cuts every message into: each
            segment is a run of the whole schedule, so a rank sends S times its messages.
        depth: how many segments are in flight at once.
        hosts: the host of every rank, as :attr:`Context.hosts` (empty: one host).
    """

    size: int
    nbytes: int
    itemsize: int = 1
    segments: int = 1
    depth: int = 4
    hosts: tuple[int, ...] = ()

    @property
    def context(self) -> Context:
        """The context of rank 0 (root 0) in this workload's group: its host helpers
        (``nhosts``, ``ranks_on``, ``leaders``) for a two-level ``cost()``."""
        return Context(0, self.size, 0, self.hosts)

    @property
    def waves(self) -> int:
        """``ceil(S / depth)``: segments in flight together share their latency terms, so
        a schedule of R rounds costs ``R * waves`` of them (the convention of the built-ins)."""
        return -(-self.segments // self.depth)

    def part(self, i: int, k: int) -> int:
        """Bytes of chunk ``i`` when the data is cut into ``k`` chunks (``array_split``)."""
        return self.span(i, i + 1, k)

    def span(self, start: int, stop: int, k: int) -> int:
        """Bytes of chunks ``start .. stop-1`` when the data is cut into ``k`` chunks."""
        q, r = divmod(self.nbytes // self.itemsize, k)
        longer = max(0, min(stop, r) - min(start, r))  # the first r chunks have one more
        return ((stop - start) * q + longer) * self.itemsize


@dataclass(frozen=True, slots=True)
class Cost:
    """A collective's critical path: ``time = rounds*alpha + sent*beta + reduced*gamma``.

    Attributes:
        rounds: messages one after the other on the critical path (the alpha terms; a rank's
            sends in one step count one each, as a single port serialises them).
        sent: bytes on the critical path (the beta terms).
        reduced: bytes reduced on the critical path (the gamma terms).
        repeats: the part of ``rounds`` that repeats a message already sent to another
            peer in the same step (a root's ``[Send(a), Send(b), ...]`` of one chunk).
        repeated: the bytes of those repeats (part of ``sent``).
        remote_rounds: the part of ``rounds`` whose messages cross hosts, or None: the
            strategy does not say (a flat one), and the cost model works it out from the
            schedule (:mod:`p2pcoll.engine.costs`). Repeats are taken as within a host.
        remote_sent: the bytes of those rounds that leave a host through its one network
            link, summed over the ranks of the host that send at once (part of ``sent``).

    A transport charges repeats a fraction ``repeat`` of alpha and beta: 1 over sockets,
    where each send is a copy of its own and the textbook's single port serialises them; 0
    over the shared-memory rings, where the piece is copied in once, every peer reads it and
    the messages' latencies overlap (their CPU is the host term's, not the critical path's).
    """

    rounds: float
    sent: float
    reduced: float = 0.0
    repeats: float = 0.0
    repeated: float = 0.0
    remote_rounds: float | None = None
    remote_sent: float = 0.0

    def messages(self, repeat: float = 1.0) -> float:
        """The rounds that pay alpha when repeats cost ``repeat`` of it (0..1)."""
        return self.rounds - (1.0 - repeat) * self.repeats

    def charged(self, repeat: float = 1.0) -> float:
        """The bytes that pay beta when repeated bytes cost ``repeat`` of it (0..1)."""
        return self.sent - (1.0 - repeat) * self.repeated

    def time(self, alpha: float, beta: float, gamma: float, repeat: float = 1.0) -> float:
        """Predicted seconds with alpha s/message, beta s/byte, gamma s/byte reduced, and
        repeats charged ``repeat`` of alpha and beta."""
        return (self.messages(repeat) * alpha + self.charged(repeat) * beta
                + self.reduced * gamma)


@dataclass(frozen=True, slots=True)
class Traffic:
    """What every rank sends in one collective, exactly: ``messages[r]`` messages and
    ``bytes_sent[r]`` payload bytes from rank r (as counted by ``Group.stats()``)."""

    messages: tuple[int, ...]
    bytes_sent: tuple[int, ...]


class Strategy:
    """Base class of collective algorithms. Subclass, set the class variables, write schedule().

    Class variables:
        name: the name users select it by (``strategy="ring"``).
        collective: one of :data:`COLLECTIVES`.
        description: one line for ``p2pcoll strategies``.
        automatic: whether ``"auto"`` may pick it (default True). False for a strategy that
            is chosen for what it computes rather than how fast (``gloo_ring``: Gloo's bits).
        needs_hosts: whether it is written for groups over several hosts (default False):
            ``"auto"`` then considers it only when the group spans several hosts and one of
            them holds several ranks (on one host, or one rank per host, a hierarchical
            schedule is a flat one that other strategies already are).
        whole_messages: whether some of its messages carry every chunk at once (a tree's or
            a star's ``ALL``, beside per-chunk messages; default False). Then the data is cut
            into segments so that a whole segment fits ``P2PCOLL_SEGMENT_BYTES``, not only
            one chunk's part of it.

    Contract by collective (what the data holds when the schedule ends):
        broadcast: every rank holds the root's data.
        reduce: the root holds the reduction; others anything.
        allreduce: every rank holds the reduction.
        reduce_scatter: rank r holds the reduction of chunk r (``chunks(size)`` must be size).
        allgather: every rank holds every part (part r starts on rank r).
        gather: the root holds every part.  scatter: rank r holds part r (all start on root).
        barrier: no data; every rank must hear, directly or not, from every other.
        alltoall: ``chunks(size)`` is ``size * size``; rank r starts with the blocks
            ``ctx.block(r, j)`` and must end with every ``ctx.block(i, r)``. Blocks may
            differ in length (every rank knows every length); a rank may hold and forward
            others' blocks (Bruck), each in a buffer of its own.
    """

    name: ClassVar[str]
    collective: ClassVar[str]
    description: ClassVar[str] = ""
    automatic: ClassVar[bool] = True
    needs_hosts: ClassVar[bool] = False
    whole_messages: ClassVar[bool] = False

    def chunks(self, size: int) -> int:
        """How many chunks to cut the data into for a group of ``size`` ranks."""
        return 1

    def cuts(self, size: int, count: int, itemsize: int) -> Sequence[int] | None:
        """Where the chunks of a reduce or allreduce begin, or None (the default): every
        array cut like ``numpy.array_split``, chunk c being part c of each.

        Otherwise ``chunks(size) + 1`` non-decreasing element offsets from 0 to ``count``
        into the data seen as one flat run of ``count`` elements of ``itemsize`` bytes (the
        leaves of a pytree one after the other): chunk c is ``[cuts[c], cuts[c + 1])``, and
        may be empty. For a strategy whose results must match another library's bit for bit,
        which fixes where each partial sum is taken (``plugins/gloo_ring.py``).
        """
        return None

    def schedule(self, ctx: Context) -> Schedule:
        """Yield this rank's steps, in order."""
        raise NotImplementedError

    def cost(self, work: Workload) -> Cost | None:
        """The critical path of this collective for ``work`` (root 0), or None: no model."""
        return None

    def traffic(self, work: Workload) -> Traffic | None:
        """What every rank sends for ``work`` (root 0), or None: not modelled."""
        return None
