"""The TCP lanes' records and tokens, with no sockets (see :mod:`.tcp_lane`).

A record is ``size: u32, count: u32, count x length: u32``, then the frames back to back;
``size`` is the whole record's, and a record of no frames (:data:`END`) is a lane's last.
:class:`RecordReader` takes bytes as they come and gives whole, checked records; a record
that does not add up is a :class:`~p2pcoll.errors.ProtocolError`. :class:`Tokens` are the
one-time tokens a sender names in its hellos and a connector presents.
"""

from __future__ import annotations

import hmac
import secrets
import struct
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import ProtocolError
from .lane import MAX_FRAMES, Record

if TYPE_CHECKING:
    from typing_extensions import Buffer  # collections.abc.Buffer from Python 3.12

__all__ = ["END", "LARGEST", "MAX_FRAMES", "TOKEN_BYTES", "Record", "RecordReader", "Tokens",
           "encode_record", "encode_sized", "record_size"]

# Bytes of the largest record a lane carries: a 64 KiB piece and its header. Larger messages
# go over the ZeroMQ link, zero-copy, and striped where the path wants it (.stripes).
LARGEST = (64 << 10) + (4 << 10)
TOKEN_BYTES = 16
_HEAD = struct.Struct("<II")
END = _HEAD.pack(8, 0)  # the record a lane closed in good order ends with
_LENGTHS = [struct.Struct(f"<{n}I") for n in range(5)]  # a record's lengths, 0-4 frames
_PREFIXES = [struct.Struct(f"<II{n}I") for n in range(5)]  # its size, count and lengths


def record_size(frames: Sequence[Buffer]) -> int:
    """Bytes a record of ``frames`` takes on the lane."""
    return 8 + 4 * len(frames) + sum(_lengths(frames))


def _lengths(frames: Sequence[Buffer]) -> list[int]:
    """Each frame's bytes (a header's bytes or an array: no view made)."""
    lengths = []
    items: Sequence[Any] = frames  # (typing.cast would be a call)
    for f in items:
        if type(f) is bytes:
            lengths.append(len(f))
        elif type(f) is np.ndarray:
            lengths.append(f.nbytes)
        else:
            lengths.append(memoryview(f).nbytes)
    return lengths


def encode_record(frames: Sequence[Buffer]) -> list[Buffer]:
    """The pieces of one record of ``frames`` (bytes-like, C-contiguous), head first: the
    prefix, then the frames themselves (what ``sendmsg`` takes as they are)."""
    return encode_sized(frames)[0]


def encode_sized(frames: Sequence[Buffer]) -> tuple[list[Buffer], int]:
    """:func:`encode_record`'s pieces and the record's size in bytes (one pass)."""
    lengths = _lengths(frames)
    count = len(lengths)
    size = 8 + 4 * count + sum(lengths)
    prefix = _PREFIXES[count].pack(size, count, *lengths) if count <= 4 else \
        struct.pack(f"<II{count}I", size, count, *lengths)
    return [prefix, *frames], size


class RecordReader:
    """The receiving side's record codec: bytes in, checked records out (no socket).

    Args:
        largest: the largest record accepted, in bytes.
    """

    def __init__(self, largest: int = LARGEST) -> None:
        self.largest = largest
        self.records: deque[Record] = deque()
        self.sizes: deque[int] = deque()  # the size of each, for held
        self.held = 0  # bytes of the records not yet taken
        self.ended = False  # the sender's END came
        self._buf = bytearray()

    @property
    def partial(self) -> bool:
        """Whether part of a record came and its rest did not (yet)."""
        return bool(self._buf)

    def feed(self, data: Buffer) -> None:
        """Take bytes as they came; every whole record among them joins :attr:`records`.

        Raises:
            ProtocolError: a record's sizes do not add up; nothing after the last good
                record is kept, and the reader must not be fed again.
        """
        buf = self._buf
        try:
            if buf:  # the rest of a record that came in part: after it
                buf += data
                with memoryview(buf) as view:
                    at = self._parse(view)
                del buf[:at]
                return
            # Nothing held (as nearly always): records are read from ``data`` itself, and
            # only a record that came in part is kept.
            with memoryview(data) as given, given.cast("B") as view:
                at = self._parse(view)
                if at < len(view):
                    buf += view[at:]
        except ProtocolError:
            buf.clear()
            raise

    def _parse(self, view: memoryview) -> int:
        """Whole records of ``view`` to :attr:`records` (copied); bytes read."""
        at, end = 0, len(view)
        while end - at >= 8:
            size, count = _HEAD.unpack_from(view, at)
            if self.ended:
                raise self._corrupt("bytes after the end")
            if size == 8 and count == 0:
                self.ended = True
                at += 8
                continue
            if (count < 1 or count > MAX_FRAMES or size < 8 + 4 * count
                    or size > self.largest + 8 + 4 * MAX_FRAMES):
                raise self._corrupt(f"a record of {size} bytes with {count} frames")
            if end - at < size:
                break
            lengths = _LENGTHS[count].unpack_from(view, at + 8) if count <= 4 else \
                struct.unpack_from(f"<{count}I", view, at + 8)
            if 8 + 4 * count + sum(lengths) != size:
                raise self._corrupt(f"frames of {sum(lengths)} bytes in a record of "
                                    f"{size}")
            # Every frame copied, the first too: the bytes they are in are reused as more
            # come. (Inline, as on every record: frames_of's split, but no view kept.)
            start = at + 8 + 4 * count
            stop = start + lengths[0]
            rest = []
            for n in lengths[1:]:
                rest.append(view[stop:stop + n].tobytes())
                stop += n
            self.records.append((memoryview(view[start:start + lengths[0]].tobytes()), rest))
            self.sizes.append(size)
            self.held += size
            at += size
        return at

    def take(self) -> Record | None:
        """The oldest whole record not yet taken, or None."""
        if not self.records:
            return None
        self.held -= self.sizes.popleft()
        return self.records.popleft()

    def _corrupt(self, what: str) -> ProtocolError:
        return ProtocolError(f"TCP lane record does not add up ({what})")


class Tokens:
    """One-time tokens a sender names in its hellos: whoever presents one is that peer."""

    def __init__(self) -> None:
        self._issued: dict[bytes, int] = {}

    def issue(self, peer: int) -> bytes:
        """A new token that only ``peer`` is told of (in the hello to it)."""
        token = secrets.token_bytes(TOKEN_BYTES)
        self._issued[token] = peer
        return token

    def redeem(self, presented: bytes) -> int | None:
        """The peer a presented token was issued to, once; None for any other bytes."""
        for token, peer in self._issued.items():  # compared in constant time, each
            if hmac.compare_digest(token, presented):
                del self._issued[token]
                return peer
        return None

    def revoke(self, peer: int) -> None:
        """Forget the tokens issued to ``peer``."""
        for token in [t for t, p in self._issued.items() if p == peer]:
            del self._issued[token]
