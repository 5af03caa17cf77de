"""How a collective's data is cut into chunks and pipeline segments.

The data of a collective is a list of flat, C-contiguous arrays (the leaves of a pytree, or
the per-rank parts of an allgather). A *chunk* is a set of pieces ``(array, start, stop)``;
a strategy addresses chunks by index. Large data is additionally cut into *segments*: piece
``[start, stop)`` of a chunk is split into ``nseg`` sub-pieces, and segment s of the whole
schedule works on the s-th sub-piece of every piece. Segments are independent copies of the
schedule, so the executor can pipeline them: the reduction of one overlaps the transfer of
the next, and no single message is larger than about ``segment_bytes``.

Chunks are split first and segments second, so the bytes a rank sends for a chunk are the
chunk's size exactly, whatever the segmentation.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ..strategy import Chunk, chunk_indices
import itertools

Piece = tuple[int, int, int]  # (array index, start, stop) in elements
HEADER_ROOM = 4096  # bytes of a message's cap left for its header frame


def _split_point(length: int, parts: int, i: int) -> int:
    """Start of part i when ``length`` items are split like ``numpy.array_split``."""
    q, r = divmod(length, parts)
    return i * q + min(i, r)


class Extent:
    """Stands in for a flat array in a :class:`Layout`: only its length and item size (a
    cost model's data, an alltoall's blocks of other ranks: the same cut on every rank)."""

    def __init__(self, size: int, itemsize: int) -> None:
        self.size, self.itemsize, self.nbytes = size, itemsize, size * itemsize


class Layout:
    """Chunks and segments over a list of flat arrays."""

    def __init__(self, arrays: Sequence[np.ndarray], chunks: list[list[Piece]]) -> None:
        self.arrays = list(arrays)
        self.chunks = chunks
        self.nseg = 1

    @classmethod
    def split(
        cls, arrays: Sequence[np.ndarray], nchunks: int, row_sizes: Sequence[int] | None = None
    ) -> Layout:
        """Cut every array into ``nchunks`` pieces; chunk c is piece c of every array.

        With ``row_sizes`` the cut falls between rows (``array_split`` along axis 0 of the
        original array, whose rows have that many elements); otherwise between elements.
        """
        chunks: list[list[Piece]] = [[] for _ in range(nchunks)]
        for i, a in enumerate(arrays):
            row = row_sizes[i] if row_sizes is not None else 1
            nrows = a.size // row if row else 0
            for c in range(nchunks):
                lo = _split_point(nrows, nchunks, c) * row
                hi = _split_point(nrows, nchunks, c + 1) * row
                chunks[c].append((i, lo, hi))
        return cls(arrays, chunks)

    @classmethod
    def cut(cls, arrays: Sequence[np.ndarray], cuts: Sequence[int]) -> Layout:
        """Chunk c is elements ``[cuts[c], cuts[c + 1])`` of the arrays seen as one flat run
        (a chunk may span arrays, or be empty). ``cuts`` as :func:`~.plan.chunking` checked
        them: non-decreasing from 0 to the count."""
        bounds = [int(c) for c in cuts]
        starts = np.cumsum([0] + [a.size for a in arrays]).tolist()
        chunks: list[list[Piece]] = []
        for lo, hi in itertools.pairwise(bounds):
            chunks.append([(i, max(lo, a) - a, min(hi, b) - a)
                           for i, (a, b) in enumerate(itertools.pairwise(starts))
                           if max(lo, a) < min(hi, b)])
        return cls(arrays, chunks)

    @classmethod
    def parts(cls, arrays: Sequence[np.ndarray]) -> Layout:
        """One chunk per array: chunk r is array r whole."""
        return cls(arrays, [[(i, 0, a.size)] for i, a in enumerate(arrays)])

    def segment(self, segment_bytes: int, max_message_bytes: int | None = None, *,
                whole: bool = False) -> int:
        """Choose the number of pipeline segments so that no piece exceeds ``segment_bytes``
        (no whole segment, with ``whole``: a strategy whose messages may carry every chunk)
        and no message (at most every chunk of one segment) exceeds ``max_message_bytes``,
        the receivers' cap: a group whose cap is below its segment size still works."""
        if whole:
            largest = sum(a.nbytes for a in self.arrays)
        else:
            largest = max(
                ((hi - lo) * self.arrays[i].itemsize
                 for chunk in self.chunks for i, lo, hi in chunk),
                default=0,
            )
        nseg = max(1, math.ceil(largest / segment_bytes)) if segment_bytes > 0 else 1
        if max_message_bytes:
            # A piece of n elements splits into parts of at most ceil(n / nseg) elements,
            # so a segment is at most the total divided by nseg, plus one element per piece;
            # the header frame counts against the cap too.
            pieces = sum(len(chunk) for chunk in self.chunks)
            item = max((a.itemsize for a in self.arrays), default=1)
            header = min(max_message_bytes // 2, HEADER_ROOM)
            room = max_message_bytes - header - pieces * item
            total = sum(a.nbytes for a in self.arrays)
            if room > 0 and total > room:
                nseg = max(nseg, math.ceil(total / room))
        self.nseg = nseg
        return self.nseg

    def chunk_ids(self, chunk: Chunk) -> Sequence[int]:
        return chunk_indices(chunk, len(self.chunks))

    def pieces(self, chunk: Chunk, seg: int) -> list[np.ndarray]:
        """The array views that make up ``chunk`` in segment ``seg``."""
        out = []
        for c in self.chunk_ids(chunk):
            for i, lo, hi in self.chunks[c]:
                n = hi - lo
                a = lo + _split_point(n, self.nseg, seg)
                b = lo + _split_point(n, self.nseg, seg + 1)
                out.append(self.arrays[i][a:b])
        return out

    def nbytes(self, chunk: Chunk) -> int:
        """Payload bytes of ``chunk`` over all segments."""
        return sum(
            (hi - lo) * self.arrays[i].itemsize
            for c in self.chunk_ids(chunk)
            for i, lo, hi in self.chunks[c]
        )
