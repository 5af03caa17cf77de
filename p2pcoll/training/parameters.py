"""broadcast_parameters: every replica starts from the root's weights, in its own arrays."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ..pytree import Pytree, as_array, is_torch_tensor, named_leaves, replace_leaves
from .agreement import NOT_A_ROUND, Call, Kind, agree, table
from .buckets import TensorSpec

if TYPE_CHECKING:
    from .. import Group

__all__ = ["broadcast_parameters"]


async def broadcast_parameters(
    group: Group, params: Pytree, root: int = 0, *, timeout: float | None = None,
) -> Pytree:
    """Give every rank the root's parameters, written into each rank's own arrays.

    Call it once before training, so every replica starts from the same weights however
    each was initialised.

    Args:
        group: the group; every rank calls this with the same ``root``.
        params: a pytree of arrays (usually a dict of name -> ndarray or torch tensor) with
            the same names, shapes and dtypes on every rank.
        root: the rank whose values everyone gets.
        timeout: seconds for each collective (default: the group's).

    Returns:
        ``params``' structure holding the caller's own arrays (and tensors), now filled with
        the root's values, so a model that keeps references to them sees the new values.
        Leaves that were not arrays (Python numbers) come back as new arrays.

    Raises:
        ValueError: ``root`` is not a rank, or on a non-root rank an array is read-only.
        CollectiveMismatch: names, shapes or dtypes differ from the root's; the message names
            the first tensor that differs, and every rank raises it.
        CollectiveTimeout, PeerLost, GroupBroken: as the group's collectives.

    Cancellation: breaks the group if it happens during a collective; the arrays may then
        hold a mix of old and new values.
    """
    if not isinstance(root, int) or not 0 <= root < group.world_size:
        raise ValueError(f"root {root!r} is not a rank of this group of {group.world_size}")
    named = named_leaves(params)
    arrays = [as_array(leaf, path) for path, leaf in named]
    if group.rank != root:
        for (path, _), array in zip(named, arrays, strict=True):
            if not array.flags.writeable:
                raise ValueError(f"parameter {path!r} is read-only; cannot receive into it")
    # Arrays and tensors come back as themselves, numbers as the arrays made of them.
    result = replace_leaves(params, [_own(leaf, array) for (_, leaf), array
                                     in zip(named, arrays, strict=True)])
    if not named or group.world_size == 1:
        return result

    specs = [TensorSpec.of(path, array) for (path, _), array in zip(named, arrays, strict=True)]
    await agree(group, Call(Kind.BROADCAST, NOT_A_ROUND, "broadcast_parameters",
                            table({"root": root}, specs)), timeout)
    if group.rank == root:
        await group.broadcast(arrays, root=root, timeout=timeout)
        return result
    # Receive straight into the caller's arrays where the group can write into them.
    buffers = [mine if mine.flags.c_contiguous and mine.dtype.isnative
               else np.empty(spec.shape, spec.dtype) for mine, spec in zip(arrays, specs,
                                                                          strict=True)]
    got = await group.broadcast(buffers, root=root, timeout=timeout)
    for mine, value in zip(arrays, got, strict=True):
        if value is not mine:
            np.copyto(mine, value)
    return result


def _own(leaf: Any, array: np.ndarray) -> Any:
    return leaf if isinstance(leaf, np.ndarray) or is_torch_tensor(leaf) else array
