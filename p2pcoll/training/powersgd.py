"""PowerSGD: gradients averaged as rank-r factors, with error feedback and warm start.

Vogels, Karimireddy and Jaggi, *PowerSGD: Practical Low-Rank Gradient Compression for
Distributed Optimization* (NeurIPS 2019), Algorithm 1 with error feedback. Each gradient of
two or more dimensions is seen as a matrix ``M`` of ``n`` rows (its first dimension) and
``m`` columns (the rest); every rank keeps, per matrix, a residual ``e`` (``n x m``, its own)
and a factor ``Q`` (``m x r``, the same on every rank). A round is one step of power
iteration on the average of the ranks' matrices::

    M     = grad + e                 the gradient with what earlier rounds left out
    P     = avg over ranks (M Q)     allreduce 1: n x r per matrix
    P^    = orthonormal columns of P, computed alike on every rank
    Q     = avg over ranks (M^T P^)  allreduce 2: m x r per matrix; kept for the next round
    out   = P^ Q^T                   the rank-r estimate of avg(M): the same on every rank
    e     = M - out                  kept locally, added to the next round's gradient

Keeping ``Q`` between rounds (warm start) makes each round one more step of power
iteration on a slowly changing matrix, so one iteration per round is enough; the residual
makes sure that nothing is lost for good, only delayed. A matrix costs ``r (n + m)``
elements instead of ``n m``; a tensor for which that is no saving (vectors, biases, small
or thin matrices) is averaged whole, in the first allreduce, as the paper does.

Identical replicas. ``P`` and ``Q`` come out of allreduces, so every rank holds the same
bits of both. What is computed from them afterwards, ``P^`` and ``P^ Q^T``, uses only numpy's
element-wise operations and its pairwise ``add.reduce`` in a fixed order (Gram-Schmidt column
by column, and the product as a sum of ``r`` outer products), never BLAS, whose kernels
depend on the CPU: ranks on different machines running the same numpy get the same bits.
``M Q`` and ``M^T P^`` are local (the allreduce averages them), so they may use BLAS.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from ..pytree import Pytree, like, named_leaves, replace_leaves
from .buckets import DEFAULT_BUCKET_BYTES, TensorSpec
from .modes import (Traffic, agree_on, average, float_tensors, positive_int, report_nonfinite,
                    same_tensors)
from .nonfinite import Nonfinite, check_nonfinite
from .state import state_of

if TYPE_CHECKING:
    from .. import Group

__all__ = ["PowerSGD", "low_rank_product", "orthonormal_columns"]


class PowerSGD:
    """Averages gradients over a group as rank-``rank`` factors (module docstring).

    One reducer serves one set of gradients (the same names, shapes and dtypes every round)
    on one group; it keeps each matrix's residual and ``Q`` factor between rounds::

        reducer = training.PowerSGD(rank=4)
        for step in range(steps):
            grads = await reducer.allreduce(group, compute_gradients(params))
            for name, g in grads.items():
                params[name] -= lr * g
        print(reducer.traffic.ratio)       # how many times fewer bytes than a plain allreduce

    Args:
        rank: the rank r of the factors, >= 1.
        warm_start: keep ``Q`` from round to round (the paper's choice); False draws a new
            random ``Q`` every round (the same on every rank).
        seed: the seed of the first (or every) ``Q``; the same on every rank.
        bucket_bytes: how large a fused buffer of factors may grow (as
            :func:`allreduce_gradients`).
        strategy: the allreduce strategy; None is the group's choice.
        nonfinite: a NaN or Inf in the result: "raise" :class:`NonFiniteGradients`, "warn",
            or "ignore".

    Attributes:
        traffic: the bytes handed to the collectives so far, against a plain allreduce
            (:class:`~p2pcoll.training.modes.Traffic`).

    Raises:
        ValueError: ``rank`` is not an int >= 1, or a bad ``nonfinite`` or ``bucket_bytes``.
    """

    def __init__(self, rank: int = 4, *, warm_start: bool = True, seed: int = 0,
                 bucket_bytes: int | None = None, strategy: str | None = None,
                 nonfinite: Nonfinite = "raise") -> None:
        self.rank = positive_int(rank, "PowerSGD rank")
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise ValueError(f"seed must be an int >= 0, got {seed!r}")
        if bucket_bytes is not None and (not isinstance(bucket_bytes, int) or bucket_bytes < 0):
            raise ValueError(f"bucket_bytes must be an int >= 0, got {bucket_bytes!r}")
        check_nonfinite(nonfinite)
        self.warm_start, self.seed = bool(warm_start), seed
        self.bucket_bytes, self.strategy, self.nonfinite = bucket_bytes, strategy, nonfinite
        self.traffic = Traffic()
        self._specs: list[TensorSpec] | None = None
        self._matrices: dict[int, tuple[int, int]] = {}  # tensor index -> (n, m)
        self._q: dict[int, np.ndarray] = {}
        self._error: dict[int, np.ndarray] = {}

    @property
    def settings(self) -> dict[str, Any]:
        """What every rank must agree on (it goes into the agreement header)."""
        return {"mode": "powersgd", "rank": self.rank, "warm_start": self.warm_start,
                "seed": self.seed, "nonfinite": self.nonfinite,
                "bucket_bytes": (DEFAULT_BUCKET_BYTES if self.bucket_bytes is None
                                 else self.bucket_bytes)}

    def compressed(self) -> list[str]:
        """The names of the tensors sent as factors (the others are averaged whole); empty
        before the first round."""
        return [self._specs[i].name for i in self._matrices] if self._specs else []

    async def allreduce(self, group: Group, grads: Pytree, *, round: int | None = None,
                        timeout: float | None = None) -> Pytree:
        """One round: the rank-r estimate of the average of every rank's ``grads``.

        Args:
            group: the group; every rank calls this with the same reducer settings.
            grads: a pytree of floating-point gradients (numpy arrays or CPU torch tensors),
                the same names, shapes and dtypes on every rank and in every round.
            round: this round's number; None takes the group's next (as
                :func:`allreduce_gradients`, whose round numbers these share).
            timeout: seconds for each collective (default: the group's).

        Returns:
            ``grads``' structure holding new arrays (tensors where the input had them), equal
            bit for bit on every rank. ``grads`` is unchanged.

        Raises:
            TypeError: a gradient that is not floating-point.
            ValueError: other tensors than in this reducer's first round, or a bad ``round``.
            CollectiveMismatch: the ranks are in different rounds, or differ in a tensor or in
                a setting (the rank r, ...): the message names it, every rank raises it.
            NonFiniteGradients: the result holds NaN or Inf (``nonfinite="raise"``); the
                residuals and factors are left as they were.
            CollectiveTimeout, PeerLost, GroupBroken: as the group's collectives.

        Cancellation: breaks the group if it happens during a collective; the residuals and
            factors are left as they were before the round.
        """
        names, arrays, specs = float_tensors(grads, "PowerSGD")
        self._bind(specs)
        round_no = state_of(group).take_round(round)
        if not specs:
            return replace_leaves(grads, [])
        await agree_on(group, "PowerSGD", round_no, self.settings, specs, timeout)

        matrices = list(self._matrices.items())
        plain = [i for i in range(len(specs)) if i not in self._matrices]
        ms = {i: self._with_residual(i, arrays[i], n, m) for i, (n, m) in matrices}
        qs = {i: self._q_for(i, m, ms[i].dtype, round_no) for i, (_, m) in matrices}
        local_p = [ms[i] @ qs[i] for i, _ in matrices]
        first = await average(group, [*local_p, *(arrays[i] for i in plain)],
                              bucket_bytes=self.bucket_bytes, strategy=self.strategy,
                              timeout=timeout)
        p_hat = {i: orthonormal_columns(p)
                 for (i, _), p in zip(matrices, first[:len(matrices)], strict=True)}
        local_q = [ms[i].T @ p_hat[i] for i, _ in matrices]
        second = await average(group, local_q, bucket_bytes=self.bucket_bytes,
                               strategy=self.strategy, timeout=timeout)
        new_q = {i: q for (i, _), q in zip(matrices, second, strict=True)}

        results: list[np.ndarray] = [np.empty(0)] * len(specs)
        estimates = {i: low_rank_product(p_hat[i], new_q[i]) for i, _ in matrices}
        for i, _ in matrices:
            results[i] = estimates[i].astype(specs[i].dtype, copy=False).reshape(specs[i].shape)
        for i, averaged in zip(plain, first[len(matrices):], strict=True):
            results[i] = averaged
        report_nonfinite("PowerSGD", names, results, self.nonfinite, round_no)

        # Nothing awaits from here on: the round's residuals and factors change together.
        for i, _ in matrices:
            self._error[i] = np.subtract(ms[i], estimates[i], out=ms[i])
            self._q[i] = new_q[i]
        sent = sum(p.nbytes for p in local_p) + sum(q.nbytes for q in local_q)
        sent += sum(specs[i].nbytes for i in plain)
        self.traffic.add(sum(s.nbytes for s in specs), sent)
        return replace_leaves(grads, [like(leaf, out) for (_, leaf), out
                                      in zip(named_leaves(grads), results, strict=True)])

    def _bind(self, specs: list[TensorSpec]) -> None:
        """Plan the matrices at the first round; later rounds must bring the same tensors."""
        if same_tensors("PowerSGD", self._specs, specs):
            return
        self._specs = specs
        r = self.rank
        for i, spec in enumerate(specs):
            if len(spec.shape) < 2:
                continue
            n, m = spec.shape[0], math.prod(spec.shape[1:])
            if r * (n + m) < n * m:  # the factors are smaller than the matrix
                self._matrices[i] = (n, m)

    def _with_residual(self, i: int, grad: np.ndarray, n: int, m: int) -> np.ndarray:
        """``grad`` as an n x m matrix in the compute dtype (float16 goes to float32), plus
        the residual of earlier rounds: a new array."""
        dtype = np.result_type(grad.dtype, np.float32)
        matrix = grad.reshape(n, m).astype(dtype, copy=True)
        if i in self._error:
            matrix += self._error[i]
        return matrix

    def _q_for(self, i: int, m: int, dtype: np.dtype[Any], round_no: int) -> np.ndarray:
        if self.warm_start and i in self._q:
            return self._q[i]
        # The same draw on every rank: the generator is seeded by values all ranks share.
        key = [self.seed, i] if self.warm_start else [self.seed, i, round_no]
        rng = np.random.default_rng(key)
        return rng.standard_normal((m, self.rank)).astype(dtype)


def orthonormal_columns(p: np.ndarray) -> np.ndarray:
    """The columns of ``p`` (n x r) made orthonormal by modified Gram-Schmidt, in order.

    A column that is (numerically) a combination of the ones before it becomes zero, so a
    rank-deficient ``p`` gives fewer orthonormal columns and zeros, never noise blown up to
    unit length. Only element-wise ufuncs and ``np.add.reduce`` over contiguous rows are
    used, so the same input gives the same bits on every machine running the same numpy.
    """
    cols = np.array(p.T, dtype=p.dtype, order="C")  # r rows of n: each column contiguous
    tiny = math.sqrt(float(np.finfo(p.dtype).eps))
    for i in range(cols.shape[0]):
        col = cols[i]
        before = math.sqrt(float(np.add.reduce(col * col)))
        for j in range(i):
            col -= np.add.reduce(cols[j] * col) * cols[j]
        norm = math.sqrt(float(np.add.reduce(col * col)))
        if norm <= tiny * before or norm == 0.0:
            col[...] = 0
        else:
            col /= p.dtype.type(norm)
    return cols.T


def low_rank_product(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """``p @ q.T`` (n x r times r x m) as a sum of r outer products, in order: element-wise
    operations only, so the same bits on every machine (see :func:`orthonormal_columns`)."""
    n, r = p.shape
    out = np.zeros((n, q.shape[0]), np.result_type(p, q))
    term = np.empty_like(out)
    for k in range(r):
        np.multiply(p[:, k:k + 1], q[:, k], out=term)
        out += term
    return out
