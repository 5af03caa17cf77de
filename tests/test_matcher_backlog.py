"""A receiver's backlog: many operations' early messages in the matcher at once.

A fast sender may leave its whole eager window unreceived in a peer (thousands of small
transfers: p2pcoll.engine.credit). Each operation then sees only its own early messages:
declaring its signature checks its messages alone, finishing it drops its messages alone,
and what a timeout reports as left over names its messages alone. (Before 0.22.1 every one
of these scanned the whole backlog, so draining a backlog of n messages took O(n^2): a
receiver took 10 s and more to reach the failure of a sender that had died;
``benchmarks/eager_window.py --count 8000 --size 8K`` shows the figure.)
"""

from __future__ import annotations

import asyncio

import pytest

from p2pcoll.engine.matching import Matcher
from p2pcoll.errors import CollectiveMismatch
from p2pcoll.transport.base import BytesPiece
from p2pcoll.types import OpKey
from p2pcoll.wire import Header, Signature

from test_message_poll import GROUP, _Record

TAG = 7
OURS = Signature.of("recv", "direct", "", 1, "*|<f8(4,)")
THEIRS = Signature.of("recv", "direct", "", 1, "*|<f4(4,)")


def _transfer(n: int, sig: Signature = OURS, src: int = 1) -> Header:
    """The header of the n-th transfer from ``src`` to rank 0 with TAG."""
    return Header("data", GROUP, src, n, 0, 0, sig=sig.digest, nbytes=[1], tag=TAG,
                  described=list(sig.fields))


def _op(n: int, src: int = 1) -> OpKey:
    return OpKey(n, TAG, src, 0)


def _backlog(count: int, odd: int | None = None) -> Matcher:
    """A matcher holding ``count`` early transfers from rank 1 (transfer ``odd`` with the
    other signature)."""
    matcher = Matcher(_Record())
    for n in range(count):
        header = _transfer(n, THEIRS if n == odd else OURS)
        assert matcher.put(header, [BytesPiece(bytes([n % 256]))])
    return matcher


def test_a_backlog_is_received_in_order_and_leaves_nothing_behind() -> None:
    count = 3000
    matcher = _backlog(count)
    assert matcher.stats()["buffered"] == count

    async def drain() -> list[int]:
        got = []
        for n in range(count):
            op = _op(n)
            matcher.expect(op, OURS, 0)
            header, frames = await matcher.get((op, 0, 1, 0))
            got.append(frames[0].buffer[0])
            assert header.seq == n
            matcher.finish(op)
        return got

    assert asyncio.run(drain()) == [n % 256 for n in range(count)]
    assert matcher.stats() == {"buffered": 0, "waiting": 0}


def test_a_mismatch_fails_only_its_own_operation() -> None:
    matcher = _backlog(50, odd=20)
    for n in (19, 21, 49):
        matcher.expect(_op(n), OURS, 0)
        assert matcher.failure(_op(n)) is None
    matcher.expect(_op(20), OURS, 0)
    failure = matcher.failure(_op(20))
    assert isinstance(failure, CollectiveMismatch)
    assert "float32[4]" in str(failure) and "float64[4]" in str(failure)


def test_finishing_an_operation_drops_its_early_messages_alone() -> None:
    matcher = _backlog(10)
    matcher.put(Header("data", GROUP, 1, 4, 1, 0, sig=OURS.digest, nbytes=[1], tag=TAG),
                [BytesPiece(b"x")])  # a second segment of transfer 4
    assert matcher.leftover(_op(4)) == [1]
    assert matcher.stray(_op(4)) is not None
    matcher.finish(_op(4))
    assert matcher.leftover(_op(4)) == []
    assert matcher.stray(_op(4)) is None
    assert matcher.stats()["buffered"] == 9
    assert matcher.leftover(_op(5)) == [1]
    # A late message of the finished transfer is stale: dropped, not buffered.
    assert not matcher.put(_transfer(4), [BytesPiece(b"y")])
    assert matcher.stats()["buffered"] == 9


def test_a_repeated_key_in_a_backlog_is_refused() -> None:
    from p2pcoll.errors import ProtocolError

    matcher = _backlog(5)
    with pytest.raises(ProtocolError, match="duplicate"):
        matcher.put(_transfer(3), [BytesPiece(b"z")])
    assert matcher.stats()["buffered"] == 5
