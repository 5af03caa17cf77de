"""Endpoint policies: where a ZeroMQ peer binds, and which address reaches a given peer.

The ZeroMQ mesh (:mod:`.zmq_mesh`) takes one of these; the policies differ in the addresses
a peer binds and advertises:

- ``tcp``: ``tcp://HOST:PORT`` on the interface that routes to the rendezvous host (any host);
- ``ipc``: a Unix socket path (peers on one host);
- ``inproc``: an in-process queue (peers in one process; tests and simulations);
- ``auto`` (the default): binds both tcp and ipc, and reaches each peer over ipc when it runs
  on the same host (same hostname and kernel boot id), over tcp otherwise.

An ipc socket file is named after the process that binds it, ``p2pcoll-<pid>-<16 hex>.sock``
in the temporary directory. A peer that closes removes its file; one that is killed
(SIGKILL, the OOM killer) cannot, so every group that binds ipc endpoints first removes the
files of processes that are gone (:func:`sweep_ipc`, one ``listdir``). A peer that creates
a shared-memory ring does the same for the rings of dead peers (:func:`.shm.sweep`).
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import socket
import stat
import tempfile
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable


class EndpointPolicy(ABC):
    """Chooses the endpoints a peer binds and the address it uses for each peer."""

    name: str

    @abstractmethod
    def bind_addresses(self, host: str) -> list[str]:
        """Addresses to bind; a port ``*`` lets the OS pick."""

    def choose(self, my_host: str, their_host: str, their_endpoints: list[str]) -> str:
        """The endpoint of a peer to connect to (the first one by default)."""
        return their_endpoints[0]

    def cleanup(self, endpoint: str) -> None:
        """Release anything a bound endpoint left behind (socket files, ...)."""
        if endpoint.startswith("ipc://"):
            try:
                os.unlink(endpoint.removeprefix("ipc://"))
            except FileNotFoundError:
                pass


# The name of an ipc socket file; group 1 is the pid of the process that bound it.
IPC_NAME = re.compile(r"p2pcoll-([1-9][0-9]{0,9})-[0-9a-f]{16}\.sock")


def ipc_address() -> str:
    """A fresh ipc endpoint of this process (swept by :func:`sweep_ipc` once it exits)."""
    return _ipc_address()


def _ipc_address() -> str:
    # Unix socket paths are limited to ~107 bytes, so keep this short.
    name = f"p2pcoll-{os.getpid()}-{uuid.uuid4().hex[:16]}.sock"
    return "ipc://" + os.path.join(tempfile.gettempdir(), name)


def owner_gone(pid: int) -> bool:
    """Whether process ``pid`` has exited (no such process, or a zombie not yet reaped).

    Only a definite answer counts: a process of another user (``PermissionError``) is alive,
    and a number that is no pid at all (too large for the kernel) names nothing we made.
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (OSError, OverflowError, ValueError):
        return False
    try:  # a killed process whose parent has not reaped it yet holds nothing any more
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rpartition(b")")[2].split()[:1]
    except OSError:
        return False
    return state == [b"Z"]


def remove_orphans(directory: str, pattern: re.Pattern[str],
                   is_kind: Callable[[int], bool],
                   in_use: Callable[[str], bool] = lambda path: False) -> list[str]:
    """Remove the files p2pcoll made in ``directory`` for processes that have exited.

    A file goes only if its name matches ``pattern`` in full (group 1 is the pid of the
    process that made it), that process is gone (:func:`owner_gone`), the file belongs to
    this user and is of the expected type (``is_kind`` of its ``lstat`` mode, which rules
    out symbolic links), and ``in_use(path)`` is False. Costs one ``listdir``, plus a
    ``kill(pid, 0)`` per name that matches. Never raises; returns the paths removed.
    """
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    uid = os.geteuid()
    removed = []
    for name in names:
        match = pattern.fullmatch(name)
        if match is None or not owner_gone(int(match.group(1))):
            continue
        path = os.path.join(directory, name)
        try:
            info = os.lstat(path)
            if info.st_uid != uid or not is_kind(info.st_mode) or in_use(path):
                continue
            os.unlink(path)
        except OSError:
            continue
        removed.append(path)
    return removed


def _listened_on(path: str) -> bool:
    """Whether some process accepts connections on the Unix socket file ``path``.

    The pid in a file's name is that of its creator's pid namespace: a container that shares
    the temporary directory but not the pid namespace may see it as gone while it serves.
    Only a refused connection proves that nobody listens.
    """
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.setblocking(False)
        try:
            probe.connect(path)
        except ConnectionRefusedError:
            return False
        except OSError:  # a full backlog, a path too long to connect to: leave it be
            return True
    return True


def sweep_ipc(directory: str | None = None) -> list[str]:
    """Remove the ipc socket files of processes that have exited (from ``directory``, by
    default the temporary directory, where :func:`_ipc_address` puts them); returns them."""
    return remove_orphans(directory or tempfile.gettempdir(), IPC_NAME, stat.S_ISSOCK,
                          _listened_on)


def sweep_peer(endpoint: str, shm_dir: str) -> list[str]:
    """Remove the files a peer of this host left behind, if its process has exited (a
    SIGKILLed peer removes nothing itself): the socket file of its ipc ``endpoint`` and
    its files in ``shm_dir`` (rings, lanes, a board: named after its pid, see
    :mod:`.shmfile`); returns them. Nothing of a live process (a stopped peer, one in
    another pid namespace still serving) goes, nor anything of another endpoint kind.
    Costs a ``listdir`` of each directory. Never raises."""
    path = endpoint.removeprefix("ipc://")
    match = IPC_NAME.fullmatch(os.path.basename(path))
    if not endpoint.startswith("ipc://") or match is None:
        return []
    pid = match.group(1)
    return (remove_orphans(os.path.dirname(path) or ".",
                           re.compile(rf"p2pcoll-({pid})-[0-9a-f]{{16}}\.sock"),
                           stat.S_ISSOCK, _listened_on)
            + remove_orphans(shm_dir, re.compile(rf"p2pcoll-({pid})-[0-9a-f]{{16}}"),
                             stat.S_ISREG))


class TcpEndpoints(EndpointPolicy):
    name = "tcp"

    def bind_addresses(self, host: str) -> list[str]:
        return [f"tcp://{host}:*"]


class IpcEndpoints(EndpointPolicy):
    name = "ipc"

    def bind_addresses(self, host: str) -> list[str]:
        sweep_ipc()
        return [_ipc_address()]


class InprocEndpoints(EndpointPolicy):
    name = "inproc"

    def bind_addresses(self, host: str) -> list[str]:
        return [f"{inproc_prefix()}{uuid.uuid4().hex}"]


def inproc_prefix() -> str:
    """The start of this process's inproc endpoints: they name their process, so a peer
    can tell that another's inproc endpoint is out of its reach (another process)."""
    return f"inproc://p2pcoll-{os.getpid()}-"


class AutoEndpoints(EndpointPolicy):
    name = "auto"

    def bind_addresses(self, host: str) -> list[str]:
        sweep_ipc()
        return [f"tcp://{host}:*", _ipc_address()]

    def choose(self, my_host: str, their_host: str, their_endpoints: list[str]) -> str:
        if their_host == my_host:
            for endpoint in their_endpoints:
                if endpoint.startswith("ipc://"):
                    return endpoint
        return their_endpoints[0]


POLICIES: dict[str, type[EndpointPolicy]] = {
    t.name: t for t in (AutoEndpoints, TcpEndpoints, IpcEndpoints, InprocEndpoints)
}


def host_identity(configured: str | None = None) -> str:
    """Names this machine and the file systems ipc needs: peers with equal identities can
    reach each other over ipc (a socket file in the temporary directory) and shared memory
    (a file in /dev/shm); the rendezvous hands every peer the others' identities, and the
    transport (rings, lanes, the board) and auto's cost model follow from them.

    The two directories are part of it because containers of one host may share its
    hostname (``--network host``) and boot id but not its /tmp or /dev/shm; processes in
    network namespaces of one host (``ip netns exec``) do share them, and may use ipc.

    Args:
        configured: the host this peer says it is on (``$P2PCOLL_HOST_ID``, checked by
            :class:`~p2pcoll.settings.Settings`), or None. It goes in front of what is
            detected, so peers that name different hosts never share memory or ipc, and
            peers that name the same one are told apart as they would be without it.
    """
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    places = []
    for path in (tempfile.gettempdir(), "/dev/shm"):
        try:
            st = os.stat(path)
            places.append(f"{st.st_dev}:{st.st_ino}")
        except OSError:
            places.append("-")
    detected = f"{socket.gethostname()}/{boot}/{'/'.join(places)}"
    return detected if configured is None else f"{configured}@{detected}"


# Ports below the kernel's ephemeral range are never handed out by a bind to port 0 nor used
# as the source port of a connection; 10000 keeps clear of the well-known services.
_LOW_PORT = 10000


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default, where the file cannot be read


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port of ``host`` that was free a moment ago, for a rendezvous to be bound later.

    Chosen below the ephemeral range: a port from there (what a bind to port 0 gives) can be
    taken, before the rendezvous host binds it, by any socket of this host that binds port
    0 (a peer's own endpoint, which then accepts the joins and never answers) or by a
    client's connection to it (a TCP self-connection): both left every peer waiting for the
    join timeout.

    Raises:
        OSError: no port of the range could be bound on ``host``.
    """
    top = max(_ephemeral_start(), _LOW_PORT + 1)
    for port in random.sample(range(_LOW_PORT, top), min(200, top - _LOW_PORT)):
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise OSError(f"no free TCP port in {_LOW_PORT}..{top - 1} on {host}")


def endpoint_policy(name: str) -> EndpointPolicy:
    """The policy named ``name`` (one of :data:`POLICIES`); names are checked by Settings."""
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(
            f"unknown transport {name!r}; expected one of {', '.join(POLICIES)}"
        ) from None


# The endpoints :func:`listening` can check.
CHECKABLE = ("tcp://", "ipc://")


def _address(endpoint: str) -> tuple[int, str | tuple[str, int]]:
    """The socket family and address of a :data:`CHECKABLE` endpoint.

    Raises:
        ValueError: ``endpoint`` is not one of :data:`CHECKABLE`.
    """
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
        if not port.isdigit():
            raise ValueError(f"cannot check {endpoint!r}: no port number")
        family = socket.AF_INET6 if host.startswith("[") else socket.AF_INET
        return family, (host.strip("[]"), int(port))
    if endpoint.startswith("ipc://"):
        return socket.AF_UNIX, endpoint.removeprefix("ipc://")
    raise ValueError(f"cannot check {endpoint!r}: expected one of {CHECKABLE}")


async def listening(endpoint: str, timeout: float) -> bool | None:
    """Whether something still listens at a peer's ``endpoint`` (one of :data:`CHECKABLE`):
    a process that is gone has no listening socket (a connection is refused, or the socket
    file is gone), one that is stopped or frozen still has, and its kernel accepts for it.
    None: no answer within ``timeout`` (a cut network, say). The connection is closed at
    once, before any byte.

    Raises:
        ValueError: ``endpoint`` is not one of :data:`CHECKABLE`.
    """
    family, address = _address(endpoint)
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setblocking(False)
        try:
            await asyncio.wait_for(asyncio.get_running_loop().sock_connect(sock, address),
                                   timeout)
        except (ConnectionRefusedError, FileNotFoundError):
            return False
        except (OSError, TimeoutError):
            return None
    return True


async def answers(endpoint: str, timeout: float) -> bool | None:
    """Whether the process at a peer's ``endpoint`` (one of :data:`CHECKABLE`) still runs:
    its ZeroMQ I/O thread greets a new connection within ``timeout`` (ZMTP's signature, whose
    first byte is 0xFF, is the first thing libzmq sends). A process whose event loop is
    only busy (a long compute step, a call that holds the GIL) greets, since libzmq does
    on its own thread; one that is stopped or frozen does not, though its kernel accepts the
    connection. False: nothing listens, or the connection closed without a greeting (the
    process is going); None: accepted, and silent for ``timeout``. Closed by this end
    after the first byte: the peer's ROUTER never counts it (no handshake completes).

    Raises:
        ValueError: ``endpoint`` is not one of :data:`CHECKABLE`.
    """
    family, address = _address(endpoint)
    loop = asyncio.get_running_loop()
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setblocking(False)
        try:
            async with asyncio.timeout(timeout):
                await loop.sock_connect(sock, address)
                first = await loop.sock_recv(sock, 1)
        except (ConnectionRefusedError, FileNotFoundError, ConnectionResetError):
            return False
        except (OSError, TimeoutError):
            return None
    return first == b"\xff" if first else False
