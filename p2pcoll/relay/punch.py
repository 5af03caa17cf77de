"""A direct connection between two peers behind NAT: TCP simultaneous open, each side
dialling the other from the port it reached the relay from (see :mod:`.protocol`).

A NAT that keeps a connection's source port (Linux MASQUERADE does when it can) maps the
port a peer bound to the address the relay saw. Each side dials the other's mapped address
from that same port: its own SYN opens its NAT for the other's (conntrack takes the other's
SYN as the answer to its own), and when the two SYNs cross, one TCP connection forms (a
simultaneous open: no side listens, no port is forwarded). A NAT that drops an unexpected
SYN lets the first attempt wait in the kernel's SYN retransmits until the other side's SYN
opens the way; one that answers it with a reset refuses the attempt at once, so each side
tries again at every tick of its ``interval_s`` from the relay's word, and the two sides'
intervals differ (5 and 7 ms: at one interval, two sides that missed each other once
would keep missing). An attempt meets the other side's only if the other's SYN comes
while its own is out, within one round trip (the other NAT's reset closes its way
again): on a path of milliseconds the first attempts meet; in a lab of network namespaces
(microseconds) it takes a lottery of a few hundred attempts, a second or two. Every
attempt binds the same port (``SO_REUSEADDR``, beside the relay's connection from it), and
all end at the deadline.

On the connection got, each side sends its nonce and checks the other's (from the relay):
a connection to anything else than the other side is not taken.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from collections.abc import Callable

from .protocol import DIRECT, FAILED, HOLE, HOLE_BYTES, OK, BadPreamble, Hole

log = logging.getLogger("p2pcoll.relay")

__all__ = ["MAX_PUNCH_S", "answered", "ask", "dial", "open_bound"]

MAX_PUNCH_S = 10.0  # a relay's deadline is held to this
ATTEMPT_S = 0.25  # an attempt that neither connects nor is refused: given up after this
MIN_INTERVAL_S = 0.001  # and its interval to at least this
NONCE_S = 2.0  # the nonces' exchange, at most


def _bound(port: int = 0) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setblocking(False)
        sock.bind(("", port))
    except OSError:
        sock.close()
        raise
    return sock


async def open_bound(host: str, port: int, timeout: float) -> socket.socket:
    """A TCP connection to ``host:port`` (IPv4) from a port of its own, bound so that it
    can dial from it again.

    Raises:
        OSError: not connected within ``timeout`` seconds, or refused."""
    loop = asyncio.get_running_loop()
    sock: socket.socket | None = None
    try:
        async with asyncio.timeout(timeout):
            infos = await loop.getaddrinfo(host, port, family=socket.AF_INET,
                                           type=socket.SOCK_STREAM)
            sock = _bound()
            await loop.sock_connect(sock, infos[0][4])
    except BaseException as exc:  # (cancelled too: the socket is closed either way)
        if sock is not None:
            sock.close()
        if not isinstance(exc, OSError | TimeoutError | IndexError):
            raise
        raise OSError(f"{host}:{port} not reached: {exc or type(exc).__name__}") from None
    return sock


async def read_exactly(sock: socket.socket, n: int, timeout: float) -> bytes:
    """``n`` bytes from ``sock``, and not one more.

    Raises:
        OSError: it closed first, or ``timeout`` seconds passed."""
    loop = asyncio.get_running_loop()
    got = bytearray()
    try:
        async with asyncio.timeout(timeout):
            while len(got) < n:
                chunk = await loop.sock_recv(sock, n - len(got))
                if not chunk:
                    raise OSError(f"closed after {len(got)} of {n} bytes")
                got += chunk
    except TimeoutError:
        raise OSError(f"{len(got)} of {n} bytes in {timeout:g}s") from None
    return bytes(got)


async def dial(hole: Hole, port: int, most_s: float = MAX_PUNCH_S) -> socket.socket | None:
    """Dial ``hole``'s address from ``port`` until its deadline, or ``most_s`` if sooner
    (see the module docstring); the connection, once the nonces are exchanged, or None.

    The attempts run on a thread of their own, in blocking calls, so they keep to their
    ticks whatever the relay loop is busy with (its splices). Cancellation: the thread
    stops at its next attempt (at the deadline, at most)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[socket.socket | None] = loop.create_future()
    stop = threading.Event()

    def deliver(sock: socket.socket | None) -> None:
        if done.cancelled():
            if sock is not None:
                sock.close()
        else:
            done.set_result(sock)

    def run() -> None:
        sock = None
        try:
            sock = _dial(hole, port, min(most_s, MAX_PUNCH_S), stop)
        finally:
            try:
                loop.call_soon_threadsafe(deliver, sock)
            except RuntimeError:  # the loop has closed
                if sock is not None:
                    sock.close()

    threading.Thread(target=run, name="p2pcoll-dial", daemon=True).start()
    try:
        return await done
    finally:
        stop.set()


def _dial(hole: Hole, port: int, most_s: float, stop: threading.Event
          ) -> socket.socket | None:
    start = time.monotonic()
    deadline = start + min(hole.deadline_s, most_s)
    interval = max(hole.interval_s, MIN_INTERVAL_S)
    attempts = 0
    why: BaseException | None = None
    while not stop.is_set() and (left := deadline - time.monotonic()) > 0:
        attempts += 1
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("", port))
            # A NAT that drops the SYN leaves the attempt waiting in the kernel's
            # retransmits (the other side's SYN then completes it), but not for long: a
            # SYN lost for another reason would hold up the next attempts.
            sock.settimeout(min(left, ATTEMPT_S))
            sock.connect((hole.host, hole.port))
        except OSError as exc:
            why = exc
            sock.close()
            # again at this side's next tick
            now = time.monotonic()
            tick = start + (int((now - start) / interval) + 1) * interval
            time.sleep(max(0.0, min(tick, deadline) - now))
            continue
        log.debug("dialled %s:%d from port %d: connected in %.3fs, attempt %d", hole.host,
                  hole.port, port, time.monotonic() - start, attempts)
        try:
            sock.settimeout(NONCE_S)
            sock.sendall(hole.mine)
            got = b""
            while len(got) < len(hole.theirs):
                chunk = sock.recv(len(hole.theirs) - len(got))
                if not chunk:
                    break
                got += chunk
            if got == hole.theirs:
                sock.setblocking(False)
                return sock
        except OSError:
            pass
        sock.close()
        return None
    log.debug("dialled %s:%d from port %d for %.3fs, %d attempts: %r", hole.host, hole.port,
              port, time.monotonic() - start, attempts, why)
    return None


async def answered(sock: socket.socket, port: int, timeout: float,
                   most_s: float = MAX_PUNCH_S) -> tuple[socket.socket | None, str]:
    """What the relay answers a dial or an answer on ``sock`` (bound at ``port``), and the
    path: ``OK``, ``(None, "plain")`` (it forwards over ``sock`` without an attempt); a
    hole, the direct connection got by :func:`dial` and ``direct`` (the caller closes
    ``sock``), or ``(None, "relayed")`` once the relay says ``OK`` after the attempt
    failed (it forwards over ``sock``). ``most_s``: this side dials for that long at most.

    Raises:
        OSError: the relay refused, closed, said something else, or said nothing within
            ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    first = await read_exactly(sock, 1, timeout)
    if first == OK:
        return None, "plain"
    if first != HOLE:
        raise OSError(f"the relay answered {first!r}")
    try:
        hole = Hole.unpack(await read_exactly(sock, HOLE_BYTES, timeout))
    except BadPreamble as exc:
        raise OSError(str(exc)) from None
    direct = await dial(hole, port, most_s)
    try:
        await loop.sock_sendall(sock, DIRECT if direct is not None else FAILED)
    except OSError:
        if direct is None:
            raise
    if direct is not None:
        return direct, "direct"
    if await read_exactly(sock, 1, timeout) != OK:
        raise OSError("the relay closed after a failed direct attempt")
    return None, "relayed"


async def ask(host: str, port: int, say: Callable[[int], bytes], timeout: float,
              most_s: float = MAX_PUNCH_S) -> tuple[socket.socket, str]:
    """A dial or an answer, whole: a connection to the relay ``host:port`` from a port of
    its own (:func:`open_bound`), ``say(that port)`` on it, and what comes of it
    (:func:`answered`): the connection to splice and its path, the direct connection
    (``direct``: the relay's is closed) or the relay's (``plain``, ``relayed``).

    Raises:
        OSError: as :func:`open_bound` and :func:`answered` (nothing is left open)."""
    loop = asyncio.get_running_loop()
    sock = await open_bound(host, port, timeout)
    try:
        bound = sock.getsockname()[1]
        await loop.sock_sendall(sock, say(bound))
        direct, path = await answered(sock, bound, timeout, most_s)
    except BaseException:  # OSError, or cancelled (closing)
        sock.close()
        raise
    if direct is None:
        return sock, path
    sock.close()
    return direct, path
