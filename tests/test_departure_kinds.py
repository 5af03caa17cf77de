"""How a peer went, as the first line of the error its peers raise (issue 35): a real peer
process that is SIGKILLed, SIGSTOPped, whose program raises inside ``with``/``async with``,
or that closes normally, while rank 0 (this process) waits for it in an allreduce.

Run as a script, this module is that peer: ``python test_departure_kinds.py URL API``
joins as rank 1 of 2 (API ``async`` or ``blocking``), runs a barrier, then does what the
next line of its stdin says: ``raise`` (raises ValueError inside the group's ``with``
block) or ``close`` (leaves it normally); until then the test may kill or stop it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

import p2pcoll
from p2pcoll.rendezvous import RendezvousServer
from p2pcoll.types import OpKey

pytestmark = pytest.mark.processes

HEARTBEAT_S = 1.0  # both peers': a stopped peer is declared lost after this
WAIT_S = 60  # the longest any step may take before the test counts it as hung


def child(url: str, api: str) -> None:
    if api == "blocking":
        from p2pcoll import blocking

        with blocking.join(url, world_size=2, rank=1, timeout=WAIT_S,
                           heartbeat_timeout=HEARTBEAT_S) as bg:
            bg.barrier()
            act(sys.stdin.readline().strip())
        return

    async def main() -> None:
        async with p2pcoll.join(url, world_size=2, rank=1, timeout=WAIT_S,
                                heartbeat_timeout=HEARTBEAT_S) as g:
            await g.barrier()
            act(await asyncio.to_thread(sys.stdin.readline))

    asyncio.run(main())


def act(command: str) -> None:
    """Leave the group's block as ``command`` says: by an error (``raise``), or normally."""
    if command.strip() == "raise":
        raise ValueError("boom")


async def rank_1_goes(how: str, api: str = "async") -> p2pcoll.PeerLost:
    """Rank 1 (a child process) goes ``how`` while rank 0 waits for it in an allreduce;
    returns rank 0's error."""
    server = RendezvousServer("tcp://127.0.0.1:0")
    url = server.bind()
    proc = subprocess.Popen(
        [sys.executable, __file__, url, api], stdin=subprocess.PIPE, text=True,
        env={k: v for k, v in os.environ.items() if not k.startswith("P2PCOLL_")})
    try:
        async with p2pcoll.join(url, world_size=2, rank=0, timeout=WAIT_S,
                                heartbeat_timeout=HEARTBEAT_S,
                                collective_timeout=WAIT_S) as g:
            await g.barrier()
            running = asyncio.create_task(g.allreduce(np.ones(4)))
            while not g.session.matcher.waiting_on(OpKey(1)):
                await asyncio.sleep(0.005)
            assert proc.stdin is not None
            if how == "killed":
                proc.send_signal(signal.SIGKILL)
            elif how == "stopped":
                proc.send_signal(signal.SIGSTOP)
            else:
                proc.stdin.write(f"{how}\n")
                proc.stdin.flush()
            with pytest.raises(p2pcoll.PeerLost) as caught:
                await asyncio.wait_for(running, WAIT_S)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
        proc.wait()
        if proc.stdin is not None:
            proc.stdin.close()
        await server.aclose()
    return caught.value


def first_line(err: BaseException) -> str:
    return str(err).splitlines()[0]


async def test_a_killed_peer_reads_as_killed() -> None:
    err = await rank_1_goes("killed")
    line = first_line(err)
    assert line.startswith("rank 1 (") and ") ended without a word: its process was killed " \
        "or crashed hard" in line, line
    assert err.how == "killed" and err.rank == 1


async def test_a_stopped_peer_reads_as_unresponsive() -> None:
    err = await rank_1_goes("stopped")
    line = first_line(err)
    assert line.startswith("rank 1 (") and ") stopped answering: its process is there but " \
        "silent past the heartbeat timeout" in line and "P2PCOLL_HEARTBEAT_TIMEOUT" in line, line
    assert err.how == "unresponsive" and err.rank == 1


@pytest.mark.parametrize("api", ["async", "blocking"])
async def test_a_peer_whose_program_raised_reads_as_crashed(api: str) -> None:
    err = await rank_1_goes("raise", api)
    assert first_line(err).startswith(
        "rank 1 crashed (ValueError: boom) and closed the group"), first_line(err)
    assert err.how == "crashed" and err.rank == 1


async def test_a_peer_that_closed_reads_as_closed() -> None:
    err = await rank_1_goes("close")
    assert first_line(err) == "rank 1 left the group: it closed it normally", first_line(err)
    assert err.how == "closed" and err.rank == 1


if __name__ == "__main__":
    child(sys.argv[1], sys.argv[2])
