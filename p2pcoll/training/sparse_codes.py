"""topk2bit's codes: the two levels each chunk's selected entries are coded against, and how
indices and codes are packed for the wire (:mod:`.compressors`).

The levels. Each chunk's selected magnitudes (the largest of the chunk, so they sit close
together: on DiLoCo's pseudo-gradients of an MLP, 5-95 % of them within 0.5-0.9 of the
chunk's largest) are coded as one of two levels, ``m s`` and ``(m + 1) s``, with the sign:
2 bits. The group agrees, per chunk, on ``mu``, the largest over the ranks of each rank's
mean selected magnitude, and on ``sigma``, the largest of their standard deviations (one
allreduce("max") of float32 pairs, as the int8 codec agrees its block scale: exact, so the
same bits on every rank under every strategy), and every rank derives the same levels from
them::

    m = clip(rint(mu / (2 sigma) - 1/2), 1, LEVELS)    the lower level, in steps
    s = mu / (m + 1/2)                                 the step: the levels straddle mu,
                                                       about 2 sigma apart
    q = sign(a) * clip(rint(|a| / s), m, m + 1)        the code, an integer

Codes are integers, so the ranks' codes sum exactly in any order (the aggregation stays
deterministic); the step is the chunk's, shared, so the sum times ``s / p`` is the average.
Levels ``s`` and ``2 s`` at half the chunk's largest magnitude (the rule before 0.22) put the
boundary between them, 0.75 of the largest, in the middle of where the selected values sit,
and sent each about 25 % off; levels spaced by the values' own spread send them within
about 10 %.

On the wire a code is 2 bits, ``2 * (q > 0) + (|q| - m)`` (the receiver knows ``m``), four
to a byte, low bits first; an index within its chunk of 4096 is 12 bits, two to three bytes.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["LEVELS", "code_dtype", "index_bytes", "levels", "pack_codes", "pack_indices",
           "quantise", "sparse_bytes", "statistics", "unpack_codes", "unpack_indices"]

LEVELS = 7
"""The largest lower level ``m`` (levels 7 s and 8 s: 14 % apart); a chunk whose selected
magnitudes are all equal gets it."""


def levels(agreed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each chunk's step ``s`` (float64) and lower level ``m`` (int64) from the group's
    largest (mean, standard deviation) of the selected magnitudes, float32 pairs laid end to
    end; NaN steps where they are not finite."""
    pairs = agreed.reshape(-1, 2).astype(np.float64)
    mu, sigma = pairs[:, 0], pairs[:, 1]
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.rint(mu / (2 * sigma) - 0.5)
    finite = np.isfinite(mu) & np.isfinite(sigma)
    low = np.where(np.isnan(ratio), LEVELS, np.clip(np.nan_to_num(ratio, posinf=LEVELS),
                                                   1, LEVELS)).astype(np.int64)
    step = np.where(finite, mu / (low + 0.5), np.nan)
    return step, low


def statistics(magnitudes: np.ndarray) -> np.ndarray:
    """One rank's (mean, standard deviation) of each row of selected magnitudes (float64
    rows), as float32 pairs."""
    out = np.empty((magnitudes.shape[0], 2), np.float32)
    with np.errstate(over="ignore"):
        out[:, 0] = magnitudes.mean(axis=1)
        out[:, 1] = magnitudes.std(axis=1)
    return out


def quantise(values: np.ndarray, step: np.ndarray, low: np.ndarray) -> np.ndarray:
    """The codes (int8, +-m or +-(m + 1)) of ``values`` against each one's ``step`` and
    lower level ``low``."""
    values = values.astype(np.float64)
    safe = np.where((step > 0) & np.isfinite(step), step, 1.0)
    with np.errstate(invalid="ignore", over="ignore"):
        magnitude = np.clip(np.rint(np.abs(values) / safe), low, low + 1)
        magnitude = np.where(np.isfinite(magnitude), magnitude, low)
    return np.where(values < 0, -magnitude, magnitude).astype(np.int8)


def code_dtype(world_size: int) -> np.dtype[Any]:
    """The dense codes' dtype: sums of p codes in [-(LEVELS + 1), LEVELS + 1] must fit."""
    top = (LEVELS + 1) * world_size
    return np.dtype(np.int8 if top <= 127 else np.int16 if top <= 32767 else np.int32)


def sparse_bytes(selected: int) -> int:
    """A rank's sparse message: a 12-bit index and a 2-bit code per selected entry."""
    return index_bytes(selected) + -(-selected // 4)


def index_bytes(selected: int) -> int:
    return 3 * -(-selected // 2)


def pack_indices(indices: np.ndarray) -> np.ndarray:
    """Indices in [0, 4096) as 12 bits each, two to three bytes (little-endian nibbles)."""
    pairs = np.concatenate([indices, np.zeros(indices.size % 2, np.int64)]).reshape(-1, 2)
    a, b = pairs[:, 0], pairs[:, 1]
    packed = np.stack([a & 0xFF, (a >> 8) | ((b & 0xF) << 4), b >> 4], axis=1)
    out: np.ndarray = packed.astype(np.uint8).reshape(-1)
    return out


def unpack_indices(packed: np.ndarray, count: int) -> np.ndarray:
    triples = packed.reshape(-1, 3).astype(np.int64)
    a = triples[:, 0] | ((triples[:, 1] & 0xF) << 8)
    b = (triples[:, 1] >> 4) | (triples[:, 2] << 4)
    indices: np.ndarray = np.stack([a, b], axis=1).reshape(-1)[:count]
    return indices


def pack_codes(q: np.ndarray, low: np.ndarray) -> np.ndarray:
    """Codes +-m, +-(m + 1) (``low``: each one's m) as 2 bits each, ``2 * (q > 0) +
    (|q| - m)``, four to a byte, low bits first."""
    bits = (2 * (q > 0) + (np.abs(q.astype(np.int64)) - low)).astype(np.uint8)
    bits = np.concatenate([bits, np.zeros(-bits.size % 4, np.uint8)]).reshape(-1, 4)
    packed: np.ndarray = (bits[:, 0] | bits[:, 1] << 2 | bits[:, 2] << 4
                          | bits[:, 3] << 6).astype(np.uint8)
    return packed


def unpack_codes(packed: np.ndarray, low: np.ndarray) -> np.ndarray:
    """The codes (int64) :func:`pack_codes` packed, ``low`` each one's m."""
    bits = (packed[:, None] >> np.array([0, 2, 4, 6], np.uint8)) & 3
    flat = bits.reshape(-1)[:low.size].astype(np.int64)
    magnitude = low + (flat & 1)
    unpacked: np.ndarray = np.where(flat >= 2, magnitude, -magnitude)
    return unpacked
