"""One bfloat16 rule for every front end: the same allreduce gives the same bits through
``p2pcoll.Group``, ``p2pcoll.blocking``, the torch backend and the Ray backend.

Three ranks sum the same random bfloat16 tensors (``torch_worker.noise``), whose sum
rounded at every step differs from the sum rounded once (checked below, so the test can
tell the two rules apart). Every front end runs Gloo's ring order (``gloo_ring``, the torch
backend's default above two ranks), so the bits must equal Gloo's own, through each of:
memory-transport groups and blocking groups (threads of this process), torch processes
(``tests/torch_worker.py bf16``, also printing Gloo's bits) and Ray actors (a local Ray).
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import sys
from functools import partial
from typing import Any

import numpy as np
import pytest
import torch  # CI installs the torch extra: the torch tests must not skip

if importlib.util.find_spec("ray") is None:  # pragma: no cover - the ray extra is in dev
    if os.environ.get("CI") == "true":
        raise RuntimeError("ray is missing: CI installs it with the dev extra (p2pcoll[ray])")
    pytest.skip("ray not installed: pip install 'p2pcoll[ray]'", allow_module_level=True)

import ray
import ray.util.collective as col
from test_blocking import join_pair, on_ranks
from test_torch_backend import world
from torch_worker import BF16_N, noise

from p2pcoll.integrations import ray as p2pcoll_ray
from p2pcoll.testing import memory_groups

pytestmark = pytest.mark.slow  # Ray and torch processes: the slow tier

SIZE = 3
ORDER = "gloo_ring"


def inputs() -> list[Any]:
    return [noise(rank, BF16_N, torch.bfloat16) for rank in range(SIZE)]


def bits(t: Any) -> bytes:
    return bytes(t.view(torch.int16).numpy().tobytes())


@ray.remote(num_cpus=0)
class Rank:
    def __init__(self) -> None:
        p2pcoll_ray.register()

    def allreduce(self, rank: int, data: np.ndarray) -> bytes:
        import torch

        col.init_collective_group(SIZE, rank, backend="p2pcoll", group_name="bf16")
        x = torch.from_numpy(np.array(data)).view(torch.bfloat16)  # a writable copy
        col.allreduce(x, group_name="bf16")
        col.destroy_collective_group("bf16")
        return bytes(x.view(torch.int16).numpy().tobytes())


def through_group() -> list[bytes]:
    async def run() -> list[Any]:
        groups = await memory_groups(SIZE)
        try:
            xs = inputs()
            return list(await asyncio.gather(*(
                g.allreduce(xs[g.rank], strategy=ORDER) for g in groups)))
        finally:
            await asyncio.gather(*(g.close() for g in groups))

    results = asyncio.run(run())
    assert all(isinstance(r, torch.Tensor) and r.dtype == torch.bfloat16 for r in results)
    return [bits(r) for r in results]


def through_blocking() -> list[bytes]:
    groups = join_pair(SIZE, strategies={"allreduce": ORDER})
    try:
        xs = inputs()
        on_ranks([partial(g.allreduce, xs[g.rank], out=xs[g.rank]) for g in groups])
        return [bits(x) for x in xs]  # in place, as asked
    finally:
        on_ranks([g.close for g in groups])


def through_torch() -> tuple[list[bytes], list[bytes]]:
    """(p2pcoll backend's bits, Gloo's bits) per rank."""
    ours, gloo = [], []
    for rank, (code, text) in enumerate(world("bf16", SIZE)):
        assert code == 0, f"rank {rank}:\n{text[-3000:]}"
        lines = dict(line.split()[1:] for line in text.splitlines() if line.startswith("BITS"))
        ours.append(bytes.fromhex(lines["p2pcoll"]))
        gloo.append(bytes.fromhex(lines["gloo"]))
    return ours, gloo


def through_ray() -> list[bytes]:
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # actors can't import tests
    ray.init(num_cpus=SIZE, include_dashboard=False, log_to_driver=False, runtime_env={
        "env_vars": {"P2PCOLL_ALLREDUCE": ORDER, "OMP_NUM_THREADS": "1"}})
    try:
        p2pcoll_ray.register()
        actors = [Rank.remote() for _ in range(SIZE)]
        xs = inputs()
        return list(ray.get([a.allreduce.remote(r, xs[r].view(torch.int16).numpy())
                             for r, a in enumerate(actors)], timeout=180))
    finally:
        ray.shutdown()


@pytest.mark.timeout(600)
def test_a_bfloat16_sum_has_the_same_bits_through_every_front_end() -> None:
    xs = inputs()
    once = bits(sum(x.float() for x in xs).to(torch.bfloat16))  # rounded once

    torch_ours, gloo = through_torch()
    assert len(set(gloo)) == 1, "Gloo's ranks disagree"
    assert gloo[0] != once, "these inputs do not tell the two rules apart"
    results = {"Group": through_group(), "blocking": through_blocking(),
               "torch backend": torch_ours, "Ray": through_ray()}
    for front_end, per_rank in results.items():
        for rank, got in enumerate(per_rank):
            assert got == gloo[0], f"{front_end}, rank {rank}: not Gloo's bits"
