"""The sparse overlay: who watches whom, and how news of a departure reaches everyone.

A peer does not keep a link to every other peer (links open on demand, see
:mod:`p2pcoll.transport.zmq_mesh`), so liveness cannot rest on every pair either. Instead
each rank watches its :data:`WATCHED` ring successors (a heartbeat probe each, which
:class:`~p2pcoll.departures.Departures` asks the transport to open) and is watched by its as
many predecessors, so a peer's liveness costs a constant number of connections and heartbeats
whatever the size of the group. When a peer learns that another
has gone (its probe or link went down, it said goodbye, or a peer told it), it tells its
:func:`fingers` once: ranks ``r + 1, r + 2, r + 4, ...``. Every peer that learns something
new forwards it the same way, so the news reaches all ``p`` peers within about ``log2 p``
hops, each peer sending ``log2 p`` messages per departure; a finger known to have gone is
replaced by the next rank after it. Aborts travel the same way (see
:class:`~p2pcoll.departures.Departures`): the rank whose collective failed tells the peers
it has sent anything to and its fingers, and every peer passes the first abort of an
operation on to its own fingers once.

When a watched peer goes, its watchers watch the next live successor instead (``gone``
below), so after every departure each live rank is watched by :data:`WATCHED` live
predecessors again, however many consecutive ranks have gone: a run of lost ranks is found
one after another, each as its predecessor's probe reaches it (a probe that cannot connect
to a peer's port is a lost peer too).

Everything here is arithmetic on ranks: no sockets, the same answer on every rank.
"""

from __future__ import annotations

from collections.abc import Collection

__all__ = ["WATCHED", "fingers", "watched", "watchers"]

WATCHED = 2
"""How many ring successors each rank watches (and so how many predecessors watch it)."""


def watched(rank: int, size: int, count: int = WATCHED, gone: Collection[int] = ()
            ) -> list[int]:
    """The ranks ``rank`` watches: its ``count`` ring successors that have not ``gone``
    (fewer in a small group).

    >>> watched(0, 5), watched(4, 5), watched(1, 2), watched(0, 8, gone={1, 2, 4})
    ([1, 2], [0, 1], [0], [3, 5])
    """
    return _nearest(rank, size, count, gone, 1)


def watchers(rank: int, size: int, count: int = WATCHED, gone: Collection[int] = ()
             ) -> list[int]:
    """The ranks that watch ``rank``: its ``count`` ring predecessors that have not ``gone``.

    >>> watchers(0, 5), watchers(0, 8, gone={7})
    ([4, 3], [6, 5])
    """
    return _nearest(rank, size, count, gone, -1)


def _nearest(rank: int, size: int, count: int, gone: Collection[int], way: int) -> list[int]:
    _check(rank, size)
    out: list[int] = []
    for i in range(1, size):
        if len(out) == count:
            break
        peer = (rank + way * i) % size
        if peer not in gone:
            out.append(peer)
    return out


def fingers(rank: int, size: int, gone: Collection[int] = ()) -> list[int]:
    """The ranks ``rank`` tells of a departure: ``rank + 2**i`` (mod ``size``) for every
    ``2**i < size``, each replaced by the next rank after it that is not known to have
    ``gone``; without repeats.

    Each rank forwards what it learns to its own fingers, so the news reaches everyone in
    at most ``ceil(log2 size)`` hops (more when some ranks on the way died unnoticed).

    >>> fingers(0, 8), fingers(6, 8), fingers(0, 5), fingers(0, 8, gone={2, 3})
    ([1, 2, 4], [7, 0, 2], [1, 2, 4], [1, 4])
    """
    _check(rank, size)
    out: list[int] = []
    step = 1
    while step < size:
        for offset in range(step, size):
            peer = (rank + offset) % size
            if peer not in gone:
                break
        else:
            break  # everyone else has gone
        if peer not in out:
            out.append(peer)
        step *= 2
    return out


def _check(rank: int, size: int) -> None:
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"rank {rank} is not a rank of a group of {size}")
