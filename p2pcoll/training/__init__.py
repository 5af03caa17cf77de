"""Synchronous data-parallel training rounds, with no parameter server.

Every worker holds a replica of the model. Each round it computes gradients on its own part
of the data, the group reduces them (an allreduce: every worker gets the result), and every
worker applies the same update to the same weights, so the replicas stay bit-for-bit equal::

    async with p2pcoll.join() as g:
        params = await training.broadcast_parameters(g, params, root=0)   # identical start
        for step in range(steps):
            grads = compute_gradients(params, my_shard)                    # name -> ndarray
            grads = await training.allreduce_gradients(g, grads, op="avg")
            for name, grad in grads.items():
                params[name] -= lr * grad                                  # same bits everywhere
            if step % 100 == 0:
                await training.check_replicas(g, params)                   # ReplicaDivergence?

Names. Parameters and gradients are pytrees of arrays: nested dicts (and lists or tuples)
whose leaves are numpy arrays or CPU torch tensors. A leaf is named by its path,
``"layer1.weight"`` or ``"blocks.0.bias"`` (:func:`named_leaves`). Torch tensors are used
through ``tensor.detach().numpy()``, which shares their memory: nothing is copied on the way
in, and :func:`broadcast_parameters` writes into the tensors themselves.

Buckets (tensor fusion). Reducing a hundred small tensors one by one costs a hundred
collectives, each paying the latency of every step of its algorithm. So the gradients are
packed into a few flat buffers, one dtype per buffer, of about ``bucket_bytes`` each
(:class:`BucketPlan`); each buffer is one allreduce, and the results are cut back into
tensors as views, without copying. A tensor larger than a bucket gets a bucket of its own.
The packed buffers are kept for the next round (per group, or per :class:`GradientReducer`):
as much memory as the gradients, in exchange for not faulting in fresh pages every round.

Checks. Before a round moves any gradient, the ranks compare a 48-byte header (one small
allgather): which function they are in, the round number, and a digest of the gradients'
names, shapes and dtypes and of the settings that shape the buckets. Buckets filled from
different tensors would otherwise be reduced into silent garbage; instead every rank raises
the same :class:`~p2pcoll.CollectiveMismatch`, naming the round or the first tensor that
differs, and the group stays usable. Round numbers are counted per group (every call of
:func:`allreduce_gradients` or :meth:`GradientReducer.start_round` is a round, an empty one
included), so a rank that skipped or repeated a round is caught at its next one.
:func:`check_replicas` compares digests of the parameters themselves; a
:class:`GradientReducer` can do it every K rounds inside that same header, at no extra cost
in messages. A NaN or Inf in the reduced gradients is reported by name (an error, a warning
or nothing, see ``nonfinite``); the reduced values are equal on every rank, so every rank
reports the same thing.

Overlap. :func:`allreduce_gradients` takes gradients that are all ready. A
:class:`GradientReducer` takes them one at a time as the backward pass produces them
(:meth:`Round.add`) and starts each bucket's allreduce as soon as the bucket is full, in
bucket order, so communication proceeds while later gradients are still being computed.
The communication advances whenever the training loop awaits, so run heavy computation in a
thread (``await asyncio.to_thread(layer.backward, ...)``) to overlap it with the transfers.

Every coroutine here is a sequence of the group's collectives and raises what they raise
(:class:`~p2pcoll.CollectiveTimeout`, :class:`~p2pcoll.PeerLost`,
:class:`~p2pcoll.GroupBroken`, ...). Cancellation in the middle of one breaks the group, as
for any collective. Issue other collectives on the same group between rounds, not during one.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import math
import sys
import warnings
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal

import numpy as np

from .errors import CollectiveMismatch, ProtocolError, ReplicaDivergence
from .group import Group
from .types import Pytree, ReduceOp, as_op, check_dtype, check_op_dtype

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "BucketPlan",
    "GradientReducer",
    "Round",
    "TensorSpec",
    "allreduce_gradients",
    "broadcast_parameters",
    "check_replicas",
    "named_leaves",
    "replace_leaves",
]

DEFAULT_BUCKET_BYTES = 4 << 20
"""Default bucket size, 4 MiB.

DDP uses 25 MiB and Horovod 64 MiB, sizes chosen for GPUs and fast fabrics. Here a bucket is
already cut into 1 MiB pipeline segments by the executor, so a few MiB are enough to pay the
per-collective latency only once per bucket (about a millisecond on loopback), while smaller
buckets start their reduction earlier in a backward pass and keep the peak memory of the
packed copies low. ``benchmarks/training_bench.py`` measures 1 MiB to 25 MiB.
"""

Nonfinite = Literal["raise", "warn", "ignore"]
_NONFINITE = ("raise", "warn", "ignore")

# What a rank is doing when it sends its header; ranks doing different things is a mismatch.
_GRADIENTS, _BROADCAST, _REPLICAS, _REDUCER = 1, 2, 3, 4
_KIND_NAMES = {
    _GRADIENTS: "allreduce_gradients",
    _BROADCAST: "broadcast_parameters",
    _REPLICAS: "check_replicas",
    _REDUCER: "a GradientReducer",
}
_NO_DIGEST = (0, 0)
_NOT_A_ROUND = -1

# Next round number of each group (a weak mapping, so a closed group is forgotten).
_rounds: weakref.WeakKeyDictionary[Group, int] = weakref.WeakKeyDictionary()

# Bucket buffers that allreduce_gradients keeps between calls, per group. Fresh memory costs a
# page fault per 4 KiB on first touch, which made packing 100 MB five times slower; a buffer
# is free again as soon as the group has copied it, when the bucket's allreduce starts.
_scratch: weakref.WeakKeyDictionary[Group, list[np.ndarray]] = weakref.WeakKeyDictionary()


# --- names --------------------------------------------------------------------------------


def named_leaves(tree: Pytree) -> list[tuple[str, Any]]:
    """The leaves of a pytree with their path names, in the tree's own order.

    Dict keys join with dots and list or tuple positions count from 0:
    ``{"fc": {"w": a, "b": b}, "blocks": [c]}`` gives ``[("fc.w", a), ("fc.b", b),
    ("blocks.0", c)]``. A bare array is named ``""``.

    Args:
        tree: an array, a CPU torch tensor, a number, or a dict/list/tuple of pytrees.

    Returns:
        ``(name, leaf)`` pairs, dicts in insertion order.

    Raises:
        TypeError: a dict key is not a str, or a leaf is None.
        ValueError: two leaves get the same name (``{"a": {"b": x}, "a.b": y}``).
    """
    out: list[tuple[str, Any]] = []

    def walk(node: Any, path: str) -> None:
        if isinstance(node, Mapping):
            for key, child in node.items():
                if not isinstance(key, str):
                    raise TypeError(f"pytree dict keys must be str, got {key!r} in {path!r}")
                walk(child, f"{path}.{key}" if path else key)
        elif isinstance(node, (list, tuple)):
            for i, child in enumerate(node):
                walk(child, f"{path}.{i}" if path else str(i))
        elif node is None:
            raise TypeError(f"pytree leaf {path!r} is None")
        else:
            out.append((path, node))

    walk(tree, "")
    seen: set[str] = set()
    for name, _ in out:
        if name in seen:
            raise ValueError(f"two leaves of the pytree are both named {name!r}")
        seen.add(name)
    return out


def replace_leaves(tree: Pytree, leaves: Sequence[Any]) -> Pytree:
    """A copy of ``tree``'s structure holding ``leaves`` in :func:`named_leaves` order."""
    it = iter(leaves)

    def build(node: Any) -> Any:
        if isinstance(node, Mapping):
            return {key: build(child) for key, child in node.items()}
        if isinstance(node, (list, tuple)):
            items = [build(child) for child in node]
            return items if isinstance(node, list) else tuple(items)
        return next(it)

    return build(tree)


def _is_torch(leaf: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(leaf, torch.Tensor)


def _as_numpy(leaf: Any, name: str) -> np.ndarray:
    """The leaf as an ndarray: itself, a view of a CPU torch tensor, or a new 0-d/n-d array."""
    if isinstance(leaf, np.ndarray):
        return leaf
    if _is_torch(leaf):
        if leaf.device.type != "cpu":
            raise TypeError(f"tensor {name!r} is on {leaf.device}; move it to the CPU first")
        view: np.ndarray = leaf.detach().numpy()  # shares the tensor's memory
        return view
    arr = np.asarray(leaf)
    if arr.dtype == object:
        raise TypeError(f"leaf {name!r} of type {type(leaf).__name__} is not a numeric array")
    return arr


def _like(template: Any, arr: np.ndarray) -> Any:
    """``arr`` as a torch tensor (sharing memory) if ``template`` is one, else ``arr``."""
    if _is_torch(template):
        return sys.modules["torch"].from_numpy(arr)
    return arr


# --- buckets ------------------------------------------------------------------------------


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


# --- headers: what every rank compares before moving data ------------------------------------


def _digest(data: bytes) -> tuple[int, int]:
    raw = hashlib.blake2b(data, digest_size=16).digest()
    return (int.from_bytes(raw[:8], "little", signed=True),
            int.from_bytes(raw[8:], "little", signed=True))


def _table(settings: Mapping[str, Any], specs: Sequence[TensorSpec],
           digests: Sequence[str] | None = None) -> dict[str, Any]:
    """A JSON-able description of a call: its settings and its tensors (and their hashes)."""
    rows: list[list[Any]] = [[s.name, s.dtype.name, list(s.shape)] for s in specs]
    if digests is not None:
        for row, digest in zip(rows, digests, strict=True):
            row.append(digest)
    return {"settings": dict(settings), "tensors": rows}


def _table_digest(table: Mapping[str, Any]) -> tuple[int, int]:
    return _digest(json.dumps(table, sort_keys=True).encode())


def _content_digest(array: np.ndarray) -> str:
    """A hash of the array's bytes (C order, native byte order)."""
    flat = np.ascontiguousarray(array, dtype=check_dtype(array.dtype)).reshape(-1)
    return hashlib.blake2b(flat.view(np.uint8).data, digest_size=16).hexdigest()


async def _broadcast_json(group: Group, obj: Any, root: int, timeout: float | None) -> Any:
    if group.rank == root:
        data = np.frombuffer(json.dumps(obj, sort_keys=True).encode(), np.uint8)
        await group.broadcast(data, root=root, timeout=timeout)
        return obj
    got = await group.broadcast(None, root=root, timeout=timeout)
    try:
        return json.loads(np.asarray(got, np.uint8).tobytes())
    except (ValueError, TypeError) as exc:
        raise ProtocolError(f"rank {root} sent an unreadable description: {exc}") from None


def _first_difference(t0: Mapping[str, Any], tr: Mapping[str, Any], r: int
                      ) -> tuple[str | None, str]:
    """The first way rank r's table differs from rank 0's: (tensor name or None, words)."""
    s0, sr = t0["settings"], tr["settings"]
    for key in sorted(set(s0) | set(sr)):
        if s0.get(key) != sr.get(key):
            return None, f"{key} is {s0.get(key)!r} on rank 0 but {sr.get(key)!r} on rank {r}"
    a, b = t0["tensors"], tr["tensors"]
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


class _Call:
    """What one rank says about the call it is in, and how to explain a disagreement."""

    def __init__(self, kind: int, round_no: int, what: str, spec_table: Mapping[str, Any],
                 data_table: Mapping[str, Any] | None = None) -> None:
        self.kind = kind
        self.round = round_no
        self.what = what
        self.spec_table = spec_table
        self.spec = _table_digest(spec_table)
        self.data_table = data_table
        self.data = _table_digest(data_table) if data_table is not None else _NO_DIGEST

    def header(self) -> np.ndarray:
        return np.array([self.kind, self.round, *self.spec, *self.data], dtype=np.int64)


async def _agree(group: Group, call: _Call, timeout: float | None) -> None:
    """Compare every rank's header; raise the same error on every rank if they differ.

    Raises:
        CollectiveMismatch: the ranks are in different functions or rounds, or their tensors'
            names, shapes or dtypes (or settings) differ.
        ReplicaDivergence: the ranks' data digests differ.
    """
    if group.world_size == 1:
        return
    headers = [h.tolist() for h in await group.allgather(call.header(), timeout=timeout)]
    first = headers[0]
    if any(h[:2] != first[:2] for h in headers):
        doing = ", ".join(
            f"rank {r} in {_KIND_NAMES.get(h[0], f'call kind {h[0]}')}"
            + (f" round {h[1]}" if h[1] != _NOT_A_ROUND else "")
            for r, h in enumerate(headers)
        )
        raise CollectiveMismatch(
            f"{call.what}: the ranks are not in the same training step ({doing}); every "
            f"rank must make the same calls, once per round, in the same order"
        )
    spec_diff = [r for r, h in enumerate(headers) if h[2:4] != first[2:4]]
    data_diff = [r for r, h in enumerate(headers) if h[4:6] != first[4:6]]
    if spec_diff:
        t0 = await _broadcast_json(group, call.spec_table, 0, timeout)
        tr = await _broadcast_json(group, call.spec_table, spec_diff[0], timeout)
        _, words = _first_difference(t0, tr, spec_diff[0])
        raise CollectiveMismatch(
            f"{call.what}{_round_words(call.round)}: ranks {spec_diff} disagree with rank 0 "
            f"about the tensors: {words}"
        )
    if data_diff:
        assert call.data_table is not None  # otherwise every rank sent _NO_DIGEST
        t0 = await _broadcast_json(group, call.data_table, 0, timeout)
        tr = await _broadcast_json(group, call.data_table, data_diff[0], timeout)
        tensor, words = _first_difference(t0, tr, data_diff[0])
        raise ReplicaDivergence(
            f"replicas differ{_round_words(call.round)}: ranks {data_diff} do not hold the "
            f"same parameters as rank 0; first difference: {words}",
            ranks=data_diff, tensor=tensor,
        )


def _round_words(round_no: int) -> str:
    return f" (round {round_no})" if round_no != _NOT_A_ROUND else ""


def _take_round(group: Group, explicit: int | None) -> int:
    if explicit is not None and (not isinstance(explicit, int) or explicit < 0):
        raise ValueError(f"round must be an int >= 0, got {explicit!r}")
    number = _rounds.get(group, 0) if explicit is None else explicit
    _rounds[group] = number + 1
    return number


def _check_nonfinite(mode: str) -> None:
    if mode not in _NONFINITE:
        raise ValueError(f"nonfinite must be one of {_NONFINITE}, got {mode!r}")


def _report_nonfinite(plan: BucketPlan, flats: Sequence[np.ndarray], mode: str,
                      round_no: int) -> None:
    """Warn or raise, naming every reduced tensor that holds a NaN or an Inf."""
    if mode == "ignore":
        return
    bad = []
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
                bad.append(f"{spec.name!r} ({count} of {spec.size} values)")
    if not bad:
        return
    message = (f"reduced gradients of round {round_no} hold NaN or Inf: {', '.join(bad)}")
    if mode == "raise":
        raise FloatingPointError(message)
    warnings.warn(message, RuntimeWarning, stacklevel=3)


# --- the public functions ------------------------------------------------------------------


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
    """
    if not isinstance(root, int) or not 0 <= root < group.world_size:
        raise ValueError(f"root {root!r} is not a rank of this group of {group.world_size}")
    named = named_leaves(params)
    arrays = {name: _as_numpy(leaf, name) for name, leaf in named}
    order = sorted(arrays)
    if group.rank != root:
        for name in order:
            if not arrays[name].flags.writeable:
                raise ValueError(f"parameter {name!r} is read-only; cannot receive into it")
    if not order or group.world_size == 1:
        return replace_leaves(params, [leaf if isinstance(leaf, np.ndarray) or _is_torch(leaf)
                                       else arrays[name] for name, leaf in named])

    specs = [TensorSpec.of(name, arrays[name]) for name in order]
    call = _Call(_BROADCAST, _NOT_A_ROUND, "broadcast_parameters",
                 _table({"root": root}, specs))
    await _agree(group, call, timeout)
    if group.rank == root:
        await group.broadcast([arrays[name] for name in order], root=root, timeout=timeout)
    else:
        # Receive straight into the caller's arrays where the group can write into them.
        buffers = []
        for name, spec in zip(order, specs, strict=True):
            mine = arrays[name]
            usable = mine.flags.c_contiguous and mine.dtype.isnative
            buffers.append(mine if usable else np.empty(spec.shape, spec.dtype))
        got = await group.broadcast(buffers, root=root, timeout=timeout)
        for name, value in zip(order, got, strict=True):
            if value is not arrays[name]:
                np.copyto(arrays[name], value)
    return replace_leaves(params, [leaf if isinstance(leaf, np.ndarray) or _is_torch(leaf)
                                   else arrays[name] for name, leaf in named])


async def allreduce_gradients(
    group: Group,
    grads: Pytree,
    op: str | ReduceOp = "avg",
    *,
    bucket_bytes: int | None = None,
    strategy: str | None = None,
    nonfinite: Nonfinite = "raise",
    round: int | None = None,  # noqa: A002 - the natural name, keyword-only
    timeout: float | None = None,
) -> Pytree:
    """Reduce named gradients over the group, fused into buckets; every rank gets the result.

    Every rank calls this once per training round with gradients of the same names, shapes
    and dtypes. Before any gradient moves, the ranks check that they are in the same round
    and agree on the tensors (one small allgather); then each bucket is one allreduce.

    Args:
        group: the group.
        grads: a pytree of gradients (usually a dict of name -> ndarray or CPU torch tensor).
            An empty pytree is a no-op without communication on every rank (it still counts
            as a round).
        op: "avg" (default), "sum", "min", "max" or "prod".
        bucket_bytes: how large a fused buffer may grow; None is :data:`DEFAULT_BUCKET_BYTES`,
            0 reduces each tensor on its own.
        strategy: the allreduce strategy of every bucket ("ring", "recursive_doubling",
            "reduce_broadcast", ...); None is the group's choice.
        nonfinite: a NaN or Inf in the result: "raise" FloatingPointError, "warn"
            (RuntimeWarning), or "ignore". Either way it names the tensors.
        round: this round's number; None takes the group's next (0, 1, 2, ...). The number
            after it becomes the group's next.
        timeout: seconds for each collective (default: the group's).

    Returns:
        ``grads``' structure holding new arrays (torch tensors where the input had them) of
        the same shapes and dtypes, equal bit for bit on every rank. ``grads`` is unchanged.

    Raises:
        ValueError: an unknown op or ``nonfinite``, "avg" on an integer gradient, a negative
            ``bucket_bytes``.
        TypeError: a leaf whose dtype cannot be communicated.
        CollectiveMismatch: the ranks are in different rounds, or a gradient's name, shape or
            dtype (or ``op``/``bucket_bytes``/``nonfinite``) differs between ranks; the
            message names the first tensor that differs, and every rank raises it.
        FloatingPointError: a reduced gradient holds NaN or Inf and ``nonfinite="raise"``.
        CollectiveTimeout, PeerLost, GroupBroken: as the group's collectives.

    Cancellation: breaks the group if it happens during a collective.
    """
    red = as_op(op)
    _check_nonfinite(nonfinite)
    named = named_leaves(grads)
    arrays = {name: _as_numpy(leaf, name) for name, leaf in named}
    order = sorted(arrays)
    specs = [TensorSpec.of(name, arrays[name]) for name in order]
    for spec in specs:
        try:
            check_op_dtype(red, spec.dtype)
        except ValueError as exc:
            raise ValueError(f"gradient {spec.name!r}: {exc}") from None
    plan = BucketPlan(specs, bucket_bytes)
    round_no = _take_round(group, round)
    if not specs:
        return replace_leaves(grads, [])
    settings = {"op": red.value, "bucket_bytes": plan.bucket_bytes, "nonfinite": nonfinite}
    call = _Call(_GRADIENTS, round_no, "allreduce_gradients", _table(settings, specs))
    await _agree(group, call, timeout)
    flats = plan.pack([arrays[name] for name in order], reuse=_scratch.pop(group, []))
    try:
        reduced = await asyncio.gather(*(
            group.allreduce(flat, red, strategy=strategy, timeout=timeout) for flat in flats
        ))
    finally:
        _scratch[group] = flats  # every allreduce has copied its bucket by now
    _report_nonfinite(plan, reduced, nonfinite, round_no)
    result = dict(zip(order, plan.unpack(reduced), strict=True))
    return replace_leaves(grads, [_like(leaf, result[name]) for name, leaf in named])


def _replica_table(params: Pytree) -> dict[str, Any]:
    named = sorted(named_leaves(params), key=lambda kv: kv[0])
    arrays = [_as_numpy(leaf, name) for name, leaf in named]
    specs = [TensorSpec.of(name, a) for (name, _), a in zip(named, arrays, strict=True)]
    return _table({}, specs, [_content_digest(a) for a in arrays])


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
            ``.tensor`` names the first tensor in which the first of them differs (every rank
            raises the same error).
        CollectiveMismatch: a rank called another training function at this point.
        CollectiveTimeout, PeerLost, GroupBroken: as the group's collectives.
    """
    table = _replica_table(params)
    call = _Call(_REPLICAS, _NOT_A_ROUND, "check_replicas", _table({}, []), table)
    await _agree(group, call, timeout)


# --- overlap: reducing buckets while the gradients are still being produced ----------------


class GradientReducer:
    """Reduces the gradients of a fixed set of parameters, round after round, bucket by bucket.

    The buckets are planned once, from the parameters' names, shapes and dtypes, in the order
    the backward pass is expected to produce the gradients. In each round (:meth:`start_round`)
    gradients are added one at a time as they become available; a bucket's allreduce starts
    as soon as it and every bucket before it are full, so early buckets travel while later
    gradients are still being computed::

        reducer = GradientReducer(group, params, check_every=100)
        async with reducer.start_round() as rnd:
            for name, grad in backward_pass():      # e.g. await asyncio.to_thread(...)
                rnd.add(name, grad)
                await asyncio.sleep(0)              # let full buckets get going
            grads = await rnd.wait()

    or, with every gradient at hand, ``grads = await reducer.allreduce(grads)``.

    Args:
        group: the group.
        params: the parameters; their gradients must have the same names, shapes and dtypes.
            With ``check_every`` they are also what is compared between ranks: the reducer
            keeps this pytree (not copies) and reads its leaves at each check, so update the
            arrays in place or assign new ones into the same dicts.
        op: "avg" (default), "sum", "min", "max" or "prod".
        order: the names in the order their gradients will be produced; None is the
            reverse of ``params``' order, which is what a backward pass through layers
            listed input to output produces (as PyTorch DDP assumes).
        bucket_bytes: bucket size; None is :data:`DEFAULT_BUCKET_BYTES`.
        strategy: the allreduce strategy of the buckets; None is the group's choice.
        nonfinite: "raise", "warn" or "ignore" a NaN or Inf in the result.
        check_every: compare the replicas' parameters at the start of every round whose
            number is a multiple of this (0: never). The digests ride in the round's header,
            so a check costs hashing the parameters but no extra message.
        timeout: seconds for each collective (default: the group's).

    Raises:
        ValueError, TypeError: bad arguments, as for :func:`allreduce_gradients`, or an
            ``order`` that is not a permutation of the parameters' names.
    """

    def __init__(
        self,
        group: Group,
        params: Pytree,
        op: str | ReduceOp = "avg",
        *,
        order: Sequence[str] | None = None,
        bucket_bytes: int | None = None,
        strategy: str | None = None,
        nonfinite: Nonfinite = "raise",
        check_every: int = 0,
        timeout: float | None = None,
    ) -> None:
        self.group = group
        self.params = params
        self.op = as_op(op)
        _check_nonfinite(nonfinite)
        if not isinstance(check_every, int) or check_every < 0:
            raise ValueError(f"check_every must be an int >= 0, got {check_every!r}")
        named = named_leaves(params)
        arrays = {name: _as_numpy(leaf, name) for name, leaf in named}
        if order is None:
            order = [name for name, _ in reversed(named)]
        elif sorted(order) != sorted(arrays):
            raise ValueError("order must list every parameter name exactly once")
        specs = [TensorSpec.of(name, arrays[name]) for name in order]
        for spec in specs:
            try:
                check_op_dtype(self.op, spec.dtype)
            except ValueError as exc:
                raise ValueError(f"gradient {spec.name!r}: {exc}") from None
        self.plan = BucketPlan(specs, bucket_bytes)
        self.strategy = strategy
        self.nonfinite = nonfinite
        self.check_every = check_every
        self.timeout = timeout
        settings = {"op": self.op.value, "bucket_bytes": self.plan.bucket_bytes,
                    "nonfinite": nonfinite, "check_every": check_every}
        self._spec_table = _table(settings, specs)
        self._open: Round | None = None
        # One set of bucket buffers for all rounds: a round's allreduces have copied them
        # before it finishes, and rounds never overlap.
        self._flats = self.plan.empty_buffers()

    def start_round(self, *, round: int | None = None) -> Round:  # noqa: A002
        """Begin a round: its header exchange starts at once, and buckets as they fill.

        Args:
            round: this round's number; None takes the group's next.

        Returns:
            The :class:`Round`; use it as ``async with`` so that an error in the loop body
            cancels it.

        Raises:
            RuntimeError: the previous round of this reducer has not finished.
        """
        if self._open is not None and not self._open.done():
            raise RuntimeError(f"round {self._open.number} is still open; wait() for it first")
        number = _take_round(self.group, round)
        self._open = Round(self, number)
        return self._open

    async def allreduce(self, grads: Pytree, *, round: int | None = None) -> Pytree:  # noqa: A002
        """Run a whole round with gradients that are all ready; returns the reduced pytree."""
        async with self.start_round(round=round) as rnd:
            rnd.add_all(grads)
            return await rnd.wait()

    async def check_replicas(self) -> None:
        """:func:`check_replicas` on the reducer's parameters, now."""
        await check_replicas(self.group, self.params, timeout=self.timeout)


class Round:
    """One round of a :class:`GradientReducer`: add gradients, then wait for the result.

    Attributes:
        number: the round number, carried in the header every rank compares.
    """

    def __init__(self, reducer: GradientReducer, number: int) -> None:
        self.number = number
        self._reducer = reducer
        plan = reducer.plan
        self._flats = reducer._flats
        self._added = [False] * len(plan.specs)
        self._waiting = [len(b.members) for b in plan.buckets]
        self._full = [asyncio.Event() for _ in plan.buckets]
        # The parameters are hashed now, before the caller can touch them again.
        check = reducer.check_every and number % reducer.check_every == 0
        data_table = _replica_table(reducer.params) if check else None
        self._call = _Call(_REDUCER, number, "GradientReducer", reducer._spec_table, data_table)
        self._task = asyncio.get_running_loop().create_task(self._run())

    def add(self, name: str, grad: Any) -> None:
        """Copy gradient ``name`` into its bucket; start buckets that are now full, in order.

        Raises:
            ValueError: an unknown name, a gradient added twice, or a shape or dtype that is
                not the parameter's.
            RuntimeError: the round was cancelled.
            CollectiveMismatch, ReplicaDivergence, ...: the round has already failed with it
                (in the header exchange, or a bucket).
        """
        if self._task.done():
            if not self._task.cancelled():
                self._task.result()  # raises the error that ended the round
            raise RuntimeError(f"round {self.number} is over")
        plan = self._reducer.plan
        i = plan.index.get(name)
        if i is None:
            raise ValueError(f"{name!r} is not one of the reducer's parameters")
        if self._added[i]:
            raise ValueError(f"gradient {name!r} was already added in round {self.number}")
        plan.place(i, _as_numpy(grad, name), self._flats)
        self._added[i] = True
        b = plan.bucket_of[i]
        if b is not None:
            self._waiting[b] -= 1
            if self._waiting[b] == 0:
                self._full[b].set()

    def add_all(self, grads: Pytree) -> None:
        """:meth:`add` every leaf of a pytree shaped like the parameters."""
        for name, grad in named_leaves(grads):
            self.add(name, grad)

    async def wait(self) -> Pytree:
        """The reduced gradients, in the parameters' structure, once every bucket is reduced.

        Returns:
            New arrays (torch tensors where the parameters are), equal on every rank.

        Raises:
            ValueError: some gradients were never added (the round is cancelled; peers that
                already sent buckets fail, the others time out).
            CollectiveMismatch, ReplicaDivergence, FloatingPointError, and the group's
            errors: as :func:`allreduce_gradients` and :func:`check_replicas`.
        """
        plan = self._reducer.plan
        missing = [s.name for s, added in zip(plan.specs, self._added, strict=True) if not added]
        if missing:
            await self.cancel()
            raise ValueError(f"round {self.number}: gradients never added: {missing}")
        reduced = await self._task
        _report_nonfinite(plan, reduced, self._reducer.nonfinite, self.number)
        by_name = dict(zip((s.name for s in plan.specs), plan.unpack(reduced), strict=True))
        params = self._reducer.params
        return replace_leaves(params, [_like(leaf, by_name[name])
                                       for name, leaf in named_leaves(params)])

    def done(self) -> bool:
        """Whether the round's communication has finished (or failed, or was cancelled)."""
        return self._task.done()

    async def cancel(self) -> None:
        """Stop the round. A collective cut off part-way breaks the group."""
        self._task.cancel()
        with contextlib.suppress(BaseException):  # the round is abandoned, its error with it
            await self._task

    async def __aenter__(self) -> Round:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if not self._task.done():
            await self.cancel()

    async def _run(self) -> list[np.ndarray]:
        """Compare headers, then launch each bucket's allreduce once it and those before are
        full. Tasks start in creation order, so every rank numbers the buckets' collectives
        alike."""
        reducer = self._reducer
        if not reducer.plan.specs and self._call.data_table is None:
            return []  # no gradients: a no-op round, like allreduce_gradients({})
        await _agree(reducer.group, self._call, reducer.timeout)
        loop = asyncio.get_running_loop()
        tasks: list[asyncio.Task[Any]] = []
        try:
            for flat, full in zip(self._flats, self._full, strict=True):
                await full.wait()
                tasks.append(loop.create_task(reducer.group.allreduce(
                    flat, reducer.op, strategy=reducer.strategy, timeout=reducer.timeout)))
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
