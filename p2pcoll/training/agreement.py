"""Before a training call moves any data, the ranks check that they agree on what it moves.

Each rank describes its call in a *table*: the settings that shape the data (op,
bucket_bytes, ...) and one row ``[name, dtype, shape]`` per tensor, in the order the call
will move them (plus a hash of each tensor's bytes when the parameters themselves are
compared). Then the ranks allgather a 48-byte header, six int64::

    [kind, round, spec digest (2 words), data digest (2 words)]

``kind`` says which function the rank is in and ``round`` which training round (-1 for calls
that are not rounds); the digests are 128-bit hashes of the spec table and of the data table.
If every header matches, the call goes on. Otherwise every rank has every header, so every
rank raises the same error:

- kind or round differ: :class:`~p2pcoll.CollectiveMismatch`, listing what each rank is in;
- spec digests differ: rank 0 and the first rank that differs broadcast their spec tables,
  and :class:`~p2pcoll.CollectiveMismatch` names the first setting or tensor that differs;
- data digests differ: the same with the data tables, raised as
  :class:`~p2pcoll.ReplicaDivergence` with the ranks and that first tensor.

A disagreement costs two more broadcasts; agreement costs the one allgather. No gradient has
moved when the error is raised, so the group stays usable.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from enum import IntEnum
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import CollectiveMismatch, ProtocolError, ReplicaDivergence
from .buckets import TensorSpec

if TYPE_CHECKING:
    from .. import Group

__all__ = ["NOT_A_ROUND", "Call", "Kind", "agree", "first_difference", "round_words", "table"]

NOT_A_ROUND = -1
"""The round number in the header of a call that is not a training round."""

_NO_DIGEST = (0, 0)


class Kind(IntEnum):
    """Which training function a rank is in; ranks in different ones are a mismatch."""

    GRADIENTS = 1
    BROADCAST = 2
    REPLICAS = 3
    REDUCER = 4

    @property
    def what(self) -> str:
        return _KIND_NAMES[self]


_KIND_NAMES = {
    Kind.GRADIENTS: "allreduce_gradients",
    Kind.BROADCAST: "broadcast_parameters",
    Kind.REPLICAS: "check_replicas",
    Kind.REDUCER: "a GradientReducer",
}


def table(settings: Mapping[str, Any], specs: Sequence[TensorSpec],
          digests: Sequence[str] | None = None) -> dict[str, Any]:
    """A JSON-able description of a call: its settings and its tensors (and their hashes)."""
    rows: list[list[Any]] = [[s.name, s.dtype.name, list(s.shape)] for s in specs]
    if digests is not None:
        for row, digest in zip(rows, digests, strict=True):
            row.append(digest)
    return {"settings": dict(settings), "tensors": rows}


class Call:
    """What one rank says about the call it is in: its header, and the tables behind it.

    Args:
        kind: the function.
        round_no: the round, or :data:`NOT_A_ROUND`.
        what: the caller's name in error messages.
        spec_table: settings and tensors (:func:`table`).
        data_table: the tensors' contents too, when the replicas are compared.
    """

    def __init__(self, kind: Kind, round_no: int, what: str, spec_table: Mapping[str, Any],
                 data_table: Mapping[str, Any] | None = None) -> None:
        self.kind = kind
        self.round = round_no
        self.what = what
        self.spec_table = spec_table
        self.data_table = data_table
        self._spec = _table_digest(spec_table)
        self._data = _table_digest(data_table) if data_table is not None else _NO_DIGEST

    def header(self) -> np.ndarray:
        return np.array([self.kind, self.round, *self._spec, *self._data], dtype=np.int64)


async def agree(group: Group, call: Call, timeout: float | None) -> None:
    """Compare every rank's header; raise the same error on every rank if they differ.

    Raises:
        CollectiveMismatch: the ranks are in different functions or rounds, or their tensors'
            names, shapes or dtypes (or settings) differ.
        ReplicaDivergence: the ranks' data digests differ.
        CollectiveTimeout, PeerLost, GroupBroken: as the group's collectives.
    """
    if group.world_size == 1:
        return
    headers = [h.tolist() for h in await group.allgather(call.header(), timeout=timeout)]
    first = headers[0]
    if any(h[:2] != first[:2] for h in headers):
        doing = ", ".join(f"rank {r} in {_doing(h[0], h[1])}" for r, h in enumerate(headers))
        raise CollectiveMismatch(
            f"{call.what}: the ranks are not in the same training step ({doing}); every "
            f"rank must make the same calls, once per round, in the same order"
        )
    spec_diff = [r for r, h in enumerate(headers) if h[2:4] != first[2:4]]
    if spec_diff:
        _, words = await _first_difference_between(group, call.spec_table, spec_diff[0],
                                                   timeout)
        raise CollectiveMismatch(
            f"{call.what}{round_words(call.round)}: ranks {spec_diff} disagree with rank 0 "
            f"about the tensors: {words}"
        )
    data_diff = [r for r, h in enumerate(headers) if h[4:6] != first[4:6]]
    if data_diff:
        # Equal spec digests imply equal settings, so every rank has a data table here.
        tensor, words = await _first_difference_between(group, call.data_table or {},
                                                        data_diff[0], timeout)
        raise ReplicaDivergence(
            f"replicas differ{round_words(call.round)}: ranks {data_diff} do not hold the "
            f"same parameters as rank 0; first difference: {words}",
            ranks=data_diff, tensor=tensor,
        )


def first_difference(t0: Mapping[str, Any], tr: Mapping[str, Any], r: int
                     ) -> tuple[str | None, str]:
    """The first way rank r's table differs from rank 0's: (tensor name or None, words)."""
    s0, sr = t0.get("settings", {}), tr.get("settings", {})
    for key in sorted(set(s0) | set(sr)):
        if s0.get(key) != sr.get(key):
            return None, f"{key} is {s0.get(key)!r} on rank 0 but {sr.get(key)!r} on rank {r}"
    a, b = t0.get("tensors", []), tr.get("tensors", [])
    names_a, names_b = {row[0] for row in a}, {row[0] for row in b}
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x[0] != y[0]:
            if x[0] not in names_b:
                return x[0], f"{x[0]!r} is on rank 0 but not on rank {r}"
            if y[0] not in names_a:
                return y[0], f"{y[0]!r} is on rank {r} but not on rank 0"
            return x[0], f"tensor #{i} is {x[0]!r} on rank 0 but {y[0]!r} on rank {r}"
        if x[1:3] != y[1:3]:
            return x[0], (f"{x[0]!r} is {x[1]}{x[2]} on rank 0 but {y[1]}{y[2]} "
                          f"on rank {r}")
        if x[3:] != y[3:]:
            return x[0], f"{x[0]!r} holds different values on rank 0 and rank {r}"
    if len(a) != len(b):
        name = (a if len(a) > len(b) else b)[min(len(a), len(b))][0]
        where = 0 if len(a) > len(b) else r
        return name, f"{name!r} is on rank {where} only"
    return None, "their descriptions hash differently but read the same"


def round_words(round_no: int) -> str:
    """`` (round 3)`` for a round, nothing for a call that is not one."""
    return f" (round {round_no})" if round_no != NOT_A_ROUND else ""


def _doing(kind: int, round_no: int) -> str:
    try:
        what = Kind(kind).what
    except ValueError:
        what = f"call kind {kind}"
    return what + (f" round {round_no}" if round_no != NOT_A_ROUND else "")


async def _first_difference_between(group: Group, mine: Mapping[str, Any], r: int,
                                    timeout: float | None) -> tuple[str | None, str]:
    """Rank 0's and rank r's tables, sent to every rank, and the first way they differ."""
    t0 = await _broadcast_json(group, mine, 0, timeout)
    tr = await _broadcast_json(group, mine, r, timeout)
    return first_difference(t0, tr, r)


async def _broadcast_json(group: Group, obj: Any, root: int, timeout: float | None) -> Any:
    if group.rank == root:
        data = np.frombuffer(json.dumps(obj, sort_keys=True).encode(), np.uint8)
        await group.broadcast(data, root=root, timeout=timeout)
        return obj
    got = await group.broadcast(None, root=root, timeout=timeout)
    try:
        parsed = json.loads(np.asarray(got, np.uint8).tobytes())
    except (ValueError, TypeError) as exc:
        raise ProtocolError(f"rank {root} sent an unreadable description: {exc}") from None
    if not isinstance(parsed, dict):
        raise ProtocolError(f"rank {root} sent a description that is not a table")
    return parsed


def _table_digest(table: Mapping[str, Any]) -> tuple[int, int]:
    raw = hashlib.blake2b(json.dumps(table, sort_keys=True).encode(), digest_size=16).digest()
    return (int.from_bytes(raw[:8], "little", signed=True),
            int.from_bytes(raw[8:], "little", signed=True))
