"""Files of dead peers: the ipc socket files and shared-memory rings that a peer killed with
SIGKILL leaves behind are removed by the survivors of its group on the host as they find it
lost (and else by the next group on the host), and nothing of a live process, of another
user, or not named like ours ever is."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import p2pcoll
from p2pcoll.testing import free_port, run_ranks
from p2pcoll.transport import shm, shmfile
from p2pcoll.transport.endpoints import IPC_NAME, owner_gone, remove_orphans, sweep_ipc

NO_PID = 1 << 22  # pids stay below pid_max, which is at most 2**22: no process has this one

pytestmark = pytest.mark.skipif(not shm.available(), reason="needs /dev/shm")


def _hex() -> str:
    return uuid.uuid4().hex[:16]


def _socket_file(path: str, *, listening: bool = False) -> socket.socket | None:
    """Leave a Unix socket file at ``path``: bound and closed (nobody listens, as after a
    crash), or bound and listening (the socket is returned; close it when done)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    if listening:
        sock.listen()
        return sock
    sock.close()
    return None


@pytest.fixture
def live_pid() -> Iterator[int]:
    """The pid of a live process of ours that is no peer (a ``sleep``)."""
    sleeper = subprocess.Popen(["sleep", "120"])
    yield sleeper.pid
    sleeper.kill()
    sleeper.wait()


@pytest.fixture
def sock_dir() -> Iterator[str]:
    """A directory of this test's own, with a path short enough for Unix sockets, so that
    no group forming on the host meanwhile sweeps its files."""
    d = tempfile.mkdtemp(prefix="p2pst-", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def ring_dir() -> Iterator[str]:
    """A directory of this test's own in /dev/shm, for the same reason."""
    d = tempfile.mkdtemp(prefix="p2pst-", dir=shm.SHM_DIR)
    yield d
    shutil.rmtree(d, ignore_errors=True)


# --- the sweep on crafted names -----------------------------------------------------------

def test_owner_gone() -> None:
    assert not owner_gone(os.getpid())
    assert owner_gone(NO_PID)
    assert not owner_gone(1)  # init: alive, and of another user (PermissionError) or ours
    assert not owner_gone(10**12)  # no pid at all (kill() overflows): nothing we made


def test_a_zombie_is_gone() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        # Exited but not reaped: kill(pid, 0) still succeeds, yet the process holds nothing.
        for _ in range(1000):
            with open(f"/proc/{child.pid}/stat", "rb") as f:
                if f.read().rpartition(b")")[2].split()[0] == b"Z":
                    break
            time.sleep(0.01)
        os.kill(child.pid, 0)
        assert owner_gone(child.pid)
    finally:
        child.wait()


def test_ipc_sweep_on_crafted_names(sock_dir: str, live_pid: int) -> None:
    d = sock_dir
    dead = f"p2pcoll-{NO_PID}-{_hex()}.sock"
    alive = f"p2pcoll-{live_pid}-{_hex()}.sock"
    served = f"p2pcoll-{NO_PID}-{_hex()}.sock"  # its creator is in another pid namespace
    _socket_file(os.path.join(d, dead))
    _socket_file(os.path.join(d, alive))
    listener = _socket_file(os.path.join(d, served), listening=True)
    assert listener is not None
    # Socket files whose names are not ours, or malformed.
    others = [
        f"p2pcoll-{NO_PID}-{_hex()}",  # a ring's name
        f"p2pcoll-{NO_PID}-{_hex()}.sock.bak",
        f"p2pcoll-0{NO_PID}-{_hex()}.sock",  # a leading zero: no pid is written so
        f"p2pcoll-0-{_hex()}.sock",
        f"p2pcoll--1-{_hex()}.sock",
        f"p2pcoll-{'9' * 10}-{_hex()}.sock",  # too large for kill(): no pid
        f"p2pcoll-{'9' * 11}-{_hex()}.sock",  # more digits than any pid
        f"p2pcoll-{'9' * 40}-{_hex()}.sock",
        f"p2pcoll-{NO_PID}-{_hex().upper()}.sock",
        f"p2pcoll-{NO_PID}-{_hex()[:15]}.sock",
        f"p2pcoll-{NO_PID}-{_hex()}.sock\n",
        "p2pcoll-\u0663\u0663-0123456789abcdef.sock",  # digits, but not ASCII ones
        f"p2pcoll-{_hex()}.sock",  # the name before pids were in it
        f"other-{NO_PID}-{_hex()}.sock",
    ]
    for name in others:
        _socket_file(os.path.join(d, name))
    # Our name on what is not a socket: a regular file, a symbolic link to a dead socket.
    regular = f"p2pcoll-{NO_PID}-{_hex()}.sock"
    Path(d, regular).touch()
    linked = f"p2pcoll-{NO_PID}-{_hex()}.sock"
    _socket_file(os.path.join(d, "target"))
    os.symlink(os.path.join(d, "target"), os.path.join(d, linked))
    everything = {alive, served, *others, regular, linked, "target"}
    try:
        assert sweep_ipc(d) == [os.path.join(d, dead)]
        assert set(os.listdir(d)) == everything
        assert sweep_ipc(d) == []
    finally:
        listener.close()
    assert sweep_ipc(d) == [os.path.join(d, served)]  # nobody listens on it any more
    assert set(os.listdir(d)) == everything - {served}
    assert sweep_ipc(os.path.join(d, "missing")) == []


def test_ring_sweep_on_crafted_names(ring_dir: str, live_pid: int) -> None:
    d = ring_dir
    dead = [f"p2pcoll-{NO_PID}-{_hex()}" for _ in range(2)]
    alive = f"p2pcoll-{live_pid}-{_hex()}"
    mine = f"p2pcoll-{os.getpid()}-{_hex()}"
    others = [f"p2pcoll-{NO_PID}-{_hex()}.sock", f"p2pcoll-{'9' * 10}-{_hex()}",
              f"p2pcoll-{'9' * 11}-{_hex()}",
              f"p2pcoll-00-{_hex()}", f"p2pcoll-{NO_PID}-{_hex()}x", "p2pcoll-1-zz",
              f"psm_{NO_PID}"]
    for name in (*dead, alive, mine, *others):
        Path(d, name).touch()
    os.mkdir(os.path.join(d, f"p2pcoll-{NO_PID}-{_hex()}"))  # a directory: not a ring
    assert shm.sweep(d) == 2
    kept = set(os.listdir(d))
    assert not kept & set(dead)
    assert {alive, mine, *others} <= kept and len(kept) == len(others) + 3


def test_sweep_leaves_files_of_other_users(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / f"p2pcoll-{NO_PID}-{_hex()}"
    path.touch()
    uid = os.geteuid()
    monkeypatch.setattr(os, "geteuid", lambda: uid + 1)  # as another user sees the file
    assert remove_orphans(str(tmp_path), shm.NAME, stat.S_ISREG) == []
    assert path.exists()
    monkeypatch.undo()
    assert remove_orphans(str(tmp_path), shm.NAME, stat.S_ISREG) == [str(path)]


# --- real peers, killed ---------------------------------------------------------------------

# A peer of a 2-peer group over ipc, shared memory on; its socket and ring files go to the
# directories it is given (so no other group on the host sweeps them before the test looks).
CHILD = """
import asyncio, sys, numpy as np, p2pcoll
from p2pcoll.transport import shmfile
shmfile.SHM_DIR = sys.argv[2]
async def main():
    g = await p2pcoll.join(sys.argv[1], world_size=2, rank=1, timeout=20, transport="ipc")
    await g.allreduce(np.ones(1 << 18, np.float32), timeout=20)
    print("joined", flush=True)
    await g.allreduce(np.ones(1 << 18, np.float32), timeout=60)  # killed while waiting here
asyncio.run(main())
"""


def _files_of(pid: int, sock_dir: str, ring_dir: str) -> list[str]:
    """The ipc socket files and ring files named after process ``pid``."""
    prefix = f"p2pcoll-{pid}-"
    return sorted(
        [os.path.join(sock_dir, n) for n in os.listdir(sock_dir)
         if n.startswith(prefix) and IPC_NAME.fullmatch(n)]
        + [os.path.join(ring_dir, n) for n in os.listdir(ring_dir)
           if n.startswith(prefix) and shm.NAME.fullmatch(n)]
    )


@pytest.mark.processes
@pytest.mark.parametrize("ring_mapped", [False, True], ids=["ring-unmapped", "ring-mapped"])
async def test_files_of_a_killed_peer_go_with_its_survivors(
    ring_mapped: bool, live_pid: int, sock_dir: str, ring_dir: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A peer joins a 2-peer group over ipc with shared memory on and is SIGKILLed in a
    collective. Its socket file stays; so does its ring if the other peer never mapped it
    (shared memory off there), not if it did. The survivor removes what is left as it finds
    the peer lost; files named after a live process stay, there and in the next group."""
    monkeypatch.setattr(tempfile, "tempdir", sock_dir)  # as $TMPDIR would
    monkeypatch.setattr(shmfile, "SHM_DIR", ring_dir)
    url = f"tcp://127.0.0.1:{free_port()}"
    env = {**os.environ, "P2PCOLL_SHM": "1", "TMPDIR": sock_dir}
    monkeypatch.setenv("P2PCOLL_SHM", "1" if ring_mapped else "0")  # for this process
    # Files named after a live process (no peer): the sweeps must leave them.
    fake_sock = os.path.join(sock_dir, f"p2pcoll-{live_pid}-{_hex()}.sock")
    fake_ring = os.path.join(ring_dir, f"p2pcoll-{live_pid}-{_hex()}")
    _socket_file(fake_sock)
    Path(fake_ring).touch()
    with subprocess.Popen([sys.executable, "-c", CHILD, url, ring_dir], env=env,
                          stdout=subprocess.PIPE, text=True) as child:
        try:
            async with p2pcoll.join(url, world_size=2, rank=0, timeout=20,
                                    transport="ipc") as g:
                await g.allreduce(np.ones(1 << 18, np.float32), timeout=20)
                assert child.stdout is not None
                assert await asyncio.to_thread(child.stdout.readline) == "joined\n"
                left = _files_of(child.pid, sock_dir, ring_dir)
                socks = [p for p in left if p.endswith(".sock")]
                # Unmapped, its ring and its lane to rank 0 stay (both in ring_dir, which
                # is shmfile.SHM_DIR in the child); mapped, rank 0 unlinked them.
                assert len(socks) == 1 and len(left) == (1 if ring_mapped else 3), left
                os.kill(child.pid, signal.SIGKILL)  # in its second allreduce
                # (not reaped yet: a zombie holds nothing, and counts as gone)
                while g.state is p2pcoll.GroupState.READY:  # until rank 0 finds it lost
                    await asyncio.sleep(0.02)
                assert g.state is p2pcoll.GroupState.DEGRADED
                assert _files_of(child.pid, sock_dir, ring_dir) == []
                assert os.path.exists(fake_sock) and os.path.exists(fake_ring)
                assert await asyncio.to_thread(child.wait) == -signal.SIGKILL
        finally:
            child.kill()  # (dead already, unless something above failed)
    monkeypatch.setenv("P2PCOLL_SHM", "1")

    async def fn(g: p2pcoll.Group) -> bool:
        # Right after join both sweeps have run: at bind, and when the ring was made.
        return os.path.exists(fake_sock) and os.path.exists(fake_ring)

    assert await run_ranks(2, fn, transport="ipc") == [True, True]
    assert os.listdir(sock_dir) == [os.path.basename(fake_sock)]  # the group's own went too
    assert os.listdir(ring_dir) == [os.path.basename(fake_ring)]
