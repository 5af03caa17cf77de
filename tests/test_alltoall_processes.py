"""All-to-all on the board between real processes, through the windows and read where the
parts are (cross-memory attach); a peer killed mid-exchange is named by every survivor."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from typing import Any

import pytest

from conftest import finish
from p2pcoll.testing import free_port
from p2pcoll.transport import cross_memory

pytestmark = pytest.mark.processes

_KILLED = textwrap.dedent("""
    import asyncio, os, sys, time
    import numpy as np
    import p2pcoll

    async def main():
        async with p2pcoll.join() as g:
            p, r = g.world_size, g.rank
            # In the windows (0.8 MB for others), then read where they are (16.8 MB).
            for n in (100_000,) * 4 + (2_100_000,) * 6:
                parts = [np.full(n, 10 * r + j, np.float32) for j in range(p)]
                got = await g.alltoall(parts)
                assert all(np.all(got[i] == 10 * i + r) for i in range(p))
            assert g.stats()["collectives_by_strategy"]["alltoall"] == {"shm": 10}
            print("DIRECT", g.session.runner._alltoall._read_by_all, flush=True)
            if r == 1:
                os.kill(os.getpid(), 9)  # SIGKILL: no goodbye, mid-way through the loop
            started = time.monotonic()
            try:
                await g.alltoall(parts, timeout=60)
            except p2pcoll.PeerLost as exc:
                print("LOST", exc.rank, round(time.monotonic() - started, 2), flush=True)
                sys.exit(0)
            print("NO ERROR", flush=True)
            sys.exit(3)

    asyncio.run(main())
""")


def test_a_peer_killed_mid_exchange_is_peer_lost_naming_it_on_every_survivor(
        tmp_path: Any) -> None:
    script = tmp_path / "killed.py"
    script.write_text(_KILLED)
    port = free_port()
    procs = [subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env={**os.environ, "P2PCOLL_HEARTBEAT_TIMEOUT": "2", "RANK": str(rank),
                        "WORLD_SIZE": "3", "P2PCOLL_RENDEZVOUS": f"tcp://127.0.0.1:{port}"})
        for rank in range(3)]
    outcomes = finish(procs, timeout=120)
    assert outcomes[1][0] == -signal.SIGKILL, outcomes[1]
    for rank in (0, 2):
        code, out = outcomes[rank]
        assert code == 0 and "LOST 1 " in out, (rank, code, out)
        assert "DIRECT True" in out or not cross_memory.available(), out
        # Named within a few heartbeats (2 s), not at the 60 s deadline (a loaded host
        # stretches the heartbeat's own timing).
        assert float(out.split("LOST 1 ")[1].split()[0]) < 20, out
