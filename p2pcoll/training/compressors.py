"""Compressors of DiLoCo's pseudo-gradients: what travels instead of the dense update.

A :class:`Compressor` averages a list of pseudo-gradients over a group, bit-identically on
every rank, keeping in a per-rank accumulator (error feedback) what it did not send. DiLoCo
takes one by name (``DiLoCo(..., compressor="topk2bit", density=0.015)``, see
:func:`make_compressor`) or as an object. The names come from one entry-point table
(:data:`COMPRESSORS`, the group ``p2pcoll.compressors``): the built-in ``topk2bit``, then
plugins, each a Compressor subclass named in its distribution's metadata::

    [project.entry-points."p2pcoll.compressors"]
    signsgd = "mypkg.compress:SignSGD"

``topk2bit`` (:class:`TopK2Bit`, after SparseLoCo: Sarfi et al. 2025) sends, of each chunk
of ``CHUNK`` consecutive elements of each tensor, the ``k = ceil(density * chunk)`` entries
of largest magnitude, each as a 2-bit code against two levels agreed by the group. One
exchange, on every rank::

    a      = delta + beta * e              the pseudo-gradient with what was held back
                                           (beta: ``decay``, SparseLoCo's 0.95; 1 keeps all)
    idx    = per chunk, the k entries of a of largest magnitude
    mu, sd = max over ranks of the mean and std of |a[idx]|   per chunk: one allreduce("max")
    m, s   = the levels m s, (m + 1) s straddling mu, about 2 sd apart (.sparse_codes)
    q      = sign(a[idx]) * clip(rint(|a[idx]| / s), m, m + 1)   2 bits: sign, which level
    e      = a; e[idx] = a[idx] - q * s    what was not sent, kept for the next exchange
    Q      = sum over ranks of q at idx    integers: exact, in any order
    out    = Q * s / p                     the average, the same bits on every rank

``Q`` is gathered one of two ways, chosen from (p, k, chunk) alone so every rank chooses
the same: the *sparse* way, an allgather of each rank's indices (12 bits within the chunk)
and packed codes, summed by every rank in rank order; or, when p ranks' entries could
cover as many bytes as the dense chunk (the union is dense), the *dense* way, an allreduce
of the codes laid out densely (int8; int16 beyond 15 ranks), which the strategies run as a
reduce-scatter and an allgather. Both give the same ``Q``, exactly.

Where it runs: the selection, the coding and the decoding (the time an exchange takes
besides its collectives: seconds per round on a model of millions of parameters) run on a
worker thread of the loop's executor, the collectives on the loop, which meanwhile serves
the group: heartbeats, other calls' messages, and, under asynchronous DiLoCo, the loop side
of the inner steps the exchange overlaps. The two collectives of one exchange hold a turn
of the group (:mod:`p2pcoll.session.turns`), as a coded reduction's do.

What the accumulator keeps: where an entry was not sent, ``e`` is ``a`` bit for bit; where
it was, ``e`` is ``a - q * s`` (in float64) rounded once to the tensor's dtype. So what was
sent plus what was kept is what there was, to half a unit in the last place of the kept
value. With ``decay`` below 1 the accumulator forgets a share of what it holds each
exchange (SparseLoCo: the decayed accumulator then plays the outer momentum's part; pair it
with DiLoCo's ``outer_momentum=0``).

Bytes: each rank hands ``k`` times (1.5 + 0.25) bytes per chunk to the allgather (12-bit
indices, 2-bit codes), plus 8 bytes of its chunk statistics: at density 1.5 % about 0.028
bytes per float32 element, 140x fewer than the element's 4; DiLoCo with H = 50 makes that
about 7,100x fewer than a per-step float32 allreduce hands over. On the wire an allgather
delivers every rank's message to every other, ``(p - 1) m`` bytes sent per rank, where a
ring allreduce of n floats sends ``2 (p - 1) / p * 4 n``: the advantage over the dense
allreduce shrinks as p grows, about ``280 H / p`` at 1.5 %, and past ``p m >= 2 d`` (d the
dense codes' bytes: int16 beyond 15 ranks, so p about 140 at 1.5 %) the dense codes are the
cheaper way.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from importlib.metadata import EntryPoint, entry_points
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import numpy as np

from ..errors import PluginValidationError, ProtocolError
from ..plugin_table import PluginTable, named_class
from .errors import NonFiniteGradients
from .sparse_codes import (code_dtype, index_bytes, levels, pack_codes, pack_indices,
                           quantise, sparse_bytes, statistics, unpack_codes, unpack_indices)

if TYPE_CHECKING:
    from .. import Group

__all__ = ["CHUNK", "COMPRESSORS", "ENTRY_POINT_GROUP", "Compressor", "TopK2Bit",
           "compressor_table", "make_compressor", "validate"]

DECAY = 0.95
"""``topk2bit``'s default decay of the error-feedback accumulator (see :class:`TopK2Bit`)."""

CHUNK = 4096
"""Elements per chunk of ``topk2bit``: one agreed step each; an index within it fits in
12 bits."""

Pick = tuple[np.ndarray, np.ndarray, np.ndarray]
"""One tensor's selection (:meth:`TopK2Bit._pick`): indices, chunk starts, and each chunk's
(mean, standard deviation) of the selected magnitudes (:func:`.sparse_codes.statistics`)."""

Levels = tuple[np.ndarray, np.ndarray]
"""One tensor's agreed levels per chunk: the step (float64) and the lower level m (int64)."""

T = TypeVar("T")


class Compressor(ABC):
    """Averages DiLoCo's pseudo-gradients over a group in fewer bytes than they take.

    An implementation is deterministic: every rank that calls :meth:`average` with arrays
    of the same shapes gets the same bits back, whatever the strategy. It keeps its
    error-feedback accumulator in the ``residuals`` it is handed (the caller owns them).
    A plugin's class is made as ``cls(density)`` when DiLoCo is given a density, ``cls()``
    otherwise.
    """

    name: ClassVar[str]

    @property
    @abstractmethod
    def settings(self) -> dict[str, Any]:
        """What every rank must agree on; goes into the agreement header (keys start with
        ``compressor`` or name the argument, so a mismatch names it)."""

    @abstractmethod
    def message_bytes(self, sizes: Sequence[int], world_size: int) -> int:
        """The bytes one rank hands to the collectives for one exchange of tensors of
        ``sizes`` elements."""

    @abstractmethod
    async def average(self, group: Group, deltas: Sequence[np.ndarray],
                      residuals: Sequence[np.ndarray] | None, *, names: Sequence[str],
                      round_no: int, nonfinite: str, strategy: str | None,
                      timeout: float | None) -> list[np.ndarray]:
        """The average over the group of ``deltas`` (plus each rank's ``residuals``), new
        arrays with the same bits on every rank; ``residuals`` (one per delta, if given)
        updated in place to what was not sent, only once the exchange has completed.

        Raises:
            NonFiniteGradients: NaN or Inf in some rank's data with ``nonfinite="raise"``
                (nothing but the scales has moved; the residuals are as they were).
            CollectiveTimeout, PeerLost, GroupBroken: as the group's collectives.

        Cancellation: breaks the group during a collective; the residuals are untouched.
        """


class TopK2Bit(Compressor):
    """Chunk-wise top-k with 2-bit codes against per-chunk levels agreed by the group
    (module docstring).

    Args:
        density: the share of each chunk's entries sent per exchange, in (0, 1] (at least
            one per chunk).
        decay: beta, the share of the error-feedback accumulator kept into the next
            exchange, in [0, 1] (1: all of it; SparseLoCo: 0.95).

    Raises:
        ValueError: ``density`` is not a number in (0, 1], ``decay`` not one in [0, 1].
    """

    name = "topk2bit"

    def __init__(self, density: float = 0.015, *, decay: float = DECAY) -> None:
        if (not isinstance(density, (int, float)) or isinstance(density, bool)
                or not 0 < density <= 1):
            raise ValueError(f"density must be a number in (0, 1], got {density!r}")
        if (not isinstance(decay, (int, float)) or isinstance(decay, bool)
                or not 0 <= decay <= 1):
            raise ValueError(f"decay must be a number in [0, 1], got {decay!r}")
        self.density = float(density)
        self.decay = float(decay)
        self.chunk = CHUNK

    @property
    def settings(self) -> dict[str, Any]:
        return {"compressor": self.name, "compressor_chunk": self.chunk,
                "compressor_decay": self.decay, "density": self.density}

    def k_of(self, length: int) -> int:
        """Entries sent of a chunk of ``length`` elements."""
        return min(length, max(1, math.ceil(self.density * length))) if length else 0

    def _layout(self, size: int) -> tuple[np.ndarray, np.ndarray]:
        """A tensor of ``size`` elements: each chunk's first element and its k."""
        starts = np.arange(0, size, self.chunk, dtype=np.int64)
        lengths = np.minimum(self.chunk, size - starts)
        return starts, np.array([self.k_of(int(n)) for n in lengths], dtype=np.int64)

    def _selected(self, sizes: Sequence[int]) -> int:
        return sum(int(self._layout(n)[1].sum()) for n in sizes)

    def _chunks(self, sizes: Sequence[int]) -> int:
        return sum(-(-n // self.chunk) for n in sizes)

    def dense(self, sizes: Sequence[int], world_size: int) -> bool:
        """Whether the codes travel densely: each rank would send as many bytes in the
        allgather of p sparse messages, (p - 1) m, as in an allreduce of the dense codes,
        2 (p - 1) / p n (the union of the indices is dense)."""
        dense_bytes = sum(sizes) * code_dtype(world_size).itemsize
        return world_size * sparse_bytes(self._selected(sizes)) >= 2 * dense_bytes

    def message_bytes(self, sizes: Sequence[int], world_size: int) -> int:
        scales = 8 * self._chunks(sizes)  # two float32 statistics per chunk
        if self.dense(sizes, world_size):
            return scales + sum(sizes) * code_dtype(world_size).itemsize
        return scales + sparse_bytes(self._selected(sizes))

    async def average(self, group: Group, deltas: Sequence[np.ndarray],
                      residuals: Sequence[np.ndarray] | None, *, names: Sequence[str],
                      round_no: int, nonfinite: str, strategy: str | None,
                      timeout: float | None) -> list[np.ndarray]:
        # The selection, the coding and the decoding run on a worker thread (_in_thread),
        # the collectives on the loop. What the threads write (the accumulators, the codes,
        # the message) is this call's own until the residuals are written at the end.
        p = group.world_size
        # Two collectives, the second started once the first and the coding are done, at
        # different moments on different ranks: a turn keeps calls started meanwhile after
        # them, on every rank (p2pcoll.session.turns).
        async with group.turns.hold() as turn:  # taken before the first await
            accs, picks, local = await _in_thread(self._select, deltas, residuals)

            # Each chunk's levels, from the largest over the ranks of their statistics of
            # what they selected (max: exact, the same bits under every strategy).
            agreed = (local if p == 1 else await group.allreduce(
                local, "max", strategy=strategy, timeout=timeout))
            bounds = 2 * np.cumsum([0, *(starts.size for _, starts, _ in picks)])
            steps = [levels(agreed[a:b]) for a, b in itertools.pairwise(bounds)]
            bad = [names[i] for i, (s, _) in enumerate(steps) if not np.isfinite(s).all()]
            if bad and nonfinite == "raise":
                raise NonFiniteGradients(
                    f"NaN or Inf in the pseudo-gradient of some rank (round {round_no}), "
                    f"which topk2bit cannot scale: {', '.join(repr(b) for b in bad)}",
                    round=round_no, tensors=bad)

            sizes = [a.size for a in accs]
            codes, entries, message = await _in_thread(self._encode, sizes, accs, picks,
                                                       steps, p)
            # Passing the turn on only schedules the next one's wake-up: the collective
            # below, started before any await, takes its number first.
            turn.release()
            if p == 1:
                gathered: np.ndarray | list[np.ndarray] | None = None
            elif self.dense(sizes, p):
                gathered = await group.allreduce(message, "sum", strategy=strategy,
                                                 timeout=timeout)
            else:
                gathered = await group.allgather(message, strategy=strategy, timeout=timeout)
        results = await _in_thread(self._decode, deltas, accs, picks, codes, steps, entries,
                                   gathered, p, residuals is not None)
        if residuals is not None:  # the exchange is complete: keep what was not sent
            for r, a in zip(residuals, accs, strict=True):
                np.copyto(r, a.reshape(r.shape))  # r may be a view that cannot be flattened
        return results

    def _select(self, deltas: Sequence[np.ndarray], residuals: Sequence[np.ndarray] | None
                ) -> tuple[list[np.ndarray], list[Pick], np.ndarray]:
        """Each tensor's accumulator (a new flat array: delta plus the residual times the
        decay), its selected entries (:meth:`_pick`), and the chunks' statistics of them,
        all tensors' in one float32 array of (mean, standard deviation) pairs."""
        accs = [d.reshape(-1).copy() if residuals is None else d.reshape(-1) + (
                    r.reshape(-1) if self.decay == 1 else r.reshape(-1) * r.dtype.type(
                        self.decay)) for d, r in zip(
                    deltas, residuals if residuals is not None else deltas, strict=True)]
        picks = [self._pick(a) for a in accs]
        local = np.concatenate([m.reshape(-1) for _, _, m in picks]
                               or [np.empty(0, np.float32)])
        return accs, picks, local

    def _encode(self, sizes: list[int], accs: list[np.ndarray], picks: list[Pick],
                steps: list[Levels], p: int
                ) -> tuple[list[np.ndarray], list[Levels], np.ndarray]:
        """Each tensor's codes (int8, one per selected entry), each selected entry's step and
        lower level (:meth:`_per_entry`, which decoding needs again), and what this rank
        hands to the codes' collective: the dense codes of every tensor end to end, or (the
        sparse way) its chunk-local indices and packed codes."""
        entries = [self._per_entry(a.size, lv) for a, lv in zip(accs, steps, strict=True)]
        codes = [quantise(a[idx], *per)
                 for a, (idx, _, _), per in zip(accs, picks, entries, strict=True)]
        indices = [idx for idx, _, _ in picks]
        if p == 1:
            return codes, entries, np.empty(0, np.uint8)
        if self.dense(sizes, p):
            dense = np.zeros(sum(sizes), code_dtype(p))
            offset = 0
            for n, idx, q in zip(sizes, indices, codes, strict=True):
                dense[offset + idx] = q
                offset += n
            return codes, entries, dense
        local = [idx - np.repeat(*self._layout(n)) for n, idx in zip(sizes, indices, strict=True)]
        message = np.concatenate([
            pack_indices(np.concatenate(local or [np.empty(0, np.int64)])),
            pack_codes(np.concatenate(codes or [np.empty(0, np.int8)]), _lows(entries))])
        return codes, entries, message

    def _decode(self, deltas: Sequence[np.ndarray], accs: list[np.ndarray], picks: list[Pick],
                codes: list[np.ndarray], steps: list[Levels], entries: list[Levels],
                gathered: np.ndarray | list[np.ndarray] | None, p: int, keep: bool
                ) -> list[np.ndarray]:
        """The averages (new arrays of the deltas' shapes and dtypes) from what the codes'
        collective returned; with ``keep``, each accumulator (this call's own) made what
        was not sent."""
        totals = self._sum_codes([a.size for a in accs], [idx for idx, _, _ in picks], codes,
                                 entries, gathered, p)
        results = []
        for d, total, (s, _), a in zip(deltas, totals, steps, accs, strict=True):
            step = np.repeat(s / p, np.minimum(self.chunk, a.size - np.arange(
                0, a.size, self.chunk)))
            with np.errstate(invalid="ignore"):  # 0 * NaN in a chunk that was refused
                results.append((total * step).astype(d.dtype).reshape(d.shape))
        if keep:
            for a, (idx, _, _), q, (step, _) in zip(accs, picks, codes, entries, strict=True):
                # sent: q s exactly (in float64); kept: a - q s, rounded once
                sent = q * step
                a[idx] = (a[idx].astype(np.float64) - sent).astype(a.dtype)
        return results

    def _pick(self, a: np.ndarray) -> Pick:
        """The selected entries of flat ``a`` (global indices, chunk by chunk, ascending
        within a chunk), the chunks' starts and each chunk's (mean, standard deviation) of
        the selected magnitudes (float32 pairs)."""
        starts, ks = self._layout(a.size)
        index_parts, stats = [], []
        full = a.size // self.chunk
        if full:
            rows = np.abs(a[:full * self.chunk].reshape(full, self.chunk))
            k = int(ks[0])
            chosen = np.sort(np.argpartition(rows, self.chunk - k, axis=1)[:, self.chunk - k:],
                             axis=1)
            stats.append(statistics(np.take_along_axis(rows, chosen, axis=1).astype(
                np.float64)))
            index_parts.append((chosen + starts[:full, None]).reshape(-1))
        if full < starts.size:
            tail = np.abs(a[full * self.chunk:])
            k = int(ks[-1])
            chosen_tail = np.sort(np.argpartition(tail, tail.size - k)[tail.size - k:])
            stats.append(statistics(tail[chosen_tail].astype(np.float64)[None, :]))
            index_parts.append(chosen_tail + starts[full])
        idx = np.concatenate(index_parts) if index_parts else np.empty(0, np.int64)
        return idx, starts, (np.concatenate(stats) if stats else np.empty((0, 2), np.float32))

    def _per_entry(self, size: int, lv: Levels) -> Levels:
        """Each selected entry's step and lower level (its chunk's), of a tensor of
        ``size`` elements."""
        ks = self._layout(size)[1]
        return np.repeat(lv[0], ks), np.repeat(lv[1], ks)

    def _sum_codes(self, sizes: list[int], picks: list[np.ndarray], codes: list[np.ndarray],
                   entries: list[Levels], gathered: np.ndarray | list[np.ndarray] | None,
                   p: int
                   ) -> list[np.ndarray]:
        """Q per tensor (int64, flat): the sum over ranks of each rank's codes, from what
        the codes' collective returned (None for one rank: this rank's codes)."""
        if gathered is None:
            out = [np.zeros(n, np.int64) for n in sizes]
            for o, idx, q in zip(out, picks, codes, strict=True):
                o[idx] = q
            return out
        if isinstance(gathered, np.ndarray):  # the dense way: already summed
            bounds = np.cumsum([0, *sizes])
            return [gathered[a:b].astype(np.int64) for a, b in itertools.pairwise(bounds)]
        # The sparse way: each rank's chunk-local indices and packed codes.
        selected = sum(idx.size for idx in picks)
        lows = _lows(entries)
        out = [np.zeros(n, np.int64) for n in sizes]
        for got in gathered:  # rank order; integer sums are exact in any order anyway
            got = np.asarray(got, np.uint8)
            if got.size != sparse_bytes(selected):
                raise ProtocolError(f"topk2bit: a rank sent {got.size} bytes, expected "
                                    f"{sparse_bytes(selected)}")
            split = index_bytes(selected)
            indices = unpack_indices(got[:split], selected)
            qs = unpack_codes(got[split:], lows)
            at = 0
            for o, n in zip(out, sizes, strict=True):
                starts, ks = self._layout(n)
                m = int(ks.sum())
                o[indices[at:at + m] + np.repeat(starts, ks)] += qs[at:at + m]
                at += m
        return out


ENTRY_POINT_GROUP = "p2pcoll.compressors"
"""Where compressor plugins are declared: ``name = "module:Class"``, a :class:`Compressor`
subclass whose constructor takes ``density`` (or nothing, when it has no density)."""


def validate(obj: object, where: str) -> type[Compressor]:
    """``obj`` if it is a usable Compressor class, else PluginValidationError naming
    ``where``: a concrete subclass with a name like ``"topk2bit"`` that can be made with
    its defaults."""
    cls: type[Compressor] = named_class(obj, Compressor,
                                        "p2pcoll.training.compressors.Compressor",
                                        "topk2bit", where)
    try:
        cls()
    except Exception as exc:
        raise PluginValidationError(f"{where}: {cls.__name__}() raised "
                                    f"{type(exc).__name__}: {exc}") from exc
    return cls


def _intended(ep: EntryPoint, obj: object) -> tuple[str | None, str | None]:
    name = getattr(obj, "name", None)
    return None, name if isinstance(name, str) and name else ep.name


def compressor_table() -> PluginTable[str, type[Compressor]]:
    """A new table of the compressors (loaded on first use): the built-in ``topk2bit``, then
    the entry points of ``p2pcoll.compressors``."""
    return PluginTable(
        kind="compressor", scan=lambda: entry_points(group=ENTRY_POINT_GROUP), check=validate,
        key=lambda cls: cls.name, intended=_intended, key_of=lambda _, name: name,
        builtins=lambda: [(TopK2Bit, "p2pcoll (built-in)")],
        log=logging.getLogger("p2pcoll.training"))


COMPRESSORS = compressor_table()
"""The compressors by name: the built-in ``topk2bit``, then the entry points of
``p2pcoll.compressors`` (:mod:`p2pcoll.plugin_table`, the table strategies and codecs use)."""


def make_compressor(compressor: Any, density: Any) -> Compressor | None:
    """The compressor ``compressor`` names (at ``density``), or ``compressor`` itself if it
    is one already; None for None.

    Args:
        compressor: a name from :data:`COMPRESSORS` (``"topk2bit"`` or a plugin's), an
            object implementing :class:`Compressor`, or None.
        density: the named compressor's density, or None for its default.

    Raises:
        ValueError: an unknown name (naming it and the known ones), ``compressor`` neither
            a name nor a Compressor, ``density`` outside (0, 1] or without a named
            compressor.
        PluginValidationError: the plugin that provides the name is installed but broken.
    """
    if compressor is None or isinstance(compressor, Compressor):
        if density is not None:
            raise ValueError(f"density={density!r} applies to a compressor given by name; "
                             f"pass compressor=\"topk2bit\" too" if compressor is None else
                             f"density={density!r} applies to a compressor given by name; "
                             f"{type(compressor).__name__} has its own")
        return compressor
    if not isinstance(compressor, str):
        raise ValueError(f"compressor must be a name ({_known()}) or a Compressor, got "
                         f"{compressor!r}")
    found = COMPRESSORS.entries().get(compressor)
    if found is None:
        plugin = COMPRESSORS.broken_for(compressor)
        if plugin is not None:
            raise PluginValidationError(f"compressor {compressor!r} cannot be used: {plugin}"
                                        ) from plugin.error
        raise ValueError(f"unknown compressor {compressor!r}; known: {_known()}")
    return found.value() if density is None else found.value(density)  # type: ignore[call-arg]


async def _in_thread(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on a worker thread of the loop's executor (``asyncio.to_thread``), so
    the loop serves the group meanwhile: heartbeats, other calls' messages, the training
    step's own awaits. numpy releases the GIL in the kernels that take the time.

    Cancellation: held until ``fn`` has returned, then passed on to the caller's next
    await, where it would have landed had ``fn`` run on the loop (in an exchange, its next
    collective, which breaks the group, as a cancellation during a collective does): a
    rank does not leave its peers waiting in a collective it will never start, and what
    ``fn`` writes is never left half-written. A timeout's cancellation stays one
    cancellation (it still becomes the timeout's TimeoutError).
    """
    work = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    task = asyncio.current_task()
    held = False
    try:
        while True:
            try:
                return await asyncio.shield(work)
            except asyncio.CancelledError:
                if work.cancelled() or task is None:  # the loop is shutting down
                    raise
                held = True
                task.uncancel()  # given back below, once fn has returned
    finally:
        if held and task is not None:
            task.cancel()


def _lows(entries: list[Levels]) -> np.ndarray:
    """Every tensor's selected entries' lower levels, end to end (as the message packs them)."""
    return np.concatenate([low for _, low in entries] or [np.empty(0, np.int64)])


def _known() -> str:
    return ", ".join(repr(n) for n in sorted(COMPRESSORS.entries()))
