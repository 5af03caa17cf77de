"""``ProcessGroupP2PColl``: a torch.distributed process group whose collectives run on a
p2pcoll group, and the creator torch calls for ``init_process_group("p2pcoll")`` and for
every ``new_group``.

Each torch call turns its tensors into numpy arrays (shared, not copied, where they are
contiguous), starts the p2pcoll collectives on the loop thread (:mod:`.runtime`) and
returns a :class:`~.work.Work` at once; results are written into torch's output tensors
before the work completes. How each torch call maps onto p2pcoll's:

    allreduce, allreduce_coalesced     one allreduce of all the tensors (a pytree)
    broadcast, reduce                  broadcast, reduce (of all the tensors)
    allgather, all_gather_single,      one allgather per input tensor
      allgather_into_tensor_coalesced, allgather_coalesced
    reduce_scatter_single,             per output, as Gloo: one allreduce of its input,
      reduce_scatter_tensor_coalesced  keeping part ``rank``
    reduce_scatter                     per output, as Gloo: one allreduce per input tensor,
                                       keeping the ``rank``-th
    gather, scatter, barrier           gather, scatter, barrier
    alltoall, all_to_all_single        one alltoall (split sizes: its per-pair lengths)
    send, recv                         send, recv (with torch's tag)

(with a reduce_scatter strategy configured, the reduce_scatters are one p2pcoll
reduce_scatter per output over the inputs stacked as (world size, n)).

Unless ``pg_options`` or ``$P2PCOLL_ALLREDUCE`` / ``$P2PCOLL_REDUCE`` name others,
allreduces and reduces run ``gloo_ring``, which sums in the order of Gloo's ring (torch
2.13): a script moved from "gloo" to "p2pcoll" gets the same bits from allreduce, reduce
and reduce_scatter. At two ranks a sum (SUM, PREMUL_SUM, bfloat16's SUM and AVG) adds two
terms per element, which gives the same bits in either order, so sums there take the
group's own choice (the shared-memory board for small tensors of one host) and only the
other ops ask for ``gloo_ring``.

BAND, BOR and BXOR are no p2pcoll ops: they allgather the data and fold it in rank
order, so every rank gets the same bits. PREMUL_SUM multiplies a copy of the input by
its factor and sums. bfloat16 moves as its bits and is rounded after every step, as in
Gloo (its AVG: a SUM, then torch's division).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import replace
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ...api import Group, form_group
from ...errors import P2PCollError
from ...registry import available_strategies
from ...session.flight import arm_signal
from ...settings import Settings
from . import ops, shrinking
from .options import Options, options_from
from .ops import Reduction, bits, shares, store, values
from .runtime import Runtime
from .work import Work

# What runs unless pg_options or $P2PCOLL_<COLLECTIVE> say otherwise: Gloo's summation order,
# so a script moved from "gloo" to "p2pcoll" computes the same bits.
GLOO_ORDER = {"allreduce": "gloo_ring", "reduce": "gloo_ring"}
Coro = Coroutine[Any, Any, Any]
# Calls whose outputs are at most this many bytes start on the caller's thread when the
# loop is idle (Runtime.drive); larger ones, DDP's buckets, go to the loop thread, so that
# the caller's thread (autograd's, in DDP) goes back to computing at once. (A call made
# with async_op=True looks the same to the backend: a small one costs its caller the
# copies of its first steps, 100-200 us at 1 MiB, and saves the hop to the loop thread.)
DRIVE_BYTES = 1 << 20


def _seconds(timeout: timedelta | None) -> float | None:
    """torch's per-call timeout in seconds, None for the group's (torch's -1 ms default)."""
    if timeout is None:
        return None
    s = timeout.total_seconds()
    return s if s > 0 else None


class ProcessGroupP2PColl(dist.ProcessGroup):
    """A torch process group on a p2pcoll group (made by torch through the creator)."""

    def __init__(self, store: Any, rank: int, size: int, timeout: timedelta,
                 options: Options | None = None, *,
                 form: Callable[[Settings], Coro] | None = None) -> None:
        """``form(settings)``: how the p2pcoll group comes to be (default: formed through
        ``store``; :meth:`shrink` passes the old group's shrink)."""
        super().__init__(rank, size)
        self._options, self._given_timeout = options, timeout
        self._name = self._desc = ""
        self._shrunk = False  # once shrunk, it closes at once: the survivors have moved on
        seconds = timeout.total_seconds() if timeout.total_seconds() > 0 else math.inf
        self._timeout = seconds
        settings = Settings.resolve(
            world_size=size, rank=rank, collective_timeout=seconds,
            join_timeout=min(seconds, 24 * 3600.0),
            strategies=dict(options.strategies) if options else None,
        )
        installed = available_strategies()
        gloo = {c: name for c, name in GLOO_ORDER.items()  # where neither pg_options nor
                if c not in settings.strategies and name in installed[c]}  # $P2PCOLL_* chose
        # At two ranks each element of a sum is one addition, the same bits in either
        # order: sums take the group's quickest path (the shared-memory board for small
        # tensors), and the other ops ask for Gloo's order call by call.
        self._gloo_calls = gloo if size == 2 else {}
        if size != 2:
            settings = replace(settings, strategies={**settings.strategies, **gloo})
        if settings.flight_dir:  # here: the loop's thread cannot set a signal handler
            arm_signal()
        self._runtime = Runtime.acquire()
        shrinking.install()
        try:
            group = self._runtime.run(form(settings) if form is not None
                                      else form_group(settings, store=store))
        except BaseException:
            Runtime.release()
            raise
        self._group: Group | None = group
        Runtime._open.add(self)

    # --- what torch asks of a process group ---------------------------------------------

    def getBackendName(self) -> str:
        return "p2pcoll"

    def setGroupName(self, name: str) -> None:
        self._name = name

    def getGroupName(self) -> str:
        return self._name

    def setGroupDesc(self, desc: str) -> None:
        self._desc = desc

    def getGroupDesc(self) -> str:
        return self._desc

    @property
    def group(self) -> Group:
        """The p2pcoll group underneath (raises GroupBroken once shut down)."""
        if self._group is None:
            from ...errors import GroupBroken

            raise GroupBroken("the p2pcoll process group has been shut down")
        return self._group

    def flight_record(self) -> list[dict[str, Any]]:
        """This rank's last calls through this process group, oldest first (see
        :meth:`p2pcoll.Group.flight_record`): every op of the backend is a call of its
        group, point-to-point ones too."""
        return self._runtime.run(_snapshot(self.group))

    def shutdown(self, timeout: float = 60.0, *, wait: bool = True) -> None:
        """Leave the p2pcoll group and close its sockets; the last group of the process
        also stops the loop and completer threads (and waits for them). Idempotent; run
        at exit for groups that were never destroyed. Calls in flight end with
        GroupBroken here and PeerLost on the peers; it waits (at most the heartbeat
        timeout, for a frozen peer) until the peers have read the goodbye, unless not
        ``wait``."""
        group, self._group = self._group, None
        if group is None:
            return
        Runtime._open.discard(self)
        try:
            self._runtime.run(group.close(wait=wait and not self._shrunk), timeout=timeout)
        finally:
            Runtime.release()

    def abort(self) -> None:
        """:meth:`shutdown` at once: no waiting for the peers to read the goodbye."""
        self.shutdown(wait=False)

    # --- dist.shrink_group (see .shrinking) ---------------------------------------------

    supports_shrinking = True
    supports_splitting = supports_coalescing = supports_time_estimate = False

    def _get_backend(self, device: Any) -> ProcessGroupP2PColl:
        return shrinking.backend_for(self, device)  # for CPU, this group itself

    def supports_tensor_alloc(self, device: Any) -> bool:
        return False

    def lost_ranks(self) -> list[int]:
        """The ranks to pass to ``dist.shrink_group``: see :func:`.shrinking.lost_ranks`."""
        return shrinking.lost_ranks(self.group)

    def shrink(self, ranks_to_exclude: list[int], shrink_flags: int = 0,
               opts_override: Any = None) -> ProcessGroupP2PColl:
        """torch's ``Backend.shrink``, which ``dist.shrink_group`` calls with the ranks
        checked: a process group of the survivors over :meth:`p2pcoll.Group.shrink`
        (``SHRINK_ABORT`` first ends this group's calls in flight)."""
        old, abort = self.group, shrinking.abort_flag(shrink_flags)
        rank, size = shrinking.renumbered(self.rank(), self.size(), ranks_to_exclude)
        new = ProcessGroupP2PColl(
            None, rank, size, self._given_timeout,
            options_from(opts_override) or self._options,
            form=lambda s: old.shrink(ranks_to_exclude, strategies=s.strategies,
                                      abort=abort))
        self._shrunk = True
        return new

    def __repr__(self) -> str:
        return f"ProcessGroupP2PColl(rank={self.rank()}, size={self.size()})"

    # --- running ------------------------------------------------------------------------

    def _launch(self, collective: str, outputs: list[torch.Tensor],
                make: Callable[[Group], list[Coro]]) -> Work:
        """Start the call ``make`` makes and return its Work: a small one (outputs of at
        most :data:`DRIVE_BYTES`) on this thread if it can (:meth:`Runtime.drive`)."""
        group = self.group
        work = Work(collective, outputs, self._timeout, self._runtime.completer)
        if sum(t.numel() * t.element_size() for t in outputs) <= DRIVE_BYTES:
            self._runtime.drive(lambda: make(group), work._settle, work.is_completed)
        else:
            self._runtime.start(lambda: make(group), work._settle)
        return work

    # --- reductions -----------------------------------------------------------------------

    def _order(self, collective: str, red: Reduction) -> str | None:
        """The strategy a reduction asks for itself: Gloo's order where the group's
        settings do not pin it (two ranks) and the op is no sum (see ``__init__``)."""
        if red.op == "sum" or red.op is ops.BFLOAT16["sum"]:
            return None
        return self._gloo_calls.get(collective)

    def _reduce(self, collective: str, tensors: list[torch.Tensor], red: Reduction,
                root: int | None, timeout: float | None) -> list[Coro]:
        """The coroutines of a reduction of ``tensors`` (root None: to every rank)."""
        me = self.rank()
        if red.fold is not None:
            fold = red.fold

            async def folded(g: Group, t: torch.Tensor, a: np.ndarray) -> None:
                parts = await g.allgather(a, timeout=timeout)
                if root is None or root == me:
                    store(t, fold.reduce(np.stack(parts), axis=0))

            return [lambda g, t=t: folded(g, t, bits(t)) for t in tensors]  # type: ignore[misc]
        arrays = [values(t, red.factor) for t in tensors]
        op = red.op or "sum"
        divide = self.size() if red.average else None
        # values() gave the tensors' own memory (the result lands in them) where it could.
        shared = red.factor is None and all(t.is_contiguous() for t in tensors)
        value: Any = arrays[0] if len(arrays) == 1 else arrays  # one array: no pytree

        strategy = self._order("allreduce" if root is None else "reduce", red)

        async def native(g: Group) -> None:
            if root is None:
                await g.allreduce(value, op, out=value, strategy=strategy, timeout=timeout)
                if shared and divide is None:
                    return
                result: Any = arrays
            else:
                result = await g.reduce(value, root, op, strategy=strategy, timeout=timeout)
                if result is None:
                    return
                if value is not arrays:
                    result = [result]
            for t, a in zip(tensors, result, strict=True):
                store(t, a, divide=divide)

        return [native]  # type: ignore[list-item]

    def _reduction(self, collective: str, tensors: list[torch.Tensor], rop: Any,
                   root: int | None, timeout: timedelta | None) -> Work:
        red = ops.reduction(rop, collective, tensors)
        makers = self._reduce(collective, tensors, red, root, _seconds(timeout))
        return self._launch(collective, tensors,
                            lambda g: [m(g) for m in makers])  # type: ignore[operator]

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Work:
        if isinstance(opts, dist.ReduceOp):
            rop, timeout = opts, None
        else:
            opts = opts if opts is not None else dist.AllreduceOptions()
            rop, timeout = opts.reduceOp, opts.timeout
        return self._reduction("allreduce", list(tensors), rop, None, timeout)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Work:
        opts = opts if opts is not None else dist.AllreduceCoalescedOptions()
        return self._reduction("allreduce_coalesced", list(tensors), opts.reduceOp, None,
                               opts.timeout)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Work:
        opts = opts if opts is not None else dist.ReduceOptions()
        return self._reduction("reduce", list(tensors), opts.reduceOp, opts.rootRank,
                               opts.timeout)

    def _scatter_reduced(self, collective: str, outputs: list[torch.Tensor],
                         inputs: list[list[torch.Tensor]], rop: Any,
                         timeout: timedelta | None, *, whole: bool) -> Work:
        """Output i gets part ``rank`` of the reduction of ``inputs[i]`` (one part per rank).

        In Gloo's order (the default: see :data:`GLOO_ORDER`) this is Gloo's way: an
        allreduce of the input (``whole``: the p parts as one buffer, as for
        ``reduce_scatter_tensor``; else one per part, as for a list of tensors) of which
        this rank keeps its part. A configured strategy runs a true reduce_scatter (each
        rank receives only its part: (p-1)/p of the bytes of one allreduce).
        """
        chosen = self.group.settings.strategies
        gloo_way = ((chosen.get("allreduce") == GLOO_ORDER["allreduce"]
                     or "allreduce" in self._gloo_calls)
                    and "reduce_scatter" not in chosen)
        p, me = self.size(), self.rank()
        flat = [t for row in inputs for t in row]
        red = ops.reduction(rop, collective, flat + outputs)
        limit = _seconds(timeout)
        strategy = self._order("allreduce", red)
        stacks = []
        for out, row in zip(outputs, inputs, strict=True):
            if len(row) != p or any(t.numel() != out.numel() for t in row):
                raise ValueError(f"{collective}: needs {p} inputs of {out.numel()} elements "
                                 f"per output")
            if red.fold is not None:
                stacks.append(np.stack([bits(t).reshape(-1) for t in row]))
            else:
                stacks.append(np.stack([values(t, red.factor).reshape(-1) for t in row]))

        def make(g: Group) -> list[Coro]:
            async def one(out: torch.Tensor, stack: np.ndarray) -> None:
                if red.fold is not None:
                    stacks = await g.allgather(stack, timeout=limit)
                    store(out, red.fold.reduce(np.stack([s[me] for s in stacks]), axis=0))
                elif not gloo_way:
                    part = await g.reduce_scatter(stack, red.op or "sum", timeout=limit)
                    store(out, part, divide=self.size() if red.average else None)
                else:  # whole: the p parts as one buffer (the rows go below)
                    await g.allreduce(stack, red.op or "sum", out=stack, strategy=strategy,
                                      timeout=limit)
                    store(out, stack[me], divide=self.size() if red.average else None)

            async def row(out: torch.Tensor, stack: np.ndarray, k: int) -> None:
                await g.allreduce(stack[k], red.op or "sum", out=stack[k],
                                  strategy=strategy, timeout=limit)
                if k == me:  # the others' rows are reduced for the others
                    store(out, stack[k], divide=self.size() if red.average else None)

            if gloo_way and not whole and red.fold is None:
                # One coroutine per row, issued in order now: awaiting the rows one after
                # another would issue row k+1 only once row k is done here, when another
                # rank may have issued a later collective already.
                return [row(o, s, k) for o, s in zip(outputs, stacks, strict=True)
                        for k in range(p)]
            return [one(o, s) for o, s in zip(outputs, stacks, strict=True)]

        return self._launch(collective, outputs, make)

    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]],
                       opts: Any = None) -> Work:
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        return self._scatter_reduced("reduce_scatter", list(outputs),
                                     [list(r) for r in inputs], opts.reduceOp, opts.timeout,
                                     whole=False)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor,
                              opts: Any = None) -> Work:
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        return self._scatter_reduced("reduce_scatter_single", [output],
                                     [list(input.reshape(self.size(), -1).unbind(0))],
                                     opts.reduceOp, opts.timeout, whole=True)

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor],
                                        inputs: list[torch.Tensor], opts: Any = None) -> Work:
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        return self._scatter_reduced(
            "reduce_scatter_tensor_coalesced", list(outputs),
            [list(t.reshape(self.size(), -1).unbind(0)) for t in inputs],
            opts.reduceOp, opts.timeout, whole=True)

    # --- data movement ---------------------------------------------------------------------

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Work:
        opts = opts if opts is not None else dist.BroadcastOptions()
        tensors = list(tensors)
        for t in tensors:
            ops.check_tensor(t, "broadcast")
        root, limit = opts.rootRank, _seconds(opts.timeout)
        arrays = [bits(t) for t in tensors]
        shared = all(t.is_contiguous() for t in tensors)  # bits() gave their own memory
        value: Any = arrays[0] if len(arrays) == 1 else arrays  # one array: no pytree

        async def run(g: Group) -> None:
            result = await g.broadcast(value, root=root, timeout=limit)
            if g.rank == root:
                return
            for t, mine, a in zip(tensors, arrays, [result] if value is not arrays else result,
                                  strict=True):
                if not (shared and a is mine):  # else filled in place
                    store(t, a)

        return self._launch("broadcast", tensors, lambda g: [run(g)])

    def _gather_each(self, collective: str, pairs: Sequence[tuple[torch.Tensor, Any]],
                     outputs: list[torch.Tensor], timeout: timedelta | None) -> Work:
        """One allgather per (input, sink): ``sink(parts)`` stores the parts."""
        for t, _ in pairs:
            ops.check_tensor(t, collective)
        limit = _seconds(timeout)
        arrays = [(bits(t), sink) for t, sink in pairs]

        def make(g: Group) -> list[Coro]:
            async def one(a: np.ndarray, sink: Callable[[list[np.ndarray]], None]) -> None:
                sink(await g.allgather(a, timeout=limit))

            return [one(a, sink) for a, sink in arrays]

        return self._launch(collective, outputs, make)

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                  opts: Any = None) -> Work:
        opts = opts if opts is not None else dist.AllgatherOptions()

        def into(row: list[torch.Tensor]) -> Callable[[list[np.ndarray]], None]:
            def sink(parts: list[np.ndarray]) -> None:
                for t, a in zip(row, parts, strict=True):
                    store(t, a)
            return sink

        rows = [list(r) for r in outputs]
        return self._gather_each("allgather", [(t, into(r)) for t, r in zip(inputs, rows,
                                 strict=True)], [t for r in rows for t in r], opts.timeout)

    def allgather_coalesced(self, outputs: list[list[torch.Tensor]],
                            inputs: list[torch.Tensor], opts: Any = None) -> Work:
        """``outputs[r][i]`` gets rank r's ``inputs[i]`` (nested the other way round from
        :meth:`allgather`'s): the inputs' bytes travel as one allgather."""
        opts = opts if opts is not None else dist.AllgatherOptions()
        for t in inputs:
            ops.check_tensor(t, "allgather_coalesced")
        if len(outputs) != self.size() or any(len(row) != len(inputs) for row in outputs):
            raise ValueError(
                f"allgather_coalesced: outputs must be {self.size()} lists (one per rank) of "
                f"{len(inputs)} tensors (one per input), got "
                f"{[len(row) for row in outputs]}")
        arrays = [bits(t) for t in inputs]
        packed = np.concatenate([np.ascontiguousarray(a).reshape(-1).view(np.uint8)
                                 for a in arrays] or [np.empty(0, np.uint8)])
        limit = _seconds(opts.timeout)

        async def run(g: Group) -> None:
            for row, part in zip(outputs, await g.allgather(packed, timeout=limit),
                                 strict=True):
                at = 0
                for t, a in zip(row, arrays, strict=True):
                    store(t, part[at:at + a.nbytes].view(a.dtype).reshape(a.shape))
                    at += a.nbytes

        return self._launch("allgather_coalesced", [t for row in outputs for t in row],
                            lambda g: [run(g)])

    @staticmethod
    def _into_tensor(out: torch.Tensor) -> Callable[[list[np.ndarray]], None]:
        def sink(parts: list[np.ndarray]) -> None:
            store(out, np.concatenate([p.reshape(-1) for p in parts]))
        return sink

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor,
                          opts: Any = None) -> Work:
        opts = opts if opts is not None else dist.AllgatherOptions()
        return self._gather_each("all_gather_single", [(input, self._into_tensor(output))],
                                 [output], opts.timeout)

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor],
                                        inputs: list[torch.Tensor], opts: Any = None) -> Work:
        opts = opts if opts is not None else dist.AllgatherOptions()
        return self._gather_each(
            "allgather_into_tensor_coalesced",
            [(i, self._into_tensor(o)) for o, i in zip(outputs, inputs, strict=True)],
            list(outputs), opts.timeout)

    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor],
               opts: Any = None) -> Work:
        opts = opts if opts is not None else dist.GatherOptions()
        root, limit = opts.rootRank, _seconds(opts.timeout)
        ops.check_tensor(inputs[0], "gather")
        a = bits(inputs[0])
        row = list(outputs[0]) if outputs else []

        async def run(g: Group) -> None:
            parts = await g.gather(a, root=root, timeout=limit)
            if parts is not None:
                for t, part in zip(row, parts, strict=True):
                    store(t, part)

        return self._launch("gather", row, lambda g: [run(g)])

    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]],
                opts: Any = None) -> Work:
        opts = opts if opts is not None else dist.ScatterOptions()
        root, limit = opts.rootRank, _seconds(opts.timeout)
        out = outputs[0]
        ops.check_tensor(out, "scatter")
        parts = [bits(t) for t in inputs[0]] if self.rank() == root else None

        async def run(g: Group) -> None:
            store(out, await g.scatter(parts, root=root, timeout=limit))

        return self._launch("scatter", [out], lambda g: [run(g)])

    def _exchange(self, collective: str, sends: list[torch.Tensor],
                  recvs: list[torch.Tensor], outputs: list[torch.Tensor],
                  timeout: timedelta | None) -> Work:
        """Rank r's ``sends[j]`` arrives in rank j's ``recvs[r]``: one p2pcoll alltoall of
        the tensors' elements (received in place where a tensor is contiguous), whose
        lengths the senders and receivers must agree on (else CollectiveMismatch)."""
        for t in sends + recvs:
            ops.check_tensor(t, collective)
        limit = _seconds(timeout)
        data = [bits(t).reshape(-1) for t in sends]
        into = [bits(t).reshape(-1) for t in recvs]

        async def run(g: Group) -> None:
            await g.alltoall(data, out=into, timeout=limit)
            for t, a in zip(recvs, into, strict=True):
                store(t, a)  # a copy's only: a contiguous tensor has it already

        return self._launch(collective, outputs, lambda g: [run(g)])

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                 opts: Any = None) -> Work:
        opts = opts if opts is not None else dist.AllToAllOptions()
        return self._exchange("alltoall", list(inputs), list(outputs), list(outputs),
                              opts.timeout)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,
                          output_split_sizes: list[int], input_split_sizes: list[int],
                          opts: Any = None) -> Work:
        opts = opts if opts is not None else dist.AllToAllOptions()
        p = self.size()

        def split(t: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
            sizes = list(sizes) or [t.shape[0] // p] * p
            return list(torch.split(t, sizes, dim=0))

        return self._exchange("all_to_all_single", split(input, input_split_sizes),
                              split(output, output_split_sizes), [output], opts.timeout)

    alltoall_base = all_to_all_single

    def barrier(self, opts: Any = None) -> Work:
        limit = _seconds(opts.timeout) if opts is not None else None
        return self._launch("barrier", [], lambda g: [g.barrier(timeout=limit)])

    # --- point to point ----------------------------------------------------------------

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> Work:
        ops.check_tensor(tensors[0], "send")
        a = bits(tensors[0])
        return self._launch("send", list(tensors), lambda g: [g.send(a, dst, tag=tag)])

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> Work:
        t = tensors[0]
        ops.check_tensor(t, "recv")
        a = bits(t)
        own = shares(t, a)

        async def run(g: Group) -> None:
            got = await g.recv(src, tag=tag, out=a if own else None)
            store(t, got)

        return self._launch("recv", [t], lambda g: [run(g)])

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> Work:
        """torch's ``recv(src=None)``: the first message any rank sends with ``tag``; the
        Work's ``_source_rank()`` names the sender once it is done."""
        t = tensors[0]
        ops.check_tensor(t, "recv")
        a = bits(t)
        own = shares(t, a)
        sender: list[int] = []  # the Work's, which may be made after the receive is done

        async def run(g: Group) -> None:
            src, got = await g.recv_any(tag=tag, out=a if own else None)
            sender.append(src)
            store(t, got)

        work = self._launch("recv", [t], lambda g: [run(g)])
        work.sender = sender
        return work


async def _snapshot(group: Group) -> list[dict[str, Any]]:
    return group.flight_record()  # on the loop, where the record changes


def create(opts: Any, pg_options: Any = None) -> ProcessGroupP2PColl:
    """torch's creator (``extended_api=True``): one p2pcoll group per process group,
    formed through the prefix store torch passes."""
    return ProcessGroupP2PColl(opts.store, opts.group_rank, opts.group_size, opts.timeout,
                               options_from(pg_options))


__all__ = ["Options", "P2PCollError", "ProcessGroupP2PColl", "create"]
