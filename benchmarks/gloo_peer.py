"""The Gloo side of the benchmarks: a rank of ``torch.distributed`` (backend gloo).

Not a script: the workers of ``slow_pair.py``, ``long_link.py``, ``hierarchical_hosts.py``
and ``slow_training.py`` import it (from beside them) to run the reference that p2pcoll's
figures are set against. A rank takes ``RANK`` and ``WORLD_SIZE`` from its environment (and
``GLOO_SOCKET_IFNAME``, which its driver sets), as the p2pcoll workers beside it do, and runs
on one torch thread.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta


@contextmanager
def group(address: str, port: int, timeout: float = 900.0) -> Iterator[tuple[int, int]]:
    """Join the Gloo group whose rank 0 listens at ``tcp://address:port``, with
    ``timeout`` seconds for each collective; yields (rank, world size).

    On leaving without an error the ranks meet at a barrier first (none destroys the
    group while another is still calling); the group is destroyed in any case.
    """
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"tcp://{address}:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=timeout))
    try:
        yield rank, world
        dist.barrier()
    finally:
        dist.destroy_process_group()


def time_collectives(address: str, port: int, sizes: Sequence[int], iterations: int,
                     collectives: Sequence[str] = ("allreduce",), *,
                     time_refill: bool = False) -> dict[tuple[str, int], list[float]]:
    """Time Gloo's ``all_reduce`` (and ``broadcast`` from rank 0, if in ``collectives``) of
    float32 tensors of each of ``sizes`` bytes, in a :func:`group` at ``address:port``.

    Pass after pass (the first a warm-up, then ``iterations`` timed), every size and in it
    every collective once, so that a change in the machine's load falls on all alike; each
    call after a barrier. An allreduce's tensor is refilled with ``1 + rank`` after it (its
    sums stay small), out of the timed call unless ``time_refill`` (hierarchical_hosts.py
    times it with the call, as its p2pcoll workers do). Returns this rank's seconds per
    (collective, size), one per timed pass.

    Raises:
        ValueError: ``collectives`` names another collective.
    """
    import torch
    import torch.distributed as dist

    calls = {"allreduce": dist.all_reduce, "broadcast": lambda x: dist.broadcast(x, src=0)}
    unknown = set(collectives) - set(calls)
    if unknown:
        raise ValueError(f"Gloo's side times allreduce and broadcast, not {sorted(unknown)}")
    times: dict[tuple[str, int], list[float]] = {}
    with group(address, port) as (rank, _):
        data = {n: torch.full((n // 4,), 1.0 + rank, dtype=torch.float32) for n in sizes}
        for i in range(iterations + 1):
            for nbytes in sizes:
                x = data[nbytes]
                for collective in collectives:
                    dist.barrier()
                    t = time.perf_counter()
                    calls[collective](x)
                    done = time.perf_counter()
                    if collective == "allreduce":
                        x.fill_(1.0 + rank)
                    if i:
                        end = time.perf_counter() if time_refill else done
                        times.setdefault((collective, nbytes), []).append(end - t)
    return times
