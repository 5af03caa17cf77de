"""Wire format, pytrees, layouts and exports: the pieces below the group API."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

import p2pcoll
from p2pcoll.errors import ProtocolError
from p2pcoll.engine.layout import Layout
from p2pcoll.strategy import ALL
from p2pcoll.pytree import flatten, unflatten
from p2pcoll.types import check_dtype
from p2pcoll.wire import (
    WIRE_VERSION,
    Header,
    Limits,
    Signature,
    decode_header,
    encode_header,
    group_digest,
    validate,
)
from p2pcoll.wire.header import DATA_MAGIC, DataHeaders


def test_header_round_trip() -> None:
    sig = Signature.of("allreduce", "ring", "sum", -1, "x")
    h = Header("data", "g1", 3, seq=7, seg=2, step=1, sig=sig.digest, nbytes=[4, 0],
               meta={"strategy": "ring", "leaves": [["<f4", [1]]]}, described=list(sig.fields),
               collective="allreduce")
    raw = encode_header(h)
    assert raw[0] == DATA_MAGIC  # a data header is the binary frame, with the group's digest
    back = decode_header(raw)
    assert back.group == "#" + group_digest("g1").hex()
    back.group = "g1"
    assert back == h and back.key == (7, 2, 3, 1)
    # validate() knows the group: it compares the digest and returns the group's id.
    assert validate(3, raw, [4, 0], Limits("g1", 0, 4, 1 << 20)) == h
    abort = Header("abort", "g1", 0, seq=4, err=["CollectiveTimeout", "late"])
    assert decode_header(encode_header(abort)).err == ["CollectiveTimeout", "late"]
    assert decode_header(encode_header(abort)).group == "g1"  # control messages: msgpack maps


@pytest.mark.parametrize(
    "raw, reason",
    [
        (b"\xc1", "not valid msgpack"),
        (msgpack.packb("text"), "expected a map"),
        (msgpack.packb({"v": WIRE_VERSION + 1, "k": "data"}), "wire version"),
        (msgpack.packb({"v": WIRE_VERSION, "k": "pickle", "g": "", "r": 0}), "unknown message kind"),
        (msgpack.packb({"v": WIRE_VERSION, "k": "hello", "g": 5, "r": 0}), "'g'"),
        (msgpack.packb({"v": WIRE_VERSION, "k": "hello", "g": "x", "r": True}), "'r'"),
        (msgpack.packb({"v": WIRE_VERSION, "k": "data", "g": "x", "r": 0, "q": 0, "seg": 0,
                        "s": 0, "sig": b"12345678", "n": [8]}), "binary frame"),
        (msgpack.packb({"v": WIRE_VERSION, "k": [1]}), "unknown message kind"),
        (msgpack.packb({"v": WIRE_VERSION, "k": "abort", "g": "x", "r": 0, "q": 0,
                        "err": ["only one"]}), "abort"),
        (msgpack.packb({"v": WIRE_VERSION, "k": "hello", "g": "x", "r": 0, "meta": [1]}), "meta"),
        (msgpack.packb({"v": WIRE_VERSION, "k": "hello", "g": "x", "r": 0, b"\x00": 1}),
         "unknown keys"),
    ],
)
def test_bad_headers_are_rejected(raw: bytes, reason: str) -> None:
    with pytest.raises(ProtocolError, match=reason):
        decode_header(raw)


def test_msgpack_extension_types_are_not_executed() -> None:
    ext = msgpack.packb(msgpack.ExtType(1, b"\x80\x04K\x01."))  # a pickle inside an ext type
    with pytest.raises(ProtocolError):
        decode_header(ext)


def test_pytree_round_trip_and_key_order() -> None:
    tree = {"b": [np.zeros(2), (np.ones((2, 3), np.int8),)], "a": np.float32(3.5)}
    leaves, treedef = flatten(tree)
    assert [leaf.shape for leaf in leaves] == [(), (2,), (2, 3)]  # keys sorted: a, b
    back = unflatten(treedef, leaves)
    assert isinstance(back["b"], list) and isinstance(back["b"][1], tuple)
    assert back["a"] == np.float32(3.5)
    with pytest.raises(TypeError, match="None"):
        flatten({"x": None})
    with pytest.raises(TypeError, match="keys must be str"):
        flatten({1: np.zeros(1)})


def test_dtype_allow_list() -> None:
    assert check_dtype(np.dtype(">f4")) == np.dtype("<f4")
    for bad in (np.dtype(object), np.dtype("U3"), np.dtype([("a", "i4")]), np.dtype("M8[s]")):
        with pytest.raises(TypeError, match="cannot be communicated"):
            check_dtype(bad)


def test_layout_chunks_then_segments() -> None:
    a = np.arange(10, dtype=np.float32)
    layout = Layout.split([a], 3)
    assert [layout.nbytes(c) for c in range(3)] == [16, 12, 12]  # array_split: 4, 3, 3
    assert layout.segment(8) == 2
    pieces = [layout.pieces(0, s)[0].tolist() for s in range(2)]
    assert pieces == [[0, 1], [2, 3]]
    # Every element belongs to exactly one (chunk, segment) piece.
    seen = np.concatenate([layout.pieces(c, s)[0] for c in range(3) for s in range(2)])
    np.testing.assert_array_equal(np.sort(seen), a)
    assert layout.nbytes(ALL) == a.nbytes and layout.nbytes(range(1, 3)) == 24


def test_layout_split_by_rows() -> None:
    a = np.arange(12.0).reshape(6, 2)
    layout = Layout.split([a.reshape(-1)], 4, row_sizes=[2])
    parts = np.array_split(a, 4, axis=0)
    for c in range(4):
        np.testing.assert_array_equal(layout.pieces(c, 0)[0], parts[c].reshape(-1))


def test_public_exports() -> None:
    for name in p2pcoll.__all__:
        assert hasattr(p2pcoll, name), name
    for err in ("RendezvousError", "CollectiveTimeout", "PeerLost", "CollectiveMismatch",
                "ProtocolError", "UnknownStrategy"):
        assert issubclass(getattr(p2pcoll, err), p2pcoll.P2PCollError)
    assert p2pcoll.ReduceOp("avg") is p2pcoll.ReduceOp.AVG and p2pcoll.ReduceOp.SUM == "sum"


def test_transport_choice() -> None:
    from p2pcoll.transport import endpoint_policy as get_transport

    auto = get_transport("auto")
    addresses = auto.bind_addresses("127.0.0.1")
    assert addresses[0] == "tcp://127.0.0.1:*" and addresses[1].startswith("ipc://")
    theirs = ["tcp://10.0.0.2:5000", "ipc:///tmp/x.sock"]
    assert auto.choose("hostA/boot1", "hostA/boot1", theirs) == "ipc:///tmp/x.sock"
    assert auto.choose("hostA/boot1", "hostB/boot1", theirs) == "tcp://10.0.0.2:5000"
    assert get_transport("tcp").choose("a", "a", ["tcp://h:1"]) == "tcp://h:1"
    with pytest.raises(ValueError, match="unknown transport 'udp'"):
        get_transport("udp")


async def test_auto_transport_uses_ipc_on_one_host() -> None:
    from p2pcoll.testing import run_ranks

    async def fn(g: p2pcoll.Group) -> tuple[str, ...]:
        await g.barrier(timeout=10)
        return g.membership.endpoints

    for endpoints in await run_ranks(3, fn, transport="auto"):
        assert all(e.startswith("ipc://") for e in endpoints), endpoints
    for endpoints in await run_ranks(2, fn, transport="tcp"):
        assert all(e.startswith("tcp://127.0.0.1:") for e in endpoints), endpoints


def test_validate_names_what_is_wrong_with_a_members_message() -> None:
    """What the live peer's reader drops (tests/test_faults.py), reason by reason (the
    binary frame's own byte-level cases are in tests/test_wire_binary.py)."""
    limits = Limits("gid", rank=0, world_size=3, max_message_bytes=1 << 20)

    def frame(group: str = "gid", src: int = 1, nbytes: tuple[int, ...] = (8,)) -> bytes:
        return DataHeaders(group, src).frame(0, 0, 0, b"\0" * 8, list(nbytes))

    good = frame()
    cases = [
        (1, b"\xc1 not msgpack", [], "not valid msgpack"),
        (1, msgpack.packb([1, 2, 3]), [], "expected a map"),
        (1, good[:1] + bytes([99]) + good[2:], [8], "wire version 99"),
        (1, msgpack.packb({"v": 2.0, "k": "bye"}), [], "wire version 2.0"),
        (1, frame("another-group"), [8], "another group"),
        (1, msgpack.packb({"v": WIRE_VERSION, "k": "bye", "g": "another-group", "r": 1,
                           "q": 0}), [], "another-group"),
        (1, good, [3], "payload frame 0 has 3 bytes"),
        (1, good, [], "lists 1 payload frames"),
        (1, frame(src=2), [8], "claims rank 2"),
        (1, frame(nbytes=(2 << 20,)), [2 << 20], "cap"),
        (1, msgpack.packb({"v": WIRE_VERSION, "k": "exec", "g": "gid", "r": 1}), [],
         "unknown message kind"),
        (1, msgpack.packb({"v": WIRE_VERSION, "k": "data", "g": "gid", "r": 1, "q": 0,
                           "seg": 0, "s": 0, "sig": b"\0" * 8, "n": [8]}), [8],
         "binary frame"),
        (0, frame(src=0), [8], "no other member"),  # my own rank
        (5, frame(src=5), [8], "no other member"),
    ]
    for link, raw, sizes, reason in cases:
        with pytest.raises(ProtocolError, match=reason):
            validate(link, raw, sizes, limits)
    assert validate(1, good, [8], limits).key == (0, 0, 1, 0)
