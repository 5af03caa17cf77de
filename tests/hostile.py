"""Random hostile values for the fuzz tests: msgpack-able objects, keys, header mutations.

Shared by tests/test_live_fuzz.py and tests/test_flood.py (whose attacker process runs
that file as a script, with this folder on its path).
"""

from __future__ import annotations

import random
from typing import Any

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
