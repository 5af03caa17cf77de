"""torch's ``torch.backends`` entry point registers "p2pcoll" inside ``import torch`` without
importing p2pcoll's backend, which loads on the first process group that uses it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytestmark = pytest.mark.processes

SCRIPT = """
import sys
import torch
import torch.distributed as dist

loaded = {m for m in sys.modules if m.startswith("p2pcoll")}
light = {"p2pcoll", "p2pcoll.errors", "p2pcoll.lazy", "p2pcoll.integrations",
         "p2pcoll.integrations.torch_autoload"}
assert loaded <= light, sorted(loaded - light)
assert "zmq" not in sys.modules and "msgpack" not in sys.modules
assert dist.Backend.P2PCOLL == "p2pcoll"

dist.init_process_group("p2pcoll", store=dist.HashStore(), rank=0, world_size=1)
assert "p2pcoll.integrations.torch.backend" in sys.modules and "zmq" in sys.modules
t = torch.arange(4, dtype=torch.float32)
dist.all_reduce(t)
assert t.tolist() == [0.0, 1.0, 2.0, 3.0], t
dist.destroy_process_group()
print("OK")
"""


def test_import_torch_loads_no_backend_until_a_group_uses_it() -> None:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    env.pop("TORCH_DEVICE_BACKEND_AUTOLOAD", None)
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "OK", done.stdout + done.stderr
