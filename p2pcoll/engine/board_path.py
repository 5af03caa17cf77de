"""Small collectives on the board: no messages, no event-loop round trip when the peers
are already there.

When every peer of a group shares this host, rank 0 creates the group's board
(:mod:`p2pcoll.transport.board`) and allreduce, reduce, broadcast and barrier of
up to :data:`~p2pcoll.transport.board.SLOT_BYTES`, and alltoall of any size
(:mod:`.board_alltoall`), run on it instead of as messages. A rank
copies its data into its slot and publishes a count; the ranks that need it read it in
place. The reductions fold the slots in rank order 0, 1, ..., p-1 on every rank, so every
rank gets the same bits (and integer results equal every other strategy's).

Waiting. A rank first polls its peers' counts for a budget learned from how late they
recently arrived, at most ``P2PCOLL_SPIN`` microseconds (of its own time on the core, which
it yields between polls, when there are more peers than cores: hybrid waiting,
:mod:`p2pcoll.engine.waiting`), then sleeps: it says so in its line, with whom it waits
for, and the peer whose publication completes that writes a byte into its wake-up pipe
(the lanes' own, :class:`~p2pcoll.transport.lane.Wakeup`), once per sleep. Both sides
fence between their store and their load, so a publish never misses a sleeper; a timer
that backs off to :data:`MAX_NAP` covers the failures that arrive as messages (a peer's
abort). A collective whose peers have published returns without awaiting anything: the
awaitable completes in the caller's step.

Failures. A board collective runs under the failure model like any other (deadline, lost
peers: the sleep is where they end it) and is matched by the session's sequence number,
written beside the data, so a rank that runs another collective, or the same one as
messages (another size), is a :class:`~p2pcoll.errors.CollectiveMismatch` naming the
field, not a hang.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any, NamedTuple

import msgpack
import numpy as np

from ..errors import CollectiveMismatch, ProtocolError
from ..strategy import COLLECTIVES
from ..transport.board import (
    ATTACHED,
    CODES,
    COUNT,
    DEPTH,
    DIGEST,
    EVERY_OTHER,
    FIELDS,
    FLAGS,
    META,
    NAP,
    NBYTES,
    PARITY,
    SEQ,
    SLEEPING,
    SOME,
    STAMP,
    VIA_MESSAGES,
    WANTS,
    WOKEN,
    WORDS,
    Board,
)
from ..types import OpKey
from ..transport.shmfile import barrier as fence
from ..wire import Signature
from .board_mismatch import OPS, mismatch, stray_mismatch
from .matching import Matcher
from .waiting import Patience, yield_core

MIN_NAP, MAX_NAP = 1e-3, 0.02
# A board collective whose peers are there never yields to the event loop; one that starts
# this long after the loop last turned under the board yields once first, so a loop of
# board collectives still lets heartbeats and the transport's callbacks run.
TURN_EVERY = 1e-3


class _Plan(NamedTuple):
    """A reduction's place on the board: its bytes, and per parity, per rank, a typed view
    of each leaf's part of that rank's slot."""

    nbytes: int
    views: tuple[tuple[tuple[np.ndarray, ...], ...], ...]


@lru_cache(maxsize=1024)  # every board call asks: a cached answer is a tenth of the work
def codes(collective: str, op: str, root: int) -> int:
    """The CODES word: what a rank thinks a board collective is, field by field."""
    return (COLLECTIVES.index(collective) + 1) | (_op_code(op) << 8) | ((root + 1) << 16)


def _op_code(op: str) -> int:
    return OPS.index(op) if op in OPS else 255  # custom ops: compared by the digest


# As a decorator, errstate costs half of the context manager made at every call (0.4 us,
# not 0.9): a small collective's result folds under it every call.
@np.errstate(all="ignore")  # inf and NaN are what the op gives, as in the message path
def _fold(fold: Callable[..., Any], arrays: Sequence[np.ndarray],
          views: Sequence[Sequence[np.ndarray]]) -> None:
    """Fold every rank's slot (``views[q][i]``, rank order) into ``arrays[i]``."""
    ufunc = fold if isinstance(fold, np.ufunc) else None
    first, second, rest = views[0], views[1], views[2:]
    for i, a in enumerate(arrays):
        if ufunc is not None:
            ufunc(first[i], second[i], out=a)
            for part in rest:
                ufunc(a, part[i], out=a)
        else:
            np.copyto(a, first[i])
            fold(a, second[i], out=a)
            for part in rest:
                fold(a, part[i], out=a)


class BoardPath:
    """Runs board collectives for one session (one per group epoch)."""

    def __init__(self, board: Board, matcher: Matcher, spin: float) -> None:
        self.board = board
        self.matcher = matcher
        self.rank, self.size = board.rank, board.world_size
        self.others = [q for q in range(self.size) if q != self.rank]
        # Never poll for a peer of this process (tasks of one event loop: polling would
        # only hold it up).
        pids = [int(v) for v in board.words[:, ATTACHED]]
        alone = pids.count(os.getpid()) == 1
        self.spin = spin if alone else 0.0  # the ceiling of every wait's polling
        self.patience = Patience(self.spin, self.size)
        self._quick = int(self.patience.quick * 1e9)  # ns every wait polls first
        # More peers than cores: a partner may be waiting for this rank's core, so a poll
        # yields it (with a core per peer it would go to the host's other work instead).
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
        self.crowded = self.size > cores
        # A crowded wait's polling (ns): its own time on the core and the clock's so far,
        # and the most on the clock (a sleep's first nap, or the ceiling if longer).
        self._held = self._polled = 0
        self._reach = int(max(self.spin, MIN_NAP) * 1e9)
        self.slot_bytes = board.slot_bytes
        self._w = board.control()
        self._me = self.rank * WORDS
        self._waiter: asyncio.Future[None] | None = None
        self._naps = 0  # this rank's sleeps so far (its NAP word)
        self._peers_of = [[r for r in range(self.size) if r != q] for q in range(self.size)]
        # Board collectives run one at a time per rank, in the order they were called: the
        # number in flight, and the turns of those that wait (no future when none waits).
        self._inflight = 0
        self._turns: deque[asyncio.Future[None]] = deque()
        # When the event loop last turned under a board collective, and whether one has
        # finished since (then a message collective turns it first: see owes_turn).
        self._turned = 0.0
        self.owes_turn = False
        # The signature of the board collective running now (for mismatch messages), each
        # signature's digest word and readable form, and the digest whose readable form
        # is in my meta area of each parity.
        self.sig: Signature | None = None
        # What this rank ran at a recent sequence number (set by the session's runner).
        self.history: Callable[[int], Signature | None] = lambda seq: None
        self._signatures: dict[bytes, tuple[int, bytes]] = {}
        self._written: list[int | None] = [None] * DEPTH
        board.on_wake = self._on_wake
        # Called at close: what keeps files of its own for the board's collectives (the
        # alltoall's windows, :mod:`.board_alltoall`).
        self.closing: list[Callable[[], None]] = []

    # --- the protocol's steps ---------------------------------------------------------

    def _on_wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _missing(self, count: int, ranks: Sequence[int]) -> int:
        """The first of ``ranks`` that has not published ``count`` yet, or -1."""
        w = self._w
        for q in ranks:
            if w[q * WORDS + COUNT] < count:
                return q
        return -1

    async def _wait(self, count: int, ranks: Sequence[int], seq: int) -> None:
        """Until every one of ``ranks`` has published ``count``: poll, then sleep."""
        first = self._missing(count, ranks)
        if first < 0:
            return
        began = time.monotonic_ns()
        w, patience, crowded = self._w, self.patience, self.crowded
        poll = self._poll_crowded if crowded else self._poll
        self._held = self._polled = 0
        # A quick poll first: partners found meanwhile came early, which teaches a sure
        # policy nothing (waiting.py). Else poll on for the budget of those not there yet.
        found = poll(count, ranks, began, self._quick)
        if found and patience.sure:
            return
        if not found:
            late = [first] if len(ranks) == 1 else \
                [q for q in ranks if w[q * WORDS + COUNT] < count] or [first]
            if not poll(count, ranks, began, int(patience.budget(late) * 1e9)):
                await self._sleep(count, ranks, seq)
        # Learnt only from waits that ended well: how late each partner published (its
        # stamp unchecked: the budget stays in the ceiling whatever it says); crowded, one
        # found while this rank polled came within the time it held the core.
        if patience.ceiling:
            polled, held = self._polled, self._held
            for q in ranks:
                after = w[q * WORDS + STAMP] - began
                patience.learn(q, (min(after, held) if after <= polled else after) * 1e-9)

    def _poll(self, count: int, ranks: Sequence[int], began: int, budget: int) -> bool:
        """Poll for ``ranks`` until ``budget`` ns after ``began`` (``time.monotonic_ns()``);
        whether they all published ``count``. It looks at least once."""
        missing, clock = self._missing, time.monotonic_ns
        until = began + budget
        while clock() < until:
            if missing(count, ranks) < 0:
                return True
        return missing(count, ranks) < 0

    def _poll_crowded(self, count: int, ranks: Sequence[int], began: int,
                      budget: int) -> bool:
        """:meth:`_poll` with more peers than cores (waiting.py): it yields the core
        between looks, and only the time it held the core (its thread's CPU time, summed
        over the wait's polls in :attr:`_held`) counts against ``budget``; at most
        :attr:`_reach` ns after ``began`` on the clock (then in :attr:`_polled`)."""
        missing, cpu, clock = self._missing, time.thread_time_ns, time.monotonic_ns
        start, until = cpu() - self._held, began + self._reach
        try:
            while missing(count, ranks) >= 0:
                if cpu() - start >= budget or clock() >= until:
                    return False
                yield_core()
            return True
        finally:
            self._held, self._polled = cpu() - start, clock() - began

    async def _sleep(self, count: int, ranks: Sequence[int], seq: int) -> None:
        """Sleep until ``ranks`` have published ``count``, woken by the publisher that
        completes them (:meth:`_due`) or by a timer that backs off to MAX_NAP.

        Raises:
            PeerLost, CollectiveTimeout, CollectiveMismatch: what ended collective
                ``seq`` meanwhile.
        """
        w, me, matcher = self._w, self._me, self.matcher
        loop = asyncio.get_running_loop()
        nap = MIN_NAP
        op = OpKey(seq)
        # Whom it still waits for, as it goes to sleep (a timeout's inquiry and the
        # flight record ask): those that have not published yet.
        matcher.note_waiting(op, [q for q in ranks if w[q * WORDS + COUNT] < count])
        # Whom it sleeps for: the peer whose publication completes it wakes it (_publish).
        w[me + WANTS] = ranks[0] if len(ranks) == 1 else \
            EVERY_OTHER if len(ranks) == len(self.others) else SOME  # SOME: anyone wakes it
        try:
            while True:
                self._naps += 1
                w[me + NAP] = self._naps  # before SLEEPING: a waker reads them after it
                w[me + SLEEPING] = count
                fence()  # the stores above before the loads below (see the docstring)
                if self._missing(count, ranks) < 0:
                    return
                failure = matcher.failure(op) or self._stray(seq)
                if failure is not None:
                    raise failure
                waiter = self._waiter = loop.create_future()
                timer = loop.call_later(nap, self._on_wake)
                try:
                    await waiter
                    self._turned = time.perf_counter()
                finally:
                    timer.cancel()
                    self._waiter = None
                nap = min(nap * 2, MAX_NAP)
        finally:
            w[me + SLEEPING] = 0

    def _publish(self, count: int) -> None:
        w = self._w
        w[self._me + STAMP] = time.monotonic_ns()  # before the count: see waiting.py
        w[self._me + COUNT] = count
        fence()  # the count before the loads of who sleeps (see the docstring)
        behind = None
        for q in self.others:
            until = w[q * WORDS + SLEEPING]
            if until:
                if behind is None:  # read once per publication, after the fence
                    behind = self._behind(count)
                if self._due(q, until, count, behind):
                    self.board.wake(q)

    def _behind(self, count: int) -> int:
        """The one peer that has not published ``count`` yet; -1: none, -2: several."""
        w, found = self._w, -1
        for q in self.others:
            if w[q * WORDS + COUNT] < count:
                if found >= 0:
                    return -2
                found = q
        return found

    def _due(self, q: int, until: int, count: int, behind: int) -> bool:
        """Whether rank ``q``, asleep until its peers publish ``until``, is this rank's to
        wake now: what it waits for (its WANTS; SOME, or a word that does not add up:
        anything) is there, and no peer has woken it from this nap (then this rank notes it WOKEN).
        Of peers that publish together the last finds it complete (each fences between
        its count and these loads); a WOKEN nap's wake-up is on its way (it was written
        after q noted the NAP, before it slept). ``behind``: :meth:`_behind` of ``count``,
        this rank's publication (what every peer of q has published, when ``until`` is
        ``count`` and no peer but q is behind)."""
        w, line = self._w, q * WORDS
        wants = w[line + WANTS]
        if wants == EVERY_OTHER:
            if until == count:
                if behind != -1 and behind != q:
                    return False
            elif self._missing(until, self._peers_of[q]) >= 0:
                return False
        elif 0 <= wants < self.size and wants != q:
            if w[wants * WORDS + COUNT] < until:
                return False
        nap = w[line + NAP]
        if w[line + WOKEN] == nap:
            return False
        w[line + WOKEN] = nap
        return True

    def _fields(self, parity: int, seq: int, digest: int, nbytes: int, code: int,
                meta: int = 0, flags: int = 0) -> None:
        base = self._me + PARITY + parity * FIELDS
        w = self._w
        w[base + SEQ], w[base + DIGEST], w[base + NBYTES] = seq, digest, nbytes
        w[base + CODES], w[base + META], w[base + FLAGS] = code, meta, flags

    def _check(self, q: int, parity: int, seq: int, digest: int | None, code: int,
               nbytes: int | None) -> tuple[int, int, int]:
        """Read rank ``q``'s fields of this collective and compare them with mine.

        Returns its (nbytes, meta bytes, flags).

        Raises:
            CollectiveMismatch: it called another collective (named field by field).
            ProtocolError: its line does not add up (a corrupt board).
        """
        w = self._w
        base = q * WORDS + PARITY + parity * FIELDS
        if (digest is not None and nbytes is not None and w[base + SEQ] == seq
                and w[base + DIGEST] == digest and w[base + NBYTES] == nbytes
                and w[base + CODES] == code and w[base + FLAGS] == 0):
            return nbytes, 0, 0  # the usual case: all agree (the digest covers the rest)
        theirs = (w[base + SEQ], w[base + DIGEST], w[base + NBYTES], w[base + CODES],
                  w[base + META], w[base + FLAGS])
        t_seq, t_digest, t_nbytes, t_code, t_meta, t_flags = theirs
        if not (0 <= t_nbytes <= self.slot_bytes and 0 <= t_meta <= self.board.meta_bytes
                and t_flags in (0, VIA_MESSAGES)):
            raise ProtocolError(f"rank {q}'s line of the shared-memory board does not add "
                                f"up: {theirs}")
        if t_seq != seq or t_code != code or (nbytes is not None and t_nbytes != nbytes) \
                or (digest is not None and t_digest != digest):
            raise mismatch(self, q, parity, seq, code, nbytes, theirs)
        return t_nbytes, t_meta, t_flags

    def _signed(self, sig: Signature, parity: int) -> tuple[int, int]:
        """The digest of ``sig`` as a board word, with its readable form in my meta area of
        ``parity`` (written when it changes: a loop of one call writes it once per buffer); returns
        (digest, bytes of the readable form)."""
        self.sig = sig
        known = self._signatures.get(sig.digest)
        if known is None:
            packed = msgpack.packb(list(sig.fields), use_bin_type=True)
            known = (int.from_bytes(sig.digest, "little", signed=True), packed)
            if len(packed) > self.board.meta_bytes:
                known = (known[0], b"")
            if len(self._signatures) > 1024:
                self._signatures.clear()
            self._signatures[sig.digest] = known
        digest, packed = known
        if self._written[parity] != digest:
            self.board.meta[self.rank][parity][:len(packed)] = np.frombuffer(packed, np.uint8)
            self._written[parity] = digest
        return digest, len(packed)

    async def _start(self, seq: int) -> int:
        """Wait for this call's turn, take the next board count and wait until its buffer
        is free (every peer has published count - DEPTH + 1, so has finished reading
        count - DEPTH, the buffer's last use). Pair with :meth:`_end`."""
        self._inflight += 1
        if self._inflight > 1 or time.perf_counter() - self._turned > TURN_EVERY:
            await self._queue()
        count = self.board.count = self.board.count + 1
        if count > DEPTH and self._missing(count - DEPTH + 1, self.others) >= 0:
            await self._wait(count - DEPTH + 1, self.others, seq)
        return count

    async def _queue(self) -> None:
        """:meth:`_start`'s wait for the call's turn, or its turn of the event loop."""
        if self._inflight > 1:  # waiting for its turn turns the loop anyway
            turn = asyncio.get_running_loop().create_future()
            self._turns.append(turn)
            await turn
        else:
            await self.turn()

    async def turn(self) -> None:
        """One turn of the event loop: the transport's callbacks that are due (what earlier
        collectives sent, a shared-memory ring's releases) run. The session's runner calls
        it before a message collective when :attr:`owes_turn`: without it, a 1 MiB
        allreduce right after a board barrier found its ring still full and went over the
        socket (0.9 ms, not 0.3 ms)."""
        await asyncio.sleep(0)
        self._turned = time.perf_counter()
        self.owes_turn = False

    def _end(self, seq: int) -> None:
        """This call's board work is over (done or failed): the next one's turn."""
        self.owes_turn = True
        if not self.board.unlinked:  # rank 0, until every peer has mapped the board
            self.board.unlink_when_all_attached()
        self._inflight -= 1
        while self._turns:
            turn = self._turns.popleft()
            if not turn.done():  # a cancelled call's turn is skipped
                turn.set_result(None)
                return

    def _stray(self, seq: int) -> CollectiveMismatch | None:
        return stray_mismatch(self, seq)

    # --- the collectives --------------------------------------------------------------
    # Each runs under _start/_end (reduction inlines them); the bodies (_barrier, ...) follow.

    async def reduction(self, seq: int, collective: str, arrays: Sequence[np.ndarray],
                        fold: Callable[..., Any], op: str, sig: Signature,
                        root: int | None, plan: _Plan) -> None:
        """allreduce (``root`` None) or reduce, in place in ``arrays`` (flat, contiguous,
        together at most the slot; ``plan`` from :meth:`plan`). :meth:`_start` inlined, and
        nothing awaited where nothing need be: one coroutine per call (a loop of small
        allreduces spends more on frames than on the board)."""
        try:
            self._inflight += 1
            if self._inflight > 1 or time.perf_counter() - self._turned > TURN_EVERY:
                await self._queue()
            count = self.board.count = self.board.count + 1
            others = self.others
            if count > DEPTH and self._missing(count - DEPTH + 1, others) >= 0:
                await self._wait(count - DEPTH + 1, others, seq)
            parity = count % DEPTH
            code = codes(collective, op, -1 if root is None else root)
            views = plan.views[parity]
            for a, slot in zip(arrays, views[self.rank], strict=True):
                np.copyto(slot, a)
            digest, described = self._signed(sig, parity)
            nbytes = plan.nbytes
            self._fields(parity, seq, digest, nbytes, code, described)
            self._publish(count)
            if root is not None and root != self.rank:
                return
            if self._missing(count, others) >= 0:
                await self._wait(count, others, seq)
            w, at = self._w, PARITY + parity * FIELDS
            for q in others:  # _check's usual case inlined: every field agrees
                base = q * WORDS + at
                if (w[base + SEQ] != seq or w[base + DIGEST] != digest or w[base + FLAGS]
                        or w[base + NBYTES] != nbytes or w[base + CODES] != code):
                    self._check(q, parity, seq, digest, code, nbytes)
            _fold(fold, arrays, views)
        finally:
            self._end(seq)

    async def barrier(self, seq: int, sig: Signature) -> None:
        try:
            await self._barrier(await self._start(seq), seq, sig)
        finally:
            self._end(seq)

    async def broadcast_root(self, seq: int, arrays: Sequence[np.ndarray],
                             layout: bytes) -> bool:
        """The root's part: its data and packed ``layout`` on the board (they fit: the
        caller checked), or (``layout`` empty) word that they come as messages. Returns
        whether they went here."""
        try:
            return await self._broadcast_root(await self._start(seq), seq, arrays, layout)
        finally:
            self._end(seq)

    async def broadcast_receive(self, seq: int, root: int) -> tuple[bytes, np.ndarray] | None:
        """A non-root's part: the root's layout and payload (a view of its slot, valid
        until this rank's next board collective), or None: they come as messages."""
        try:
            return await self._broadcast_receive(await self._start(seq), seq, root)
        finally:
            self._end(seq)

    def plan(self, arrays: Sequence[np.ndarray]) -> _Plan:
        """Where each of ``arrays`` lies in the slots: built once per prepared call."""
        spans, at = [], 0
        for a in arrays:
            spans.append((at, a.nbytes, a.dtype))
            at += (a.nbytes + 7) & ~7
        board = self.board
        views = tuple(
            tuple(tuple(board.data[q][b][lo:lo + n].view(dtype) for lo, n, dtype in spans)
                  for q in range(self.size))
            for b in range(DEPTH))
        return _Plan(sum(a.nbytes for a in arrays), views)

    async def _barrier(self, count: int, seq: int, sig: Signature) -> None:
        parity = count % DEPTH
        code = codes("barrier", "", -1)
        digest, described = self._signed(sig, parity)
        self._fields(parity, seq, digest, 0, code, described)
        self._publish(count)
        await self._wait(count, self.others, seq)
        for q in self.others:
            self._check(q, parity, seq, digest, code, 0)

    async def _broadcast_root(self, count: int, seq: int, arrays: Sequence[np.ndarray],
                              layout: bytes) -> bool:
        parity = count % DEPTH
        code = codes("broadcast", "", self.rank)
        board = self.board
        if layout:
            mine, at = board.data[self.rank][parity], 0
            for a in arrays:
                n = a.nbytes
                mine[at:at + n] = a.view(np.uint8)
                at += (n + 7) & ~7
            board.meta[self.rank][parity][:len(layout)] = np.frombuffer(layout, np.uint8)
            self._fields(parity, seq, 0, at, code, len(layout))
        else:
            self._fields(parity, seq, 0, 0, code, 0, VIA_MESSAGES)
        self._publish(count)
        return bool(layout)

    async def _broadcast_receive(self, count: int, seq: int,
                                 root: int) -> tuple[bytes, np.ndarray] | None:
        parity = count % DEPTH
        code = codes("broadcast", "", root)
        self._fields(parity, seq, 0, 0, code)
        self._publish(count)
        await self._wait(count, (root,), seq)
        nbytes, meta, flags = self._check(root, parity, seq, None, code, None)
        if flags & VIA_MESSAGES:
            return None
        board = self.board
        layout = bytes(board.meta[root][parity][:meta])
        return layout, board.data[root][parity][:nbytes]

    def close(self) -> None:
        for close in self.closing:
            close()
        self._w.release()
        self.board.on_wake = None


__all__ = ["BoardPath", "codes"]
