"""Message headers: what a message says about itself, and how that is encoded.

A message is ``[header, payload_0, payload_1, ...]``. A ``data`` message (what collectives
and transfers are made of, so the one kind sent on the hot path) has a fixed binary header,
described below; every other kind has a msgpack map. The first byte tells them apart:
:data:`DATA_MAGIC` (0x50, ``b"P"``) begins a binary frame, and no msgpack map can begin with
it (a map begins with 0x80-0x8f, 0xde or 0xdf). The byte after it is the wire version, so a
binary frame of another version is refused as such, not as garbage.

The msgpack map (control messages)::

    v    format version (WIRE_VERSION)        k    kind: "abort" | "hello" | "bye"
                                                   | "farewell" (a bye was read;
                                                     back on the bye's connection)
                                                   | "why" | "waiting" | "lane" (see below)
                                                   | "gone" (news of a departure)
                                                   | "end" (a link's last message, see
                                                     p2pcoll.transport.links)
                                                   | "credit" (eager credits, below)
    g    group id                             r    source rank
    q    collective sequence number (bye:     meta optional extras (abort and waiting:
         how many the peer had started)            see below)
    err  [error class name, message]          (abort only)
    t    point-to-point tag (abort of a send/recv only)

A map never spells a ``data`` message: the reader refuses one (one encoding per kind).

The binary data frame. Integers are little-endian and unsigned; nothing is padded::

    offset       size     field
    0            1        magic, DATA_MAGIC (0x50)
    1            1        WIRE_VERSION
    2            1        flags: 1 tag, 2 shm (m), 4 described (d), 8 meta; others zero
    3            1        collective code: the index in CALLS ("" = 0, then COLLECTIVES
                          of p2pcoll.strategy up to barrier, "send", "recv", then alltoall)
    4            8        group digest: blake2b of the group id's UTF-8, 8 bytes
    12           4        src     source rank (at most MAX_RANK)
    16           8        seq     collective sequence number (at most 2**62)
    24           4        seg     pipeline segment
    28           4        step    index of the message on its link within (seq, seg)
    32           8        sig     digest of the collective's signature
    40           4        count   payload pieces (at most MAX_PIECES)
    44           4        tag     point-to-point tag, only if flag 1 (then T = 4, else 0)
    44+T         8*count  the byte length of each piece, u64 each (below 2**48)
    44+T+8*count rest     only if a flag 2, 4 or 8 is set: ONE msgpack array holding the
                          flagged parts in this order: m, d, meta (as in the map); without
                          them the frame ends exactly here

A frame is exactly as long as its flags and count say (:data:`DATA_FIXED` = 44 bytes for a
frame with no tag, no pieces and no optional part). :class:`DataHeaders` packs one with a
single ``struct`` call.

The fields:

    group   the group id (the binary frame carries only its digest: see
            :func:`group_digest`; validation compares it with the digest of this peer's group)
    src     source rank                       seg   pipeline segment
    seq     collective sequence number        step  index of the message on its link
    sig     8-byte digest of the collective's signature
    nbytes  the byte length of each payload piece
    described  the signature itself, readable: on the first message of each digest to
            each peer (the receiver keeps it by sender and digest)
    shm     [ring name, [offset per piece], [reader index per piece]]: pieces in the
            sender's shared-memory ring (offset -1: this piece is a frame); optional
    meta    a data message's: the layout a broadcast or scatter root sends (strategy,
            leaves, tree)
    tag     point-to-point tag (data and abort of a send/recv only); q of such a message
            counts the messages its sender sent the receiver on that tag
    collective  the sender's collective, one of CALLS (data only), so that a receiver can
            name it when the two disagree

Kinds: ``data`` carries a collective's payload; ``hello`` and ``bye`` open and close a
peer's part in the session; ``abort`` reports that collective ``q`` failed at its sender
(meta ``{collective, waiting_on, blame, lost, origin, told}``: the ranks it blamed for a
timeout, and how it found them, one of :data:`BLAMES`: they did not answer, they had not
started, or only whom it waits for itself, which its peers need not take for theirs; the
rank a PeerLost names; ``origin``, the rank whose failure it is when the sender only passes
it on over the overlay (see :mod:`p2pcoll.session.failure`; absent: the sender's own); and
``told``, the peers the origin sent it to itself, which take that copy, after the origin's
data on their link, and not one passed on). ``why`` and
``waiting`` are how a rank whose deadline passed finds out whom to blame before it aborts:
it asks every peer ``why`` about collective ``q``, and each answers at once with
``waiting``, meta ``{state, waiting_on}``: one of :data:`STATES` and the ranks its receives
of ``q`` are waiting for. A ``bye`` (``q``: how many collectives its peer started) has meta
``{told, lost, cause}``: ``told`` the peers it went to; only from a peer whose group had
failed, ``lost`` a rank it knows to be lost and ``cause`` what broke its group,
``{q, t, err: [class, message], rank}`` (the operation, as in an abort; ``rank``: whom a
PeerLost names; message at most :data:`MAX_CAUSE_TEXT` characters), which a reader takes as
news of that loss and as that abort before the goodbye itself, so the root cause is never
overtaken by the departure it led to. A ``gone`` (news of a departure, see
:mod:`p2pcoll.departures.overlay`) has meta ``{rank, graceful, how, told, lost, cause}``:
the departed rank, whether it said goodbye, for a lost one how it went if known
(``killed``, ``unresponsive``), and for a goodbye the rest of its ``bye``'s meta.
A ``hello`` may name the sender's shared-memory ring (meta
``ring``) and, to a peer of its host, its lane to that peer and its wake-up pipe (``lane``,
``wake``: see :mod:`p2pcoll.transport.lane`) and the shared-memory board (``board``), and
to a peer of another host its TCP lane's port and token (``tcp_lane``: see
:mod:`p2pcoll.transport.tcp_lane`).
``credit`` returns eager credit (:mod:`p2pcoll.engine.credit`): a report, ``q`` the
receiver's collective watermark and meta ``{b}`` the bytes of the sender's transfers it has
finished (cumulative); or a sender's request for one, meta ``{ask}``: its window in bytes.
``lane`` (meta ``{on: bool}``) says that the sender's next messages come on its lane
(``on``, sent on the socket) or on the socket again (sent on the lane): the receiver
follows it to keep the sender's order.

A point-to-point message (``Group.send``/``Group.recv``) is a ``data`` message with a tag:
not every rank takes part, so its ``seq`` is no collective sequence number but the count of
the sender's earlier sends to the same receiver with the same tag (see
:mod:`p2pcoll.engine.matching`). An ``abort`` with a tag reports a failed send or receive.

Payload frames are the raw bytes of C-contiguous arrays, read back with ``np.frombuffer``.
Nothing in a message can run code: no pickle, only fixed binary fields, msgpack scalars,
strings, lists and maps. Decoding and checking a received message happens in one place,
:mod:`.validation`.
"""

from __future__ import annotations

import hashlib
import re
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import msgpack
import numpy as np

from ..strategy import COLLECTIVES

WIRE_VERSION = 16  # 16: eager credits ("credit", see p2pcoll.engine.credit), which a peer
# of 15 would refuse; 15 (0.21): a probe's row carries the rank's window; 14: a hello may
# name a TCP lane (meta "tcp_lane"), which a peer of 13 would refuse; 13 (0.18): a board
# line says what its sleeper waits for (board version 3: WANTS, NAP, WOKEN); 12 (0.17):
# the shared-memory board keeps four buffers per rank (board version 2), so peers of one
# host must agree on its layout; 11 (0.14): a striped link's turn frames and stripe
# identities ("#i");
# board publishes carry a time stamp; a join may ask to be checked for reachability; 10
# (0.13): the alltoall collective's code; news, aborts and a goodbye's cause say how a lost
# peer went (meta "how": killed, unresponsive); 9 (0.11): links closed
# for the budget and opened again (generations in link identities, "end"); a goodbye (and the
# news of it) carries what broke its peer's group (meta "lost", "cause"); an abort spreads
# over the overlay's fingers, naming the rank whose failure it is (meta "origin") and the
# peers that rank sent it to itself ("told"); 8 (0.10): links on demand, news of departures
# ("gone"); 7 (0.8): data messages have a fixed binary header instead of a msgpack map; hellos
# may name the shared-memory board (6: link identities with the group secret and a nonce;
# rosters in two frames)
KINDS = frozenset({"data", "abort", "hello", "bye", "farewell", "why", "waiting", "lane",
                   "gone", "end", "credit"})
WITH_SEQ = frozenset({"data", "abort", "bye", "why", "waiting", "gone",
                      "credit"})  # kinds that carry "q"
# What a peer answers about a collective, in a "waiting" message.
WAITING, FINISHED, NOT_STARTED, FAILED = "waiting", "finished", "not started", "failed"
STATES = frozenset({WAITING, FINISHED, NOT_STARTED, FAILED})
# How the rank that timed out found whom to blame, in its "abort" message.
SILENT, ABSENT, OWN = "silent", "absent", "own"
BLAMES = frozenset({SILENT, ABSENT, OWN})
DIGEST_BYTES = 8
MAX_TAG = (1 << 32) - 1
MAX_RANK = 1 << 20
MAX_SEQ = 1 << 62
# The cause a goodbye carries (see "bye" below): its error's class name and message.
MAX_CAUSE_NAME = 64
MAX_CAUSE_TEXT = 1024

# The binary data frame (see the module docstring for its layout).
DATA_MAGIC = 0x50  # b"P": a positive fixint to msgpack, never the first byte of a map
DATA_FIXED = struct.Struct("<BBBB8sIQII8sI")  # magic .. count: 44 bytes
TAG_FLAG, SHM_FLAG, DESCRIBED_FLAG, META_FLAG = 1, 2, 4, 8
TAIL_FLAGS = SHM_FLAG | DESCRIBED_FLAG | META_FLAG  # the parts in the msgpack tail
DATA_FLAGS = TAG_FLAG | TAIL_FLAGS
# What a data message's ``collective`` may name, by its one-byte code (the index). The
# collectives added since "send" and "recv" (alltoall) go after them, so no code moves.
_LATER = ("alltoall",)
CALLS = ("", *(c for c in COLLECTIVES if c not in _LATER), "send", "recv", *_LATER)
_CODES = {name: code for code, name in enumerate(CALLS)}
NO_SIG = bytes(DIGEST_BYTES)  # what a data header without a signature digest carries

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
    described: list[Any] | None = None  # the readable signature (once per peer and digest)
    tag: int | None = None  # point-to-point messages only
    collective: str = ""  # data only: the sender's collective, one of CALLS ("" unsaid)

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
            f"{name}: rank {me} has {shown(name, a)}, rank {them} has {shown(name, b)}"
            for name, a, b in zip(SIGNATURE_FIELDS, self.fields, theirs, strict=False)
            if a != b
        ]
        return "; ".join(diffs) or f"rank {them}'s signature differs from rank {me}'s"

    def text(self) -> str:
        return ", ".join(f"{n}={shown(n, v)}"
                         for n, v in zip(SIGNATURE_FIELDS, self.fields, strict=True))


# One leaf of a signature's data field: numpy's dtype code and the shape as a tuple
# (``<f4(4,)``, ``|i1(2, 3)``, ``<f8()``), as p2pcoll.session.calls.describe_data writes it.
_LEAF = re.compile(r"([<>|=])([biufc])(\d+)\(((?:\d+, )*\d*),?\)")


def shown(name: str, value: Any) -> str:
    """A signature field as error messages show it: the data field in the user's terms
    (``float32[4]``, see :func:`readable_data`), the others as Python literals."""
    if name == "data" and isinstance(value, str):
        return readable_data(value)
    return repr(value)


def readable_data(text: str) -> str:
    """The data field of a signature (``<pytree>|<leaf>,<leaf>...``, each leaf numpy's dtype
    code and shape: ``*|<f4(4,)``) in the user's terms: ``float32[4]``, ``int8[2, 3]``,
    ``float64 scalar``, with the pytree named unless it is one array. What the ranks
    compare (and the wire carries) is unchanged; a text not of that form is shown as is."""
    tree, bar, leaves = text.partition("|")
    if not bar:
        return text  # a long layout, by its digest
    shown_leaves = []
    at = 0
    while at < len(leaves):
        match = _LEAF.match(leaves, at)
        if match is None:
            return repr(text)
        order, kind, size, dims = match.groups()
        try:
            dtype = np.dtype(f"{order}{kind}{size}").name
        except (TypeError, ValueError):
            return repr(text)
        shown_leaves.append(f"{dtype}[{dims}]" if dims else f"{dtype} scalar")
        at = match.end()
        if at < len(leaves):
            if leaves[at] != ",":
                return repr(text)
            at += 1
    body = ", ".join(shown_leaves) or "no arrays"
    return body if tree in ("*", "None") else f"{body} in pytree {tree}"


@lru_cache(maxsize=4096)
def _signature(collective: str, strategy: str, op: str, root: int, data: str) -> Signature:
    # A training loop asks for the same few signatures every round: hash each once.
    fields = (collective, strategy, op, root, data)
    raw = msgpack.packb(list(fields), use_bin_type=True)
    return Signature(fields, hashlib.blake2b(raw, digest_size=DIGEST_BYTES).digest())


@lru_cache(maxsize=256)
def group_digest(group: str) -> bytes:
    """The 8 bytes a binary data header carries instead of the group id: blake2b of its
    UTF-8 (computed once per group string)."""
    raw = group.encode("utf-8", "surrogatepass")
    return hashlib.blake2b(raw, digest_size=DIGEST_BYTES).digest()


# One compiled struct per (pieces, tagged) for the piece counts a sender uses again and
# again (other counts are compiled per call); a plain header (no tag, no tail) looks up its
# own by count alone.
_PACKERS: dict[tuple[int, bool], Callable[..., bytes]] = {}
_CACHED_PIECES = 64


def _packer(count: int, tagged: bool) -> Callable[..., bytes]:
    pack = _PACKERS.get((count, tagged))
    if pack is None:
        fmt = DATA_FIXED.format + ("I" if tagged else "") + "Q" * count
        pack = struct.Struct(fmt).pack
        if count <= _CACHED_PIECES:
            _PACKERS[count, tagged] = pack
    return pack


_PLAIN = {count: _packer(count, False) for count in range(9)}


class DataHeaders:
    """The binary headers of one sender's data messages in one group.

    The group's digest and the source rank are fixed once; :meth:`frame` then packs a header
    with one ``struct`` call (no Header, no dict, no msgpack) unless it carries one of the
    rare optional parts, which go into a msgpack tail::

        headers = DataHeaders(group_id, rank)
        frame = headers.frame(seq, seg, step, sig.digest, [4096], collective="allreduce")

    Raises (the constructor):
        ValueError: ``src`` is not a rank from 0 to MAX_RANK.
    """

    __slots__ = ("_digest", "group", "src")

    def __init__(self, group: str, src: int) -> None:
        if type(src) is not int or not 0 <= src <= MAX_RANK:
            raise ValueError(f"source rank {src!r} is not a rank from 0 to {MAX_RANK}")
        self.group = group
        self.src = src
        self._digest = group_digest(group)

    def __repr__(self) -> str:
        return f"DataHeaders({self.group!r}, {self.src})"

    def frame(self, seq: int, seg: int, step: int, sig: bytes, nbytes: Sequence[int], *,
              tag: int | None = None, collective: str = "", shm: list[Any] | None = None,
              described: list[Any] | None = None,
              meta: dict[str, Any] | None = None) -> bytes:
        """The header frame of one data message (see the module docstring for its layout).

        Args:
            seq, seg, step: the message's key (sequence number, segment, index on its link).
            sig: the collective's 8-byte signature digest.
            nbytes: the byte length of each payload piece.
            tag: a point-to-point message's tag (0 to MAX_TAG).
            collective: the sender's collective, one of :data:`CALLS`.
            shm, described, meta: the optional parts (see :class:`Header`).

        Raises:
            ValueError: an unknown collective, a digest that is not 8 bytes, or a number
                that does not fit its field.
        """
        code = _CODES.get(collective)
        if code is None or len(sig) != DIGEST_BYTES:
            raise ValueError(f"data header: collective {collective!r} (one of {CALLS}) and "
                             f"a {DIGEST_BYTES}-byte signature digest expected, got "
                             f"{sig!r}")
        try:
            if tag is None and shm is None and described is None and meta is None:
                count = len(nbytes)
                pack = _PLAIN.get(count) or _packer(count, False)
                head: bytes = pack(DATA_MAGIC, WIRE_VERSION, 0, code, self._digest, self.src,
                                   seq, seg, step, sig, count, *nbytes)
                return head
            flags = 0 if tag is None else TAG_FLAG
            tail: list[Any] = []
            for part, flag in ((shm, SHM_FLAG), (described, DESCRIBED_FLAG),
                               (meta, META_FLAG)):
                if part is not None:
                    flags |= flag
                    tail.append(part)
            fixed = (DATA_MAGIC, WIRE_VERSION, flags, code, self._digest, self.src, seq, seg,
                     step, sig, len(nbytes))
            head = _packer(len(nbytes), tag is not None)(
                *fixed, *(() if tag is None else (tag,)), *nbytes)
        except struct.error as exc:
            raise ValueError(f"data header ({seq=}, {seg=}, {step=}, {tag=}, nbytes="
                             f"{list(nbytes)!r}): a field does not fit: {exc}") from None
        if not tail:
            return head
        packed: bytes = msgpack.packb(tail, use_bin_type=True)
        return head + packed


@lru_cache(maxsize=256)
def _data_headers(group: str, src: int) -> DataHeaders:
    return DataHeaders(group, src)


def encode_header(h: Header) -> bytes:
    """Serialise a header: a data header to its binary frame (a header without a signature
    digest, ``sig == b""``, carries eight zero bytes), any other to its msgpack map.

    Raises:
        ValueError: a data header whose fields do not fit the binary frame (see
            :meth:`DataHeaders.frame`).
    """
    if h.kind == "data":
        return _data_headers(h.group, h.src).frame(
            h.seq, h.seg, h.step, h.sig or NO_SIG, h.nbytes, tag=h.tag,
            collective=h.collective, shm=h.shm, described=h.described, meta=h.meta)
    d: dict[str, Any] = {"v": WIRE_VERSION, "k": h.kind, "g": h.group, "r": h.src}
    if h.kind in WITH_SEQ:
        d["q"] = h.seq  # bye: how many collectives the peer had started when it left
    if h.kind == "abort":
        d["err"] = h.err
    if h.tag is not None:
        d["t"] = h.tag
    if h.meta is not None:
        d["meta"] = h.meta
    packed: bytes = msgpack.packb(d, use_bin_type=True)
    return packed
