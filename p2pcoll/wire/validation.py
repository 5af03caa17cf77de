"""The one validation point for everything a peer receives.

Every received message goes through :func:`validate` before anything else looks at it: the
header's schema (types, not only keys), the claimed source against the link it came on and
the group's roster, the frame count and sizes against the header, the size cap, the dtype
allow-list and shape bounds of a broadcast's layout, the signature digest. It returns a typed
:class:`~.header.Header` or raises :class:`~p2pcoll.ProtocolError`, never anything else, for
any bytes at all (property tests feed it arbitrary msgpack, byte strings and mutated binary
data frames). Pieces that lie in a peer's shared-memory ring are then resolved by the
transport, whose own bounds checks raise ProtocolError too.

A data message's binary header (see :mod:`.header`) is read with ``struct`` after its length
has been checked against what its flags and piece count say, so a hostile frame never makes
it read or allocate beyond the frame; its optional msgpack tail goes through the same checks
as the fields of a msgpack map.

Each ProtocolError carries a ``reason``, one of :data:`REASONS`, by which the transport
counts the messages it drops (``Group.stats()["messages_dropped_by_reason"]``):

    stranger    the link (or the source rank) is no other member of this group
    impostor    a connection that claims a member's rank but is not that rank's link (the
                first link of a rank that speaks is its link for the group; raised by the
                mesh, see ``ZmqMesh``)
    oversize    the message, its header or the payload it names is over a size cap
    version     another wire version
    group       a header for another group (another job, or an earlier one on this port)
    mismatch    the header disagrees with the message it heads or the link it came on: the
                number or sizes of its frames, or a source rank other than the link's
    duplicate   a second message with the same key (raised by the matcher, after this)
    unexpected  a valid message on a connection that does not carry its kind: a farewell
                anywhere but back on the connection its bye went on (raised by the
                transport, see ``Transport.post``)
    malformed   anything else: not msgpack, unknown kinds or keys, wrong types, bounds
                (ProtocolError's default, so the checks below name only the others)

The transport counts a message whose handling raised anything but a ProtocolError (a bug
in p2pcoll, not a bad message) as ``error``.
"""

from __future__ import annotations

import reprlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn, cast

import msgpack
import numpy as np

from ..errors import DEPARTURES, ProtocolError
from ..types import ALLOWED_DTYPES
from .header import (
    BLAMES,
    CALLS,
    DATA_FIXED,
    DATA_FLAGS,
    DATA_MAGIC,
    DESCRIBED_FLAG,
    KINDS,
    MAX_CAUSE_NAME,
    MAX_CAUSE_TEXT,
    MAX_RANK,
    MAX_SEQ,
    MAX_TAG,
    META_FLAG,
    OWN,
    SHM_FLAG,
    SIGNATURE_FIELDS,
    STATES,
    TAG_FLAG,
    TAIL_FLAGS,
    WAITING,
    WIRE_VERSION,
    WITH_SEQ,
    Header,
    group_digest,
)

REASONS = ("stranger", "impostor", "oversize", "version", "group", "mismatch", "duplicate",
           "unexpected", "malformed")

# Bounds on what a header may describe; far above any real use, far below what would let a
# few bytes make a peer allocate gigabytes or recurse without end.
MAX_HEADER_BYTES = 1 << 20
MAX_PIECES = 1 << 16
MAX_LEAVES = 1 << 16
MAX_NDIM = 32
MAX_TREE_DEPTH = 64
MAX_LEAF_BYTES = 1 << 46
MAX_TEXT = 1 << 16
MAX_PIECE_BYTES = 1 << 48
MAX_U32 = (1 << 32) - 1
FIELDS = frozenset({"v", "k", "g", "r", "q", "err", "meta", "t"})  # of a control message
BYE_FIELDS = frozenset({"told", "lost", "cause"})  # of a bye's meta
GONE_FIELDS = frozenset({"rank", "graceful", "how"}) | BYE_FIELDS  # of a gone's meta
GONE_HOWS = ("killed", "unresponsive")  # a lost peer's PeerLost.how, as news carries it
CAUSE_FIELDS = frozenset({"q", "t", "err", "rank", "how"})  # of the cause a goodbye carries
ABORT_FIELDS = frozenset({"collective", "waiting_on", "blame", "lost", "how", "origin", "told"})


@dataclass(frozen=True, slots=True)
class Limits:
    """What a message must agree with: this peer's group, rank, group size and size cap
    (and the group's digest, which binary data headers carry instead of its id)."""

    group: str
    rank: int
    world_size: int
    max_message_bytes: int
    group_digest: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "group_digest", group_digest(self.group))


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlist, _REPR.maxdict = 3, 60, 60, 6, 6


def _short(value: Any) -> str:
    """A bounded repr: a hostile value may be huge or nested thousands deep."""
    return _REPR.repr(value)


# The checks below run for every message a peer receives, so they test exact types
# (``type(v) is int`` refuses bools too) rather than calling isinstance twice.


def _int(d: dict[str, Any], name: str, low: int = 0, high: int = 1 << 62) -> int:
    value = d.get(name)
    if type(value) is not int or not low <= value <= high:
        raise ProtocolError(f"header field {name!r} is {_short(value)}, expected an integer "
                            f"from {low} to {high}")
    return value


def _str(d: dict[str, Any], name: str, limit: int = 256) -> str:
    value = d.get(name)
    if not isinstance(value, str) or len(value) > limit:
        raise ProtocolError(f"header field {name!r} is {_short(value)}, expected a string")
    return value


def _int_list(value: Any, name: str, low: int, count: int | None = None) -> list[int]:
    if not isinstance(value, list) or len(value) > MAX_PIECES or (
            count is not None and len(value) != count):
        raise ProtocolError(f"header field {name!r} is {_short(value)}, expected a list of "
                            f"{count if count is not None else f'at most {MAX_PIECES}'} "
                            f"integers")
    for v in value:
        if type(v) is not int or not low <= v < MAX_PIECE_BYTES:
            raise ProtocolError(f"header field {name!r} holds {_short(v)}, expected integers "
                                f">= {low}")
    return value


def _ranks(value: Any, name: str) -> list[int]:
    if not isinstance(value, list) or len(value) > MAX_PIECES:
        raise ProtocolError(f"header field {name!r} is {_short(value)}, expected a list of "
                            f"ranks")
    for v in value:
        if type(v) is not int or not 0 <= v < MAX_RANK:
            raise ProtocolError(f"header field {name!r} holds {_short(v)}, expected ranks")
    return value


def decode_header(raw: bytes | memoryview) -> Header:
    """Parse and check a header frame on its own (no roster needed).

    A binary data header carries no group id, only its digest: the Header returned here has
    ``group`` set to ``"#"`` and the digest in hex (``"#0f3c..."``, which no group id made by
    p2pcoll looks like); :func:`validate` compares the digest with its own group's instead
    and returns that group's id.

    Raises:
        ProtocolError: not a binary data header nor msgpack, another version, an unknown
            kind, or a field that is missing, of the wrong type or out of bounds.
    """
    header, digest = _decode(raw)
    if digest is not None:
        header.group = "#" + digest.hex()
    return header


def _decode(raw: bytes | memoryview) -> tuple[Header, bytes | None]:
    """The header, and the group digest if it is a binary data header (else None)."""
    if len(raw) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {len(raw)} bytes exceeds {MAX_HEADER_BYTES}",
                            reason="oversize")
    if raw and raw[0] == DATA_MAGIC:
        return _decode_data(raw)
    return _decode_map(raw), None


def _unpack(raw: bytes | memoryview, what: str) -> Any:
    try:
        return msgpack.unpackb(raw, raw=False, strict_map_key=True, max_bin_len=1 << 16,
                               max_str_len=MAX_HEADER_BYTES, max_array_len=MAX_LEAVES,
                               max_map_len=1 << 10, max_ext_len=0)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise ProtocolError(f"{what} is not valid msgpack: {_short(exc)}") from None


# The piece lengths (after the tag, if any) that follow the fixed part, for the counts seen
# again and again; and for a frame without a tail, the whole frame by its size (a size says
# whether it has a tag: 44 + 8 * count bytes without, 48 + 8 * count with).
_PIECES = {(count, tagged): struct.Struct("<" + "I" * tagged + "Q" * count)
           for count in range(9) for tagged in (0, 1)}
_WHOLE = {DATA_FIXED.size + 4 * tagged + 8 * count:
          (struct.Struct(DATA_FIXED.format + "I" * tagged + "Q" * count), tagged)
          for count in range(9) for tagged in (0, 1)}
_NCALLS = len(CALLS)


def _decode_data(raw: bytes | memoryview) -> tuple[Header, bytes]:
    """A binary data header (see :mod:`.header`): every length is checked before it is
    used, so nothing is read or allocated beyond the frame."""
    size = len(raw)
    if size < 2 or raw[1] != WIRE_VERSION:
        got = raw[1] if size >= 2 else "(none)"
        raise ProtocolError(f"wire version {got} in a binary data header, expected "
                            f"{WIRE_VERSION}", reason="version")
    whole = _WHOLE.get(size)
    if whole is not None and not raw[2] & TAIL_FLAGS:
        # The usual frame, in one unpack; whatever does not add up goes the long way below.
        layout, tagged = whole
        (_, _, flags, code, digest, src, seq, seg, step, sig, count,
         *nbytes) = layout.unpack_from(raw)
        tag = nbytes.pop(0) if tagged else None
        if (flags == tagged and count == len(nbytes) and code < _NCALLS and src <= MAX_RANK
                and seq <= MAX_SEQ and (not nbytes or max(nbytes) < MAX_PIECE_BYTES)):
            # Header's fields in order: kind, group, src, seq, seg, step, sig, nbytes, meta,
            # err, shm, described, tag, collective.
            return Header("data", "", src, seq, seg, step, sig, nbytes, None, None, None,
                          None, tag, CALLS[code]), digest
    if size < DATA_FIXED.size:
        raise ProtocolError(f"binary data header of {size} bytes, shorter than its fixed "
                            f"{DATA_FIXED.size}")
    _, _, flags, code, digest, src, seq, seg, step, sig, count = DATA_FIXED.unpack_from(raw)
    if flags & ~DATA_FLAGS or code >= _NCALLS or src > MAX_RANK or seq > MAX_SEQ:
        raise ProtocolError(f"binary data header has flags {flags:#x}, collective code "
                            f"{code}, source {src}, sequence number {seq}: expected flags "
                            f"within {DATA_FLAGS:#x}, a code below {_NCALLS}, a rank up "
                            f"to {MAX_RANK}, a number up to {MAX_SEQ}")
    if count > MAX_PIECES:
        raise ProtocolError(f"binary data header lists {count} pieces, over {MAX_PIECES}")
    tagged = flags & TAG_FLAG
    end = DATA_FIXED.size + 4 * tagged + 8 * count
    if size < end or (size != end and not flags & TAIL_FLAGS):
        raise ProtocolError(f"binary data header of {size} bytes, its flags {flags:#x} and "
                            f"{count} pieces make {end}")
    pieces = _PIECES.get((count, tagged)) or struct.Struct("<" + "I" * tagged + "Q" * count)
    nbytes = list(pieces.unpack_from(raw, DATA_FIXED.size))
    tag = nbytes.pop(0) if tagged else None
    if nbytes and max(nbytes) >= MAX_PIECE_BYTES:
        raise ProtocolError(f"binary data header lists pieces of {_short(nbytes)} bytes, "
                            f"expected fewer than {MAX_PIECE_BYTES}")
    h = Header("data", "", src, seq, seg, step, sig, nbytes, tag=tag, collective=CALLS[code])
    if flags & TAIL_FLAGS:
        if size == end:
            raise ProtocolError(f"binary data header's flags {flags:#x} announce a tail, "
                                f"it has none")
        parts = [flag for flag in (SHM_FLAG, DESCRIBED_FLAG, META_FLAG) if flags & flag]
        tail = _unpack(raw[end:], "binary data header's tail")
        if type(tail) is not list or len(tail) != len(parts):
            raise ProtocolError(f"binary data header's tail is {_short(tail)}, expected a "
                                f"list of {len(parts)} parts (flags {flags:#x})")
        for flag, part in zip(parts, tail, strict=True):
            if flag == SHM_FLAG:
                h.shm = _shm(part, count)
            elif flag == DESCRIBED_FLAG:
                h.described = _described(part)
            else:
                h.meta = _meta("data", part)
    return h, digest


def _decode_map(raw: bytes | memoryview) -> Header:
    d = _unpack(raw, "header")
    if not isinstance(d, dict):
        raise ProtocolError(f"header is a {type(d).__name__}, expected a map")
    version = d.get("v")  # first: another version may well have other keys
    if type(version) is not int or version != WIRE_VERSION:
        raise ProtocolError(f"wire version {_short(version)}, expected {WIRE_VERSION}",
                            reason="version")
    kind = d.get("k")
    if not isinstance(kind, str) or kind not in KINDS:
        raise ProtocolError(f"unknown message kind {_short(kind)}")
    if kind == "data":
        raise ProtocolError("a data message's header is the binary frame (magic 0x50), "
                            "not a msgpack map")
    if not FIELDS.issuperset(d):
        strange = [k for k in d if k not in FIELDS]
        raise ProtocolError(f"header has unknown keys {_short(strange)}")
    h = Header(kind=kind, group=_str(d, "g"), src=_int(d, "r", 0, MAX_RANK))
    if kind in WITH_SEQ:
        h.seq = _int(d, "q", 0, MAX_SEQ)
    if kind == "abort":
        err = d.get("err")
        if not (isinstance(err, list) and len(err) == 2
                and all(isinstance(e, str) and len(e) <= MAX_TEXT for e in err)):
            raise ProtocolError(f"abort header 'err' is {_short(err)}, expected "
                                f"[class, message]")
        h.err = err
    if "t" in d:
        if kind != "abort":
            raise ProtocolError(f"a {kind} message carries no tag")
        h.tag = _int(d, "t", 0, MAX_TAG)
    if d.get("meta") is not None:
        h.meta = _meta(kind, d["meta"])
    elif kind == "lane":
        raise ProtocolError("a lane message says neither on nor off (no meta)")
    elif kind == "gone":
        raise ProtocolError("a gone message names no rank (no meta)")
    return h


def _shm(shm: Any, count: int) -> list[Any]:
    """``m``: [ring name, [offset per piece], [reader index per piece]]."""
    if not (isinstance(shm, list) and len(shm) == 3 and isinstance(shm[0], str)
            and len(shm[0]) <= 256):
        raise ProtocolError(f"header field 'm' is {_short(shm)}, expected "
                            f"[ring name, [offset per piece], [index per piece]]")
    _int_list(shm[1], "m offsets", -1, count)
    _int_list(shm[2], "m indices", -1, count)
    return shm


def _described(described: Any) -> list[Any]:
    """``d``: the readable signature."""
    ok = type(described) is list and len(described) == len(SIGNATURE_FIELDS)
    for v in described if ok else ():
        t = type(v)
        ok = ok and (t is int or (t is str and len(v) <= 1024))
    if not ok:
        raise ProtocolError(f"header field 'd' is {_short(described)}, expected the "
                            f"{len(SIGNATURE_FIELDS)} fields of a signature")
    return cast(list[Any], described)


def _meta(kind: str, meta: Any) -> dict[str, Any]:
    if not isinstance(meta, dict):
        raise ProtocolError(f"header field 'meta' is {_short(meta)}, expected a map")
    _check_meta(kind, meta)
    return meta


def _check_meta(kind: str, meta: dict[str, Any]) -> None:
    """The extras each kind may carry; anything else is refused."""
    if kind == "hello":
        names = ("ring", "lane", "wake", "board", "tcp_lane")
        if set(meta) - set(names) or not all(
                v is None or (isinstance(v, str) and len(v) < 256) for v in meta.values()):
            raise ProtocolError(f"hello meta is {_short(meta)}, expected {{'ring': name, "
                                f"'lane': name, 'wake': name}}")
    elif kind == "gone":
        if (not {"rank", "graceful"} <= set(meta) <= GONE_FIELDS
                or type(meta["graceful"]) is not bool):
            raise ProtocolError(f"gone meta is {_short(meta)}, expected {{'rank': rank, "
                                f"'graceful': true|false, 'told': [rank, ...], 'lost': rank, "
                                f"'cause': {{...}}}}")
        _int(meta, "rank", 0, MAX_RANK)
        _ranks(meta.get("told", []), "told")
        if not meta["graceful"] and ("lost" in meta or "cause" in meta):
            raise ProtocolError("news of a lost peer carries no 'lost' or 'cause' (only a "
                                "goodbye does)")
        if "how" in meta and (meta["graceful"] or meta["how"] not in GONE_HOWS):
            raise ProtocolError(f"gone 'how' is {_short(meta['how'])}: expected one of "
                                f"{GONE_HOWS}, in news of a lost peer")
        _failure_news(meta)
    elif kind == "bye":
        if not {"told"} <= set(meta) <= BYE_FIELDS:
            raise ProtocolError(f"bye meta is {_short(meta)}, expected {{'told': [rank, ...], "
                                f"'lost': rank, 'cause': {{...}}}}")
        _ranks(meta["told"], "told")
        _failure_news(meta)
    elif kind == "end":
        raise ProtocolError(f"an end message carries no meta, not {_short(meta)}")
    elif kind == "lane":
        if set(meta) != {"on"} or type(meta["on"]) is not bool:
            raise ProtocolError(f"lane meta is {_short(meta)}, expected {{'on': true|false}}")
    elif kind == "abort":
        coll, waiting = meta.get("collective", ""), meta.get("waiting_on", [])
        blame = meta.get("blame", OWN)
        for name in ("lost", "origin"):
            if name in meta:
                _int(meta, name, 0, MAX_RANK)
        if (not ABORT_FIELDS.issuperset(meta)
                or not (isinstance(coll, str) and len(coll) <= 256)
                or not (isinstance(blame, str) and blame in BLAMES)):
            raise ProtocolError(f"abort meta is {_short(meta)}, expected {{'collective': "
                                f"name, 'waiting_on': [rank, ...], 'blame': one of "
                                f"{sorted(BLAMES)}, 'lost': rank, 'origin': rank, "
                                f"'told': [rank, ...]}}")
        _ranks(waiting, "waiting_on")
        _ranks(meta.get("told", []), "told")
        _how(meta, "abort")
    elif kind == "waiting":
        state = meta.get("state", WAITING)
        if set(meta) - {"state", "waiting_on"} or not (isinstance(state, str)
                                                        and state in STATES):
            raise ProtocolError(f"waiting meta is {_short(meta)}, expected {{'state': one of "
                                f"{sorted(STATES)}, 'waiting_on': [rank, ...]}}")
        _ranks(meta.get("waiting_on", []), "waiting_on")
    elif kind == "credit":  # a report {b} or a request {ask} (see p2pcoll.engine.credit)
        if len(meta) != 1 or not set(meta) <= {"b", "ask"}:
            raise ProtocolError(f"credit meta is {_short(meta)}, expected {{'b': bytes}} or "
                                f"{{'ask': window}}")
        _int(meta, "b" if "b" in meta else "ask", 0 if "b" in meta else 1, MAX_SEQ)
    elif kind == "data":
        check_layout(meta)
    else:
        raise ProtocolError(f"a {kind} message carries no meta, got {_short(meta)}")


def _failure_news(meta: dict[str, Any]) -> None:
    """The failure a goodbye may carry (see :mod:`.header`): ``lost``, a rank, and ``cause``,
    ``{q, t, err: [class, message], rank}`` with ``q`` and ``err`` required, the class name
    at most MAX_CAUSE_NAME characters and the message MAX_CAUSE_TEXT. (That the ranks are in
    the group is checked in :func:`validate`.)"""
    if "lost" in meta:
        _int(meta, "lost", 0, MAX_RANK)
    if "cause" not in meta:
        return
    cause = meta["cause"]
    if type(cause) is not dict or not {"q", "err"} <= cause.keys() <= CAUSE_FIELDS:
        raise ProtocolError(f"header field 'cause' is {_short(cause)}, expected {{'q': number, "
                            f"'t': tag, 'err': [class, message], 'rank': rank}}")
    _int(cause, "q", 0, MAX_SEQ)
    if "t" in cause:
        _int(cause, "t", 0, MAX_TAG)
    if "rank" in cause:
        _int(cause, "rank", 0, MAX_RANK)
    _how(cause, "cause")
    err = cause["err"]
    if not (type(err) is list and len(err) == 2
            and type(err[0]) is str and 0 < len(err[0]) <= MAX_CAUSE_NAME
            and type(err[1]) is str and len(err[1]) <= MAX_CAUSE_TEXT):
        raise ProtocolError(f"header field 'cause' has 'err' {_short(err)}, expected [class "
                            f"name of at most {MAX_CAUSE_NAME} characters, message of at most "
                            f"{MAX_CAUSE_TEXT}]")


def _how(meta: dict[str, Any], where: str) -> None:
    """How the rank a PeerLost names went (its ``how``), if ``meta`` says."""
    if "how" in meta and meta["how"] not in DEPARTURES:
        raise ProtocolError(f"{where} 'how' is {_short(meta['how'])}, expected one of "
                            f"{DEPARTURES}")


def check_layout(meta: dict[str, Any]) -> None:
    """The layout a broadcast or scatter root sends: strategy, leaf dtypes/shapes, tree."""
    if set(meta) - {"strategy", "leaves", "tree"}:
        raise ProtocolError(f"data meta has unknown keys {_short(sorted(map(str, meta)))}")
    name, leaves = meta.get("strategy"), meta.get("leaves")
    if not isinstance(name, str) or not name.isidentifier() or len(name) > 64:
        raise ProtocolError(f"layout names strategy {_short(name)}, expected an identifier")
    if not isinstance(leaves, list) or len(leaves) > MAX_LEAVES:
        raise ProtocolError(f"layout leaves are {_short(leaves)}, expected a list")
    for spec in leaves:
        if not (isinstance(spec, list) and len(spec) == 2 and isinstance(spec[0], str)
                and isinstance(spec[1], list) and len(spec[1]) <= MAX_NDIM):
            raise ProtocolError(f"layout leaf {_short(spec)}, expected [dtype, shape]")
        if spec[0] not in ALLOWED_DTYPES:
            raise ProtocolError(f"layout leaf dtype {_short(spec[0])} is not allowed")
        count = 1
        for n in spec[1]:
            if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                raise ProtocolError(f"layout leaf shape {_short(spec[1])} is not a shape")
            count *= n
            if count > MAX_LEAF_BYTES:
                raise ProtocolError(f"layout leaf shape {_short(spec[1])} is too large")
        if count * np.dtype(spec[0]).itemsize > MAX_LEAF_BYTES:
            raise ProtocolError(f"layout leaf shape {_short(spec[1])} is too large")
    if "tree" in meta and meta["tree"] is not None:
        found = _tree_leaves(meta["tree"], 0)
        if found != len(leaves):
            raise ProtocolError(f"layout tree has {found} leaves, the layout {len(leaves)}")


def _tree_leaves(td: Any, depth: int) -> int:
    """Check a pytree definition (see p2pcoll.pytree) and count its leaves."""
    if td == "*":
        return 1
    if depth > MAX_TREE_DEPTH or not (isinstance(td, list) and len(td) == 2
                                      and td[0] in ("d", "l", "t") and isinstance(td[1], list)):
        raise ProtocolError(f"layout tree node {_short(td)} is malformed")
    if td[0] == "d":
        total = 0
        for item in td[1]:
            if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str)):
                raise ProtocolError(f"layout tree entry {_short(item)} is malformed")
            total += _tree_leaves(item[1], depth + 1)
        return total
    return sum(_tree_leaves(child, depth + 1) for child in td[1])


def validate(link: int, header_frame: bytes | memoryview, payload_sizes: Sequence[int],
             limits: Limits) -> Header:
    """Check one received message against the wire format and this peer's group.

    Args:
        link: the rank of the link the message came on (from its identity).
        header_frame: the first frame.
        payload_sizes: the byte length of each further frame.
        limits: this peer's group, rank, group size and size cap.

    Returns:
        The decoded header; the caller resolves pieces that lie in shared memory.

    Raises:
        ProtocolError: for anything that does not fit; the message must be dropped.
    """
    # A stranger's message is refused before anything is decoded: parsing a dense 1 MiB
    # header costs the event loop a good part of a second.
    if not 0 <= link < limits.world_size or link == limits.rank:
        raise ProtocolError(f"message on the link of rank {link}, which is no other member "
                            f"of this group of {limits.world_size}", reason="stranger")
    total = len(header_frame) + sum(payload_sizes)
    if total > limits.max_message_bytes:
        raise ProtocolError(f"message of {total} bytes exceeds the "
                            f"{limits.max_message_bytes}-byte cap", reason="oversize")
    # (_decode, inline: once a message)
    if len(header_frame) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {len(header_frame)} bytes exceeds {MAX_HEADER_BYTES}",
                            reason="oversize")
    if header_frame and header_frame[0] == DATA_MAGIC:
        header, digest = _decode_data(header_frame)
    else:
        header, digest = _decode_map(header_frame), None
    nbytes = header.nbytes
    if header.shm is None:
        # All pieces are frames, whose sizes were within the cap above.
        if payload_sizes != nbytes and list(payload_sizes) != nbytes:
            _mismatch(header, payload_sizes, nbytes)
    else:
        inline = [n for n, at in zip(nbytes, header.shm[1], strict=True) if at == -1]
        if list(payload_sizes) != inline:
            _mismatch(header, payload_sizes, inline)
        if sum(nbytes) > limits.max_message_bytes:
            raise ProtocolError(f"message names {sum(nbytes)} payload bytes, over the "
                                f"{limits.max_message_bytes}-byte cap", reason="oversize")
    if digest is None:
        if header.group != limits.group:
            raise ProtocolError(f"message for group {_short(header.group)}, this is "
                                f"{limits.group!r}", reason="group")
    elif digest != limits.group_digest:
        raise ProtocolError(f"message for another group (digest {digest.hex()}), this is "
                            f"{limits.group!r} ({limits.group_digest.hex()})", reason="group")
    else:
        header.group = limits.group
    if header.src != link:  # the link is another member's (checked first), so src is too
        raise ProtocolError(f"header claims rank {header.src} but came on rank {link}'s link",
                            reason="mismatch")
    if header.meta is not None and header.kind != "data":  # a data message's: its layout
        _in_group(header.kind, header.meta, limits.world_size)
    return header


def _in_group(kind: str, meta: dict[str, Any], world_size: int) -> None:
    """The ranks a control message's meta names are ranks of this group."""
    if kind in ("gone", "bye"):
        named = [meta.get("rank", 0), meta.get("lost", 0), *meta.get("told", ())]
        if "cause" in meta:
            named.append(meta["cause"].get("rank", 0))
    elif kind == "abort":
        named = [meta.get("origin", 0), meta.get("lost", 0), *meta.get("told", ())]
    elif kind == "waiting":
        strange = [r for r in meta.get("waiting_on", ()) if r >= world_size]
        if strange:
            raise ProtocolError(f"waiting message names ranks {_short(strange)}, not in this "
                                f"group of {world_size}")
        return
    else:
        return
    if max(named) >= world_size:
        raise ProtocolError(f"{kind} message names ranks {_short(named)}, not all in this "
                            f"group of {world_size}")


def _mismatch(header: Header, payload_sizes: Sequence[int], inline: list[int]) -> NoReturn:
    """Say how the frames of a message differ from the pieces its header lists."""
    if header.kind != "data":
        raise ProtocolError(f"a {header.kind} message has {len(payload_sizes)} payload frames",
                            reason="mismatch")
    if len(payload_sizes) != len(inline):
        raise ProtocolError(f"header lists {len(inline)} payload frames, message has "
                            f"{len(payload_sizes)}", reason="mismatch")
    for i, (got, want) in enumerate(zip(payload_sizes, inline, strict=True)):
        if got != want:
            raise ProtocolError(f"payload frame {i} has {got} bytes, header says {want}",
                                reason="mismatch")
    raise ProtocolError(f"payload frames of {_short(list(payload_sizes))} bytes, header says "
                        f"{_short(inline)}", reason="mismatch")
