"""The job key: only its holders join, get a message accepted, or read the traffic.

Every attacker here is a real process of its own (no key, a key of its own, the job's
public key with another secret), against real peers over real sockets.
"""

from __future__ import annotations

import asyncio
import os
import socket
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq

import p2pcoll
from p2pcoll.rendezvous.server import hosted_at
from p2pcoll.security import Gate, JobKey, write_key_file
from p2pcoll.testing import free_port
from p2pcoll.wire import WIRE_VERSION

ROOT = Path(__file__).resolve().parents[1]



@pytest.fixture
def key_file(tmp_path: Path) -> Path:
    path = tmp_path / "job.key"
    write_key_file(path)
    return path


def _python(code: str, env: dict[str, str] | None = None, timeout: float = 60,
            args: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter (an attacker process), with ``args`` as
    ``sys.argv[1:]``."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("P2PCOLL_")}
    full.update(env or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], env=full,
                          capture_output=True, text=True, timeout=timeout, check=False)


# --- the key file --------------------------------------------------------------------------


def test_keygen_writes_a_0600_file_and_never_overwrites(tmp_path: Path) -> None:
    path = tmp_path / "job.key"
    done = subprocess.run([sys.executable, "-m", "p2pcoll", "keygen", str(path)],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    key = JobKey.load(path)
    assert zmq.curve_public(key.secret) == key.public
    assert key.secret.decode() not in repr(key)
    before = path.read_bytes()
    again = subprocess.run([sys.executable, "-m", "p2pcoll", "keygen", str(path)],
                           capture_output=True, text=True, check=False)
    assert again.returncode == 2 and "never overwritten" in again.stderr
    assert path.read_bytes() == before


def test_bad_key_files_are_settings_errors(tmp_path: Path, key_file: Path) -> None:
    with pytest.raises(p2pcoll.SettingsError, match="P2PCOLL_KEY_FILE.*cannot read"):
        p2pcoll.Settings.resolve({"P2PCOLL_KEY_FILE": str(tmp_path / "missing")})
    os.chmod(key_file, 0o644)
    with pytest.raises(p2pcoll.SettingsError, match="every user of the host"):
        p2pcoll.join(key_file=key_file)
    os.chmod(key_file, 0o640)  # group access (a Kubernetes Secret with fsGroup) is fine
    assert p2pcoll.Settings.resolve({}, key_file=key_file).key is not None
    public_only = tmp_path / "public.key"
    public_only.write_text(f'curve\n    public-key = "{JobKey.generate().public.decode()}"\n')
    public_only.chmod(0o600)
    with pytest.raises(p2pcoll.SettingsError, match="no secret-key"):
        p2pcoll.Settings.resolve({}, key_file=public_only)
    a, b = JobKey.generate(), JobKey.generate()
    mixed = tmp_path / "mixed.key"
    mixed.write_text(f'curve\n    public-key = "{a.public.decode()}"\n'
                     f'    secret-key = "{b.secret.decode()}"\n')
    mixed.chmod(0o600)
    with pytest.raises(p2pcoll.SettingsError, match="does not belong"):
        p2pcoll.Settings.resolve({}, key_file=mixed)


# --- nobody without the key gets in ----------------------------------------------------------

ROGUE_TIMEOUT = 20  # the outsider's join timeout

ROGUE_JOIN = """
    import asyncio, sys, time, numpy as np, p2pcoll
    async def main():
        start = time.monotonic()
        try:
            g = await p2pcoll.join(sys.argv[1] if len(sys.argv) > 1 else None, world_size=4,
                                   timeout=%d)
        except p2pcoll.RendezvousError as exc:
            print("REFUSED", exc)
            print("TOOK", time.monotonic() - start)  # the join's, not the interpreter's
            return
        print("JOINED rank", g.rank, g.session.membership.group_id, flush=True)
        await g.allreduce(np.full(4, 1e6, np.float32))
        await g.close()
    asyncio.run(main())
""" % ROGUE_TIMEOUT


@pytest.mark.parametrize("rogue", ["no key", "its own key"])
async def test_a_rogue_cannot_join_and_poison_the_result(key_file: Path, tmp_path: Path,
                                                         rogue: str) -> None:
    """The probe: ranks 0-2 are there, rank 3 is late, an outsider joins with rank=None."""
    url = f"tcp://127.0.0.1:{free_port()}"
    env = {"P2PCOLL_RENDEZVOUS": url}
    if rogue == "its own key":
        own = tmp_path / "rogue.key"
        write_key_file(own)
        env["P2PCOLL_KEY_FILE"] = str(own)

    async def member(rank: int) -> np.ndarray:
        # The members wait for rank 3 while the outsider's interpreter starts and is
        # refused: under load that can take most of _python's 60 s.
        async with p2pcoll.join(url, world_size=4, rank=rank, key_file=key_file,
                                timeout=90) as g:
            return await g.allreduce(np.ones(4, np.float32))

    members = [asyncio.create_task(member(r)) for r in range(3)]
    port = int(url.rpartition(":")[2])
    while (server := hosted_at(port)) is None or server.stats()["peers"] < 3:  # 0-2 are there
        assert not any(m.done() for m in members), members
        await asyncio.sleep(0.01)
    attacker = await asyncio.to_thread(_python, ROGUE_JOIN, env)
    late = asyncio.create_task(member(3))
    results = await asyncio.gather(*members, late)
    assert "REFUSED" in attacker.stdout and "JOINED" not in attacker.stdout, attacker
    assert "handshake" in attacker.stdout
    refused_in = float(attacker.stdout.rpartition("TOOK")[2])
    assert refused_in < ROGUE_TIMEOUT / 2, refused_in  # a clear error, not the join timeout
    for r in results:
        np.testing.assert_array_equal(r, np.full(4, 4.0, np.float32))


SNOOP = """
    import msgpack, sys, time, zmq
    mode, url, public = sys.argv[1], sys.argv[2], sys.argv[3].encode()
    s = zmq.Context.instance().socket(zmq.DEALER)
    if mode == "job public key, own secret":
        pub, sec = zmq.curve_keypair()
        s.curve_serverkey, s.curve_publickey, s.curve_secretkey = public, pub, sec
    s.connect(url)
    for request in ({"v": %d, "op": "join", "job": "", "rank": None, "world_size": None,
                     "endpoints": ["tcp://127.0.0.1:1"], "host": "x", "pid": 1,
                     "heartbeat": 5.0},
                    {"v": %d, "op": "waiting", "job": ""}):
        try:  # never blocks: a refused connection leaves no pipe to queue on
            s.send(msgpack.packb(request), zmq.NOBLOCK)
        except zmq.Again:
            pass
    got = b""
    deadline = time.time() + 2
    while time.time() < deadline:
        if s.poll(100):
            got += b"".join(s.recv_multipart())
    print("GOT", len(got), got.hex())
""" % (WIRE_VERSION, WIRE_VERSION)


@pytest.mark.parametrize("mode", ["plain", "job public key, own secret"])
async def test_the_rendezvous_tells_a_rogue_nothing(key_file: Path, mode: str) -> None:
    """Not the group id, not the endpoints, not even a status: the handshake never completes
    (plain), or the ZAP gate refuses the key (one that knows the job's public key). Asked
    while the group forms (a fixed-size group's host closes the rendezvous once formed)."""
    url = f"tcp://127.0.0.1:{free_port()}"
    key = JobKey.load(key_file)

    async def member(rank: int) -> str:
        async with p2pcoll.join(url, world_size=2, rank=rank, key_file=key_file) as g:
            await g.barrier()
            return g.session.membership.group_id

    host = asyncio.create_task(member(0))
    try:
        await asyncio.sleep(0.5)  # rank 0 hosts the rendezvous and waits for rank 1
        refused = Gate.refusals(zmq.asyncio.Context.instance(), key)
        out = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-c", textwrap.dedent(SNOOP), mode, url,
                             key.public.decode()],
            capture_output=True, text=True, timeout=30, check=False)
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith("GOT 0 "), out.stdout
        if mode != "plain":
            assert Gate.refusals(zmq.asyncio.Context.instance(), key) > refused
        gids = await asyncio.gather(host, member(1))
    finally:
        host.cancel()
        await asyncio.gather(host, return_exceptions=True)
    assert gids[0] == gids[1]


STRAY_SENDER = """
    import sys, time, zmq
    endpoint, identity, header = sys.argv[1], sys.argv[2].encode(), bytes.fromhex(sys.argv[3])
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.IDENTITY, identity)
    if len(sys.argv) > 4:
        pub, sec = zmq.curve_keypair()
        s.curve_serverkey, s.curve_publickey, s.curve_secretkey = sys.argv[4].encode(), pub, sec
    s.connect(endpoint)
    for _ in range(200):  # never blocks: a refused connection leaves no pipe to queue on
        try:
            s.send_multipart([header, b"\\x00" * 4096], zmq.NOBLOCK)
        except zmq.Again:
            time.sleep(0.005)
    time.sleep(1.0)
    s.close(linger=0)
    print("SENT")
"""


async def test_no_message_from_outside_is_accepted(key_file: Path) -> None:
    """An outsider that knows a live member's exact link identity and a peer's endpoint
    connects straight to the mesh and sends well-formed data messages: none arrives."""
    url = f"tcp://127.0.0.1:{free_port()}"
    key = JobKey.load(key_file)
    rank_1_link: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

    async def member(rank: int) -> np.ndarray:
        async with p2pcoll.join(url, world_size=2, rank=rank, key_file=key_file,
                                transport="tcp") as g:
            await g.barrier()
            if rank == 1:
                rank_1_link.set_result(g.session.transport.identity)
            if rank == 0:
                header = msgpack.packb({"v": WIRE_VERSION, "k": "data",
                                        "g": g.session.membership.group_id, "src": 1,
                                        "seq": g.session.seq})
                before = g.stats()
                for extra in ([], [key.public.decode()]):
                    out = await asyncio.to_thread(
                        subprocess.run, [sys.executable, "-c", textwrap.dedent(STRAY_SENDER),
                                         g.endpoint, (await rank_1_link).decode(),
                                         header.hex(), *extra],
                        capture_output=True, text=True, timeout=30, check=False)
                    assert "SENT" in out.stdout, out.stderr
                after = g.stats()
                # Not even dropped: nothing got past the handshake to be read. (Rank 1's
                # next barrier message may have come meanwhile; it has no payload.)
                assert after["bytes_received"] == before["bytes_received"]
                assert after["messages_dropped"] == before["messages_dropped"]
            await g.barrier()
            return await g.allreduce(np.full(3, rank + 1.0))

    # Both to the end, and rank 0's failure (the checks) first, not rank 1's PeerLost.
    results = await asyncio.gather(member(0), member(1), return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
        np.testing.assert_array_equal(r, np.full(3, 3.0))


# --- a clear error for a key that does not fit ---------------------------------------------

KEYED_JOIN = """
    import asyncio, sys, time, p2pcoll
    async def main():
        start = time.monotonic()
        try:
            await p2pcoll.join(sys.argv[1], world_size=2, rank=1, timeout=30)
        except p2pcoll.RendezvousError as exc:
            print("ERROR", exc)
            print("TOOK", time.monotonic() - start)  # the join's, not the interpreter's
    asyncio.run(main())
"""


@pytest.mark.parametrize("case", ["a different key", "no key", "the host has none"])
async def test_a_key_that_does_not_fit_is_a_clear_rendezvous_error(
        key_file: Path, tmp_path: Path, case: str) -> None:
    url = f"tcp://127.0.0.1:{free_port()}"
    env: dict[str, str] = {}
    if case == "a different key":
        other = tmp_path / "other.key"
        write_key_file(other)
        env["P2PCOLL_KEY_FILE"] = str(other)
    elif case == "the host has none":
        env["P2PCOLL_KEY_FILE"] = str(key_file)
    host_key = None if case == "the host has none" else key_file
    async def hosting() -> None:  # (cancelled once the other is done: it outlives it)
        await p2pcoll.join(url, world_size=2, rank=0, key_file=host_key, timeout=120)

    host = asyncio.create_task(hosting())
    port = int(url.rpartition(":")[2])
    while hosted_at(port) is None and not host.done():  # its rendezvous is up
        await asyncio.sleep(0.01)
    done = await asyncio.to_thread(_python, KEYED_JOIN, env, args=(url,))
    assert not host.done(), host  # the host was there all along
    host.cancel()
    await asyncio.gather(host, return_exceptions=True)
    assert done.stdout.startswith("ERROR"), (done.stdout, done.stderr)
    assert "handshake with the rendezvous" in done.stdout
    assert ("has no job key" in done.stdout) == (case == "no key")
    took = float(done.stdout.rpartition("TOOK")[2])
    assert took < 15, took  # well before its 30 s join timeout


async def test_something_else_listening_is_a_clear_error() -> None:
    """A server of another protocol at the rendezvous address (torchrun's store, say)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    port = server.getsockname()[1]
    stop = threading.Event()

    def serve() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            conn.sendall(b"HTTP/1.0 400 Bad Request\r\n\r\n")
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    start = time.monotonic()
    try:
        with pytest.raises(p2pcoll.RendezvousError, match="not a p2pcoll rendezvous") as info:
            await p2pcoll.join(f"tcp://127.0.0.1:{port}", world_size=2, rank=1, timeout=30)
    finally:
        stop.set()
        thread.join()
        server.close()
    assert time.monotonic() - start < 30 / 2  # well before its join timeout
    assert info.value.permanent  # trying again cannot help


# --- what goes over the wire -----------------------------------------------------------------

MARKER = b"P2PCOLL-PLAINTEXT-MARKER-0123456789"


def _capture_loopback(stop: threading.Event, out: list[bytes]) -> None:
    raw = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))
    raw.bind(("lo", 0))
    raw.settimeout(0.05)
    try:
        while not stop.is_set():
            try:
                out.append(raw.recv(1 << 16))
            except TimeoutError:
                continue
    finally:
        raw.close()


async def _sniffed_broadcast(key_file: Path | None) -> bytes:
    """Every loopback packet during a two-peer tcp broadcast of MARKER-filled data."""
    url = f"tcp://127.0.0.1:{free_port()}"
    payload = np.frombuffer(MARKER * 2000, np.uint8)
    packets: list[bytes] = []
    stop = threading.Event()
    sniffer = threading.Thread(target=_capture_loopback, args=(stop, packets), daemon=True)
    sniffer.start()
    await asyncio.sleep(0.2)

    async def member(rank: int) -> np.ndarray:
        async with p2pcoll.join(url, world_size=2, rank=rank, key_file=key_file,
                                transport="tcp") as g:
            got = await g.broadcast(payload if rank == 0 else None, root=0)
            await g.barrier()
            return got

    try:
        results = await asyncio.gather(member(0), member(1))
    finally:
        await asyncio.sleep(0.2)
        stop.set()
        sniffer.join()
    for r in results:
        np.testing.assert_array_equal(r, payload)
    return b"".join(packets)


def _may_capture_loopback() -> bool:
    """Whether this process may read loopback packets (Linux and CAP_NET_RAW: root)."""
    if not hasattr(socket, "AF_PACKET"):
        return False
    try:
        socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003)).close()
    except PermissionError:
        return False
    return True


# CI runs as root: there the check runs (and fails if it cannot capture) rather than skip.
@pytest.mark.skipif(not _may_capture_loopback() and os.environ.get("CI") != "true",
                    reason="capturing loopback packets needs Linux and root (CAP_NET_RAW)")
async def test_a_secured_stream_carries_no_plaintext(key_file: Path) -> None:
    plain = await _sniffed_broadcast(None)
    assert MARKER in plain  # the capture sees the payload when it is not encrypted
    secured = await _sniffed_broadcast(key_file)
    assert len(secured) > 2000 * len(MARKER)  # the data did go over the wire...
    assert MARKER not in secured  # ...encrypted
    assert MARKER[:16] not in secured


# --- the launcher ----------------------------------------------------------------------------

SHOW_KEY = """
    import os, stat
    path = os.environ.get("P2PCOLL_KEY_FILE")
    if path is None:
        print("NOKEY")
    else:
        print("KEY", path, oct(stat.S_IMODE(os.stat(path).st_mode)),
              oct(stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode)))
"""


@pytest.mark.processes
def test_launch_is_secure_by_default_and_removes_its_key() -> None:
    env = {k: v for k, v in os.environ.items() if k != "P2PCOLL_KEY_FILE"}
    done = subprocess.run([sys.executable, "-m", "p2pcoll", "launch", "-n", "2", "--",
                           sys.executable, "-c", textwrap.dedent(SHOW_KEY)],
                          env=env, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    lines = [line.split()[1:] for line in done.stdout.splitlines()]
    assert len(lines) == 2 and all(w[0] == "KEY" for w in lines), done.stdout
    assert lines[0][1] == lines[1][1]  # one key for the job
    assert lines[0][2:] == ["0o600", "0o700"]
    assert not os.path.exists(lines[0][1])  # removed when the launcher exited
    insecure = subprocess.run([sys.executable, "-m", "p2pcoll", "launch", "-n", "2",
                               "--insecure", "--", sys.executable, "-c",
                               textwrap.dedent(SHOW_KEY)],
                              env=env, capture_output=True, text=True, timeout=60, check=False)
    assert insecure.stdout.split().count("NOKEY") == 2, insecure.stdout


@pytest.mark.processes
def test_launched_ranks_form_a_secured_group() -> None:
    done = subprocess.run([sys.executable, "-m", "p2pcoll", "launch", "-n", "3", "--",
                           sys.executable, "-c", textwrap.dedent("""
        import asyncio, numpy as np, p2pcoll
        async def main():
            async with p2pcoll.join() as g:
                assert g.settings.key is not None
                r = await g.allreduce(np.ones(8))
                print("SUM", r[0], g.session.transport.sockets.secure)
        asyncio.run(main())
    """)], capture_output=True, text=True, timeout=90, check=False, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("SUM 3.0 True") == 3, done.stdout
