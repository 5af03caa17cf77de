"""Random hostile values for the fuzz tests: msgpack-able objects, keys, header mutations,
and :func:`header_bytes`, which writes a header given as a map the way the wire does.

Shared by tests/test_live_fuzz.py and tests/test_flood.py (whose attacker process runs
that file as a script, with this folder on its path).
"""

from __future__ import annotations

import random
import struct
from collections.abc import Callable
from typing import Any

import msgpack

KINDS = ["data", "hello", "abort", "bye", "farewell", "why", "waiting"]


def random_object(rng: random.Random, depth: int = 0) -> Any:
    """A random msgpack-able value: scalars of every type, nested lists and maps."""
    roll = rng.random()
    if depth < 4 and roll < 0.25:
        return [random_object(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    if depth < 4 and roll < 0.45:
        return {random_key(rng): random_object(rng, depth + 1)
                for _ in range(rng.randint(0, 4))}
    return rng.choice([
        None, True, False, 0, -1, 1, 2, 3, 1 << 62, (1 << 64) - 1, -(1 << 63),
        rng.randint(-(1 << 63), (1 << 64) - 1), float("nan"), float("inf"), -0.0, 2.0,
        "", *KINDS, "<f4", "*", "x" * rng.randint(0, 300), b"", bytes(8),
        rng.randbytes(rng.randint(0, 40)),
    ])


def random_key(rng: random.Random) -> Any:
    return rng.choice(["v", "k", "g", "r", "q", "seg", "s", "sig", "n", "m", "d", "err",
                       "meta", "strategy", "leaves", "tree", "ring", "state", "waiting_on",
                       "lost", "zz", 1, -7, b"k", ""])


def mutate(rng: random.Random, d: dict[str, Any]) -> dict[str, Any]:
    """A copy of header ``d`` with one field (or one entry of its meta) replaced, deleted
    or added."""
    d = dict(d)
    target = d
    if "meta" in d and rng.random() < 0.3:
        target = d["meta"] = dict(d["meta"])
    how = rng.random()
    if how < 0.6 and target:
        target[rng.choice(list(target))] = random_object(rng)
    elif how < 0.8 and target:
        del target[rng.choice(list(target))]
    else:
        target[random_key(rng)] = random_object(rng)
    return d


def header_bytes(d: dict[Any, Any], encoder: Callable[[Any], bytes] | None = None) -> bytes:
    """The header frame of a header written as a map (the field names of
    :mod:`p2pcoll.wire.header`). A data header goes out as its binary frame, its optional
    parts (m, d, meta) in the msgpack tail, unless a fixed field cannot be packed (a
    mutation made it a string, say): then, like every other kind, as a msgpack map (which
    the reader refuses for data). ``encoder`` writes the msgpack parts (plain msgpack by
    default).
    """
    encode = encoder or _packb
    from p2pcoll.wire import group_digest
    from p2pcoll.wire.header import (
        DATA_FIXED,
        DATA_MAGIC,
        DESCRIBED_FLAG,
        META_FLAG,
        SHM_FLAG,
        TAG_FLAG,
    )

    if d.get("k") == "data":
        try:
            n, tag = d["n"], d.get("t")
            flags = 0 if tag is None else TAG_FLAG
            tail = []
            for key, flag in (("m", SHM_FLAG), ("d", DESCRIBED_FLAG), ("meta", META_FLAG)):
                if d.get(key) is not None:
                    flags |= flag
                    tail.append(d[key])
            head = DATA_FIXED.pack(DATA_MAGIC, d["v"], flags, 0, group_digest(d["g"]), d["r"],
                                   d["q"], d["seg"], d["s"], d["sig"], len(n))
            head += (b"" if tag is None else struct.pack("<I", tag)) + struct.pack(
                f"<{len(n)}Q", *n)
        except (KeyError, TypeError, AttributeError, struct.error, OverflowError):
            pass
        else:
            return head + encode(tail) if tail else head
    return encode(d)


def _packb(obj: Any) -> bytes:
    packed: bytes = msgpack.packb(obj, use_bin_type=True)
    return packed
