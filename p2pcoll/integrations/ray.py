"""p2pcoll as a ``ray.util.collective`` backend, named ``"P2PCOLL"``.

    import ray.util.collective as col
    from p2pcoll.integrations import ray as p2pcoll_ray

    p2pcoll_ray.register()                        # in the driver and in every actor
    col.init_collective_group(4, rank, backend="p2pcoll", group_name="grads")
    col.allreduce(tensor, group_name="grads")     # numpy arrays or CPU torch tensors

Ray looks a backend up by its name in upper case and constructs its class as
``cls(world_size, rank, group_name)``, in ``init_collective_group`` or, for groups declared
by the driver with ``create_collective_group``, in the actor's first call on the group. So
:func:`register` must have run in the driver (``create_collective_group`` checks the name
there) and in every actor before either.

Who meets where: rank 0 picks a free port on its node's IP (``ray.util.get_node_ip_address``)
and publishes ``tcp://IP:PORT`` with a fresh job id in Ray's internal key-value store, under a
key made of the Ray job's id and the group's name; it then hosts the p2pcoll rendezvous
there, as ``p2pcoll.join`` does for rank 0. The other ranks wait for the key (up to the join
timeout) and join with that job id, so two groups, or two generations of one group name
(``destroy_collective_group`` then a new group of the same name), cannot cross: the
rendezvous refuses a peer with another job id. Rank 0 deletes the key once the group has
formed, as Ray's GLOO backend does with its ``MASTER_ADDR``.

Ray's calls are blocking. Each group runs on :mod:`p2pcoll.blocking`'s loop thread, never on
the caller's event loop, so a call from an ``async def`` method of an async actor works (it
holds that method until it is done, as any blocking call does); to keep the actor serving
its other methods meanwhile, run the call in a thread:
``await asyncio.to_thread(col.allreduce, tensor, group_name="grads")``.

What GLOO's backend takes, this one takes: allreduce, broadcast, reduce, allgather,
reducescatter, barrier, send and recv; ``ReduceOp`` SUM, PRODUCT, MIN and MAX; numpy
arrays and CPU torch tensors of bool, (u)int8/16/32/64, float16/32/64, complex64/128, and
torch's bfloat16 (reduced exactly on the bfloat16 bits, rounded at every step, as Gloo and
every p2pcoll front end do: :mod:`p2pcoll.tensors`). Results land in the caller's tensors,
in place, as with GLOO; unlike GLOO's ``reducescatter``, the input list is left as it was. A
CUDA tensor is a ``TypeError`` that names its device: p2pcoll moves CPU memory.
``ray.util.collective`` has no all-to-all; the group's own ``alltoall(outputs, inputs)``
(through ``col.get_group_handle(name)``) fills ``outputs[i]`` with what rank i sent
(lengths per pair may differ: :meth:`p2pcoll.Group.alltoall`).

An array that came through Ray's object store (``ray.get``, or an actor's argument) is
read-only to numpy, but its memory is not: as GLOO's backend does (``torch.from_numpy``),
results are written into it. That memory is the object store's copy of the object, which
other readers of it on the node see too; to keep it, pass a copy (``np.array(x)``).

Failures are p2pcoll's errors (:mod:`p2pcoll.errors`), raised from Ray's call: a rank that
dies (``ray.kill``) is a ``PeerLost`` naming it within the heartbeat bound
(``$P2PCOLL_HEARTBEAT_TIMEOUT``, 5 s), after which the group is broken
(``GroupBroken``) until it is destroyed and created again.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import numpy as np

from .. import blocking, tensors
from ..errors import RendezvousError
from ..extras import needs
from ..types import CustomOp, ReduceOp as P2PReduceOp

# Ray is the ray extra's: without it, importing this module says what to install.
with needs("p2pcoll's Ray collective backend (p2pcoll.integrations.ray)"):
    import ray
    from ray.experimental import internal_kv
    from ray.util.collective.backend_registry import (
        BackendRegistry,
        register_collective_backend,
    )
    from ray.util.collective.collective_group.base_collective_group import BaseGroup
    from ray.util.collective.types import (
        AllGatherOptions,
        AllReduceOptions,
        BarrierOptions,
        BroadcastOptions,
        RecvOptions,
        ReduceOp,
        ReduceOptions,
        ReduceScatterOptions,
        SendOptions,
    )

__all__ = ["BACKEND", "P2PCollGroup", "register"]

BACKEND = "P2PCOLL"
"""The backend's name in Ray's registry (Ray upper-cases names: ``backend="p2pcoll"`` works)."""

KV_NAMESPACE = "p2pcoll"
JOIN_TIMEOUT = 60.0
"""Seconds for a group to form (``$P2PCOLL_JOIN_TIMEOUT`` overrides)."""

T = TypeVar("T")

_OPS = {ReduceOp.SUM: "sum", ReduceOp.PRODUCT: "prod", ReduceOp.MIN: "min",
        ReduceOp.MAX: "max"}


def register() -> None:
    """Register the ``"P2PCOLL"`` backend with ``ray.util.collective`` in this process.

    Call it once in the driver and once in every actor that joins a group, before
    ``init_collective_group`` or ``create_collective_group``; calling it again is harmless.

    Raises:
        ValueError: another class is already registered under the name ``"P2PCOLL"``.
    """
    registry = BackendRegistry()  # type: ignore[no-untyped-call]  # Ray is untyped
    if registry.is_registered(BACKEND):
        if registry.get(BACKEND) is not P2PCollGroup:
            raise ValueError(f"ray.util.collective already has a backend {BACKEND!r}: "
                             f"{registry.get(BACKEND)!r}, not p2pcoll's")
        return
    register_collective_backend(BACKEND, P2PCollGroup)


_waiters: concurrent.futures.ThreadPoolExecutor | None = None
_waiters_lock = threading.Lock()


def _off_loop(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)``, called on another thread when this one runs an event loop.

    In an async actor Ray's (blocking) collective calls arrive on the actor's event loop
    thread, where :mod:`p2pcoll.blocking` refuses to wait (it would stall that loop). Ray's
    API is blocking and GLOO's backend blocks there too, so a caller on such a thread gets
    what it asked for: it waits, while the collective runs on p2pcoll's loop thread and the
    wait itself on a thread of this module's. ``asyncio.to_thread`` keeps the loop serving.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return fn(*args, **kwargs)
    global _waiters
    with _waiters_lock:
        if _waiters is None:
            _waiters = concurrent.futures.ThreadPoolExecutor(
                max_workers=4, thread_name_prefix="p2pcoll-ray-wait")
    return _waiters.submit(fn, *args, **kwargs).result()


def _kv_key(group_name: str) -> bytes:
    job = ray.get_runtime_context().get_job_id()
    return f"rendezvous/{job}/{group_name}".encode()


def _join_timeout() -> float:
    raw = os.environ.get("P2PCOLL_JOIN_TIMEOUT")
    return float(raw) if raw else JOIN_TIMEOUT


def _free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def _meeting_point(group_name: str, rank: int, timeout: float) -> tuple[str, str]:
    """(rendezvous URL, job id) of ``group_name``: published by rank 0, awaited elsewhere."""
    key = _kv_key(group_name)
    if rank == 0:
        host: str = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
        url = f"tcp://{f'[{host}]' if ':' in host else host}:{_free_port(host)}"
        job_id = f"ray-{group_name}-{uuid.uuid4().hex}"
        internal_kv._internal_kv_put(key, json.dumps({"url": url, "job": job_id}),
                                     overwrite=True, namespace=KV_NAMESPACE)
        return url, job_id
    deadline = time.monotonic() + timeout
    while (raw := internal_kv._internal_kv_get(key, namespace=KV_NAMESPACE)) is None:
        if time.monotonic() > deadline:
            raise RendezvousError(
                f"rank {rank} of Ray collective group {group_name!r}: rank 0 did not publish "
                f"its p2pcoll rendezvous within {timeout:g} s (is rank 0 running, and did it "
                f"call p2pcoll.integrations.ray.register()?)")
        time.sleep(0.05)
    meeting = json.loads(raw)
    return str(meeting["url"]), str(meeting["job"])


def _seconds(options: Any) -> float | None:
    """An options object's ``timeout_ms`` in seconds; None (the group's default) when unset."""
    raw = getattr(options, "timeout_ms", None)
    if isinstance(raw, timedelta):
        seconds = raw.total_seconds()
    elif isinstance(raw, (int, float)):
        seconds = raw / 1000
    else:
        return None
    return seconds if seconds > 0 else None


def _op(options: Any) -> str:
    op = getattr(options, "reduceOp", ReduceOp.SUM)
    if op not in _OPS:
        raise ValueError(f"reduce op {op!r} is not one of ray.util.collective's ReduceOp "
                         f"{[o.name for o in _OPS]}")
    return _OPS[op]


def _reduction(options: Any, buffers: list[_Buffer]) -> P2PReduceOp | CustomOp:
    """The p2pcoll op for ``options``' reduce op over ``buffers`` (bfloat16: exact on its bits)."""
    return tensors.reduction(_op(options), [b.given for b in buffers]).op


class _Buffer:
    """A caller's numpy array or CPU torch tensor, seen as a numpy array.

    ``array`` is the caller's memory when it is contiguous (``in_place``; a read-only array
    from Ray's object store too, as GLOO writes into it); otherwise a contiguous copy, and
    :meth:`store` writes results back. bfloat16 travels as its int16 bits (:mod:`p2pcoll.tensors`).
    """

    def __init__(self, given: Any) -> None:
        if not isinstance(given, np.ndarray) and not tensors.is_tensor(given):
            raise TypeError(f"p2pcoll's Ray backend takes numpy arrays and CPU torch tensors, "
                            f"not {type(given).__name__}")
        if tensors.is_tensor(given) and given.device.type != "cpu":
            raise TypeError(f"p2pcoll moves CPU memory: this tensor is on {given.device}")
        self.given = given
        view = tensors.as_array(given, bits=True)
        # Where results go: the caller's memory, as numpy sees it (a tensor's memory is
        # not its own when it is a lazy conjugate: then it goes through torch).
        memory = (tensors.writable(view) if isinstance(given, np.ndarray)
                  else view if tensors.shares(given, view) else None)
        self._memory = memory
        self.in_place = memory is not None and bool(memory.flags.c_contiguous)
        self.array = (memory if memory is not None and memory.flags.c_contiguous
                      else np.ascontiguousarray(view))

    def store(self, result: np.ndarray | None = None) -> None:
        """Put ``result`` (default: ``self.array``, filled in place) into the caller's tensor."""
        if result is None:
            if self.in_place:
                return
            result = self.array
        if self._memory is not None:
            self._memory[...] = result.reshape(self._memory.shape)
            return
        import torch

        with torch.no_grad():
            self.given.copy_(tensors.like(self.given, np.ascontiguousarray(result))
                             .reshape(self.given.shape))

    def out(self) -> np.ndarray | None:
        """Where p2pcoll may write the result in place, or None for a returned copy."""
        return self.array if self.in_place else None


def _one(items: Any, what: str) -> Any:
    if not isinstance(items, list) or len(items) != 1:
        got = f"{len(items)} tensors" if isinstance(items, list) else type(items).__name__
        raise ValueError(f"{what}: ray.util.collective passes one tensor in a list (its "
                         f"multi-GPU calls are not for p2pcoll, which moves CPU memory); "
                         f"got {got}")
    return items[0]


class P2PCollGroup(BaseGroup):
    """One ``ray.util.collective`` group, run on a p2pcoll group of its own.

    Ray constructs it (``cls(world_size, rank, group_name)``); users call Ray's functions.
    Every method blocks until the collective is done and raises p2pcoll's errors.

    Raises (construction):
        RendezvousError: the group did not form within the join timeout
            (``$P2PCOLL_JOIN_TIMEOUT``, 60 s), naming the missing ranks, or rank 0 never
            published its rendezvous.
    """

    def __init__(self, world_size: int, rank: int, group_name: str) -> None:
        super().__init__(world_size, rank, group_name)
        timeout = _join_timeout()
        url, job_id = _meeting_point(group_name, rank, timeout)
        try:
            self._group = _off_loop(blocking.join, url, world_size=world_size, rank=rank,
                                    timeout=timeout, job_id=job_id)
        except RendezvousError as exc:
            raise RendezvousError(f"Ray collective group {group_name!r}, rank {rank}: {exc}",
                                  permanent=exc.permanent, answered=exc.answered) from exc
        if rank == 0:  # everyone has read it: the group formed
            internal_kv._internal_kv_del(_kv_key(group_name), namespace=KV_NAMESPACE)

    @classmethod
    def backend(cls) -> str:
        return BACKEND

    @classmethod
    def check_backend_availability(cls) -> bool:
        return True

    def destroy_group(self) -> None:
        """Close this rank's p2pcoll group (the peers see it leave)."""
        _off_loop(self._group.close)

    def flight_record(self) -> list[dict[str, Any]]:
        """This rank's last calls, oldest first (see :meth:`p2pcoll.Group.flight_record`)."""
        return self._group.flight_record()

    def allreduce(self, tensor: list[Any], allreduce_options: Any = None) -> None:
        options = allreduce_options or AllReduceOptions()
        buf = _Buffer(_one(tensor, "allreduce"))
        result = _off_loop(self._group.allreduce, buf.array, op=_reduction(options, [buf]),
                           out=buf.out(),
                           timeout=_seconds(options))
        buf.store(None if buf.out() is not None else result)

    def barrier(self, barrier_options: Any = None) -> None:
        _off_loop(self._group.barrier, timeout=_seconds(barrier_options or BarrierOptions()))

    def reduce(self, tensor: list[Any], reduce_options: Any = None) -> None:
        options = reduce_options or ReduceOptions()
        buf = _Buffer(_one(tensor, "reduce"))
        root = int(options.root_rank)
        result = _off_loop(self._group.reduce, buf.array, root, op=_reduction(options, [buf]),
                           timeout=_seconds(options))
        if self.rank == root:
            buf.store(result)

    def allgather(self, tensor_list: list[Any], tensor: list[Any],
                  allgather_options: Any = None) -> None:
        options = allgather_options or AllGatherOptions()
        outputs = [_Buffer(t) for t in _one(tensor_list, "allgather")]
        if len(outputs) != self.world_size:
            raise ValueError(f"allgather: {len(outputs)} output tensors for a group of "
                             f"{self.world_size}")
        mine = _Buffer(_one(tensor, "allgather"))
        parts = _off_loop(self._group.allgather, mine.array, timeout=_seconds(options))
        for out, part in zip(outputs, parts, strict=True):
            out.store(part)

    def broadcast(self, tensor: list[Any], broadcast_options: Any = None) -> None:
        options = broadcast_options or BroadcastOptions()
        buf = _Buffer(_one(tensor, "broadcast"))
        root = int(options.root_rank)
        value = buf.array if self.rank == root else buf.out()
        result = _off_loop(self._group.broadcast, value, root, timeout=_seconds(options))
        if self.rank != root:
            buf.store(result)

    def reducescatter(self, tensor: list[Any], tensor_list: list[Any],
                      reducescatter_options: Any = None) -> None:
        options = reducescatter_options or ReduceScatterOptions()
        out = _Buffer(_one(tensor, "reducescatter"))
        inputs = [_Buffer(t) for t in _one(tensor_list, "reducescatter")]
        if len(inputs) != self.world_size:
            raise ValueError(f"reducescatter: {len(inputs)} input tensors for a group of "
                             f"{self.world_size}")
        shapes = {i.array.shape for i in inputs} | {out.array.shape}
        dtypes = {i.array.dtype for i in inputs} | {out.array.dtype}
        if len(shapes) != 1 or len(dtypes) != 1:
            raise ValueError(f"reducescatter: the output and every input need one shape and "
                             f"dtype; got shapes {sorted(map(str, shapes))}, dtypes "
                             f"{sorted(map(str, dtypes))}")
        stacked = np.stack([i.array for i in inputs])
        part = _off_loop(self._group.reduce_scatter, stacked,
                         op=_reduction(options, [out, *inputs]),
                         timeout=_seconds(options))
        out.store(part.reshape(out.array.shape))

    def alltoall(self, outputs: list[Any], inputs: list[Any],
                 alltoall_options: Any = None) -> None:
        """``inputs[j]`` to rank j, ``outputs[i]`` filled from rank i (Ray has no call for
        it: use ``col.get_group_handle(name).alltoall(...)``). Raises as
        :meth:`p2pcoll.Group.alltoall`: a length that the sender and ``outputs`` disagree
        on is a CollectiveMismatch on every rank."""
        outs, ins = [_Buffer(t) for t in outputs], [_Buffer(t) for t in inputs]
        _off_loop(self._group.alltoall, [i.array for i in ins], out=[o.array for o in outs],
                  timeout=_seconds(alltoall_options))
        for o in outs:
            o.store()

    def send(self, tensor: list[Any], send_options: Any = None) -> None:
        options = send_options or SendOptions()
        buf = _Buffer(_one(tensor, "send"))
        _off_loop(self._group.send, buf.array, int(options.dst_rank), timeout=_seconds(options))

    def recv(self, tensor: list[Any], recv_options: Any = None) -> None:
        options = recv_options or RecvOptions()
        buf = _Buffer(_one(tensor, "recv"))
        result = _off_loop(self._group.recv, int(options.src_rank), out=buf.out(),
                           timeout=_seconds(options))
        buf.store(None if buf.out() is not None else result)
