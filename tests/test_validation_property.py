"""Property tests of the one validation point: for any input, a typed Header or ProtocolError.

``p2pcoll.wire.decode_header`` and ``validate`` see every byte a peer receives, so whatever
those bytes are (random bytes, arbitrary msgpack, a valid header with one field changed, a
nesting as deep as msgpack allows, a layout naming exabytes) they must raise nothing but
:class:`~p2pcoll.ProtocolError` with one of the documented reasons, and whatever they
return must have the documented types. The valid headers below are written as maps; a data
one goes out as its binary frame (:func:`pack`: the fixed fields packed, the optional parts
in the msgpack tail), unless a mutation made a fixed field unpackable, and then as the map,
which the reader refuses. The binary frame's byte-level cases are in
tests/test_wire_binary.py.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hostile import header_bytes

from p2pcoll.errors import ProtocolError
from p2pcoll.types import ALLOWED_DTYPES
from p2pcoll.wire import (
    CALLS,
    DIGEST_BYTES,
    KINDS,
    MAX_TAG,
    REASONS,
    WIRE_VERSION,
    Header,
    Limits,
    decode_header,
    encode_header,
    group_digest,
    validate,
)
from p2pcoll.wire.header import MAX_CAUSE_NAME, MAX_CAUSE_TEXT, MAX_RANK
from p2pcoll.wire.validation import MAX_HEADER_BYTES, MAX_LEAF_BYTES, MAX_LEAVES, MAX_NDIM

GROUP = "g-fuzz"
LIMITS = Limits(GROUP, rank=0, world_size=4, max_message_bytes=1 << 20)
# The link the valid headers below come on: a member, not this peer.
LINK = 1

FUZZ = settings(max_examples=300, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])
FEW = settings(max_examples=100, deadline=None, database=None,
               suppress_health_check=[HealthCheck.too_slow])


# --- what a returned header must look like ----------------------------------------------

def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def assert_typed(h: Header, ranks: int = LIMITS.world_size) -> None:
    """The documented types of a decoded header's fields; the ranks its meta names are
    below ``ranks`` (the group's size after ``validate``; ``decode_header``, which knows no
    group, bounds them by MAX_RANK only)."""
    assert isinstance(h, Header)
    assert h.kind in KINDS
    assert isinstance(h.group, str)
    for name in ("src", "seq", "seg", "step"):
        value = getattr(h, name)
        assert _is_int(value) and value >= 0, (name, value)
    assert isinstance(h.sig, bytes)
    assert isinstance(h.nbytes, list) and all(_is_int(n) and n >= 0 for n in h.nbytes)
    if h.kind == "data":
        assert len(h.sig) == DIGEST_BYTES
    assert h.meta is None or isinstance(h.meta, dict)
    if h.meta is not None:
        assert all(isinstance(k, str) for k in h.meta), h.meta
    if h.err is not None:
        assert h.kind == "abort"
        assert isinstance(h.err, list) and len(h.err) == 2
        assert all(isinstance(e, str) for e in h.err)
    if h.shm is not None:
        assert h.kind == "data"
        name, offsets, indices = h.shm
        assert isinstance(name, str)
        assert len(offsets) == len(indices) == len(h.nbytes)
        assert all(_is_int(v) and v >= -1 for v in offsets + indices)
    if h.described is not None:
        assert all(_is_int(v) or isinstance(v, str) for v in h.described)
    if h.kind in ("bye", "gone") and h.meta is not None:
        assert_failure_report(h.meta, ranks)
    if h.kind == "abort" and h.meta is not None:  # what FailureModel.on_abort reads as is
        named = [h.meta.get("origin", 0), *h.meta.get("told", ())]
        assert all(_is_int(r) and 0 <= r < ranks for r in named), h.meta
    if h.kind == "data" and h.meta is not None:
        leaves = h.meta["leaves"]
        assert isinstance(h.meta["strategy"], str) and isinstance(leaves, list)
        for dtype, shape in leaves:
            assert dtype in ALLOWED_DTYPES
            assert all(_is_int(n) and n >= 0 for n in shape)


def assert_failure_report(meta: dict[str, Any], ranks: int) -> None:
    """What a goodbye (or the news of one) says broke its peer's group: what the session
    reads from it without checking again (see p2pcoll.departures.Departures._report);
    ranks below ``ranks`` (see assert_typed)."""
    if "lost" in meta:
        assert _is_int(meta["lost"]) and 0 <= meta["lost"] < ranks
    if "cause" in meta:
        cause = meta["cause"]
        assert isinstance(cause, dict) and set(cause) <= {"q", "t", "err", "rank", "how"}
        assert cause.get("how", "closed") in ("closed", "crashed", "killed", "unresponsive")
        assert _is_int(cause["q"]) and cause["q"] >= 0
        assert "t" not in cause or (_is_int(cause["t"]) and 0 <= cause["t"] <= MAX_TAG)
        assert "rank" not in cause or (_is_int(cause["rank"]) and 0 <= cause["rank"] < ranks)
        kind, text = cause["err"]
        assert isinstance(kind, str) and 0 < len(kind) <= MAX_CAUSE_NAME
        assert isinstance(text, str) and len(text) <= MAX_CAUSE_TEXT
    if meta.get("graceful") is False:
        assert "lost" not in meta and "cause" not in meta
        assert meta.get("how", "killed") in ("killed", "unresponsive")


def inline_sizes(h: Header) -> list[int]:
    """The byte lengths of the payload frames a message with header ``h`` carries."""
    offsets = h.shm[1] if h.shm is not None else [-1] * len(h.nbytes)
    return [n for n, at in zip(h.nbytes, offsets, strict=True) if at == -1]


def only_protocol_error(fn: Callable[[], Header], ranks: int = LIMITS.world_size
                        ) -> Header | None:
    """Run ``fn``: a Header with the documented types (ranks below ``ranks``: see
    assert_typed), or None for a ProtocolError with a documented reason."""
    try:
        h = fn()
    except ProtocolError as exc:
        assert exc.reason in REASONS, exc.reason
        return None
    assert_typed(h, ranks)
    return h


def check_frame(raw: bytes, link: int = LINK, sizes: list[int] | None = None) -> None:
    """Both entry points on one header frame."""
    decoded = only_protocol_error(lambda: decode_header(raw), MAX_RANK)
    if sizes is None:
        sizes = inline_sizes(decoded) if decoded is not None else []
    h = only_protocol_error(lambda: validate(link, raw, sizes, LIMITS))
    if h is not None:
        assert decoded is not None
        if decoded.group.startswith("#"):  # a binary data header: only the group's digest
            assert decoded.group == "#" + group_digest(GROUP).hex()
            decoded.group = GROUP
        assert decoded == h
        assert inline_sizes(h) == list(sizes)
        assert h.group == GROUP and h.src == link and h.src != LIMITS.rank


# --- arbitrary input ----------------------------------------------------------------------

scalars = (
    st.none() | st.booleans()
    | st.integers(-(1 << 63), (1 << 64) - 1)  # all msgpack can carry, huge and negative
    | st.sampled_from([0, 1, 2, -1, WIRE_VERSION, 1 << 62, (1 << 62) + 1, 1 << 63])
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
    | st.sampled_from(["data", "hello", "abort", "bye", GROUP, "*", "d", "l", "t", "<f4"])
    | st.binary(max_size=12)
    | st.builds(bytes, st.just(DIGEST_BYTES))
)
keys = (st.text(max_size=6) | st.sampled_from(sorted(
    ["v", "k", "g", "r", "q", "seg", "s", "sig", "n", "m", "d", "err", "meta",
     "strategy", "leaves", "tree", "ring", "collective", "waiting_on"]))
    | st.integers(-5, 5) | st.binary(max_size=4) | st.none() | st.booleans() | st.floats())
msgpack_objects = st.recursive(
    scalars,
    lambda children: (st.lists(children, max_size=5)
                      | st.dictionaries(keys, children, max_size=5)),
    max_leaves=25,
)


def pack(obj: Any) -> bytes:
    """msgpack of ``obj``; a data header spelled as a map becomes its binary frame."""
    return header_bytes(obj) if isinstance(obj, dict) else msgpack.packb(obj, use_bin_type=True)


@FUZZ
@given(st.binary(max_size=300), st.integers(-3, 8))
def test_arbitrary_bytes_are_a_header_or_protocol_error(raw: bytes, link: int) -> None:
    check_frame(raw, link)
    check_frame(raw, link, sizes=[len(raw)])


@FUZZ
@given(msgpack_objects)
def test_arbitrary_msgpack_is_a_header_or_protocol_error(obj: Any) -> None:
    check_frame(pack(obj))


@FEW
@given(st.dictionaries(keys, msgpack_objects, max_size=8))
def test_arbitrary_msgpack_maps_are_a_header_or_protocol_error(obj: dict[Any, Any]) -> None:
    check_frame(pack(obj))
    check_frame(pack({"v": WIRE_VERSION, "g": GROUP, "r": LINK, **obj}))


# --- valid headers, one field mutated -----------------------------------------------------

SIG = bytes(range(DIGEST_BYTES))
VALID: dict[str, dict[str, Any]] = {
    "data": {"v": WIRE_VERSION, "k": "data", "g": GROUP, "r": LINK, "q": 3, "seg": 1, "s": 2,
             "sig": SIG, "n": [8, 0, 24],
             "d": ["allreduce", "ring", "sum", -1, "(3,)<f8"]},
    "hello": {"v": WIRE_VERSION, "k": "hello", "g": GROUP, "r": LINK,
              "meta": {"ring": "p2pcoll-ring-1"}},
    "abort": {"v": WIRE_VERSION, "k": "abort", "g": GROUP, "r": LINK, "q": 4,
              "err": ["CollectiveTimeout", "allreduce #4 timed out"],
              "meta": {"collective": "allreduce", "waiting_on": [2, 3]}},
    "abort passed on": {"v": WIRE_VERSION, "k": "abort", "g": GROUP, "r": LINK, "q": 4,
                        "err": ["CollectiveMismatch", "shapes differ"],
                        "meta": {"origin": 2, "told": [0, 3]}},
    "bye": {"v": WIRE_VERSION, "k": "bye", "g": GROUP, "r": LINK, "q": 9},
    "credit report": {"v": WIRE_VERSION, "k": "credit", "g": GROUP, "r": LINK, "q": 7,
                      "meta": {"b": 1 << 40}},
    "credit request": {"v": WIRE_VERSION, "k": "credit", "g": GROUP, "r": LINK, "q": 0,
                       "meta": {"ask": 64 << 20}},
    "bye after a failure": {
        "v": WIRE_VERSION, "k": "bye", "g": GROUP, "r": LINK, "q": 9,
        "meta": {"told": [0, 2], "lost": 3,
                 "cause": {"q": 8, "t": 5, "err": ["PeerLost", "rank 1 lost rank 3"],
                           "rank": 3}}},
    "gone after a failure": {
        "v": WIRE_VERSION, "k": "gone", "g": GROUP, "r": LINK, "q": 9,
        "meta": {"rank": 2, "graceful": True, "told": [1], "lost": 3,
                 "cause": {"q": 8, "err": ["CollectiveTimeout", "allreduce #8 timed out"]}}},
    "layout": {"v": WIRE_VERSION, "k": "data", "g": GROUP, "r": LINK, "q": 0, "seg": 0,
               "s": 0, "sig": SIG, "n": [24, 8],
               "meta": {"strategy": "binomial",
                        "leaves": [["<f4", [2, 3]], ["<i8", []]],
                        "tree": ["d", [["a", "*"], ["b", ["l", ["*"]]]]]},
               "m": ["p2pcoll-ring-1", [-1, 4096], [-1, 0]]},
}


def test_the_valid_headers_are_valid() -> None:
    for name, d in VALID.items():
        h = validate(LINK, pack(d), inline_sizes(decode_header(pack(d))), LIMITS)
        assert_typed(h)
        assert h.kind == d["k"], name


def _paths(obj: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in a nested dict/list, as a path of keys and indices."""
    found = [prefix] if prefix else []
    if isinstance(obj, dict):
        for k, v in obj.items():
            found += _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            found += _paths(v, (*prefix, i))
    return found


@st.composite
def mutated_headers(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    """A valid header with one place changed: replaced, deleted, or a key added next to it."""
    name = draw(st.sampled_from(sorted(VALID)))
    d = copy.deepcopy(VALID[name])
    path = draw(st.sampled_from(_paths(d)))
    parent: Any = d
    for step in path[:-1]:
        parent = parent[step]
    last = path[-1]
    how = draw(st.sampled_from(["replace", "replace", "delete", "add"]))
    if how == "replace":
        parent[last] = draw(msgpack_objects)
    elif how == "delete":
        del parent[last]
    elif isinstance(parent, dict):
        parent[draw(keys.filter(lambda k: k not in parent))] = draw(msgpack_objects)
    else:
        parent.insert(last, draw(msgpack_objects))
    return name, d


@FUZZ
@given(mutated_headers())
def test_mutated_valid_headers(case: tuple[str, dict[str, Any]]) -> None:
    _, d = case
    check_frame(pack(d))


@FEW
@given(st.sampled_from(sorted(VALID)), st.sampled_from(
    ["v", "k", "g", "r", "q", "seg", "s", "sig", "n", "m", "d", "err", "meta"]),
    msgpack_objects)
def test_each_top_level_field_set_to_anything(name: str, field: str, value: Any) -> None:
    check_frame(pack({**VALID[name], field: value}))


# --- payload sizes and links --------------------------------------------------------------

@FUZZ
@given(
    st.sampled_from(["data", "layout", "hello", "abort", "bye"]),
    st.lists(st.integers(-(1 << 70), 1 << 70) | st.sampled_from([0, 8, 24, 4096]),
             max_size=6),
    st.integers(-(1 << 40), 1 << 40) | st.integers(-2, 6),
)
def test_payload_sizes_and_links(name: str, sizes: list[int], link: int) -> None:
    raw = pack(VALID[name])
    h = only_protocol_error(lambda: validate(link, raw, sizes, LIMITS))
    if h is not None:
        assert inline_sizes(h) == sizes
        assert h.src == link and 0 <= link < LIMITS.world_size and link != LIMITS.rank
    right = inline_sizes(decode_header(raw))
    h = only_protocol_error(lambda: validate(link, raw, right, LIMITS))
    assert (h is not None) == (link == LINK)


@FEW
@given(st.integers(0, (1 << 20) + 10), st.integers(0, 3))
def test_the_size_cap(extra: int, frames: int) -> None:
    d = {**VALID["data"], "n": [extra] * frames}
    h = only_protocol_error(lambda: validate(LINK, pack(d), [extra] * frames, LIMITS))
    total = len(pack(d)) + extra * frames
    assert (h is not None) == (total <= LIMITS.max_message_bytes)


# --- round trip of generated valid headers ------------------------------------------------

names = st.text(st.characters(codec="utf-8"), max_size=20)
small = st.integers(0, (1 << 32) - 1)
treedefs = st.recursive(
    st.just("*"),
    lambda children: (
        st.builds(lambda kind, kids: [kind, kids], st.sampled_from(["l", "t"]),
                  st.lists(children, max_size=3))
        | st.builds(lambda d: ["d", [[k, v] for k, v in sorted(d.items())]],
                    st.dictionaries(st.text(max_size=4), children, max_size=3))
    ),
    max_leaves=6,
)


def _count(td: Any) -> int:
    if td == "*":
        return 1
    if td[0] == "d":
        return sum(_count(v) for _, v in td[1])
    return sum(_count(c) for c in td[1])


@st.composite
def layouts(draw: st.DrawFn) -> dict[str, Any]:
    tree = draw(st.none() | treedefs)
    count = _count(tree) if tree is not None else draw(st.integers(0, 4))
    leaves = [[draw(st.sampled_from(sorted(ALLOWED_DTYPES))),
               draw(st.lists(st.integers(0, 64), max_size=4))] for _ in range(count)]
    meta = {"strategy": draw(st.sampled_from(["binomial", "pipeline", "root", "x_1"])),
            "leaves": leaves}
    if tree is not None or draw(st.booleans()):
        meta["tree"] = tree
    return meta


@st.composite
def valid_headers(draw: st.DrawFn) -> Header:
    kind = draw(st.sampled_from(sorted(KINDS)))
    src = draw(st.integers(1, LIMITS.world_size - 1))
    h = Header(kind, GROUP, src)
    if kind in ("data", "abort", "bye", "gone"):
        h.seq = draw(st.integers(0, 1 << 62))
    if kind == "data":
        h.seg, h.step = draw(small), draw(small)
        h.sig = draw(st.binary(min_size=DIGEST_BYTES, max_size=DIGEST_BYTES))
        h.nbytes = draw(st.lists(st.integers(0, 4096), max_size=5))
        h.collective = draw(st.sampled_from(CALLS))
        h.tag = draw(st.none() | st.integers(0, MAX_TAG))
        if draw(st.booleans()):
            offsets = [draw(st.sampled_from([-1, 0, 64, 1 << 40])) for _ in h.nbytes]
            h.shm = [draw(names.filter(lambda s: len(s) <= 256)), offsets,
                     [draw(st.integers(-1, 8)) for _ in h.nbytes]]
        if draw(st.booleans()):
            h.described = [draw(st.text(max_size=30) | st.integers(-1, 1 << 40))
                           for _ in range(5)]
        if draw(st.booleans()):
            h.meta = draw(layouts())
    elif kind == "abort":
        h.err = [draw(st.sampled_from(["CollectiveTimeout", "PeerLost", "Nope"])),
                 draw(st.text(max_size=100))]
        h.tag = draw(st.none() | st.integers(0, MAX_TAG))
        if draw(st.booleans()):
            h.meta = {"collective": draw(st.text(max_size=20)),
                      "waiting_on": draw(st.lists(st.integers(0, 7), max_size=4))}
            if draw(st.booleans()):  # passed on over the overlay (see session.failure)
                h.meta["origin"] = draw(st.integers(0, LIMITS.world_size - 1))
            if draw(st.booleans()):
                h.meta["told"] = draw(st.lists(st.integers(0, LIMITS.world_size - 1),
                                               max_size=4))
    elif kind == "hello" and draw(st.booleans()):
        h.meta = {"ring": draw(st.none() | st.text(max_size=40))}
        if draw(st.booleans()):
            h.meta.update(lane=draw(st.text(max_size=40)), wake=draw(st.text(max_size=40)))
    elif kind == "lane":
        h.meta = {"on": draw(st.booleans())}
    elif kind == "bye" and draw(st.booleans()):
        h.meta = {"told": draw(st.lists(st.integers(0, LIMITS.world_size - 1), max_size=4)),
                  **draw(failure_reports())}
    elif kind == "gone":
        h.meta = {"rank": draw(st.integers(0, LIMITS.world_size - 1)),
                  "graceful": draw(st.booleans())}
        if draw(st.booleans()):
            h.meta["told"] = draw(st.lists(st.integers(0, LIMITS.world_size - 1),
                                           max_size=4))
        if h.meta["graceful"]:
            h.meta.update(draw(failure_reports()))
        elif draw(st.booleans()):
            h.meta["how"] = draw(st.sampled_from(["killed", "unresponsive"]))
    return h


@st.composite
def failure_reports(draw: st.DrawFn) -> dict[str, Any]:
    """The ``lost`` and ``cause`` a goodbye may carry: any, either, both."""
    report: dict[str, Any] = {}
    if draw(st.booleans()):
        report["lost"] = draw(st.integers(0, LIMITS.world_size - 1))
    if draw(st.booleans()):
        cause: dict[str, Any] = {
            "q": draw(st.integers(0, 1 << 62)),
            "err": [draw(st.text(min_size=1, max_size=MAX_CAUSE_NAME)),
                    draw(st.text(max_size=200) | st.just("x" * MAX_CAUSE_TEXT))]}
        if draw(st.booleans()):
            cause["t"] = draw(st.integers(0, MAX_TAG))
        if draw(st.booleans()):
            cause["rank"] = draw(st.integers(0, LIMITS.world_size - 1))
        if draw(st.booleans()):
            cause["how"] = draw(st.sampled_from(["closed", "crashed", "killed",
                                                 "unresponsive"]))
        report["cause"] = cause
    return report


@FUZZ
@given(valid_headers())
def test_valid_round_trip(h: Header) -> None:
    raw = encode_header(h)
    back = validate(h.src, raw, inline_sizes(h), LIMITS)
    assert back == h
    assert_typed(back)


# --- depth and size bombs -----------------------------------------------------------------

def _nested_list(depth: int) -> bytes:
    return b"\x91" * depth + b"\xc0"  # [[[...[None]...]]]


def _nested_map(depth: int) -> bytes:
    return b"\x81\xa1a" * depth + b"\xc0"  # {"a": {"a": ... None}}


class _AsMap(dict):  # type: ignore[type-arg]
    """A data header that :func:`encode` writes as a map (header_bytes' fallback)."""


class Raw:
    """Already-encoded msgpack, spliced in where :func:`encode` meets it."""

    def __init__(self, data: bytes) -> None:
        self.data = data


def encode(obj: Any) -> bytes:
    """msgpack of ``obj`` with its :class:`Raw` parts spliced in as they are (nested values
    built as bytes, without a Python object for every level)."""
    if isinstance(obj, Raw):
        return obj.data
    if isinstance(obj, dict) and obj.get("k") == "data" and not isinstance(obj, _AsMap):
        return header_bytes(obj, lambda part: encode(_AsMap(part) if isinstance(part, dict)
                                                     else part))
    if isinstance(obj, dict):
        assert len(obj) < 16
        return bytes([0x80 | len(obj)]) + b"".join(encode(k) + encode(v)
                                                    for k, v in obj.items())
    if isinstance(obj, list):
        assert len(obj) < 16
        return bytes([0x90 | len(obj)]) + b"".join(encode(v) for v in obj)
    return pack(obj)


DEPTHS = [64, 500, 1000, 1022, 10_000]


@pytest.mark.parametrize("depth", DEPTHS)
@pytest.mark.parametrize("nest", [_nested_list, _nested_map], ids=["list", "map"])
def test_deep_nesting_as_the_whole_header(depth: int, nest: Callable[[int], bytes]) -> None:
    with pytest.raises(ProtocolError):
        decode_header(nest(depth))
    with pytest.raises(ProtocolError):
        validate(LINK, nest(depth), [], LIMITS)


@pytest.mark.parametrize("depth", DEPTHS)
@pytest.mark.parametrize("field", ["v", "k", "g", "r", "q", "sig", "n", "m", "d", "meta"])
def test_deep_nesting_in_a_field(depth: int, field: str) -> None:
    """A value nested as deep as msgpack allows (about 1,023 levels inside the header map)
    must be refused, not crash the checks (or the repr of their error messages)."""
    for nest in (_nested_list, _nested_map):
        raw = encode({**VALID["data"], field: Raw(nest(depth))})
        with pytest.raises(ProtocolError):
            decode_header(raw)
        with pytest.raises(ProtocolError):
            validate(LINK, raw, [8, 0, 24], LIMITS)


@pytest.mark.parametrize("depth", [100, 1000, 1020])
@pytest.mark.parametrize("where", ["tree", "leaf", "shape", "waiting_on", "ring", "err"])
def test_deep_nesting_inside_meta(depth: int, where: str) -> None:
    deep = Raw(_nested_list(depth - 4))  # leave room for the enclosing maps and lists
    d: dict[str, Any] = copy.deepcopy(VALID["layout"])
    if where == "tree":
        d["meta"]["tree"] = deep
    elif where == "leaf":
        d["meta"]["leaves"] = [deep]
    elif where == "shape":
        d["meta"]["leaves"] = [["<f4", deep]]
    elif where == "waiting_on":
        d = {**VALID["abort"], "meta": {"collective": "x", "waiting_on": deep}}
    elif where == "ring":
        d = {**VALID["hello"], "meta": {"ring": deep}}
    else:
        d = {**VALID["abort"], "err": ["x", deep]}
    raw = encode(d)
    with pytest.raises(ProtocolError):
        decode_header(raw)
    with pytest.raises(ProtocolError):
        validate(LINK, raw, inline_sizes(decode_header(pack(VALID["layout"]))), LIMITS)


def test_a_deep_tree_definition_is_refused_without_recursing() -> None:
    deep: Any = "*"
    for _ in range(500):
        deep = ["l", [deep]]
    d = copy.deepcopy(VALID["layout"])
    d["meta"]["tree"] = deep
    d["meta"]["leaves"] = [["<f4", [1]]]
    with pytest.raises(ProtocolError, match="tree"):
        validate(LINK, pack(d), [24], LIMITS)


@pytest.mark.parametrize("shape", [
    [2**40, 2**40],
    [2**63 - 1],
    [2**64 - 1, 2**64 - 1],
    [2**40] * 32,
    [2**20] * 33,
    [0, 2**64 - 1, 2**64 - 1],  # zero elements, but an overflowing product without the zero
    [2**23, 2**23, 2**23],
])
def test_huge_declared_shapes(shape: list[int]) -> None:
    d = copy.deepcopy(VALID["layout"])
    d["meta"]["leaves"] = [["<f4", shape], ["<i8", []]]
    if 0 in shape and len(shape) <= 32:
        h = validate(LINK, pack(d), [24], LIMITS)  # no elements: a valid, empty leaf
        assert_typed(h)
        return
    with pytest.raises(ProtocolError, match="too large|not a shape|shape"):
        validate(LINK, pack(d), [24], LIMITS)


def _densest_header(size: int) -> bytes:
    """A valid data header whose 'd' field is as many msgpack objects as ``size`` bytes can
    hold: a list of lists of 15 empty lists, one object per byte."""
    outer = (size - 200) // 16
    assert outer < 1 << 16
    dense = b"\xdc" + outer.to_bytes(2, "big") + (b"\x9f" + b"\x90" * 15) * outer
    return encode({**VALID["data"], "g": "another-group", "r": 5, "d": Raw(dense)})


@pytest.mark.parametrize("make", [
    lambda: pack({**VALID["layout"], "g": "another-group", "r": 5, "meta": {
        "strategy": "binomial", "leaves": [["<f4", [1]]] * MAX_LEAVES}}),
    lambda: _densest_header(MAX_HEADER_BYTES),
], ids=["leaves", "objects"])
def test_a_strangers_maximal_header_is_refused_without_decoding(
    make: Callable[[], bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The largest header a non-member (link 5 of a group of 4) may send: the reader runs on
    the event loop, and parsing a dense 1 MiB header holds it up for a good part of a
    second, so a stranger's link is refused before anything is decoded."""
    raw = make()
    assert len(raw) <= MAX_HEADER_BYTES

    def no_decoding(*args: object, **kwargs: object) -> object:
        raise AssertionError("a stranger's header was decoded")

    monkeypatch.setattr("p2pcoll.wire.validation.msgpack.unpackb", no_decoding)
    with pytest.raises(ProtocolError, match="no other member"):
        validate(5, raw, [], Limits(GROUP, 0, 4, 64 << 20))


@FEW
@given(st.lists(st.integers(0, (1 << 64) - 1) | st.sampled_from([0, 1, 2**32, 2**46]),
                max_size=40),
       st.sampled_from(sorted(ALLOWED_DTYPES)))
def test_any_shape_is_bounded_or_refused(shape: list[int], dtype: str) -> None:
    d = copy.deepcopy(VALID["layout"])
    d["meta"]["leaves"] = [[dtype, shape], ["<i8", []]]
    h = only_protocol_error(lambda: validate(LINK, pack(d), [24], LIMITS))
    if h is not None:
        assert len(shape) <= MAX_NDIM
        assert math.prod(shape) * np.dtype(dtype).itemsize <= MAX_LEAF_BYTES


def test_bounds_on_lengths() -> None:
    too_many = {**VALID["data"], "n": [0] * ((1 << 16) + 1)}
    with pytest.raises(ProtocolError):
        validate(LINK, pack(too_many), [0] * ((1 << 16) + 1), LIMITS)
    big = pack({**VALID["abort"], "g": "x" * (5 << 20)})  # a binary frame has its digest
    with pytest.raises(ProtocolError):
        decode_header(big)
    with pytest.raises(ProtocolError):
        validate(LINK, big, [8, 0, 24], Limits(GROUP, 0, 4, 64 << 20))


# --- what a goodbye says broke its peer's group ---------------------------------------------

GOOD_CAUSE = {"q": 4, "err": ["PeerLost", "rank 1 lost rank 3"], "rank": 3}


@pytest.mark.parametrize("kind, meta, match", [
    ("bye", {"told": [0], "lost": -1}, "'lost' is -1"),
    ("bye", {"told": [0], "lost": True}, "'lost' is True"),
    ("bye", {"told": [0], "lost": 4}, "not all in this group of 4"),
    ("bye", {"told": [0], "lost": 1 << 40}, "'lost' is"),
    ("bye", {"told": [0], "cause": None}, "'cause' is None"),
    ("bye", {"told": [0], "cause": [4, "x"]}, "'cause' is"),
    ("bye", {"told": [0], "cause": {"q": 4}}, "'cause' is"),
    ("bye", {"told": [0], "cause": {"err": ["PeerLost", "x"]}}, "'cause' is"),
    ("bye", {"told": [0], "cause": {**GOOD_CAUSE, "blame": "own"}}, "'cause' is"),
    ("bye", {"told": [0], "cause": {**GOOD_CAUSE, "q": -1}}, "'q' is -1"),
    ("bye", {"told": [0], "cause": {**GOOD_CAUSE, "q": 2.0}}, "'q' is 2.0"),
    ("bye", {"told": [0], "cause": {**GOOD_CAUSE, "t": MAX_TAG + 1}}, "'t' is"),
    ("bye", {"told": [0], "cause": {**GOOD_CAUSE, "rank": 9}}, "not all in this group of 4"),
    ("bye", {"told": [0], "cause": {**GOOD_CAUSE, "rank": "3"}}, "'rank' is '3'"),
    ("bye", {"told": [0], "cause": {**GOOD_CAUSE, "err": "PeerLost"}}, "has 'err'"),
    ("bye", {"told": [0], "cause": {**GOOD_CAUSE, "err": ["PeerLost"]}}, "has 'err'"),
    ("bye", {"told": [0], "cause": {**GOOD_CAUSE, "err": ["", "x"]}}, "has 'err'"),
    ("bye", {"told": [0], "cause": {**GOOD_CAUSE, "err": ["E" * (MAX_CAUSE_NAME + 1), "x"]}},
     "has 'err'"),
    ("bye", {"told": [0], "cause": {**GOOD_CAUSE, "err": ["E", "x" * (MAX_CAUSE_TEXT + 1)]}},
     "has 'err'"),
    ("bye", {"told": [0], "cause": {**GOOD_CAUSE, "err": ["E", 7]}}, "has 'err'"),
    ("bye", {"told": [0], "cause": {**GOOD_CAUSE, "err": ["E", "x", "y"]}}, "has 'err'"),
    ("bye", {"lost": 2}, "bye meta is"),
    ("bye", {"told": [0], "why": 2}, "bye meta is"),
    ("gone", {"rank": 2, "graceful": False, "lost": 3}, "only a goodbye"),
    ("gone", {"rank": 2, "graceful": False, "cause": GOOD_CAUSE}, "only a goodbye"),
    ("gone", {"rank": 2, "graceful": True, "lost": 7}, "not all in this group of 4"),
    ("gone", {"rank": 2, "graceful": True, "cause": {**GOOD_CAUSE, "q": "4"}}, "'q' is '4'"),
    ("gone", {"rank": 2, "graceful": False, "how": "asleep"}, "gone 'how' is 'asleep'"),
    ("gone", {"rank": 2, "graceful": True, "how": "killed"}, "news of a lost peer"),
    ("gone", {"rank": 2, "graceful": False, "how": "closed"}, "gone 'how' is 'closed'"),
    ("bye", {"told": [0], "cause": {**GOOD_CAUSE, "how": 3}}, "cause 'how' is 3"),
])
def test_a_goodbyes_failure_report_is_checked(kind: str, meta: dict[str, Any],
                                              match: str) -> None:
    """Each wrong ``lost`` or ``cause`` of a goodbye (or of the news of one) is refused by
    name at the validation point: the message is dropped, never read as a failure."""
    raw = pack({"v": WIRE_VERSION, "k": kind, "g": GROUP, "r": LINK, "q": 3, "meta": meta})
    with pytest.raises(ProtocolError, match=match) as caught:
        validate(LINK, raw, [], LIMITS)
    assert caught.value.reason == "malformed"


@FUZZ
@given(st.sampled_from(["bye", "gone"]), msgpack_objects, msgpack_objects)
def test_a_goodbyes_failure_report_set_to_anything(kind: str, lost: Any, cause: Any) -> None:
    meta: dict[str, Any] = {"told": [0], "lost": lost, "cause": cause}
    if kind == "gone":
        meta.update(rank=2, graceful=True)
    check_frame(pack({"v": WIRE_VERSION, "k": kind, "g": GROUP, "r": LINK, "q": 3,
                      "meta": meta}))


# --- an abort passed on over the overlay: whose failure it is, whom its origin told ---------

@pytest.mark.parametrize("meta, match", [
    ({"origin": -1}, "'origin' is -1"),
    ({"origin": True}, "'origin' is True"),
    ({"origin": "2"}, "'origin' is '2'"),
    ({"origin": 1 << 40}, "'origin' is"),
    ({"origin": 4}, "not all in this group of 4"),
    ({"origin": 2, "told": 3}, "'told' is 3"),
    ({"origin": 2, "told": [0, -1]}, "'told' holds -1"),
    ({"origin": 2, "told": [0, "1"]}, "'told' holds '1'"),
    ({"origin": 2, "told": [0, 7]}, "not all in this group of 4"),
    ({"origin": 2, "via": 3}, "abort meta is"),
    ({"lost": 2, "how": "gone"}, "abort 'how' is 'gone'"),
])
def test_an_aborts_origin_and_told_are_checked(meta: dict[str, Any], match: str) -> None:
    """Each wrong ``origin`` or ``told`` of an abort is refused by name at the validation
    point: the message is dropped, never taken as a peer's failure."""
    raw = pack({"v": WIRE_VERSION, "k": "abort", "g": GROUP, "r": LINK, "q": 3,
                "err": ["CollectiveMismatch", "x"], "meta": meta})
    with pytest.raises(ProtocolError, match=match) as caught:
        validate(LINK, raw, [], LIMITS)
    assert caught.value.reason == "malformed"


@FUZZ
@given(msgpack_objects, msgpack_objects)
def test_an_aborts_origin_and_told_set_to_anything(origin: Any, told: Any) -> None:
    check_frame(pack({"v": WIRE_VERSION, "k": "abort", "g": GROUP, "r": LINK, "q": 3,
                      "err": ["PeerLost", "x"], "meta": {"origin": origin, "told": told}}))


@pytest.mark.parametrize("meta", [
    {}, {"b": 1, "ask": 2}, {"b": -1}, {"ask": 0}, {"b": "7"}, {"ask": 1.5}, {"x": 1},
    {"b": 1 << 63}])
def test_a_malformed_credit_is_a_protocol_error(meta: dict[str, Any]) -> None:
    """The eager credits' message (p2pcoll.engine.credit): a report {b} or a request {ask},
    nothing else, integers in range; anything else is refused before it reaches a ledger."""
    d = {**VALID["credit report"], "meta": meta}
    with pytest.raises(ProtocolError):
        validate(LINK, pack(d), [], LIMITS)
