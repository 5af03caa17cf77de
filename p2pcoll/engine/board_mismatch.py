"""What a board collective that does not match says: the fields that differ between two
ranks' collectives on the board (:mod:`.board_path`), read from the peer's line and the
readable signature it wrote beside its data, or a peer that ran the collective as messages.
Only on the error path: a mismatch, never a call that agrees.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import msgpack

from ..errors import CollectiveMismatch
from ..strategy import COLLECTIVES
from ..transport.board import Board
from ..types import OpKey
from ..wire import Signature
from ..wire.header import SIGNATURE_FIELDS
from .matching import Matcher


class BoardPath(Protocol):
    """What this module reads of a :class:`~.board_path.BoardPath`."""

    board: Board
    matcher: Matcher
    rank: int
    sig: Signature | None  # the board collective running now
    history: Callable[[int], Signature | None]  # what this rank ran at a sequence number

OPS = ("", "sum", "prod", "min", "max", "avg")
BROADCAST = COLLECTIVES.index("broadcast") + 1  # its meta area holds a layout, not a signature


def describe_code(word: int) -> tuple[str, str, int]:
    coll, op, root = word & 0xFF, (word >> 8) & 0xFF, (word >> 16) - 1
    name = COLLECTIVES[coll - 1] if 0 < coll <= len(COLLECTIVES) else f"code {coll}"
    return name, (OPS[op] if op < len(OPS) else "custom"), root


def mismatch(path: BoardPath, q: int, parity: int, seq: int, code: int, nbytes: int | None,
             theirs: tuple[int, ...]) -> CollectiveMismatch:
    """What differs between rank ``q``'s collective on the board and mine, by field:
    from its readable signature where it wrote one, else from its codes."""
    t_seq, _, t_nbytes, t_code, t_meta, _ = theirs
    mine_c, theirs_c = describe_code(code), describe_code(t_code)
    diffs = []
    if t_seq != seq:
        stray = stray_mismatch(path, seq)  # what the peer ran at my sequence number, if it said
        if stray is not None:
            return stray
        mine = path.history(t_seq)  # what I ran at the peer's sequence number
        described = signature_of(path, q, parity, t_meta)
        if mine is not None and described is not None and list(mine.fields) != described:
            return CollectiveMismatch(
                f"collective #{t_seq} {mine.collective}: "
                f"{mine.describe_difference(described, path.rank, q)} (rank {q} runs it "
                f"on the shared-memory board, rank {path.rank} ran it otherwise)")
        diffs.append(f"rank {q} ran its collective #{t_seq} here, rank {path.rank} "
                     f"#{seq}: the ranks called different sequences of collectives")
    described = signature_of(path, q, parity, t_meta) if t_code & 0xFF != BROADCAST else None
    sig = path.sig
    if described is not None and sig is not None and list(sig.fields) != described:
        diffs.append(sig.describe_difference(described, path.rank, q))
    else:
        for field, a, b in zip(("collective", "op", "root"), mine_c, theirs_c,
                               strict=True):
            if a != b:
                diffs.append(f"{field}: rank {path.rank} has {a!r}, rank {q} has {b!r}")
        if nbytes is not None and t_nbytes != nbytes and len(diffs) <= (t_seq != seq):
            diffs.append(f"data: rank {path.rank} has {nbytes} bytes, rank {q} has "
                         f"{t_nbytes}")
    if len(diffs) <= (t_seq != seq):
        diffs.append(f"data: rank {q}'s dtypes, shapes or op differ from rank "
                     f"{path.rank}'s")
    return CollectiveMismatch(f"collective #{seq} {mine_c[0]}: " + "; ".join(diffs))

def signature_of(path: BoardPath, q: int, parity: int, length: int) -> list[Any] | None:
    """Rank ``q``'s readable signature in its meta area (checked like a header's)."""
    if not 0 < length <= path.board.meta_bytes:
        return None
    try:
        fields = msgpack.unpackb(bytes(path.board.meta[q][parity][:length]), raw=False,
                                 max_str_len=1024, max_bin_len=0, max_array_len=8,
                                 max_map_len=0, max_ext_len=0)
    except Exception:  # msgpack raises several types for bad bytes: not described
        return None
    ok = (type(fields) is list and len(fields) == len(SIGNATURE_FIELDS)
          and all(type(v) in (int, str) for v in fields))
    return fields if ok else None

def stray_mismatch(path: BoardPath, seq: int) -> CollectiveMismatch | None:
    """A peer that sent collective ``seq`` as messages runs it otherwise: a mismatch."""
    header = path.matcher.stray(OpKey(seq))
    if header is None:
        return None
    sig = path.sig
    what = f"collective #{seq}" + (f" {sig.collective}" if sig is not None else "")
    described = path.matcher.described(header)
    if described is not None and sig is not None:
        diff = sig.describe_difference(described, path.rank, header.src)
    else:
        diff = "the ranks disagree about the collective or its size"
    return CollectiveMismatch(
        f"{what}: {diff} (rank {header.src} sent it as messages, rank {path.rank} ran "
        f"it on the shared-memory board)")


__all__ = ["OPS", "describe_code", "mismatch", "signature_of", "stray_mismatch"]
