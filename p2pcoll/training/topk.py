"""Top-k: each rank sends only its largest gradient entries, and keeps the rest for later.

Sparsification with error feedback (Stich, Cordonnier and Jaggi 2018; Lin et al.'s Deep
Gradient Compression 2018). Every rank keeps a residual ``e`` per tensor, its own. A round::

    a     = grad + e                  the gradient with what earlier rounds held back
    k     = ceil(fraction * size)     per tensor (at least 1), the same on every rank
    idx   = the k entries of a of largest magnitude; val = a[idx]
    e     = a, with a[idx] set to 0   kept for the next round
    (idx, val) of every rank          one allgather: k values and k indices per tensor
    out   = (sum over ranks r = 0, 1, ... of val_r scattered at idx_r) / world size

The sparse parts of the ranks differ in where they are, so they cannot be summed by an
allreduce; they are gathered instead, and every rank adds them up itself. It adds them in
rank order, starting from zeros, with the same numpy operations, so every rank gets the
same bits. Each rank sends ``k (itemsize + 4)`` bytes per tensor (8-byte indices for
tensors of 2**31 entries or more) and receives that from every other rank: with
``fraction=0.01`` about 2 % of a float32 gradient's bytes per peer, against twice the
gradient for a ring allreduce; allgather grows with the world size, so top-k pays most for
small groups on slow links.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..pytree import Pytree, like, named_leaves, replace_leaves
from .buckets import TensorSpec
from .modes import Traffic, agree_on, float_tensors, report_nonfinite, same_tensors
from .nonfinite import Nonfinite, check_nonfinite
from .state import state_of

if TYPE_CHECKING:
    from .. import Group

__all__ = ["TopK", "top_k_indices"]


@dataclass(frozen=True)
class _Slot:
    """Where one tensor's k values and k indices lie in a rank's message (byte offsets)."""

    k: int
    values: int
    indices: int
    index_dtype: np.dtype[Any]


class TopK:
    """Averages gradients over a group by gathering every rank's largest entries (module
    docstring), with error feedback.

    One reducer serves one set of gradients (the same names, shapes and dtypes every round)::

        reducer = training.TopK(fraction=0.01)
        grads = await reducer.allreduce(group, grads)    # the same bits on every rank

    Args:
        fraction: the share of each tensor's entries sent per round, in (0, 1]; at least
            one entry of every non-empty tensor is sent. 1 sends everything (a dense
            average by allgather).
        strategy: the allgather strategy; None is the group's choice.
        nonfinite: a NaN or Inf in the result: "raise" :class:`NonFiniteGradients`, "warn",
            or "ignore".

    Attributes:
        traffic: the bytes handed to the collectives so far, against a plain allreduce.

    Raises:
        ValueError: ``fraction`` not in (0, 1], or a bad ``nonfinite``.
    """

    def __init__(self, fraction: float = 0.01, *, strategy: str | None = None,
                 nonfinite: Nonfinite = "raise") -> None:
        if (not isinstance(fraction, (int, float)) or isinstance(fraction, bool)
                or not 0 < fraction <= 1):
            raise ValueError(f"top-k fraction must be a number in (0, 1], got {fraction!r}")
        check_nonfinite(nonfinite)
        self.fraction = float(fraction)
        self.strategy, self.nonfinite = strategy, nonfinite
        self.traffic = Traffic()
        self._specs: list[TensorSpec] | None = None
        self._slots: list[_Slot | None] = []
        self._message_bytes = 0
        self._error: dict[int, np.ndarray] = {}

    @property
    def settings(self) -> dict[str, Any]:
        """What every rank must agree on (it goes into the agreement header)."""
        return {"mode": "topk", "fraction": self.fraction, "nonfinite": self.nonfinite}

    def k_of(self, size: int) -> int:
        """How many entries of a tensor of ``size`` entries a round sends."""
        return 0 if size == 0 else min(size, max(1, math.ceil(self.fraction * size)))

    async def allreduce(self, group: Group, grads: Pytree, *, round: int | None = None,
                        timeout: float | None = None) -> Pytree:
        """One round: the average over the group of every rank's top-k entries.

        Args:
            group: the group; every rank calls this with the same ``fraction``.
            grads: a pytree of floating-point gradients (numpy arrays or CPU torch tensors),
                the same names, shapes and dtypes on every rank and in every round.
            round: this round's number; None takes the group's next (shared with
                :func:`allreduce_gradients`).
            timeout: seconds for each collective (default: the group's).

        Returns:
            ``grads``' structure holding new arrays (tensors where the input had them): zero
            except where some rank sent an entry; equal bit for bit on every rank.

        Raises:
            TypeError: a gradient that is not floating-point.
            ValueError: other tensors than in this reducer's first round, or a bad ``round``.
            CollectiveMismatch: the ranks are in different rounds, or differ in a tensor or in
                ``fraction``: the message names it, every rank raises it.
            NonFiniteGradients: the result holds NaN or Inf (``nonfinite="raise"``); the
                residuals are left as they were.
            CollectiveTimeout, PeerLost, GroupBroken: as the group's collectives.

        Cancellation: breaks the group if it happens during a collective; the residuals are
            left as they were before the round.
        """
        names, arrays, specs = float_tensors(grads, "top-k")
        self._bind(specs)
        round_no = state_of(group).take_round(round)
        if not specs:
            return replace_leaves(grads, [])
        await agree_on(group, "top-k", round_no, self.settings, specs, timeout)

        # This rank's message: per tensor, its k largest entries (after the residual).
        message = np.empty(self._message_bytes, np.uint8)
        accumulated: dict[int, np.ndarray] = {}
        for i, (array, slot) in enumerate(zip(arrays, self._slots, strict=True)):
            if slot is None:
                continue
            acc = array.reshape(-1).astype(specs[i].dtype, copy=True)
            if i in self._error:
                acc += self._error[i]
            idx = top_k_indices(acc, slot.k)
            _view(message, slot.values, slot.k, acc.dtype)[...] = acc[idx]
            _view(message, slot.indices, slot.k, slot.index_dtype)[...] = idx
            acc[idx] = 0  # what was sent leaves the residual
            accumulated[i] = acc
        messages = await group.allgather(message, strategy=self.strategy, timeout=timeout)

        # Every rank sums the same messages in the same order: rank 0's first.
        results = []
        for spec, slot in zip(specs, self._slots, strict=True):
            out = np.zeros(spec.size, spec.dtype)
            if slot is not None:
                for got in messages:
                    idx = _view(got, slot.indices, slot.k, slot.index_dtype)
                    out[idx] += _view(got, slot.values, slot.k, spec.dtype)  # idx unique
                out /= spec.dtype.type(group.world_size)
            results.append(out.reshape(spec.shape))
        report_nonfinite("top-k", names, results, self.nonfinite, round_no)

        self._error.update(accumulated)  # no await since the allgather: all or nothing
        self.traffic.add(sum(s.nbytes for s in specs), message.nbytes)
        return replace_leaves(grads, [like(leaf, out) for (_, leaf), out
                                      in zip(named_leaves(grads), results, strict=True)])

    def _bind(self, specs: list[TensorSpec]) -> None:
        """Lay out the message at the first round; later rounds must bring the same tensors."""
        if same_tensors("top-k", self._specs, specs):
            return
        self._specs = specs
        offset = 0
        for spec in specs:
            k = self.k_of(spec.size)
            if k == 0:
                self._slots.append(None)
                continue
            index_dtype = np.dtype(np.int32 if spec.size < 2**31 else np.int64)
            values = _aligned(offset, spec.dtype.itemsize)
            indices = _aligned(values + k * spec.dtype.itemsize, index_dtype.itemsize)
            self._slots.append(_Slot(k, values, indices, index_dtype))
            offset = indices + k * index_dtype.itemsize
        self._message_bytes = offset


def top_k_indices(values: np.ndarray, k: int) -> np.ndarray:
    """The positions of the ``k`` entries of largest magnitude in 1-d ``values``, ascending.

    Ties at the k-th magnitude are broken by numpy's partition; which of the tied entries is
    sent does not matter for agreement, since every rank gathers what each rank chose.
    """
    if k >= values.size:
        return np.arange(values.size)
    chosen = np.argpartition(np.abs(values), values.size - k)[values.size - k:]
    chosen.sort()
    return chosen


def _aligned(offset: int, itemsize: int) -> int:
    return -(-offset // itemsize) * itemsize


def _view(message: np.ndarray, start: int, count: int, dtype: np.dtype[Any]) -> np.ndarray:
    return message[start:start + count * dtype.itemsize].view(dtype)
