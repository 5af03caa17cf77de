"""A peer's side of a relay: the registration of a peer behind one, and the local entrances
of a peer that reaches others through one.

:class:`Attachment` keeps one outbound control connection to the relay (see
:mod:`.protocol`). For each ``OPEN`` the relay sends, it opens a new outbound connection
to the relay, says ``accept`` on it, and splices it to this peer's own mesh socket at a
local endpoint (an ipc socket file, or ``tcp://127.0.0.1:PORT``: nothing listens on the
host's network). The ZMTP session then runs between the other peer's socket and this
peer's, end to end; nothing here reads it.

The relay is lost when the control connection closes or the relay's ``PING`` has not come
for the heartbeat: ``lost`` is called once with why (no other peer can reach this one any
more), and the attachment stops. Its forwards already open stay until their connections
close.

Both run on the process's relay loop (:mod:`.thread`): a peer's liveness through a relay
does not wait on its own event loop.

:class:`Entrance` is the other end: a Unix socket of this peer's (an ipc endpoint, nothing
on the network) that its mesh connects a link or probe to, as to any peer. Each connection
to it opens one to the relay, says ``connect`` with the target and the group's tag, and
once the relay answers ``OK`` the two are spliced; a refusal closes the local connection
(libzmq connects again a moment later, as to a peer not yet listening).

Between two peers behind relays, the entrance *dials* instead (``dial_from``: this peer's
own target name): it asks the relay from a port it bound, the attachment at the other end
answers from one of its own, and both try a direct connection (:mod:`.punch`); what they
get is spliced as the relay's connection would have been. A failed attempt falls back to
the relay's forward on the same connections, and the entrance connects through the relay
from then on (logged once). Both report each connection's path (``seen``): ``direct``,
``relayed`` (after a failed attempt) or ``plain`` (not tried: see
:func:`.protocol.punchable`), and +1 when it opens, -1 when it closes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import socket
from collections.abc import Callable, Coroutine
from typing import Any

from . import punch, thread
from .pipe import Half
from .protocol import (
    ID_BYTES, NOBODY, OK, OPEN, PING, PUNCH, PUNCH_BYTES, accept_preamble, answer_preamble,
    connect_preamble, dial_preamble, register2_preamble, register_preamble,
)

log = logging.getLogger("p2pcoll.relay")

__all__ = ["Attachment", "Entrance"]

ANSWER_S = 10.0  # a dial's or answer's wait for each word of the relay (it bounds its own)
Seen = Callable[[str, str, int], None]  # (sender's target, path, +1 or -1)


class Attachment:
    """This peer's registration as ``target`` at the relay ``host:port`` (see the module
    docstring).

    Args:
        host, port: the relay.
        target, tag: this peer's target name, and its group's tag (``names.tag_of``).
        local: this peer's own mesh endpoint to splice forwards to (``ipc://PATH`` or
            ``tcp://127.0.0.1:PORT``).
        heartbeat_s: the relay is lost after this long without a word from it.
        lost: called once with why, when the relay is lost (not after :meth:`aclose`), on
            the loop that called :meth:`start`.
        count: called with the size of each chunk forwarded (both ways).
        seen: called on the relay loop with the dialling member's target name (from the
            relay: :data:`~.protocol.NOBODY` if it gave none), the path (``direct``,
            ``relayed`` after a failed attempt, ``plain`` without one) and +1 when a dial's
            connection opens, -1 when it closes.
        dial_s: a dial is answered with attempts for this long at most (the relay says
            how long; a member's mesh gives up on a connection that stays silent for its
            heartbeat timeout).
    """

    def __init__(self, host: str, port: int, target: str, tag: str, local: str,
                 heartbeat_s: float, lost: Callable[[str], None],
                 count: Callable[[int], None] = lambda n: None,
                 seen: Seen = lambda sender, path, n: None,
                 dial_s: float = punch.MAX_PUNCH_S) -> None:
        self.host, self.port = host, port
        self.target, self.tag = target, tag
        self.local = local
        self.heartbeat_s = heartbeat_s
        self.lost = lost
        self.count = count
        self.seen = seen
        self.dial_s = dial_s
        self.forwards = 0
        self._writer: asyncio.StreamWriter | None = None
        self._task: asyncio.Task[None] | None = None
        self._halves: set[Half] = set()
        self._opening: set[asyncio.Task[None]] = set()  # forwards being opened
        self._closing = False
        self._caller: asyncio.AbstractEventLoop | None = None

    @property
    def where(self) -> str:
        return f"{self.host}:{self.port}"

    async def start(self, timeout: float) -> None:
        """Register at the relay and start answering it.

        Raises:
            OSError: the relay could not be reached, or did not register this peer
                within ``timeout`` seconds (naming the relay).
        """
        self._caller = asyncio.get_running_loop()
        await thread.run(self._start(timeout))

    async def _start(self, timeout: float) -> None:
        writer: asyncio.StreamWriter | None = None
        try:
            async with asyncio.timeout(timeout):
                try:
                    reader, writer = await asyncio.open_connection(self.host, self.port)
                    writer.write(register2_preamble(self.target, self.tag))
                    answer = await reader.readexactly(1)
                except (ConnectionError, asyncio.IncompleteReadError):
                    # closed without a word: a relay of protocol version 1 (p2pcoll 0.18
                    # and older), which cannot ask for dials: registered as version 1
                    if writer is not None:
                        writer.close()
                    reader, writer = await asyncio.open_connection(self.host, self.port)
                    writer.write(register_preamble(self.target, self.tag))
                    answer = await reader.readexactly(1)
        except (OSError, TimeoutError, asyncio.IncompleteReadError) as exc:
            if writer is not None:
                writer.close()
            raise OSError(f"cannot register at the relay {self.where}: "
                          f"{exc or type(exc).__name__}") from None
        if answer != OK:
            writer.close()
            raise OSError(f"the relay at {self.where} refused this peer's registration "
                          f"(is it a p2pcoll relay?)")
        self._writer = writer
        self._task = asyncio.create_task(self._listen(reader))

    async def _listen(self, reader: asyncio.StreamReader) -> None:
        why = ""
        try:
            while True:
                try:
                    kind = await asyncio.wait_for(reader.readexactly(1), self.heartbeat_s)
                except TimeoutError:
                    why = f"the relay at {self.where} was silent for {self.heartbeat_s:g}s"
                    return
                if kind == OPEN:
                    conn = await reader.readexactly(ID_BYTES)
                    self._start_task(self._forward(conn))
                elif kind == PUNCH:
                    body = await reader.readexactly(PUNCH_BYTES)
                    sender = body[ID_BYTES:].decode("ascii", "replace")
                    self._start_task(self._answer(body[:ID_BYTES], sender))
                elif kind != PING:
                    why = f"the relay at {self.where} sent {kind!r}, which it never sends"
                    return
        except (OSError, asyncio.IncompleteReadError):
            why = f"the connection to the relay at {self.where} closed"
        finally:
            if self._writer is not None:
                self._writer.close()
            if why and not self._closing and self._caller is not None:
                log.warning("relay target %s...: %s: the peers reaching this one through it "
                            "cannot any more", self.target[:8], why)
                with contextlib.suppress(RuntimeError):  # its loop has closed meanwhile
                    self._caller.call_soon_threadsafe(self.lost, why)

    def _start_task(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._opening.add(task)
        task.add_done_callback(self._opening.discard)

    async def _forward(self, conn: bytes) -> None:
        """Open the accept connection for forward ``conn`` and splice it to the local
        endpoint; a failure ends this forward only (the other peer's socket connects
        again)."""
        await self._splice(accept_preamble(conn))

    async def _answer(self, conn: bytes, sender: str) -> None:
        """Answer the dial ``conn`` from a bound port: splice the direct connection, or
        the relay's, to the local endpoint."""
        try:
            sock, path = await punch.ask(self.host, self.port,
                                         lambda port: answer_preamble(conn, port), ANSWER_S,
                                         self.dial_s)
        except OSError as exc:
            log.debug("relay dial not answered: %s", exc)
            return
        await self._splice(b"", sock, path, sender)

    async def _splice(self, preamble: bytes, sock: socket.socket | None = None,
                      path: str = "plain", sender: str = NOBODY) -> None:
        """Splice to the local endpoint a new connection to the relay that says
        ``preamble``, or ``sock`` (a dial's, on ``path``: see :func:`.punch.answered`)."""
        loop = asyncio.get_running_loop()
        count = None if path == "direct" else self.count
        outer, inner = Half(count), Half(count)
        try:
            if sock is None:
                await loop.create_connection(lambda: outer, self.host, self.port)
                outer.write(preamble)
            else:
                await loop.create_connection(lambda: outer, sock=sock)
            if self.local.startswith("ipc://"):
                await loop.create_unix_connection(lambda: inner,
                                                  self.local.removeprefix("ipc://"))
            else:
                host, _, port = self.local.removeprefix("tcp://").rpartition(":")
                await loop.create_connection(lambda: inner, host, int(port))
        except OSError as exc:
            log.debug("relay forward not opened: %s", exc)
            if sock is not None and outer.transport is None:
                sock.close()
            outer.abort()
            inner.abort()
            return
        if self._closing:
            outer.abort()
            inner.abort()
            return
        self.forwards += 1
        dialled = sock is not None  # a dial's: its path is reported

        def lost() -> None:
            if dialled and outer in self._halves:
                self.seen(sender, path, -1)
            self._halves.difference_update((outer, inner))

        outer.lost = inner.lost = lost
        self._halves.update((outer, inner))
        if dialled:
            self.seen(sender, path, 1)
        outer.join(inner)

    async def aclose(self) -> None:
        """Unregister (close the control connection) and every forward. Idempotent."""
        self._closing = True
        await thread.run(self._aclose())

    async def _aclose(self) -> None:
        if self._writer is not None:
            self._writer.close()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for task in list(self._opening):
            task.cancel()
        for half in list(self._halves):
            half.abort()
        self._halves.clear()


class _Answered(Half):
    """The relay's side of an entrance's connection: its first byte is the relay's answer
    (``OK``: splice with ``inner``; anything else: close both)."""

    def __init__(self, count: Callable[[int], None], inner: Half) -> None:
        super().__init__(count)
        self.inner = inner
        self.answered = False

    def data_received(self, data: bytes) -> None:
        if self.answered:
            super().data_received(data)
            return
        if data[:1] != OK:
            self.abort()
            self.inner.abort()
            return
        self.answered = True
        self._held += data[1:]
        self.join(self.inner)

    def connection_lost(self, exc: Exception | None) -> None:
        # Closed unanswered: the relay refused without a word (``full``, a handshake
        # timeout) or went away. The local connection goes too, or libzmq would wait out
        # its handshake (30 s by default on a link) before it connects again.
        if not self.answered:
            self.inner.abort()
        super().connection_lost(exc)


class Entrance:
    """This peer's local way to ``target`` through the relay ``host:port`` (see the module
    docstring): a Unix socket at ``path``, listening from construction on.

    Args:
        count: called with the size of each chunk that passes through the relay (both
            ways).
        dial_from: this peer's own target name, to dial (try a direct connection first:
            this peer is behind a relay too); None: connect through the relay.
        seen: called on the relay loop with the path (as :class:`Attachment`'s) and +1
            when a dial's connection opens, -1 when it closes.
        dial_s: a dial's attempts last this long at most (see :class:`Attachment`).
    """

    def __init__(self, host: str, port: int, target: str, tag: str, path: str,
                 count: Callable[[int], None], dial_from: str | None = None,
                 seen: Callable[[str, int], None] = lambda path, n: None,
                 dial_s: float = punch.MAX_PUNCH_S) -> None:
        self.host, self.port = host, port
        self.target, self.tag = target, tag
        self.preamble = connect_preamble(target, tag)
        self.path = path
        self.count = count
        self.dial_from = dial_from
        self.seen = seen
        self.dial_s = dial_s
        self._halves: set[Half] = set()
        self._opening: set[asyncio.Task[None]] = set()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(path)
            sock.listen(64)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        self._sock: socket.socket | None = sock
        self._server: asyncio.Server | None = None
        self._serving: concurrent.futures.Future[None] = asyncio.run_coroutine_threadsafe(
            self._serve(sock), thread.loop())

    @property
    def endpoint(self) -> str:
        return "ipc://" + self.path

    async def _serve(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(self._door, sock=sock)

    def _door(self) -> Half:
        inner = Half(self.count)
        opening = self._open(inner) if self.dial_from is None else self._dial(inner)
        task = asyncio.create_task(opening)
        self._opening.add(task)
        task.add_done_callback(self._opening.discard)
        return inner

    async def _open(self, inner: Half) -> None:
        loop = asyncio.get_running_loop()
        outer = _Answered(self.count, inner)
        try:
            await loop.create_connection(lambda: outer, self.host, self.port)
        except OSError as exc:
            log.debug("relay at %s:%d not reached: %s", self.host, self.port, exc)
            inner.abort()
            return
        outer.write(self.preamble)
        pair = (outer, inner)
        outer.lost = inner.lost = lambda: self._halves.difference_update(pair)
        self._halves.update(pair)
        if inner.closed:
            outer.abort()

    async def _dial(self, inner: Half) -> None:
        """Dial the target (see the module docstring) and splice ``inner`` to what that
        gives: the direct connection or the relay's."""
        loop = asyncio.get_running_loop()
        me = self.dial_from
        assert me is not None
        try:
            sock, path = await punch.ask(
                self.host, self.port, lambda port: dial_preamble(self.target, self.tag, port,
                                                                 me), ANSWER_S, self.dial_s)
        except BaseException as exc:  # OSError, or cancelled (closing)
            inner.abort()
            if not isinstance(exc, OSError):
                raise
            # (a relay of protocol version 1 closes a dial as garbage): the mesh connects
            # again, through the relay from now on
            self.dial_from = None
            log.info("relay at %s:%d: dial not answered (%s): connecting through it",
                     self.host, self.port, exc)
            return
        if path != "direct":
            self.dial_from = None  # through the relay from now on
            log.info("relay target %s...: no direct connection (%s: the relay forwards)",
                     self.target[:8], "it failed" if path == "relayed" else "not tried")
        outer = Half(None if path == "direct" else self.count)
        inner.count = outer.count
        try:
            await loop.create_connection(lambda: outer, sock=sock)
        except OSError:
            sock.close()
            inner.abort()
            return
        pair = (outer, inner)

        def lost() -> None:
            if outer in self._halves:
                self.seen(path, -1)
            self._halves.difference_update(pair)

        outer.lost = inner.lost = lost
        self._halves.update(pair)
        self.seen(path, 1)
        outer.join(inner)
        if inner.closed:
            outer.abort()

    async def aclose(self) -> None:
        """Stop listening, remove the socket file, close every connection. Idempotent."""
        await thread.run(self._aclose())

    async def _aclose(self) -> None:
        await asyncio.gather(asyncio.wrap_future(self._serving), return_exceptions=True)
        for task in list(self._opening):
            task.cancel()
        if self._server is not None:
            self._server.close()
        elif self._sock is not None:
            self._sock.close()
        self._server = self._sock = None
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        for half in list(self._halves):
            half.abort()
        self._halves.clear()
