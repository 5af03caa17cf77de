"""torch's own backend conformance tests, run against "p2pcoll" (tests/torch_suite.py).

The selection is the collectives, DDP on CPU and point to point at WORLD_SIZE=2. Every test
there that torch does not skip for a plugin backend must pass; the skips must all be torch's
own decisions (tests written for CUDA, for a named backend, or for more ranks), never one
that p2pcoll caused.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).with_name("torch_suite.py")
SELECTION = ("all_reduce", "broadcast", "all_gather", "barrier", "reduce_scatter", "gather",
             "scatter", "DistributedDataParallelCPU", "send_recv", "all_to_all")
# Why torch skips a test for a CPU plugin backend at two ranks: none of these is p2pcoll's.
TORCH_SKIPS = re.compile(
    r"requires backend p2pcoll to be one of|CUDA|Nccl|NCCL|small world size|"
    r"Only gloo backend|Only Gloo backend|Only MPI supports|pytorch/issues/\d+")
PASSED_AT_LEAST = 41  # 34 on 0.5.0, which also had 7 errors


@pytest.mark.timeout(1200)
def test_torchs_own_backend_tests_pass_on_p2pcoll(tmp_path: Path) -> None:
    argv = [sys.executable, str(SCRIPT), "--backend", "p2pcoll"]
    for pattern in SELECTION:
        argv += ["-k", pattern]
    env = {**os.environ, "TORCH_SHOW_CPP_STACKTRACES": "0"}
    run = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=1100, check=False)
    out = run.stdout + run.stderr
    summary = re.search(r"torch suite on p2pcoll: (\d+) passed, (\d+) failed, (\d+) skipped, "
                        r"(\d+) errors", out)
    assert summary is not None, out[-5000:]
    passed, failed, skipped, errors = map(int, summary.groups())
    not_ok = re.findall(r"^NOT OK (\S+)", out, re.M)
    assert (failed, errors) == (0, 0), f"{not_ok}\n{out[-8000:]}"
    assert run.returncode == 0, out[-5000:]
    assert passed >= PASSED_AT_LEAST, out[-5000:]
    ours = [line for line in re.findall(r"^SKIP (.*)$", out, re.M)
            if not TORCH_SKIPS.search(line)]
    assert not ours, f"skipped for a reason that is not torch's own: {ours}"
    print(f"\ntorch's suite on p2pcoll: {passed} passed, {skipped} skipped by torch")
