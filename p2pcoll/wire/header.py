"""Message headers: what a message says about itself, and how that is encoded.

A message is ``[header, payload_0, payload_1, ...]``. The header is a msgpack map::

    v    format version (WIRE_VERSION)        k    kind: "data" | "abort" | "hello" | "bye"
                                                   | "farewell" (a bye was read)
                                                   | "why" | "waiting" | "lane" (see below)
    g    group id                             r    source rank
    q    collective sequence number (bye:     seg  pipeline segment
         how many the peer had started)
    s    index of the message on its link     sig  8-byte digest of the collective's
         within (q, seg)                           signature (data only)
    d    the signature itself, readable       n    byte length of each payload piece
         (first message of a link only)       meta optional extras (tree layout, strategy;
                                                   abort and waiting: see below)
    err  [error class name, message]          (abort only)
    t    point-to-point tag (data and abort   q of such a message counts the messages
         of a send/recv only)                 its sender sent the receiver on that tag
    m    [ring name, [offset per piece],      pieces in the sender's shared-memory ring
          [reader index per piece]]           (offset -1: this piece is a frame); optional

Kinds: ``data`` carries a collective's payload; ``hello`` and ``bye`` open and close a
peer's part in the session; ``abort`` reports that collective ``q`` failed at its sender
(meta ``{collective, waiting_on, blame}``: the ranks it blamed for a timeout, and how it
found them, one of :data:`BLAMES`: they did not answer, they had not started, or only whom
it waits for itself, which its peers need not take for theirs). ``why`` and
``waiting`` are how a rank whose deadline passed finds out whom to blame before it aborts:
it asks every peer ``why`` about collective ``q``, and each answers at once with
``waiting``, meta ``{state, waiting_on}``: one of :data:`STATES` and the ranks its receives
of ``q`` are waiting for. A ``hello`` may name the sender's shared-memory ring (meta
``ring``) and, to a peer of its host, its lane to that peer and its wake-up pipe (``lane``,
``wake``: see :mod:`p2pcoll.transport.lane`). ``lane`` (meta ``{on: bool}``) says that the
sender's next messages come on its lane (``on``, sent on the socket) or on the socket again
(sent on the lane): the receiver follows it to keep the sender's order.

A point-to-point message (``Group.send``/``Group.recv``) is a ``data`` message with a tag
``t``: not every rank takes part, so its ``q`` is no collective sequence number but the
count of the sender's earlier sends to the same receiver with the same tag (see
:mod:`p2pcoll.engine.matching`). An ``abort`` with a tag reports a failed send or receive.

Payload frames are the raw bytes of C-contiguous arrays, read back with ``np.frombuffer``.
Nothing in a message can run code: no pickle, only msgpack scalars, strings, lists and
maps. Decoding and checking a received message happens in one place, :mod:`.validation`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import msgpack

WIRE_VERSION = 7  # 7: hellos may name the shared-memory board (6: link identities with the
# group secret and a nonce; rosters in two frames)
KINDS = frozenset({"data", "abort", "hello", "bye", "farewell", "why", "waiting", "lane"})
WITH_SEQ = frozenset({"data", "abort", "bye", "why", "waiting"})  # kinds that carry "q"
# What a peer answers about a collective, in a "waiting" message.
WAITING, FINISHED, NOT_STARTED, FAILED = "waiting", "finished", "not started", "failed"
STATES = frozenset({WAITING, FINISHED, NOT_STARTED, FAILED})
# How the rank that timed out found whom to blame, in its "abort" message.
SILENT, ABSENT, OWN = "silent", "absent", "own"
BLAMES = frozenset({SILENT, ABSENT, OWN})
DIGEST_BYTES = 8
MAX_TAG = (1 << 32) - 1

# The signature of a collective: what the sender thinks the collective is. Every data
# message carries its digest; two ranks whose digests differ called different collectives.
SIGNATURE_FIELDS = ("collective", "strategy", "op", "root", "data")


@dataclass(slots=True)
class Header:
    """A message header (decoded, or about to be encoded)."""

    kind: str
    group: str
    src: int
    seq: int = 0
    seg: int = 0
    step: int = 0
    sig: bytes = b""
    nbytes: list[int] = field(default_factory=list)
    meta: dict[str, Any] | None = None
    err: list[str] | None = None
    shm: list[Any] | None = None  # [ring name, [offset or -1 per piece], [index per piece]]
    described: list[Any] | None = None  # the readable signature, on a link's first message
    tag: int | None = None  # point-to-point messages only

    @property
    def key(self) -> tuple[int, int, int, int]:
        """(seq, segment, src, index): what matches a collective's message to its receive
        (a point-to-point message's operation also names its receiver and tag: see
        :meth:`p2pcoll.engine.matching.Matcher.op_of`)."""
        return (self.seq, self.seg, self.src, self.step)


@dataclass(frozen=True, slots=True)
class Signature:
    """What a rank thinks a collective is; equal on every rank that agrees."""

    fields: tuple[Any, ...]
    digest: bytes

    @classmethod
    def of(cls, collective: str, strategy: str, op: str, root: int, data: str) -> Signature:
        return _signature(collective, strategy, op, root, data)

    @property
    def collective(self) -> str:
        return str(self.fields[0])

    def describe_difference(self, theirs: Sequence[Any] | None, me: int, them: int) -> str:
        """Say which fields differ from another rank's readable signature."""
        if theirs is None:
            return (f"rank {them} sent a message of another collective signature than "
                    f"rank {me}'s {self.text()}")
        diffs = [
            f"{name}: rank {me} has {a!r}, rank {them} has {b!r}"
            for name, a, b in zip(SIGNATURE_FIELDS, self.fields, theirs, strict=False)
            if a != b
        ]
        return "; ".join(diffs) or f"rank {them}'s signature differs from rank {me}'s"

    def text(self) -> str:
        return ", ".join(f"{n}={v!r}" for n, v in zip(SIGNATURE_FIELDS, self.fields, strict=True))


@lru_cache(maxsize=4096)
def _signature(collective: str, strategy: str, op: str, root: int, data: str) -> Signature:
    # A training loop asks for the same few signatures every round: hash each once.
    fields = (collective, strategy, op, root, data)
    raw = msgpack.packb(list(fields), use_bin_type=True)
    return Signature(fields, hashlib.blake2b(raw, digest_size=DIGEST_BYTES).digest())


def encode_header(h: Header) -> bytes:
    """Serialise a header to its msgpack frame."""
    d: dict[str, Any] = {"v": WIRE_VERSION, "k": h.kind, "g": h.group, "r": h.src}
    if h.kind in WITH_SEQ:
        d["q"] = h.seq  # bye: how many collectives the peer had started when it left
    if h.kind == "data":
        d.update(seg=h.seg, s=h.step, sig=h.sig, n=h.nbytes)
        if h.shm is not None:
            d["m"] = h.shm
        if h.described is not None:
            d["d"] = h.described
    elif h.kind == "abort":
        d["err"] = h.err
    if h.tag is not None:
        d["t"] = h.tag
    if h.meta is not None:
        d["meta"] = h.meta
    packed: bytes = msgpack.packb(d, use_bin_type=True)
    return packed
