"""Reporting NaN and Inf in reduced gradients, by tensor name.

The reduced values are equal on every rank, so every rank reports the same thing.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from typing import Literal

import numpy as np

from .buckets import BucketPlan
from .errors import NonFiniteGradients

__all__ = ["Nonfinite", "check_nonfinite", "report_nonfinite", "report_tensors"]

Nonfinite = Literal["raise", "warn", "ignore"]
"""What a NaN or Inf in the result does: raise :class:`NonFiniteGradients`, warn
(``RuntimeWarning``), or nothing."""

_MODES = ("raise", "warn", "ignore")


def check_nonfinite(mode: str) -> None:
    """Raises ValueError unless ``mode`` is one of :data:`Nonfinite`."""
    if mode not in _MODES:
        raise ValueError(f"nonfinite must be one of {_MODES}, got {mode!r}")


def report_nonfinite(plan: BucketPlan, flats: Sequence[np.ndarray], mode: str,
                     round_no: int) -> None:
    """Warn or raise, naming every reduced tensor that holds a NaN or an Inf.

    The warning points at the caller of the public function that called this.

    Raises:
        NonFiniteGradients: some tensor does, and ``mode`` is "raise".
    """
    if mode == "ignore":
        return
    parts: list[tuple[str, np.ndarray]] = []
    for bucket, flat in zip(plan.buckets, flats, strict=True):
        if bucket.dtype.kind not in "fc":
            continue
        with np.errstate(all="ignore"):
            if np.isfinite(flat.sum()):  # NaN and Inf survive a sum; overflow checks below
                continue
        for i, start in zip(bucket.members, bucket.offsets, strict=True):
            spec = plan.specs[i]
            parts.append((spec.name, flat[start:start + spec.size]))
    report_tensors("reduced gradients", parts, mode, round_no, stacklevel=4)


def report_tensors(what: str, named: Iterable[tuple[str, np.ndarray]], mode: str,
                   round_no: int, *, stacklevel: int = 3) -> None:
    """Warn or raise, naming every one of the ``(name, array)`` pairs that holds a NaN or
    an Inf: ``"<what> of round <n> hold NaN or Inf: 'w' (3 of 12 values), ..."``.

    The arrays are results that are equal on every rank, so every rank reports alike.

    Raises:
        ValueError: ``mode`` is not one of :data:`Nonfinite`.
        NonFiniteGradients: some array does, and ``mode`` is "raise".
    """
    check_nonfinite(mode)
    if mode == "ignore":
        return
    bad: list[tuple[str, str]] = []
    for name, array in named:
        count = array.size - int(np.count_nonzero(np.isfinite(array)))
        if count:
            bad.append((name, f"{name!r} ({count} of {array.size} values)"))
    if not bad:
        return
    message = (f"{what} of round {round_no} hold NaN or Inf: "
               f"{', '.join(words for _, words in bad)}")
    if mode == "raise":
        raise NonFiniteGradients(message, round=round_no, tensors=[name for name, _ in bad])
    warnings.warn(message, RuntimeWarning, stacklevel=stacklevel)
