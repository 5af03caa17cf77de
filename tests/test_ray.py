"""examples/ray_actors.py for real: async Ray actors on a local ``ray.init()`` form a group,
train digits and end with identical weights.

Ray (the ``ray`` extra, part of ``dev``) is needed; without it the test is skipped, except
in CI, where it fails. ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` keeps the local Ray instance
on 127.0.0.1 (Ray otherwise serves on the host's primary address even when alone), so the
rendezvous actor 0 offers is loopback too. About 25 s on two cores, most of it Ray starting.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
FOREIGN_PREFIXES = ("P2PCOLL_", "SLURM_", "OMPI_", "PMIX_", "TORCHELASTIC_", "KUBERNETES_")
FOREIGN = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "RAY_ADDRESS")


@pytest.fixture(autouse=True)
def _needs_ray() -> None:
    if importlib.util.find_spec("ray") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("ray is missing: CI installs it with the dev extra (p2pcoll[ray])")
        pytest.skip("ray not installed: pip install 'p2pcoll[ray]'")


@pytest.mark.timeout(180)
def test_ray_actors_train_digits_with_identical_weights() -> None:
    env = {k: v for k, v in os.environ.items()
           if k not in FOREIGN and not k.startswith(FOREIGN_PREFIXES)}
    env.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "examples/ray_actors.py", "--workers", "4", "--epochs", "5"],
        cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True)
    try:
        out = proc.communicate(timeout=150)[0]
    finally:
        if proc.poll() is None:  # Ray's own processes are in the session too
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, out[-4000:]
    assert "rendezvous at tcp://127.0.0.1:" in out, out[-2000:]
    assert re.search(r"all 4 actors hold identical weights \(sha256 [0-9a-f]{16}\)", out), out
    ranks = re.findall(r"rank (\d): 115 rounds", out)
    assert sorted(ranks) == ["0", "1", "2", "3"], out[-2000:]
    final = re.search(r"identical weights .*; test accuracy (\d+\.\d+)%", out)
    assert final is not None and float(final.group(1)) > 90, out[-2000:]
