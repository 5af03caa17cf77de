"""Under torchrun, join() needs nothing more: the ranks meet through torchrun's own store.

torchrun's agent listens on MASTER_PORT with torch's TCPStore, so a p2pcoll rendezvous
cannot be hosted there (0.2 timed out after 60 s on every rank). These run torchrun for
real."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import p2pcoll
from p2pcoll.testing import free_port

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which(
    "torchrun")

pytestmark = [pytest.mark.processes,
              pytest.mark.skipif(TORCHRUN is None, reason="torch (the dev extra) is needed")]



def _torchrun(script: str, n: int = 2, **env: str) -> subprocess.CompletedProcess[str]:
    assert TORCHRUN is not None
    full = {k: v for k, v in os.environ.items() if not k.startswith("P2PCOLL_")}
    full.update(env)
    return subprocess.run(
        [TORCHRUN, "--nproc-per-node", str(n), "--master-addr", "127.0.0.1",
         "--master-port", str(free_port()), script],
        capture_output=True, text=True, timeout=120, env=full, cwd=ROOT, check=False)


def test_the_demo_runs_under_torchrun() -> None:
    done = _torchrun("examples/allreduce_demo.py")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "every check passed on all 2 ranks" in done.stdout


TWO_GROUPS = """
    import asyncio, os, numpy as np, p2pcoll
    async def main():
        for n in range(2):  # a second group of the same run, right after the first
            async with p2pcoll.join() as g:
                assert g.settings.rendezvous.startswith("torch://"), g.settings.rendezvous
                total = await g.allreduce(np.full(2, g.rank + 1.0))
                # One write each: the ranks share the pipe (and may run unbuffered).
                os.write(1, f"GROUP {n} {g.rank} {g.world_size} {total.tolist()}\\n".encode())
    asyncio.run(main())
"""


def test_groups_after_groups_under_torchrun(tmp_path: Path) -> None:
    script = tmp_path / "two_groups.py"
    script.write_text(textwrap.dedent(TWO_GROUPS))
    done = _torchrun(str(script), n=3)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = sorted(re.findall(r"GROUP \d \d 3 \[6\.0, 6\.0\]", done.stdout))
    assert lines == sorted(f"GROUP {n} {r} 3 [6.0, 6.0]" for n in range(2) for r in range(3))


def test_an_explicit_rendezvous_wins_under_torchrun(tmp_path: Path) -> None:
    script = tmp_path / "explicit.py"
    script.write_text(textwrap.dedent(TWO_GROUPS).replace(
        'startswith("torch://")', 'startswith("tcp://")'))
    done = _torchrun(str(script), P2PCOLL_RENDEZVOUS=f"tcp://127.0.0.1:{free_port()}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("GROUP") == 4


NO_TORCH = """
    import asyncio, sys
    sys.modules["torch"] = None  # as if torch were not installed
    import p2pcoll
    async def main():
        try:
            await p2pcoll.join(timeout=10)
        except p2pcoll.RendezvousError as exc:
            print("ERROR", exc)
    asyncio.run(main())
"""


def test_torchrun_without_torch_says_what_to_set() -> None:
    with socket.socket() as store:  # something holds MASTER_PORT, as torchrun's agent does
        store.bind(("127.0.0.1", 0))
        store.listen()
        port = store.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if not k.startswith("P2PCOLL_")}
        env.update(TORCHELASTIC_RUN_ID="abc", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   RANK="1", WORLD_SIZE="2")
        done = subprocess.run([sys.executable, "-c", textwrap.dedent(NO_TORCH)], env=env,
                              capture_output=True, text=True, timeout=60, check=False)
    assert done.stdout.startswith("ERROR"), done.stdout + done.stderr
    assert "torch is not importable" in done.stdout
    assert "P2PCOLL_RENDEZVOUS=tcp://127.0.0.1:PORT" in done.stdout


def test_settings_under_torchrun() -> None:
    env = {"TORCHELASTIC_RUN_ID": "job7", "TORCHELASTIC_RESTART_COUNT": "2",
           "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "RANK": "1", "WORLD_SIZE": "4"}
    s = p2pcoll.Settings.resolve(env)
    assert (s.rendezvous, s.torchrun, s.rank, s.world_size) == (
        "torch://10.0.0.1:29500", "job7/2", 1, 4)
    explicit = p2pcoll.Settings.resolve({**env, "P2PCOLL_RENDEZVOUS": "tcp://10.0.0.2:1234"})
    assert explicit.rendezvous == "tcp://10.0.0.2:1234"
    plain = p2pcoll.Settings.resolve({k: v for k, v in env.items()
                                      if not k.startswith("TORCHELASTIC")})
    assert plain.rendezvous == "tcp://10.0.0.1:29500"
