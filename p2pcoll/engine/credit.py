"""Eager credits: how much one sender may leave waiting in a receiver (sans I/O).

Every send is eager: a message goes on the wire at once and, if it comes before its receive,
waits in the receiver's matcher. Unbounded, a fast sender runs arbitrarily far ahead of a
slow receiver (a loop of sends, a broadcast root's loop of collectives): the receiver's
memory grows without bound, and after the sender dies the receiver still takes its backlog
for seconds before it learns of the loss. So each pair of ranks has a window of bytes
(``P2PCOLL_EAGER_WINDOW``, 64 MiB; 0: unbounded) of what the sender sent in *earlier*
operations that the receiver has not yet finished. Each message counts its payload and
:data:`MESSAGE_COST` (what holding it costs beyond its bytes), so empty messages count too.

**The rule.** A message of operation ``op`` to ``peer`` goes at once unless what this rank
sent ``peer`` in operations *before* ``op`` that ``peer`` has not yet finished exceeds the
window; then it waits for credit. Never for ``op``'s own messages: an operation larger than
the window goes whole, as before.

- Collectives: "before" is a smaller sequence number. The receiver credits by its
  watermark (every collective below it has finished there, returned or failed).
- Point-to-point transfers: "before" is everything this rank had sent ``peer`` (in any
  transfer, any tag) when the transfer started (its *mark*). The receiver credits the
  cumulative bytes of the transfers it has finished (and of late messages it dropped).

The two are separate accounts, so a collective never waits on a transfer nor the other way.

**Why collectives never deadlock.** By induction on the sequence number: a wait in
collective ``n`` ends once ``peer`` finishes collectives below ``n``; those finish without
``n`` (a collective's completion needs only its own messages and the ranks having called
it), and their own waits end by the same argument, down to collective 0, which waits for
nothing. So every strategy (ring, trees, recursive doubling, Rabenseifner, direct, striped,
the alltoalls) runs as it did unbounded, whatever it sends within one collective.

**Transfers** follow MPI's standard-mode send: a send may wait until the receiver has taken
enough of what this rank sent it before; a program in which two ranks each send the other
more than the window before either receives is unsafe (as under MPI) and waits until its
deadline. A send never waits on its own transfer nor on later ones.

**Credit goes back in batches.** The receiver reports to a sender once what it finished of
that sender's since its last report reaches half its window (one small control message per
half window, not per message), and at once when a waiting sender asks (a sender asks when
it starts to wait, giving its window: the receiver then reports to it by half of that
window too, so ranks whose windows differ still make progress). Why a waiting sender is
always reported to: it waits only while more than ``W`` of its earlier bytes are
unreported; less than ``W/2`` of them has finished unreported, so more than ``W/2`` has yet
to finish, and finishing it (which the argument above guarantees for collectives, and a
correct program for transfers) crosses the half window and sends a report.

:class:`SendLedger` is the sender's side, :class:`Receipts` the receiver's; both are pure
(no clocks, sockets or tasks); :mod:`.flow` drives them.
"""

from __future__ import annotations

from ..types import OpKey

__all__ = ["MESSAGE_COST", "Receipts", "SendLedger"]

MESSAGE_COST = 1024
"""Bytes one message counts beyond its payload: its header, frames and bookkeeping held in
the receiver (so a stream of empty messages is bounded too)."""


class _Account:
    """What this rank sent one peer that the peer has not credited."""

    __slots__ = ("coll", "coll_bytes", "floor", "marks", "p2p_credited", "p2p_sent")

    def __init__(self) -> None:
        self.coll: dict[int, int] = {}  # collective seq -> bytes sent, seq >= floor
        self.coll_bytes = 0  # their sum
        self.floor = 0  # the peer's watermark: every collective below it finished there
        self.p2p_sent = 0  # bytes of transfers sent, cumulative
        self.p2p_credited = 0  # of those, what the peer reported finished, cumulative
        self.marks: dict[OpKey, int] = {}  # transfer running here -> p2p_sent at its start


class SendLedger:
    """The sender's side: bytes sent to each peer and not yet credited, and whether the
    next message of an operation may go (see the module docstring for the rule).

    >>> ledger = SendLedger(window=4096)
    >>> op0, op1 = OpKey(0), OpKey(1)
    >>> ledger.sent(op0, [1], 8000)  # collective 0 may send any amount
    >>> ledger.may_send(op0, 1), ledger.may_send(op1, 1)
    (True, False)
    >>> ledger.credit(1, floor=1, p2p_credited=0)  # rank 1 finished collective 0
    >>> ledger.may_send(op1, 1)
    True
    """

    __slots__ = ("_accounts", "total", "window")

    def __init__(self, window: int) -> None:
        if window <= 0:
            raise ValueError(f"an eager window is > 0 bytes (0: no ledger at all), not {window}")
        self.window = window
        self._accounts: dict[int, _Account] = {}
        # What each peer has not credited, summed over the peers that owe something (a
        # peer's may dip below zero while its report overtakes our own count of a send,
        # as a collective's may, see sent): no peer's is larger, so while this is within
        # the window every message may go (one compare a send, no account read).
        self.total = 0

    def _account(self, peer: int) -> _Account:
        account = self._accounts.get(peer)
        if account is None:
            account = self._accounts[peer] = _Account()
        return account

    def outstanding(self, peer: int) -> int:
        """Bytes sent ``peer`` that it has not credited (both accounts)."""
        a = self._accounts.get(peer)
        return 0 if a is None else a.coll_bytes + a.p2p_sent - a.p2p_credited

    def begin(self, op: OpKey, peer: int) -> None:
        """Transfer ``op`` to ``peer`` starts here: what was sent ``peer`` until now is what
        its messages may wait for. (Collectives need no call.)"""
        a = self._account(peer)
        a.marks.setdefault(op, a.p2p_sent)

    def end(self, op: OpKey, peer: int) -> None:
        """Transfer ``op`` to ``peer`` has finished here (sent, or failed)."""
        a = self._accounts.get(peer)
        if a is not None:
            a.marks.pop(op, None)

    def may_send(self, op: OpKey, peer: int) -> bool:
        """Whether a message of ``op`` may go to ``peer`` now."""
        a = self._accounts.get(peer)
        window = self.window
        if a is None or a.coll_bytes + a.p2p_sent - a.p2p_credited <= window:
            return True  # (the exact sums below are never larger)
        if op.tag is None:
            seq = op.number
            if seq < a.floor:
                return True  # finished there already (a late message of a failed one)
            return sum(n for s, n in a.coll.items() if s < seq) <= window
        return a.marks.get(op, a.p2p_sent) - a.p2p_credited <= window

    def sent(self, op: OpKey, peers: list[int], nbytes: int) -> None:
        """One message of ``op`` with ``nbytes`` of payload went to each of ``peers``."""
        cost = nbytes + MESSAGE_COST
        for peer in peers:
            a = self._accounts.get(peer) or self._account(peer)
            before = a.coll_bytes + a.p2p_sent - a.p2p_credited
            if op.tag is not None:
                a.p2p_sent += cost
            else:
                seq = op.number
                if seq < a.floor:  # credited already (the report overtook this record)
                    continue
                a.coll[seq] = a.coll.get(seq, 0) + cost
                a.coll_bytes += cost
            self.total += max(before + cost, 0) - max(before, 0)

    def credit(self, peer: int, floor: int, p2p_credited: int) -> None:
        """``peer`` reports: every collective below ``floor`` finished there, and
        ``p2p_credited`` bytes of this rank's transfers (cumulative). Reports may come out
        of order or twice: only what is new counts."""
        a = self._account(peer)
        before = a.coll_bytes + a.p2p_sent - a.p2p_credited
        if p2p_credited > a.p2p_credited:
            a.p2p_credited = p2p_credited
        if floor > a.floor:
            a.floor = floor
            if a.coll:
                done = [s for s in a.coll if s < floor]
                for s in done:
                    a.coll_bytes -= a.coll.pop(s)
        after = a.coll_bytes + a.p2p_sent - a.p2p_credited
        self.total += max(after, 0) - max(before, 0)

    def forget(self, peer: int) -> None:
        """``peer`` has gone: nothing is owed to it any more."""
        self.total -= max(self.outstanding(peer), 0)
        self._accounts.pop(peer, None)

    def most_outstanding(self) -> int:
        """The most bytes any one peer has not credited (for ``stats()``)."""
        return max(map(self.outstanding, self._accounts), default=0)


class Receipts:
    """The receiver's side: what each sender's messages hold here, and when to report.

    ``window`` is this rank's own (0: it reports only to senders that ask). Methods that
    may make a report due return the ranks to report to now; :meth:`report` then gives
    what to send and resets the batch.

    >>> r = Receipts(window=4096)
    >>> r.arrived(OpKey(0), 1, 2000)
    >>> r.held(1)
    3024
    >>> r.collective_finished(1)  # 3024 bytes finished: over half the window
    [1]
    >>> r.report(1)
    (1, 0)
    """

    __slots__ = ("_asked", "_coll", "_credited", "_held", "_p2p", "_pending", "floor",
                 "half", "peak")

    def __init__(self, window: int) -> None:
        if window < 0:
            raise ValueError(f"an eager window is >= 0 bytes, not {window}")
        self.half = window // 2 if window else 0  # 0: only when asked
        self.floor = 0  # the collectives' watermark as last told
        self.peak = 0  # the most bytes one sender's messages held here at once
        self._coll: dict[int, dict[int, int]] = {}  # seq >= floor -> {src: bytes}
        self._p2p: dict[OpKey, int] = {}  # transfer not finished -> bytes arrived
        self._held: dict[int, int] = {}  # src -> bytes arrived, not finished
        self._pending: dict[int, int] = {}  # src -> bytes finished since the last report
        self._credited: dict[int, int] = {}  # src -> bytes of its transfers finished
        self._asked: dict[int, int] = {}  # src -> its half window, when it asked

    def held(self, src: int) -> int:
        """Bytes of ``src``'s messages that arrived for operations not finished here."""
        return self._held.get(src, 0)

    def arrived(self, op: OpKey, src: int, nbytes: int) -> None:
        """A message of ``op`` from ``src`` with ``nbytes`` of payload arrived (and is
        kept, or handed to its receive)."""
        cost = nbytes + MESSAGE_COST
        if op.tag is None:
            seq = op.number
            if seq < self.floor:
                return  # its collective finished: the watermark covers it
            per = self._coll.get(seq)
            if per is None:
                per = self._coll[seq] = {}
            per[src] = per.get(src, 0) + cost
        else:
            self._p2p[op] = self._p2p.get(op, 0) + cost
        held = self._held.get(src, 0) + cost
        self._held[src] = held
        if held > self.peak:
            self.peak = held

    def dropped(self, op: OpKey, src: int, nbytes: int) -> list[int]:
        """A message of ``op`` from ``src`` came after ``op`` finished here and was
        dropped: a transfer's is credited at once (its sender counted it)."""
        if op.tag is None:
            return []
        cost = nbytes + MESSAGE_COST
        self._credited[src] = self._credited.get(src, 0) + cost
        return self._finished(src, cost)

    def collective_finished(self, watermark: int) -> list[int]:
        """Every collective below ``watermark`` has finished here."""
        floor = self.floor
        if watermark <= floor:
            return []
        self.floor = watermark
        coll = self._coll
        if not coll:
            return []
        if watermark - floor <= len(coll):  # nearly always one step
            seqs: list[int] | range = range(floor, watermark)
        else:
            seqs = [s for s in coll if s < watermark]
        due: list[int] = []
        held, pending, half = self._held, self._pending, self.half
        for seq in seqs:
            per = coll.pop(seq, None)
            if per is not None:
                for src, n in per.items():
                    held[src] = held.get(src, n) - n
                    if self._asked:
                        due += self._finished(src, n)
                        continue
                    # (_finished's usual case, inline: nobody asked)
                    now = pending[src] = pending.get(src, 0) + n
                    if half and now >= half:
                        due.append(src)
        return list(dict.fromkeys(due)) if len(due) > 1 else due

    def transfer_finished(self, op: OpKey) -> list[int]:
        """Transfer ``op`` (to this rank) has finished here (received, or failed)."""
        n = self._p2p.pop(op, 0)
        if not n:
            return []
        src = op.src
        self._held[src] = self._held.get(src, n) - n
        self._credited[src] = self._credited.get(src, 0) + n
        return self._finished(src, n)

    def _finished(self, src: int, n: int) -> list[int]:
        """``n`` more bytes of ``src``'s finished: ``[src]`` if a report to it is due."""
        pending = self._pending.get(src, 0) + n
        self._pending[src] = pending
        if not self._asked:  # (nearly always: senders ask only when they wait)
            return [src] if self.half and pending >= self.half else []
        return [src] if self._due(src, pending) else []

    def _due(self, src: int, pending: int) -> bool:
        half = self.half
        asked = self._asked.get(src)
        if asked is not None and (not half or asked < half):
            half = asked
        return pending > 0 and half > 0 and pending >= half

    def ask(self, src: int, window: int) -> bool:
        """``src`` waits for credit with a window of ``window`` bytes: from now on it is
        reported to by half of that window at most. Returns whether a report is due now
        (something finished since the last one: it may be what the sender waits for)."""
        self._asked[src] = max(1, min(window // 2, self._asked.get(src, window // 2)))
        return self._pending.get(src, 0) > 0

    def report(self, src: int) -> tuple[int, int]:
        """What to tell ``src`` now: ``(watermark, its transfer bytes credited)``; the
        batch starts again."""
        self._pending[src] = 0
        return self.floor, self._credited.get(src, 0)

    def forget(self, src: int) -> None:
        """``src`` has gone: nothing more is reported to it."""
        for table in (self._held, self._pending, self._credited, self._asked):
            table.pop(src, None)
        for per in self._coll.values():
            per.pop(src, None)
        for op in [op for op in self._p2p if op.src == src]:
            del self._p2p[op]
