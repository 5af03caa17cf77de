"""The wire format: one msgpack header frame, then one raw frame per array piece.

A message is ``[header, payload_0, payload_1, ...]``. The header is a msgpack map::

    v    format version (WIRE_VERSION)        k    kind: "data" | "abort" | "hello" | "bye"
    g    group id                             r    source rank
    q    collective sequence number           seg  pipeline segment
    s    index of the message on its link     sig  collective signature (data only)
         within (q, seg)
    n    byte length of each payload piece    meta optional extras (tree layout, strategy)
    err  [error class name, message]          (abort only)
    m    [ring name, [offset per piece],      pieces in the sender's shared-memory ring
          [reader index per piece]]           (offset -1: this piece is a frame); data only,
                                              optional

Payload frames are the raw bytes of C-contiguous arrays, sent without copying and read back
with ``np.frombuffer``. Between peers of one host large pieces may instead lie in the
sender's shared-memory ring (:mod:`.transport.shm`); then the message has frames only for
the other pieces. Nothing in a message can run code: no pickle, only msgpack scalars,
strings, lists and maps, and dtypes from an allow-list.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack

from .errors import ProtocolError

WIRE_VERSION = 1
KINDS = frozenset({"data", "abort", "hello", "bye"})


@dataclass(slots=True)
class Header:
    """A decoded message header."""

    kind: str
    group: str
    src: int
    seq: int = 0
    seg: int = 0
    step: int = 0
    sig: list[Any] = field(default_factory=list)
    nbytes: list[int] = field(default_factory=list)
    meta: dict[str, Any] | None = None
    err: list[str] | None = None
    shm: list[Any] | None = None  # [ring name, [offset or -1 per piece], [index per piece]]

    @property
    def key(self) -> tuple[int, int, int, int]:
        """The mailbox key that matches this message to the receive waiting for it."""
        return (self.seq, self.seg, self.src, self.step)


def encode_header(h: Header) -> bytes:
    """Serialise a header to its msgpack frame."""
    d: dict[str, Any] = {"v": WIRE_VERSION, "k": h.kind, "g": h.group, "r": h.src}
    if h.kind == "data":
        d.update(q=h.seq, seg=h.seg, s=h.step, sig=h.sig, n=h.nbytes)
        if h.shm is not None:
            d["m"] = h.shm
    elif h.kind == "abort":
        d.update(q=h.seq, err=h.err)
    if h.meta is not None:
        d["meta"] = h.meta
    return msgpack.packb(d, use_bin_type=True)


def _field(d: dict[str, Any], name: str, typ: type | tuple[type, ...]) -> Any:
    value = d.get(name)
    if not isinstance(value, typ) or isinstance(value, bool) and typ is int:
        raise ProtocolError(f"header field {name!r} is {value!r}, expected {typ}")
    return value


def decode_header(raw: bytes | memoryview) -> Header:
    """Parse and validate a header frame.

    Raises:
        ProtocolError: the frame is not msgpack, has another version, or a field is missing
            or of the wrong type.
    """
    try:
        d = msgpack.unpackb(raw, raw=False, strict_map_key=True, max_bin_len=0)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"header is not valid msgpack: {exc}") from None
    if not isinstance(d, dict):
        raise ProtocolError(f"header is a {type(d).__name__}, expected a map")
    if d.get("v") != WIRE_VERSION:
        raise ProtocolError(f"wire version {d.get('v')!r}, expected {WIRE_VERSION}")
    kind = d.get("k")
    if kind not in KINDS:
        raise ProtocolError(f"unknown message kind {kind!r}")
    h = Header(kind=kind, group=_field(d, "g", str), src=_field(d, "r", int))
    if kind in ("data", "abort"):
        h.seq = _field(d, "q", int)
    if kind == "data":
        h.seg = _field(d, "seg", int)
        h.step = _field(d, "s", int)
        h.sig = _field(d, "sig", list)
        h.nbytes = _field(d, "n", list)
        if not all(isinstance(n, int) and n >= 0 for n in h.nbytes):
            raise ProtocolError(f"header field 'n' must list frame sizes, got {h.nbytes!r}")
        shm = d.get("m")
        if shm is not None:
            if not (
                isinstance(shm, list) and len(shm) == 3 and isinstance(shm[0], str)
                and all(isinstance(v, list) and len(v) == len(h.nbytes) for v in shm[1:])
                and all(isinstance(o, int) and not isinstance(o, bool) and o >= -1
                        for v in shm[1:] for o in v)
            ):
                raise ProtocolError(
                    f"header field 'm' must be [name, [offset per piece], [index per piece]],"
                    f" got {shm!r}"
                )
            h.shm = shm
    elif kind == "abort":
        err = _field(d, "err", list)
        if len(err) != 2 or not all(isinstance(e, str) for e in err):
            raise ProtocolError(f"abort header 'err' must be [class, message], got {err!r}")
        h.err = err
    meta = d.get("meta")
    if meta is not None and not isinstance(meta, dict):
        raise ProtocolError(f"header field 'meta' must be a map, got {meta!r}")
    h.meta = meta
    return h


# The signature every data message carries: what the sender thinks the collective is.
SIGNATURE_FIELDS = ("collective", "strategy", "op", "root", "data")


def describe_mismatch(mine: list[Any], theirs: list[Any], me: int, them: int) -> str:
    """Say which fields of two collective signatures differ."""
    diffs = [
        f"{name}: rank {me} has {a!r}, rank {them} has {b!r}"
        for name, a, b in zip(SIGNATURE_FIELDS, mine, theirs, strict=False)
        if a != b
    ]
    if len(mine) != len(theirs):
        diffs.append(f"signature length {len(mine)} vs {len(theirs)}")
    return "; ".join(diffs)
