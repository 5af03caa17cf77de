"""Reporting NaN and Inf in reduced gradients, by tensor name.

The reduced values are equal on every rank, so every rank reports the same thing.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Literal

import numpy as np

from .buckets import BucketPlan
from .errors import NonFiniteGradients

__all__ = ["Nonfinite", "check_nonfinite", "report_nonfinite"]

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
    bad: list[tuple[str, str]] = []
    for bucket, flat in zip(plan.buckets, flats, strict=True):
        if bucket.dtype.kind not in "fc":
            continue
        with np.errstate(all="ignore"):
            if np.isfinite(flat.sum()):  # NaN and Inf survive a sum; overflow checks below
                continue
        for i, start in zip(bucket.members, bucket.offsets, strict=True):
            spec = plan.specs[i]
            part = flat[start:start + spec.size]
            count = spec.size - int(np.count_nonzero(np.isfinite(part)))
            if count:
                bad.append((spec.name, f"{spec.name!r} ({count} of {spec.size} values)"))
    if not bad:
        return
    message = (f"reduced gradients of round {round_no} hold NaN or Inf: "
               f"{', '.join(words for _, words in bad)}")
    if mode == "raise":
        raise NonFiniteGradients(message, round=round_no, tensors=[name for name, _ in bad])
    warnings.warn(message, RuntimeWarning, stacklevel=3)
