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
    out = []
    try:
        for p in procs:
            text, _ = p.communicate(timeout=timeout)
            out.append((p.returncode, text))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


@pytest.mark.parametrize("size", [2, 3])
def test_every_collective_matches_gloo(size: int) -> None:
    # World of `size` and, at size 3, the subgroup [0, 1]: all ops, dtypes, async_op,
    # futures, send/recv.
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


def test_train_ddp_example_matches_gloo(tmp_path: Path) -> None:
    # examples/train_ddp.py under torchrun with each backend and under `p2pcoll launch`:
    # the same final parameters (the example itself checks they are identical on all ranks).
    example = str(Path(__file__).resolve().parents[1] / "examples" / "train_ddp.py")
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    runs = {
        "gloo": [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                 "--master-port", str(free_port()), example, "--backend", "gloo"],
        "p2pcoll": [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                    "--master-port", str(free_port()), example, "--backend", "p2pcoll"],
        "launch": [sys.executable, "-m", "p2pcoll", "launch", "-n", "2", "--", sys.executable,
                   example, "--backend", "p2pcoll"],
    }
    import torch  # noqa: PLC0415

    saved = {}
    for name, cmd in runs.items():
        path = tmp_path / f"{name}.pt"
        done = subprocess.run([*cmd, "--epochs", "1", "--save", str(path)], env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"{name}:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
        assert "identical on all 2 ranks: True" in done.stdout, done.stdout[-2000:]
        saved[name] = torch.load(path)
    assert torch.allclose(saved["p2pcoll"], saved["gloo"], atol=1e-6, rtol=0)
    # torchrun sets OMP_NUM_THREADS=1 and `p2pcoll launch` does not, so the local maths
    # (not the reductions) may round differently.
    assert torch.allclose(saved["launch"], saved["gloo"], atol=1e-6, rtol=0)
