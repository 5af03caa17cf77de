"""p2pcoll's codecs as DDP communication hooks, for models on the "p2pcoll" backend.

    from p2pcoll.torch import hooks

    state, hook = hooks.codec_hook(codec="int8", error_feedback=True)
    ddp.register_comm_hook(state, hook)

Each gradient bucket DDP hands the hook is averaged over the process group through the
codec, exactly as ``Group.allreduce(bucket, "avg", codec=...)`` averages it
(:func:`p2pcoll.codecs.reduce_coded`: "fp16", "bf16", "int8" or a plugin's; int8 first
agrees on its scales), in the order DDP issues the buckets (the backend's call order, so
every rank pairs the same buckets), and every rank gets the same bits. The wire carries
the codec's bytes, and the group's ``stats()`` counts them.

With ``error_feedback=True`` (for a lossy codec) every rank keeps, per bucket, what the
codec took from its own contribution last time and adds it to the next one (Seide et al.
2014; Karimireddy et al. 2019): ``residual = (grad + residual) - restore(encode(grad +
residual))``, computed by the rank alone; the averages stay the same bits on every rank.
A bucket is keyed by DDP's bucket index and the addresses of its parameters, so the
residuals survive DDP's rebuilding of its buckets after the first step (a bucket whose
parameters changed starts again from zeros).

Errors: a collective that fails (a peer lost, a timeout) fails the bucket's future with
p2pcoll's error as a :class:`torch.distributed.DistBackendError`; DDP's ``backward()``
raises it as torch's RuntimeError naming it ("... PeerLost: ... rank 2 ..."), as for DDP
without a hook. NaN or Inf in a bucket under int8 is :class:`p2pcoll.codecs.NonFiniteInput`
on every rank (no scale can be agreed); the group stays usable. A bucket that is not
float16, float32 or float64 (a model in bfloat16) is :class:`UnsupportedOperation`,
before anything is sent.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ...api import Group
from ...codecs import Codec, get_codec, reduce_coded
from ...types import ReduceOp
from . import ops
from .backend import ProcessGroupP2PColl
from .ops import UnsupportedOperation

Hook = Callable[["CodecState", dist.GradBucket], torch.futures.Future[torch.Tensor]]
BucketKey = tuple[int, tuple[int, ...]]
CODED = (torch.float16, torch.float32, torch.float64)  # the bucket dtypes codecs take


def p2pcoll_group(process_group: Any = None) -> ProcessGroupP2PColl:
    """The "p2pcoll" process group behind ``process_group`` (None: the default group).

    Raises:
        UnsupportedOperation: the group does not run on the "p2pcoll" backend (naming
            the backend it runs on).
        ValueError: torch.distributed has no default group yet (``process_group`` None).
    """
    pg = process_group if process_group is not None else dist.group.WORLD
    if pg is None:
        raise ValueError("p2pcoll's DDP hooks need a process group: call "
                         "dist.init_process_group('p2pcoll') first, or pass process_group=")
    if isinstance(pg, ProcessGroupP2PColl):
        return pg
    try:  # a ProcessGroup that wraps a backend per device: its CPU one
        backend = pg._get_backend(torch.device("cpu"))
    except (AttributeError, RuntimeError):
        backend = None
    if isinstance(backend, ProcessGroupP2PColl):
        return backend
    name = pg.name() if hasattr(pg, "name") else type(pg).__name__
    raise UnsupportedOperation(f"p2pcoll's DDP hooks run on a process group of the "
                               f"\"p2pcoll\" backend, got one of {name!r}")


@dataclass
class CodecState:
    """The state of a :func:`codec_hook`: the group, the codec and each bucket's residual.

    Attributes:
        process_group: the "p2pcoll" process group the buckets are averaged over.
        codec: the codec.
        error_feedback: whether each rank keeps and adds its residuals (a codec that is
            not lossy keeps none).
        timeout: seconds per bucket's collectives (None: the group's).
        residuals: this rank's residual per bucket (see the module docstring).
    """

    process_group: ProcessGroupP2PColl
    codec: Codec
    error_feedback: bool = False
    timeout: float | None = None
    residuals: dict[BucketKey, torch.Tensor] = field(default_factory=dict)


def codec_hook(codec: str = "fp16", *, error_feedback: bool = False,
               process_group: Any = None, timeout: float | None = None,
               ) -> tuple[CodecState, Hook]:
    """A DDP communication hook that averages each gradient bucket through ``codec``, and
    its state: ``ddp.register_comm_hook(*hooks.codec_hook("int8", error_feedback=True))``.

    Args:
        codec: the codec's name: "fp16", "bf16", "int8" or a plugin's
            (``p2pcoll.codecs.available_codecs()``).
        error_feedback: keep each rank's compression error per bucket and add it to the
            bucket's next gradients.
        process_group: a process group of the "p2pcoll" backend (None: the default group,
            which must be one).
        timeout: seconds each bucket's collectives may take (None: the group's timeout).

    Returns:
        ``(state, hook)`` for ``DistributedDataParallel.register_comm_hook``.

    Raises:
        TypeError: ``codec`` is no string, ``error_feedback`` no bool.
        ValueError: ``timeout`` is not positive; no process group given and no default one;
            a codec that cannot average (or not over this many ranks: int8 sums at most
            127).
        UnknownCodec: no codec of that name (a ValueError listing the installed ones).
        UnsupportedOperation: the process group is not on the "p2pcoll" backend.
    """
    if not isinstance(codec, str) or not codec:
        raise TypeError(f"codec must be a codec's name (\"fp16\", \"int8\", ...), got "
                        f"{codec!r}")
    if not isinstance(error_feedback, bool):
        raise TypeError(f"error_feedback must be a bool, got {error_feedback!r}")
    if timeout is not None and not timeout > 0:
        raise ValueError(f"timeout must be positive seconds or None, got {timeout!r}")
    coder = get_codec(codec)
    pg = p2pcoll_group(process_group)
    coder.check(ReduceOp.AVG, np.dtype(np.float32), pg.size())
    return CodecState(pg, coder, error_feedback, timeout), _codec_hook


def _key(bucket: dist.GradBucket) -> BucketKey:
    return bucket.index(), tuple(p.data_ptr() for p in bucket.parameters())


def _residual(state: CodecState, bucket: dist.GradBucket, buffer: torch.Tensor,
              ) -> torch.Tensor | None:
    """The bucket's residual (zeros at first, and when its bucket changed), or None
    without error feedback."""
    if not (state.error_feedback and state.codec.lossy):
        return None
    key = _key(bucket)
    residual = state.residuals.get(key)
    if residual is None or residual.shape != buffer.shape or residual.dtype != buffer.dtype:
        for old in [k for k in state.residuals if k[0] == key[0]]:  # the bucket's before
            del state.residuals[old]  # DDP rebuilt it
        residual = state.residuals[key] = torch.zeros_like(buffer,
                                                           memory_format=torch.contiguous_format)
    return residual


def _codec_hook(state: CodecState, bucket: dist.GradBucket
                ) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket`` over ``state.process_group`` through ``state.codec``; the future
    holds the bucket's buffer with the average in it."""
    buffer = bucket.buffer()
    if buffer.dtype not in CODED:
        raise UnsupportedOperation(f"codec {state.codec.name!r}: DDP's bucket is {buffer.dtype}; "
                                   f"p2pcoll's codecs take float16, float32 or float64")
    residual = _residual(state, bucket, buffer)
    data = ops.values(buffer)  # the buffer's memory: the average lands there (out=)
    kept = None if residual is None else [ops.values(residual)]
    coder, limit = state.codec, state.timeout

    def make(g: Group) -> list[Coroutine[Any, Any, Any]]:
        async def run() -> None:
            await reduce_coded(g, coder, [data], "avg", out=[data], residuals=kept,
                               timeout=limit)
            if not ops.shares(buffer, data):  # a buffer that is no contiguous tensor
                ops.store(buffer, data)
        return [run()]

    future: torch.futures.Future[torch.Tensor]
    future = _start(state.process_group, buffer, make).get_future().then(_first)
    return future


# DDP checks a hook's annotations against the classes (strings here, with the future import).
_codec_hook.__annotations__ = {"state": CodecState, "bucket": dist.GradBucket,
                               "return": torch.futures.Future[torch.Tensor]}


def _start(pg: ProcessGroupP2PColl, buffer: torch.Tensor,
           make: Callable[[Group], list[Coroutine[Any, Any, Any]]]) -> Any:
    """Start ``make(group)``'s coroutines after every collective this process group was
    asked for before (its call order); the Work of ``[buffer]``, failed with the group's
    error (as torch's DistBackendError) if they fail."""
    return pg._launch("allreduce", [buffer], make)


def _first(future: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
    """The bucket's tensor of the Work's value (DDP takes a tensor from a Python hook)."""
    return future.value()[0]


__all__ = ["CodecState", "Hook", "UnsupportedOperation", "codec_hook", "p2pcoll_group"]
