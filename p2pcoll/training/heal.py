"""Heal: a replica that lacks the group's state gets it from every member that has it.

    report = await training.heal(group, state, sources=[0, 1, 2])   # every rank calls it
    # ranks 0-2 serve, rank 3 receives; rank 3's state now holds rank 0's bits

The *sources* hold the state, bit-identical (replicas of one round); every other rank of
the group is a *receiver* (a joiner, or a replica that fell behind). The state's bytes, the
leaves one after another in leaf order, are cut into *ranges* of ``chunk_bytes`` (4 MiB),
and the sources share them out in stripes: with S sources and n ranges, range ``i`` comes
from the ``i * S // n``-th. Every rank computes this plan from the same (sources, tensor
sizes), so nothing about it is sent. A receiver thus takes 1/S of the state from each
source at once, and a heal over thin uplinks takes about 1/S of one sender's time.

Digests. Each source hashes every range (SHA-256, in a thread of the lowest CPU priority,
so the loop, the transport and training go first) while the first pass moves, and the
group allgathers the tables, 32 bytes a range. The *agreed* digest of a range is the one a
strict majority of the sources hold: a source whose table differs anywhere is outvoted,
named in a warning and sends nothing more; a range without a majority (two sources that
disagree) is a :class:`HealFailed` on every rank once the pass is over. A receiver hashes
each range it receives and keeps it only if it matches the agreed digest. After each pass
the group allgathers the receivers' failures (one byte a range): a source whose bytes did
not match is named in a warning and sends nothing more, and each failed range is fetched
again from the next source of the stripe order that has not failed it. A range that no
source sent intact is a :class:`HealFailed`.

All or nothing. A receiver writes into fresh buffers and copies them over its state only
once every range matches its agreed digest, so its state is its own or the sources', never
a mix. A source that dies breaks the group (as any lost peer does): the heal ends, on every
rank, with the group's error (:class:`~p2pcoll.PeerLost`), each range in flight ending with
it, and a receiver keeps what it received, with each range's digest, in its
:class:`HealProgress`: passed to the next heal (in the group formed by the survivors), the
ranges whose digest is the one the sources agree on there are not sent again, the others
come from the sources that are left.

Survivors keep training while they serve: the heal is a coroutine that a source may run as
a task beside its own computation (hashing in a low-priority thread; each range handed to
the transport zero-copy, as one message). Its traffic yields to other traffic by size:
ranges of a few MiB, at most :data:`IN_FLIGHT` per link handed to the transport at a time,
so another message to the same peer queues behind those and the socket's buffer, not
behind the state (the transport has no priority lane). The heal runs small allgathers of
its own (the tensors' agreement, what receivers hold, the digests, one per pass for the
failures): issue no other collective on the group while it runs.

``StripedHeal.send_range`` is the one place a range leaves a source: a test subclasses it
to corrupt one source's bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import threading
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import GroupBroken, P2PCollError
from ..pytree import Pytree, as_array, named_leaves
from .agreement import NOT_A_ROUND, Call, Kind, agree, table
from .buckets import TensorSpec

if TYPE_CHECKING:
    from .. import Group

__all__ = ["CHUNK_BYTES", "HEAL_TAG", "HealFailed", "HealProgress", "HealReport",
           "StripedHeal", "heal"]

log = logging.getLogger("p2pcoll.training")

CHUNK_BYTES = 4 << 20
"""The default size of one range: big enough that a message's overhead is nothing, small
enough that a round's message queued behind one waits little."""
HEAL_TAG = 0x4845414C  # "HEAL": the point-to-point tag of the ranges
IN_FLIGHT = 2  # ranges on their way per (source, receiver): the link never waits for a turn
DIGEST = 32  # bytes of a SHA-256 digest
Piece = tuple[int, int, int]  # (leaf, first byte, end byte) of one range's part of a leaf


class HealFailed(P2PCollError):
    """No source could give a receiver some range of the state intact: the sources'
    digests of it disagree with no majority, or every source sent bytes that did not match.
    Raised on every rank alike; no receiver's state was changed.

    Attributes:
        ranges: the indices of the ranges concerned.
        bad: the sources named as sending (or holding) wrong bytes.
    """

    def __init__(self, message: str, *, ranges: Sequence[int], bad: Sequence[int]) -> None:
        super().__init__(message)
        self.ranges = list(ranges)
        self.bad = list(bad)


@dataclass
class HealProgress:
    """What a receiver holds of a heal that did not finish, for the next one.

    Pass the same object to every heal of one receiver: a heal that ends with an error
    leaves in it the ranges this rank received, and the next heal fetches only the others
    and those whose digest is not the one its sources agree on. A heal that finishes
    empties it.

    Attributes:
        layout: the leaves' sizes in bytes and the range size the buffers belong to.
        buffers: the received bytes, one flat uint8 buffer per leaf.
        held: range index -> the digest of the bytes held of it (used only once it is the
            agreed digest).
    """

    layout: tuple[tuple[int, ...], int] | None = None
    buffers: list[np.ndarray] = field(default_factory=list)
    held: dict[int, bytes] = field(default_factory=dict)

    def buffers_for(self, sizes: tuple[int, ...], chunk_bytes: int) -> list[np.ndarray]:
        """The buffers for this layout: the kept ones, or fresh ones (forgetting the rest)."""
        if self.layout != (sizes, chunk_bytes):
            self.layout = (sizes, chunk_bytes)
            self.buffers = [np.empty(n, np.uint8) for n in sizes]
            self.held = {}
        return self.buffers

    def clear(self) -> None:
        self.layout, self.buffers, self.held = None, [], {}


@dataclass
class HealReport:
    """What one heal did, as one rank saw it.

    Attributes:
        sources, receivers: the ranks that served and received.
        ranges: how many ranges the state was cut into.
        received: ranges this rank received (kept or not); 0 on a source.
        resumed: ranges this rank held from an earlier heal, with the agreed digest, and did
            not fetch again.
        refetched: ranges fetched again after a bad copy (over all receivers).
        bad: sources named for wrong digests or wrong bytes, in rank order.
        passes: transfer passes (1 when nothing had to be fetched again).
    """

    sources: list[int]
    receivers: list[int]
    ranges: int = 0
    received: int = 0
    resumed: int = 0
    refetched: int = 0
    bad: list[int] = field(default_factory=list)
    passes: int = 0


async def heal(group: Group, state: Pytree, sources: Sequence[int], *,
               progress: HealProgress | None = None, chunk_bytes: int = CHUNK_BYTES,
               timeout: float | None = None, yielding: bool = True) -> HealReport:
    """Give every rank not in ``sources`` the sources' state, striped over all of them.

    See the module docstring; ``StripedHeal(chunk_bytes, timeout, yielding).run(...)``.

    Args:
        group: the group; every rank calls this with the same ``sources``.
        state: a pytree of arrays with the same names, shapes and dtypes on every rank; the
            sources' hold the same bits, the receivers' are overwritten.
        sources: the ranks that hold the state (at least one).
        progress: a receiver's :class:`HealProgress` (ignored on a source).
        chunk_bytes: the size of a range.
        timeout: seconds for each message and collective (default: the group's).
        yielding: a source hashes the state at the lowest CPU priority, after training
            (the default: survivors that keep training while they serve go first); False:
            at the process's own, for a heal every rank waits for (a formation of
            :func:`train_elastic`: at the lowest priority on a loaded host, the hashing
            waits for every busy process and holds up the group).

    Returns:
        A :class:`HealReport`.

    Raises:
        ValueError: bad ``sources`` or ``chunk_bytes``, or a receiver's array is read-only.
        HealFailed: no source gave some range intact (see the class).
        CollectiveMismatch: the ranks disagree on the tensors or the sources.
        PeerLost, GroupBroken, CollectiveTimeout: as the group's collectives and transfers;
            a receiver's state is then unchanged and ``progress`` holds what it received.

    Cancellation: breaks the group; a receiver's state is unchanged.
    """
    return await StripedHeal(chunk_bytes=chunk_bytes, timeout=timeout,
                             yielding=yielding).run(group, state, sources, progress)


class StripedHeal:
    """The heal's algorithm (see the module docstring); :func:`heal` runs it."""

    def __init__(self, *, chunk_bytes: int = CHUNK_BYTES, timeout: float | None = None,
                 yielding: bool = True) -> None:
        if not isinstance(chunk_bytes, int) or isinstance(chunk_bytes, bool) or chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be an int >= 1, got {chunk_bytes!r}")
        self.chunk_bytes, self.timeout, self.yielding = chunk_bytes, timeout, yielding

    async def send_range(self, group: Group, dst: int, index: int,
                         pieces: list[np.ndarray]) -> None:
        """Send range ``index`` (its ``pieces``, uint8 views of this rank's state) to ``dst``."""
        await group.send(pieces, dst, tag=HEAL_TAG, timeout=self.timeout)

    async def run(self, group: Group, state: Pytree, sources: Sequence[int],
                  progress: HealProgress | None = None) -> HealReport:
        """:func:`heal` with this object's settings."""
        p, me = group.world_size, group.rank
        sources = _check_sources(sources, p)
        receivers = [r for r in range(p) if r not in sources]
        report = HealReport(list(sources), receivers)
        named = named_leaves(state)
        arrays = [as_array(leaf, path) for path, leaf in named]
        if me in receivers:
            for (path, _), array in zip(named, arrays, strict=True):
                if not array.flags.writeable:
                    raise ValueError(f"state {path!r} is read-only; cannot heal into it")
        if not receivers:
            return report
        specs = [TensorSpec.of(path, a) for (path, _), a in zip(named, arrays, strict=True)]
        await agree(group, Call(Kind.BROADCAST, NOT_A_ROUND, "heal", table(
            {"sources": list(sources), "chunk_bytes": self.chunk_bytes}, specs)), self.timeout)
        sizes = tuple(a.nbytes for a in arrays)
        ranges = plan_ranges(sizes, self.chunk_bytes)
        n = report.ranges = len(ranges)
        kept = progress if progress is not None else HealProgress()
        if me in sources:
            data = [np.ascontiguousarray(a).reshape(-1).view(np.uint8) for a in arrays]
            held = np.zeros((n, DIGEST), np.uint8)
        else:
            data = kept.buffers_for(sizes, self.chunk_bytes)
            held = np.zeros((n, DIGEST), np.uint8)
            for i, digest in kept.held.items():
                held[i] = np.frombuffer(digest, np.uint8)
        # What each receiver holds from an earlier heal; the first pass sends the rest.
        holding = await group.allgather(held, timeout=self.timeout)
        assigned = {(r, i): sources[i * len(sources) // n] for r in receivers
                    for i in range(n) if not holding[r][i].any()}
        vote = _Vote()

        async def digests() -> None:  # while the first pass moves
            mine = (await _in_background(_digests, data, ranges, self.yielding)
                    if me in sources else np.zeros((n, DIGEST), np.uint8))
            tables = await group.allgather(mine, timeout=self.timeout)
            try:
                vote.agreed, vote.bad = _vote(tables, sources)
            except HealFailed as exc:
                vote.failed = exc  # raised once the pass is over: the group stays usable

        report.passes = 1
        await _all([digests(), self._pass(group, ranges, data, assigned, kept, report, [])])
        if vote.failed is not None:
            raise vote.failed
        agreed, bad = vote.agreed, list(vote.bad)
        if bad:
            log.warning("heal: source(s) %s hold other bytes than the majority of %s: "
                        "outvoted, they send nothing more", bad, list(sources))
        failed = _check(kept, agreed) if me in receivers else np.zeros(n, np.uint8)
        if me in receivers:
            report.resumed = sum(1 for i in range(n)
                                 if holding[me][i].any() and not failed[i])
        tried: dict[tuple[int, int], set[int]] = {}
        while True:
            failures = await group.allgather(failed, timeout=self.timeout)
            again: dict[tuple[int, int], int | None] = {}
            for r in receivers:
                for i in np.flatnonzero(failures[r]).tolist():
                    sender = assigned.get((r, i))
                    again[(r, i)] = sender
                    if sender is None:
                        continue  # a stale range kept from before: nobody to blame
                    tried.setdefault((r, i), set()).add(sender)
                    if sender not in bad:
                        bad.append(sender)
                    log.warning("heal: rank %d sent range %d to rank %d with bytes that do "
                                "not match the agreed digest: not applied; fetching it "
                                "elsewhere, and nothing more from rank %d", sender, i, r,
                                sender)
            if not again:
                break
            senders = [s for s in sources if s not in bad]
            assigned = {}
            for key, sender in sorted(again.items()):
                order = _after(sources, sender) if sender is not None else sources
                left = [s for s in order if s in senders and s not in tried.get(key, ())]
                if not left:
                    raise HealFailed(
                        f"heal: no source sent range {key[1]} intact to rank {key[0]} "
                        f"(tried {sorted(tried.get(key, ()))})", ranges=[key[1]],
                        bad=sorted(bad))
                assigned[key] = left[0]
            report.refetched += len(assigned)
            report.passes += 1
            await self._pass(group, ranges, data, assigned, kept, report, bad)
            failed = _check(kept, agreed) if me in receivers else np.zeros(n, np.uint8)
        report.bad = sorted(bad)
        if me in receivers:
            for own, got in zip(arrays, data, strict=True):  # all of it, only now
                np.copyto(own, got.view(own.dtype).reshape(own.shape))
            kept.clear()
        return report

    async def _pass(self, group: Group, ranges: list[list[Piece]], data: list[np.ndarray],
                    assigned: dict[tuple[int, int], int], kept: HealProgress,
                    report: HealReport, bad: list[int]) -> None:
        """One transfer pass: a source sends what ``assigned`` gives it (unless it is
        ``bad``), a receiver receives what is assigned to it into ``kept``."""
        if group.rank in report.receivers:
            report.received += await self._receive(group, ranges, data, assigned, kept)
        elif group.rank not in bad:
            await self._serve(group, ranges, data, assigned)

    async def _serve(self, group: Group, ranges: list[list[Piece]], data: list[np.ndarray],
                     assigned: dict[tuple[int, int], int]) -> None:
        """Send this rank's ranges of the pass, each receiver's in range order, the
        receivers at once."""
        me = group.rank
        mine: dict[int, list[int]] = {}
        for (r, i), sender in sorted(assigned.items()):
            if sender == me:
                mine.setdefault(r, []).append(i)

        def to(r: int, i: int) -> Coroutine[Any, Any, None]:
            return self.send_range(group, r, i, [data[leaf][a:b] for leaf, a, b in ranges[i]])

        await _all([_in_turn([to(r, i) for i in indices]) for r, indices in mine.items()])

    async def _receive(self, group: Group, ranges: list[list[Piece]], data: list[np.ndarray],
                       assigned: dict[tuple[int, int], int], kept: HealProgress) -> int:
        """Receive this rank's ranges of the pass from each sender at once, in range order,
        each with its digest into ``kept``. Returns how many came."""
        me = group.rank
        by_sender: dict[int, list[int]] = {}
        for (r, i), sender in sorted(assigned.items()):
            if r == me:
                by_sender.setdefault(sender, []).append(i)

        hashing: list[asyncio.Future[None]] = []

        async def digest(i: int, pieces: list[np.ndarray]) -> None:
            kept.held[i] = await asyncio.to_thread(_digest, pieces)  # checked after the pass

        async def fetch(sender: int, i: int) -> None:
            kept.held.pop(i, None)
            pieces = [data[leaf][a:b] for leaf, a, b in ranges[i]]
            await group.recv(sender, tag=HEAL_TAG, out=pieces, timeout=self.timeout)
            hashing.append(asyncio.ensure_future(digest(i, pieces)))  # the next recv goes on

        try:
            await _all([_in_turn([fetch(s, i) for i in indices])
                        for s, indices in by_sender.items()])
        finally:
            await _all_tasks(hashing)
        return sum(len(indices) for indices in by_sender.values())


@dataclass
class _Vote:
    """The sources' vote on the digests, taken while the first pass moves."""

    agreed: np.ndarray = field(default_factory=lambda: np.zeros((0, DIGEST), np.uint8))
    bad: list[int] = field(default_factory=list)
    failed: HealFailed | None = None


def plan_ranges(sizes: Sequence[int], chunk_bytes: int) -> list[list[Piece]]:
    """The state's bytes (leaves of ``sizes`` bytes, back to back) cut into ranges of
    ``chunk_bytes`` (the last shorter), each as its pieces ``(leaf, first, end)``."""
    ranges: list[list[Piece]] = []
    current: list[Piece] = []
    room = chunk_bytes
    for leaf, size in enumerate(sizes):
        at = 0
        while at < size:
            take = min(room, size - at)
            current.append((leaf, at, at + take))
            at, room = at + take, room - take
            if room == 0:
                ranges.append(current)
                current, room = [], chunk_bytes
    if current:
        ranges.append(current)
    return ranges


def _check(kept: HealProgress, agreed: np.ndarray) -> np.ndarray:
    """The ranges a receiver lacks, or holds with another digest than the agreed one (those
    are forgotten): one byte a range, 1 for "fetch it"."""
    failed = np.zeros(agreed.shape[0], np.uint8)
    for i in range(agreed.shape[0]):
        digest = kept.held.get(i)
        if digest is None or digest != bytes(agreed[i]):
            kept.held.pop(i, None)
            failed[i] = 1
    return failed


def _check_sources(sources: Sequence[int], world_size: int) -> list[int]:
    ranks = list(sources)
    if not ranks or any(not isinstance(r, int) or isinstance(r, bool)
                        or not 0 <= r < world_size for r in ranks):
        raise ValueError(f"sources must be ranks of this group of {world_size} (at least "
                         f"one), got {sources!r}")
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"sources holds a rank twice: {sources!r}")
    return sorted(ranks)


async def _in_background(fn: Callable[[list[np.ndarray], list[list[Piece]]], np.ndarray],
                         data: list[np.ndarray], ranges: list[list[Piece]],
                         yielding: bool = True) -> np.ndarray:
    """``fn(data, ranges)`` in a thread of its own, ``yielding``: at the lowest CPU priority
    (Linux: a thread's own niceness), so that hashing the state takes only what training and
    the transport leave: the loop, zmq's I/O threads and a training step come first."""
    with ThreadPoolExecutor(1, thread_name_prefix="p2pcoll-heal",
                            initializer=_lowest_priority if yielding else None) as pool:
        return await asyncio.get_running_loop().run_in_executor(pool, fn, data, ranges)


def _lowest_priority() -> None:
    with contextlib.suppress(AttributeError, OSError):  # not Linux: as it is
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


def _digest(pieces: Sequence[np.ndarray]) -> bytes:
    h = hashlib.sha256()
    for piece in pieces:
        h.update(piece.data)
    return h.digest()


def _digests(data: list[np.ndarray], ranges: list[list[Piece]]) -> np.ndarray:
    """Every range's digest, one row each."""
    out = np.empty((len(ranges), DIGEST), np.uint8)
    for i, pieces in enumerate(ranges):
        out[i] = np.frombuffer(_digest([data[leaf][a:b] for leaf, a, b in pieces]), np.uint8)
    return out


def _vote(tables: Sequence[np.ndarray], sources: list[int]) -> tuple[np.ndarray, list[int]]:
    """The agreed digest of each range (a strict majority of the sources'), and the sources
    outvoted on any range.

    Raises:
        HealFailed: some range has no majority.
    """
    n = tables[sources[0]].shape[0]
    agreed = np.empty((n, DIGEST), np.uint8)
    bad: set[int] = set()
    split: list[int] = []
    for i in range(n):
        votes: dict[bytes, list[int]] = {}
        for s in sources:
            votes.setdefault(bytes(tables[s][i]), []).append(s)
        digest, holders = max(votes.items(), key=lambda kv: len(kv[1]))
        if 2 * len(holders) <= len(sources):
            split.append(i)
            continue
        agreed[i] = np.frombuffer(digest, np.uint8)
        bad.update(s for s in sources if s not in holders)
    if split:
        raise HealFailed(
            f"heal: the sources {sources} disagree on the bytes of {len(split)} range(s) "
            f"(first: {split[0]}) with no majority: no copy can be trusted",
            ranges=split, bad=[])
    return agreed, sorted(bad)


def _after(sources: list[int], sender: int) -> list[int]:
    """The sources in stripe order, starting after ``sender``."""
    at = sources.index(sender)
    return sources[at + 1:] + sources[:at + 1]


async def _in_turn(coros: list[Coroutine[Any, Any, None]]) -> None:
    """Run ``coros`` in order, :data:`IN_FLIGHT` at a time; each starts (and so takes its
    transfer's number on the channel) in list order. The first failure ends the others, as
    :func:`_all`; a coroutine never started is closed."""
    running: set[asyncio.Future[None]] = set()
    started: list[asyncio.Future[None]] = []
    failed = False
    try:
        for coro in coros:
            while len(running) >= IN_FLIGHT and not failed:
                done, running = await asyncio.wait(running,
                                                   return_when=asyncio.FIRST_COMPLETED)
                failed = any(t.cancelled() or t.exception() is not None for t in done)
            if failed:
                break  # the rest never starts; _all_tasks raises the root cause
            started.append(asyncio.ensure_future(coro))
            running.add(started[-1])
        await _all_tasks(started)
    finally:
        for coro in coros[len(started):]:
            coro.close()
        if any(not t.done() for t in started):
            for task in started:
                task.cancel()
            await asyncio.gather(*started, return_exceptions=True)


async def _all(coros: list[Coroutine[Any, Any, None]]) -> None:
    """Run ``coros`` at once. The first to fail cancels the others, every one is awaited
    (no exception is left unretrieved), and the root cause is raised: a lost peer rather
    than the broken group it left behind."""
    await _all_tasks([asyncio.ensure_future(c) for c in coros])


async def _all_tasks(tasks: list[asyncio.Future[None]]) -> None:
    """:func:`_all` of tasks already started."""
    try:
        await asyncio.gather(*tasks)
    except asyncio.CancelledError:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    except Exception:
        for task in tasks:
            task.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        errors = [r for r in results if isinstance(r, Exception)]
        root = [e for e in errors if not isinstance(e, GroupBroken)] or errors
        raise root[0] from None
