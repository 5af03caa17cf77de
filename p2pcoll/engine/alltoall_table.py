"""An all-to-all's table of lengths: what every rank passed, checked alike on every rank.

Row i is what rank i passed: the number of its parts, its dtype (as one int64 word), the
elements per row of its parts, whether it gave ``out=`` buffers (1) or not (0), then the
rows of its part for each rank j, then (with ``out=``) the rows it expects from each rank.
Every rank fills its own row; the table reaches every rank either as a small allreduce
(:mod:`p2pcoll.api.alltoall`, the message path) or as the headers of the board's one
round (:mod:`.board_alltoall`). Every rank then checks the same table with :func:`check`,
so a disagreement is the same :class:`~p2pcoll.CollectiveMismatch`, naming the ranks, on
every rank, before any data is read.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from ..errors import CollectiveMismatch

HEAD = 4  # the first columns: parts, dtype, elements per row, expects (0 or 1)


def width(p: int) -> int:
    """The columns of a group of ``p``'s table."""
    return 2 * p + HEAD


def fill(row: np.ndarray, p: int, sends: list[int], dtype: np.dtype[Any], elements: int,
         expects: list[int] | None) -> None:
    """Write one rank's row: ``sends`` its parts' rows (as many as it passed),
    ``expects`` the rows of its ``out=`` buffers (None: it gave none)."""
    zeros = [0] * p
    row[:] = [len(sends), word(dtype), elements, expects is not None,
              *(sends[:p] + zeros)[:p], *((expects or [])[:p] + zeros)[:p]]


@functools.lru_cache(maxsize=64)
def word(dtype: np.dtype[Any]) -> int:
    """A dtype as one int64 (its ``str``, at most 8 bytes: ``<f4``)."""
    return int.from_bytes(dtype.str.encode()[:8].ljust(8, b"\0"), "little", signed=True)


def _dtype_name(value: int) -> str:
    text = int(value).to_bytes(8, "little", signed=True).rstrip(b"\0").decode(
        errors="replace")
    try:
        return str(np.dtype(text))
    except TypeError:
        return text


def check(table: np.ndarray, p: int) -> np.ndarray:
    """Every rank's row of ``table`` checked alike; the rows of each block
    (``rows[i, j]``: rank i to rank j).

    Raises:
        CollectiveMismatch: naming the ranks that disagree (the same on every rank).
    """
    head, sent, expected = table[:, :HEAD], table[:, HEAD:HEAD + p], table[:, HEAD + p:]
    # The usual table (it agrees) in a few of numpy's calls, whatever p; a disagreement
    # is then found and named as :func:`check_lines` does.
    if (head[:, :3] == head[0, :3]).all() and head[0, 0] == p:
        expects = head[:, 3].nonzero()[0]
        if not len(expects) or (sent[:, expects] == expected[expects].T).all():
            return sent
    check_lines(table.tolist(), p)
    return sent


def check_lines(lines: list[list[int]], p: int) -> list[list[int]]:
    """:func:`check` of the table as lists of Python ints (a table of a few ranks is
    checked faster so than with numpy's calls); the rows of each block, as lists.

    Raises:
        CollectiveMismatch: naming the ranks that disagree (the same on every rank).
    """
    dtype, elements = lines[0][1], lines[0][2]
    for i, line in enumerate(lines):
        if line[0] != p:
            raise CollectiveMismatch(f"alltoall: rank {i} passed {line[0]} parts; a group "
                                     f"of {p} needs {p} (one per rank)")
    for i, line in enumerate(lines):
        if line[1] != dtype:
            raise CollectiveMismatch(
                f"alltoall: rank 0 sends {_dtype_name(dtype)}, rank {i} sends "
                f"{_dtype_name(line[1])}: the ranks' dtypes must be the same")
        if line[2] != elements:
            raise CollectiveMismatch(
                f"alltoall: rank 0's rows have {elements} elements, rank {i}'s "
                f"{line[2]}: the ranks' shapes after the first axis must match")
    sent = [line[HEAD:HEAD + p] for line in lines]
    for j, line in enumerate(lines):
        if line[3]:
            expected = line[HEAD + p:HEAD + 2 * p]
            for i in range(p):
                if sent[i][j] != expected[i]:
                    raise CollectiveMismatch(
                        f"alltoall: rank {i} sends rank {j} {sent[i][j]} rows, rank {j} "
                        f"expects {expected[i]} from rank {i}")
    return sent


__all__ = ["HEAD", "check", "check_lines", "fill", "width", "word"]
