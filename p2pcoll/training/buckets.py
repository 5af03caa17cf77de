"""Tensor fusion: many gradients packed into a few flat buffers, one dtype per buffer.

Reducing a hundred small tensors one by one costs a hundred collectives, each paying the
latency of every step of its algorithm. A :class:`BucketPlan` places a fixed list of tensors
in a few flat buffers of about ``bucket_bytes`` each, so each buffer is one allreduce, and cuts
the results back into tensors as views, without copying.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..types import check_dtype

__all__ = ["DEFAULT_BUCKET_BYTES", "Bucket", "BucketPlan", "TensorSpec"]

DEFAULT_BUCKET_BYTES = 4 << 20
"""Default bucket size, 4 MiB.

DDP uses 25 MiB and Horovod 64 MiB, sizes chosen for GPUs and fast fabrics. Here a bucket is
already cut into 1 MiB pipeline segments by the executor, so a few MiB are enough to pay the
per-collective latency only once per bucket (about a millisecond on loopback), while smaller
buckets start their reduction earlier in a backward pass and keep the peak memory of the
packed copies low. ``benchmarks/training_bench.py`` measures 1 MiB to 25 MiB.
"""


@dataclass(frozen=True)
class TensorSpec:
    """The name, dtype (native byte order) and shape of one tensor."""

    name: str
    dtype: np.dtype[Any]
    shape: tuple[int, ...]

    @classmethod
    def of(cls, name: str, array: np.ndarray) -> TensorSpec:
        """The spec of ``array``. Raises TypeError if its dtype cannot be communicated."""
        return cls(name, check_dtype(array.dtype), tuple(int(n) for n in array.shape))

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def __str__(self) -> str:
        return f"{self.dtype.name}{list(self.shape)}"


@dataclass(frozen=True)
class Bucket:
    """One flat buffer: tensor ``members[k]`` occupies ``[offsets[k], offsets[k] + size)``."""

    dtype: np.dtype[Any]
    members: tuple[int, ...]
    offsets: tuple[int, ...]
    size: int


class BucketPlan:
    """Where each tensor of a fixed list lives in a few flat, single-dtype buffers.

    Tensors are taken in the given order. Each dtype fills its own bucket, and a tensor that
    would take that bucket past ``bucket_bytes`` starts a new one, so a tensor larger than
    ``bucket_bytes`` has a bucket to itself and ``bucket_bytes=0`` disables fusion. Buckets
    are numbered by their last tensor, which is the order they fill in when the tensors are
    produced in the given order. Empty tensors live in no bucket.

    Example::

        plan = BucketPlan([TensorSpec.of(n, a) for n, a in named], bucket_bytes=1 << 20)
        flats = plan.pack([a for _, a in named])        # one 1-d array per bucket
        arrays = plan.unpack(flats)                     # views of flats, shaped as before

    Args:
        specs: the tensors, in order; names must be unique.
        bucket_bytes: the size a bucket may reach; None is :data:`DEFAULT_BUCKET_BYTES`.

    Raises:
        ValueError: a negative ``bucket_bytes`` or a repeated name.
    """

    def __init__(self, specs: Iterable[TensorSpec], bucket_bytes: int | None = None) -> None:
        self.specs = tuple(specs)
        limit = DEFAULT_BUCKET_BYTES if bucket_bytes is None else bucket_bytes
        if not isinstance(limit, int) or limit < 0:
            raise ValueError(f"bucket_bytes must be an int >= 0, got {bucket_bytes!r}")
        self.bucket_bytes = limit
        self.index = {spec.name: i for i, spec in enumerate(self.specs)}
        if len(self.index) != len(self.specs):
            raise ValueError("tensor names in a bucket plan must be unique")

        groups: list[list[int]] = []
        open_group: dict[np.dtype[Any], list[int]] = {}
        open_bytes: dict[np.dtype[Any], int] = {}
        for i, spec in enumerate(self.specs):
            if spec.size == 0:
                continue
            members = open_group.get(spec.dtype)
            if members and open_bytes[spec.dtype] + spec.nbytes > limit:
                groups.append(members)
                members = None
            if not members:
                members = open_group[spec.dtype] = []
                open_bytes[spec.dtype] = 0
            members.append(i)
            open_bytes[spec.dtype] += spec.nbytes
        groups.extend(open_group.values())
        groups.sort(key=lambda members: members[-1])

        buckets = []
        self.bucket_of: list[int | None] = [None] * len(self.specs)
        self.offset_of: list[int] = [0] * len(self.specs)
        for b, members in enumerate(groups):
            offsets = []
            size = 0
            for i in members:
                self.bucket_of[i], self.offset_of[i] = b, size
                offsets.append(size)
                size += self.specs[i].size
            buckets.append(Bucket(self.specs[members[0]].dtype, tuple(members), tuple(offsets),
                                  size))
        self.buckets: tuple[Bucket, ...] = tuple(buckets)

    def empty_buffers(self, reuse: Sequence[np.ndarray] = ()) -> list[np.ndarray]:
        """One flat buffer per bucket: the matching one of ``reuse``, else a new one."""
        free: dict[tuple[np.dtype[Any], int], list[np.ndarray]] = {}
        for a in reuse:
            free.setdefault((a.dtype, a.size), []).append(a)
        return [free[key].pop() if free.get(key := (b.dtype, b.size)) else
                np.empty(b.size, b.dtype) for b in self.buckets]

    def place(self, i: int, array: np.ndarray, flats: Sequence[np.ndarray]) -> None:
        """Copy tensor ``i`` into its place in ``flats``.

        Raises:
            ValueError: ``array``'s shape or dtype is not tensor ``i``'s.
        """
        spec = self.specs[i]
        if tuple(array.shape) != spec.shape or array.dtype.newbyteorder("=") != spec.dtype:
            raise ValueError(
                f"tensor {spec.name!r} is {array.dtype.name}{list(array.shape)}, "
                f"expected {spec}"
            )
        b = self.bucket_of[i]
        if b is not None:
            start = self.offset_of[i]
            flats[b][start:start + spec.size] = array.reshape(-1)

    def pack(self, arrays: Sequence[np.ndarray], reuse: Sequence[np.ndarray] = ()
             ) -> list[np.ndarray]:
        """Copy ``arrays`` (one per spec, in order) into flat buffers, one per bucket.

        Args:
            arrays: the tensors.
            reuse: buffers to fill again where one has a bucket's dtype and size.

        Raises:
            ValueError: the wrong number of arrays, or one of the wrong shape or dtype.
        """
        if len(arrays) != len(self.specs):
            raise ValueError(f"expected {len(self.specs)} arrays, got {len(arrays)}")
        flats = self.empty_buffers(reuse)
        for i, array in enumerate(arrays):
            self.place(i, array, flats)
        return flats

    def unpack(self, flats: Sequence[np.ndarray]) -> list[np.ndarray]:
        """The tensors, in spec order, as views of ``flats`` (new arrays for empty ones)."""
        if len(flats) != len(self.buckets):
            raise ValueError(f"expected {len(self.buckets)} buffers, got {len(flats)}")
        out = []
        for i, spec in enumerate(self.specs):
            b = self.bucket_of[i]
            if b is None:
                out.append(np.empty(spec.shape, spec.dtype))
            else:
                start = self.offset_of[i]
                out.append(flats[b][start:start + spec.size].reshape(spec.shape))
        return out

    def __repr__(self) -> str:
        return (f"<BucketPlan {len(self.specs)} tensors in {len(self.buckets)} buckets "
                f"of <= {self.bucket_bytes} bytes>")

