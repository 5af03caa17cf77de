"""The binary header of data messages (p2pcoll.wire.header's docstring draws its layout).

A data header is a fixed struct, not a msgpack map: packed once per message by
``DataHeaders.frame`` (and ``encode_header``), read back at the one validation point. These
tests hold it to its description byte by byte, round-trip every combination of its optional
parts, and feed ``decode_header`` and ``validate`` arbitrary, mutated, truncated and extended
frames and frames claiming huge piece counts: a typed Header or a ProtocolError with one of
the documented reasons, never anything else, and never an allocation beyond the frame.
"""

from __future__ import annotations

import itertools
import struct
import tracemalloc
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2pcoll.errors import ProtocolError
from p2pcoll.strategy import COLLECTIVES
from p2pcoll.wire import (
    CALLS,
    DIGEST_BYTES,
    KINDS,
    MAX_TAG,
    REASONS,
    WIRE_VERSION,
    DataHeaders,
    Header,
    Limits,
    Signature,
    decode_header,
    encode_header,
    group_digest,
    validate,
)
from p2pcoll.wire.header import DATA_FIXED, DATA_MAGIC, MAX_RANK, MAX_SEQ
from p2pcoll.wire.validation import MAX_PIECES

GROUP = "g-binary"
# A cap above any piece a header may list (2**48 - 1), so round trips of huge pieces pass.
LIMITS = Limits(GROUP, rank=0, world_size=4, max_message_bytes=1 << 62)
LINK = 1
SIG = Signature.of("allreduce", "ring", "sum", -1, "<f4[1024]")
SHM = ["p2pcoll-ring-1", [-1, 4096], [-1, 0]]
LAYOUT = {"strategy": "binomial", "leaves": [["<f4", [2, 3]], ["<i8", []]],
          "tree": ["d", [["a", "*"], ["b", ["l", ["*"]]]]]}
FUZZ = settings(max_examples=300, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])


def inline_sizes(h: Header) -> list[int]:
    offsets = h.shm[1] if h.shm is not None else [-1] * len(h.nbytes)
    return [n for n, at in zip(h.nbytes, offsets, strict=True) if at == -1]


def refused(fn: Any) -> ProtocolError:
    """The ProtocolError ``fn`` raises, whose reason must be one of REASONS."""
    with pytest.raises(ProtocolError) as info:
        fn()
    assert info.value.reason in REASONS, info.value.reason
    return info.value


def header_or_refused(fn: Any) -> Header | None:
    """A Header of the documented types, or None for a ProtocolError with a known reason;
    nothing else may come out."""
    try:
        h = fn()
    except ProtocolError as exc:
        assert exc.reason in REASONS, exc.reason
        return None
    assert isinstance(h, Header) and h.kind in KINDS
    if h.kind == "data":
        assert isinstance(h.sig, bytes) and len(h.sig) == DIGEST_BYTES
        assert h.collective in CALLS
        assert all(type(n) is int and 0 <= n < 1 << 48 for n in h.nbytes)
        assert len(h.nbytes) <= MAX_PIECES
        assert 0 <= h.src <= MAX_RANK and 0 <= h.seq <= MAX_SEQ
        assert h.tag is None or 0 <= h.tag <= MAX_TAG
    return h


def both(raw: bytes | memoryview, sizes: list[int] | None = None,
         link: int = LINK) -> Header | None:
    """decode_header and validate on one frame; where both accept it they agree."""
    decoded = header_or_refused(lambda: decode_header(raw))
    if sizes is None:
        sizes = inline_sizes(decoded) if decoded is not None else []
    h = header_or_refused(lambda: validate(link, raw, sizes, LIMITS))
    if h is not None:
        assert decoded is not None and h.group == GROUP
        if raw[:1] == bytes([DATA_MAGIC]):
            assert decoded.group == "#" + group_digest(GROUP).hex()
            decoded.group = GROUP
        assert decoded == h
    return h


def data_header(**fields: Any) -> Header:
    base: dict[str, Any] = dict(seq=7, seg=2, step=1, sig=SIG.digest, nbytes=[4096, 8],
                                collective="allreduce")
    return Header("data", GROUP, LINK, **{**base, **fields})


# --- the layout, byte by byte -------------------------------------------------------------

def test_the_frame_is_laid_out_as_documented() -> None:
    raw = encode_header(data_header(seq=2**40 + 3, seg=5, step=6, nbytes=[4096, 8], tag=9,
                                    collective="reduce_scatter"))
    assert len(raw) == DATA_FIXED.size + 4 + 2 * 8 == 64
    assert raw[0] == DATA_MAGIC == 0x50 and raw[1] == WIRE_VERSION
    assert raw[2] == 1  # flags: a tag, nothing else
    assert raw[3] == 1 + COLLECTIVES.index("reduce_scatter") == CALLS.index("reduce_scatter")

    def u(at: int, size: int) -> int:
        return int.from_bytes(raw[at:at + size], "little")

    assert raw[4:12] == group_digest(GROUP)
    assert (u(12, 4), u(16, 8), u(24, 4), u(28, 4)) == (LINK, 2**40 + 3, 5, 6)
    assert raw[32:40] == SIG.digest
    assert (u(40, 4), u(44, 4), u(48, 8), u(56, 8)) == (2, 9, 4096, 8)
    # Without a tag the pieces follow the count directly: 44 + 8 * count bytes.
    plain = encode_header(data_header(nbytes=[4096]))
    assert len(plain) == 52 and plain[2] == 0 and int.from_bytes(plain[44:], "little") == 4096


def test_the_codes_of_collectives() -> None:
    # Collectives added later (alltoall) go after send and recv: no older code moves.
    assert CALLS == ("", *COLLECTIVES[:COLLECTIVES.index("barrier") + 1], "send", "recv",
                     "alltoall")
    for code, name in enumerate(CALLS):
        raw = encode_header(data_header(collective=name))
        assert raw[3] == code
        assert decode_header(raw).collective == name


def test_the_group_digest_is_blake2b_of_the_id_and_cached() -> None:
    import hashlib

    assert group_digest(GROUP) == hashlib.blake2b(GROUP.encode(), digest_size=8).digest()
    assert group_digest(GROUP) is group_digest(GROUP)
    assert LIMITS.group_digest == group_digest(GROUP)
    assert Limits("other", 0, 2, 1) .group_digest != LIMITS.group_digest
    assert "group_digest" not in repr(LIMITS)  # derived, not part of what Limits says


def test_no_msgpack_map_begins_like_a_binary_frame() -> None:
    """A msgpack map begins with 0x80-0x8f (fixmap), 0xde (map 16) or 0xdf (map 32); every
    other kind is still such a map, and the binary frame's first byte is none of them."""
    map_starts = set(range(0x80, 0x90)) | {0xDE, 0xDF}
    for n in (0, 1, 15, 16, 70000):
        assert msgpack.packb({str(i): 0 for i in range(n)})[0] in map_starts
    assert DATA_MAGIC not in map_starts
    assert msgpack.unpackb(bytes([DATA_MAGIC])) == DATA_MAGIC  # to msgpack: an integer
    for kind in sorted(KINDS - {"data"}):
        h = Header(kind, GROUP, LINK, seq=1, err=["E", "m"] if kind == "abort" else None,
                   meta={"on": True} if kind == "lane" else None)
        assert encode_header(h)[0] in map_starts, kind


# --- round trips --------------------------------------------------------------------------

PARTS = list(itertools.product([None, 12345], [None, SHM], [None, list(SIG.fields)],
                               [None, LAYOUT]))


@pytest.mark.parametrize("tag, shm, described, meta", PARTS)
def test_every_combination_of_optional_parts_round_trips(
    tag: int | None, shm: list[Any] | None, described: list[Any] | None,
    meta: dict[str, Any] | None,
) -> None:
    h = data_header(tag=tag, shm=shm, described=described, meta=meta,
                    collective="send" if tag is not None else "broadcast")
    raw = encode_header(h)
    flags = ((tag is not None) | (shm is not None) << 1 | (described is not None) << 2
             | (meta is not None) << 3)
    assert raw[0] == DATA_MAGIC and raw[2] == flags
    fixed = DATA_FIXED.size + 4 * (tag is not None) + 8 * len(h.nbytes)
    tail = [part for part in (shm, described, meta) if part is not None]
    assert raw[fixed:] == (msgpack.packb(tail) if tail else b"")
    assert raw == DataHeaders(GROUP, LINK).frame(
        h.seq, h.seg, h.step, h.sig, h.nbytes, tag=tag, collective=h.collective, shm=shm,
        described=described, meta=meta)
    assert both(raw) == h
    back = decode_header(raw)
    assert (back.tag, back.shm, back.described, back.meta) == (tag, shm, described, meta)


def test_extremes_round_trip() -> None:
    for h in (data_header(nbytes=[]), data_header(nbytes=[(1 << 48) - 1] * 3),
              data_header(seq=MAX_SEQ, seg=2**32 - 1, step=2**32 - 1, tag=MAX_TAG),
              Header("data", GROUP, 3, sig=bytes(8), nbytes=[0]),
              data_header(nbytes=list(range(70)))):  # a count no struct is cached for
        raw = encode_header(h)
        back = validate(h.src, raw, inline_sizes(h), LIMITS)
        assert back == h


def test_a_header_without_a_signature_carries_zeros() -> None:
    back = decode_header(encode_header(Header("data", GROUP, LINK, nbytes=[8])))
    assert back.sig == bytes(DIGEST_BYTES)


def test_the_fast_encoder_is_encode_header() -> None:
    headers = DataHeaders(GROUP, LINK)
    assert repr(headers) == f"DataHeaders({GROUP!r}, {LINK})"
    h = data_header(nbytes=[4096])
    assert headers.frame(h.seq, h.seg, h.step, h.sig, (4096,),
                         collective="allreduce") == encode_header(h)


@pytest.mark.parametrize("call, match", [
    (lambda d: d.frame(0, 0, 0, b"short", [1]), "8-byte signature digest"),
    (lambda d: d.frame(0, 0, 0, SIG.digest, [1], collective="alltoallw"), "'alltoallw'"),
    (lambda d: d.frame(-1, 0, 0, SIG.digest, [1]), "does not fit"),
    (lambda d: d.frame(0, 2**32, 0, SIG.digest, [1]), "does not fit"),
    (lambda d: d.frame(0, 0, 0, SIG.digest, [-1]), "does not fit"),
    (lambda d: d.frame(0, 0, 0, SIG.digest, [1], tag=MAX_TAG + 1), "does not fit"),
    (lambda d: d.frame(0, 0, 0, SIG.digest, [1], tag=-1, meta=LAYOUT), "does not fit"),
])
def test_what_does_not_fit_is_a_value_error(call: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call(DataHeaders(GROUP, LINK))


def test_a_source_rank_out_of_range_is_a_value_error() -> None:
    for src in (-1, MAX_RANK + 1, True):
        with pytest.raises(ValueError, match="source rank"):
            DataHeaders(GROUP, src)


# --- what validation says about bad frames ------------------------------------------------

def _frame(**fields: Any) -> bytearray:
    return bytearray(encode_header(data_header(**fields)))


def _set(raw: bytearray, at: int, size: int, value: int) -> bytes:
    raw[at:at + size] = value.to_bytes(size, "little")
    return bytes(raw)


@pytest.mark.parametrize("make, sizes, reason, match", [
    (lambda: _set(_frame(), 1, 1, WIRE_VERSION + 1), [4096, 8], "version",
     f"wire version {WIRE_VERSION + 1}"),
    (lambda: bytes([DATA_MAGIC]), [], "version", "wire version"),
    (lambda: bytes(_frame())[:43], [4096, 8], "malformed", "shorter than its fixed 44"),
    (lambda: bytes(_frame()) + b"\0", [4096, 8], "malformed", "make 60"),
    (lambda: bytes(_frame())[:-1], [4096, 8], "malformed", "make 60"),
    (lambda: _set(_frame(), 2, 1, 0x10), [4096, 8], "malformed", "flags 0x10"),
    (lambda: _set(_frame(), 2, 1, 1), [4096, 8], "malformed", "make 64"),  # tag, no room
    (lambda: _set(_frame(), 2, 1, 4), [4096, 8], "malformed", "announce a tail"),
    (lambda: _set(_frame(), 3, 1, len(CALLS)), [4096, 8], "malformed", "collective code"),
    (lambda: _set(_frame(), 12, 4, MAX_RANK + 1), [4096, 8], "malformed", "source"),
    (lambda: _set(_frame(), 16, 8, MAX_SEQ + 1), [4096, 8], "malformed", "sequence number"),
    (lambda: _set(_frame(), 40, 4, MAX_PIECES + 1), [4096, 8], "malformed", "pieces, over"),
    (lambda: _set(_frame(), 40, 4, 2**32 - 1), [4096, 8], "malformed", "pieces, over"),
    (lambda: _set(_frame(), 40, 4, 3), [4096, 8], "malformed", "make 68"),
    (lambda: _set(_frame(), 44, 8, 1 << 48), [1 << 48, 8], "malformed", "fewer than"),
    (lambda: _set(_frame(), 4, 8, 0), [4096, 8], "group", "another group"),
    (lambda: _set(_frame(), 12, 4, 2), [4096, 8], "mismatch", "claims rank 2"),
    (lambda: bytes(_frame()), [4096], "mismatch", "lists 2 payload frames"),
    (lambda: bytes(_frame()), [4096, 9], "mismatch", "payload frame 1 has 9 bytes"),
    (lambda: bytes(_frame(nbytes=[1 << 31])), [], "mismatch", "lists 1 payload frames"),
    (lambda: bytes(_frame(shm=["r", [0], [0]], nbytes=[1 << 31])), [], "oversize", "cap"),
    (lambda: bytes(_frame(meta=LAYOUT)) + b"\0", [4096, 8], "malformed", "not valid msgpack"),
    (lambda: bytes(_frame(meta=LAYOUT))[:-1], [4096, 8], "malformed", "not valid msgpack"),
    (lambda: _set(_frame(meta=LAYOUT), 2, 1, 2), [4096, 8], "malformed", "'m'"),
    (lambda: _set(_frame(meta=LAYOUT), 2, 1, 12), [4096, 8], "malformed", "2 parts"),
    (lambda: bytes(_frame(nbytes=[4096])) + msgpack.packb([]), [4096], "malformed", "make 52"),
])
def test_validate_names_what_is_wrong_with_a_binary_frame(
    make: Any, sizes: list[int], reason: str, match: str
) -> None:
    limits = Limits(GROUP, 0, 4, (1 << 31) - 1 if reason == "oversize" else 1 << 62)
    exc = refused(lambda: validate(LINK, make(), sizes, limits))
    assert exc.reason == reason, exc
    assert match in str(exc), exc


def test_the_tail_goes_through_the_same_checks_as_a_map() -> None:
    """One bad part in the tail, each refused with the message a control message's field
    gets."""
    for bad, match in [
        ({"strategy": "binomial", "leaves": [["O", []]]}, "dtype 'O' is not allowed"),
        ({"strategy": "x", "leaves": [], "evil": 1}, "unknown keys"),
    ]:
        with pytest.raises(ProtocolError, match=match):
            decode_header(encode_header(data_header(meta=bad)))
    described = encode_header(data_header(described=["allreduce", "ring", 1.5, -1, "x"]))
    with pytest.raises(ProtocolError, match="fields of a signature"):
        decode_header(described)


def test_a_data_header_spelled_as_a_map_is_refused() -> None:
    """One encoding per kind: the fields of the binary frame in a msgpack map are no data
    message (0.8.0 never wrote one; the reader refused nothing of it until 0.9.0)."""
    h = data_header(tag=3, shm=SHM, described=list(SIG.fields), meta=LAYOUT, collective="")
    as_map = msgpack.packb({"v": WIRE_VERSION, "k": "data", "g": GROUP, "r": LINK, "q": h.seq,
                            "seg": h.seg, "s": h.step, "sig": h.sig, "n": h.nbytes,
                            "t": h.tag, "m": h.shm, "d": h.described, "meta": h.meta})
    with pytest.raises(ProtocolError, match="binary frame"):
        validate(LINK, as_map, [4096], LIMITS)
    assert validate(LINK, encode_header(h), [4096], LIMITS) == h


# --- properties ---------------------------------------------------------------------------

@st.composite
def data_headers(draw: st.DrawFn) -> Header:
    count = draw(st.integers(0, 6))
    nbytes = draw(st.lists(st.integers(0, 1 << 20) | st.sampled_from([0, (1 << 48) - 1]),
                           min_size=count, max_size=count))
    h = Header("data", GROUP, draw(st.integers(1, 3)), seq=draw(st.integers(0, MAX_SEQ)),
               seg=draw(st.integers(0, 2**32 - 1)), step=draw(st.integers(0, 2**32 - 1)),
               sig=draw(st.binary(min_size=8, max_size=8)), nbytes=nbytes,
               tag=draw(st.none() | st.integers(0, MAX_TAG)),
               collective=draw(st.sampled_from(CALLS)))
    if draw(st.booleans()):
        h.shm = ["p2pcoll-ring", [draw(st.sampled_from([-1, 0, 1 << 40])) for _ in nbytes],
                 [draw(st.integers(-1, 8)) for _ in nbytes]]
    if draw(st.booleans()):
        h.described = list(SIG.fields)
    if draw(st.booleans()):
        h.meta = LAYOUT
    return h


@FUZZ
@given(data_headers())
def test_generated_headers_round_trip(h: Header) -> None:
    raw = encode_header(h)
    assert validate(h.src, raw, inline_sizes(h), LIMITS) == h
    assert decode_header(raw).group == "#" + group_digest(GROUP).hex()


@FUZZ
@given(st.binary(max_size=200), st.integers(-2, 6))
def test_arbitrary_bytes_after_the_magic(rest: bytes, link: int) -> None:
    raw = bytes([DATA_MAGIC]) + rest
    both(raw, link=link)
    both(raw, sizes=[len(rest)], link=link)
    both(bytes([DATA_MAGIC, WIRE_VERSION]) + rest, link=link)


@FUZZ
@given(data_headers(), st.data())
def test_mutated_frames(h: Header, data: st.DataObject) -> None:
    """A valid frame with a few bytes changed: refused, or a header that encodes back to
    the same fixed part (the binary layout has one spelling of each header)."""
    raw = bytearray(encode_header(h))
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(raw) - 1))
        raw[at] = data.draw(st.integers(0, 255) | st.sampled_from([0, 1, 0x7F, 0x80, 0xFF]))
    back = both(bytes(raw), link=h.src)
    if back is not None:
        again = encode_header(back)
        fixed = DATA_FIXED.size + 4 * (back.tag is not None) + 8 * len(back.nbytes)
        assert again[:fixed] == bytes(raw[:fixed])


@FUZZ
@given(data_headers(), st.data())
def test_truncated_and_extended_frames(h: Header, data: st.DataObject) -> None:
    raw = encode_header(h)
    cut = data.draw(st.integers(0, len(raw) - 1))
    refused(lambda: decode_header(raw[:cut]))
    refused(lambda: validate(h.src, raw[:cut], inline_sizes(h), LIMITS))
    extra = data.draw(st.binary(min_size=1, max_size=40))
    refused(lambda: decode_header(raw + extra))
    refused(lambda: validate(h.src, raw + extra, inline_sizes(h), LIMITS))


@FUZZ
@given(data_headers(), st.integers(0, 2**32 - 1) | st.sampled_from(
    [MAX_PIECES, MAX_PIECES + 1, 2**31, 2**32 - 1]), st.booleans())
def test_huge_piece_counts(h: Header, count: int, as_memoryview: bool) -> None:
    raw = bytearray(encode_header(h))
    raw[40:44] = count.to_bytes(4, "little")
    frame = memoryview(bytes(raw)) if as_memoryview else bytes(raw)
    back = both(frame, link=h.src)
    if back is not None:
        assert count == len(h.nbytes)


def test_the_most_pieces_a_frame_may_list() -> None:
    h = data_header(nbytes=[1] * MAX_PIECES)
    raw = encode_header(h)
    assert len(raw) == DATA_FIXED.size + 8 * MAX_PIECES
    assert validate(LINK, raw, [1] * MAX_PIECES, LIMITS) == h
    one_more = struct.pack("<I", MAX_PIECES + 1)
    refused(lambda: decode_header(raw[:40] + one_more + raw[44:] + bytes(8)))


def test_a_small_frame_claiming_many_pieces_allocates_nothing_for_them() -> None:
    """A 52-byte frame that says it lists 2**32 - 1 (or MAX_PIECES) pieces is refused by
    its length before any piece is read: no allocation grows with the claimed count."""
    raw = bytearray(encode_header(data_header(nbytes=[8])))
    frames = []
    for count in (2**32 - 1, MAX_PIECES, 4096):
        raw[40:44] = count.to_bytes(4, "little")
        frames.append(bytes(raw))
    for frame in frames:  # once, so that what is cached on first use is not counted
        refused(lambda: validate(LINK, frame, [8], LIMITS))
    tracemalloc.start()
    try:
        for frame in frames:
            refused(lambda: decode_header(frame))
            refused(lambda: validate(LINK, frame, [8], LIMITS))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 * 1024, peak  # 4096 pieces alone would be 32 KiB of lengths
