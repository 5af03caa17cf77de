"""Comparing the replicas: does every rank hold the same bits in its parameters?"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

import numpy as np

from ..pytree import Pytree, as_array, named_leaves
from ..types import check_dtype
from .agreement import NOT_A_ROUND, Call, Kind, agree, table
from .buckets import TensorSpec

if TYPE_CHECKING:
    from .. import Group

__all__ = ["check_replicas", "content_digest", "replica_table"]


async def check_replicas(group: Group, params: Pytree, *, timeout: float | None = None) -> None:
    """Check that every rank holds the same bits in ``params``.

    Every rank hashes its parameters (names, shapes, dtypes and bytes) and the group compares
    the digests in one small allgather; only if they differ is more sent, to find the first
    tensor that differs.

    Args:
        group: the group; every rank calls this at the same point of training.
        params: the pytree of parameters.
        timeout: seconds for each collective (default: the group's).

    Returns:
        None when every rank holds the same bits.

    Raises:
        ReplicaDivergence: some ranks differ from rank 0; ``.ranks`` lists them and
            ``.tensor`` names the first tensor (in leaf order) in which the first of them
            differs (every rank raises the same error).
        CollectiveMismatch: a rank called another training function at this point.
        CollectiveTimeout, PeerLost, GroupBroken: as the group's collectives.

    Cancellation: breaks the group if it happens during a collective.
    """
    call = Call(Kind.REPLICAS, NOT_A_ROUND, "check_replicas", table({}, []),
                replica_table(params))
    await agree(group, call, timeout)


def replica_table(params: Pytree) -> dict[str, Any]:
    """The parameters' names, dtypes, shapes and content digests, in leaf order."""
    named = [(path, as_array(leaf, path)) for path, leaf in named_leaves(params)]
    specs = [TensorSpec.of(path, array) for path, array in named]
    return table({}, specs, [content_digest(array) for _, array in named])


def content_digest(array: np.ndarray) -> str:
    """A hash of the array's bytes (C order, native byte order)."""
    flat = np.ascontiguousarray(array, dtype=check_dtype(array.dtype)).reshape(-1)
    return hashlib.blake2b(flat.view(np.uint8).data, digest_size=16).hexdigest()
