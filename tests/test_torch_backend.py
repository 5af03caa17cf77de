"""The torch.distributed backend "p2pcoll", over real processes on loopback.

Each test starts one world of ``tests/torch_worker.py`` processes, which run many checks
each (every collective x op x dtype against Gloo on the same inputs, in one world), so the
whole file forms only a handful of worlds.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import finish, stop

from p2pcoll.testing import free_port

pytest.importorskip("torch")

WORKER = Path(__file__).with_name("torch_worker.py")


def world(mode: str, size: int, timeout: float = 90) -> list[tuple[int, str]]:
    """Run ``size`` ranks of the worker in ``mode``; (exit code, output) per rank."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": str(size), "PYTHONWARNINGS": "ignore"}
    env.pop("TORCH_DEVICE_BACKEND_AUTOLOAD", None)
    procs = [subprocess.Popen([sys.executable, str(WORKER), mode], env={**env, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(size)]
    return finish(procs, timeout)


@pytest.mark.parametrize("size", [2, 3, 4])
def test_every_collective_matches_gloo(size: int) -> None:
    # World of `size` and, above 2, the subgroup [0, 1]: all ops, dtypes, async_op,
    # futures, send/recv; and Gloo's bits for random floats (its order of summing).
    for rank, (code, text) in enumerate(world("compare", size)):
        ok = code == 0 and text.splitlines()[-1].startswith("OK ")
        assert ok, f"rank {rank}:\n{text[-3000:]}"


def test_default_backend_through_the_entry_point() -> None:
    # init_process_group("p2pcoll") without importing p2pcoll; unsupported ops and dtypes
    # raise errors naming them; a new_group subgroup of ranks [2, 0].
    for rank, (code, text) in enumerate(world("default", 3)):
        ok = code == 0 and text.splitlines()[-1].startswith("OK ")
        assert ok, f"rank {rank}:\n{text[-3000:]}"


def test_killed_rank_raises_in_wait() -> None:
    results = world("kill", 3)
    for rank, (code, text) in enumerate(results[:-1]):
        assert code == 0 and "RAISED PeerLost" in text and "rank 2" in text, (
            f"rank {rank}:\n{text[-3000:]}")
    assert results[-1][0] == 3  # the rank that died


@pytest.mark.timeout(900)
def test_train_ddp_example_matches_gloo(tmp_path: Path) -> None:
    # examples/train_ddp.py at 4 ranks with each backend: DDP under torchrun and under
    # `p2pcoll launch`, FSDP2 (all_gather_into_tensor, reduce_scatter_tensor with AVG), DDP
    # with the fp16 hook (sums rounded to float16 at every add) and with the PowerSGD hook
    # (a nested collective waited on inside a future's callback). At 4 ranks the sums have
    # four terms, so only Gloo's order of adding them (gloo_ring, the backend's default)
    # gives Gloo's bits; the example itself checks the ranks agree.
    example = str(Path(__file__).resolve().parents[1] / "examples" / "train_ddp.py")
    # torchrun sets OMP_NUM_THREADS=1 where it is unset, `p2pcoll launch` does not: the
    # same here, so that the local maths (not the reductions) round alike.
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    env.pop("P2PCOLL_ALLREDUCE", None)
    env.pop("P2PCOLL_REDUCE_SCATTER", None)

    def torchrun(backend: str, *extra: str) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
                "--master-port", str(free_port()), example, "--backend", backend, *extra]

    runs = {
        "gloo": torchrun("gloo"),
        "p2pcoll": torchrun("p2pcoll"),
        "launch": [sys.executable, "-m", "p2pcoll", "launch", "-n", "4", "--", sys.executable,
                   example, "--backend", "p2pcoll"],
        "fsdp-gloo": torchrun("gloo", "--fsdp"),
        "fsdp-p2pcoll": torchrun("p2pcoll", "--fsdp"),
        "fp16-gloo": torchrun("gloo", "--hook", "fp16"),
        "fp16-p2pcoll": torchrun("p2pcoll", "--hook", "fp16"),
        "powersgd-gloo": torchrun("gloo", "--hook", "powersgd"),
        "powersgd-p2pcoll": torchrun("p2pcoll", "--hook", "powersgd"),
    }
    import torch

    saved = {}
    names = list(runs)
    for wave in (names[:3], names[3:6], names[6:]):  # a few worlds at once: they mostly
        procs = {name: subprocess.Popen([*runs[name], "--epochs", "1", "--save",  # start up
                                         str(tmp_path / f"{name}.pt")], env=env,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True)
                 for name in wave}
        try:
            for name, proc in procs.items():
                out, err = proc.communicate(timeout=240)
                assert proc.returncode == 0, f"{name}:\n{out[-2000:]}\n{err[-2000:]}"
                assert "identical on all 4 ranks: True" in out, f"{name}:\n{out[-2000:]}"
                saved[name] = torch.load(tmp_path / f"{name}.pt")
        finally:
            for proc in procs.values():
                stop(proc)
    for kind in ("", "fsdp-", "fp16-", "powersgd-"):
        assert torch.equal(saved[f"{kind}p2pcoll"], saved[f"{kind}gloo"]), kind
    assert torch.equal(saved["launch"], saved["gloo"])


def test_import_p2pcoll_torch_first_registers_the_backend_quietly() -> None:
    """A program whose first torch import is ``import p2pcoll.torch``: torch runs the
    backend's entry point while p2pcoll's torch package is half imported (0.6.0 failed with
    "Failed to load the backend extension: p2pcoll")."""
    import subprocess
    import sys

    code = ("import p2pcoll.torch, torch.distributed as dist; "
            "print(dist.Backend.P2PCOLL)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=False)
    assert (run.returncode, run.stdout.strip()) == (0, "p2pcoll"), run.stderr
    assert "could not register" not in run.stderr, run.stderr
