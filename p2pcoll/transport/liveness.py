"""Liveness: the heartbeat probes of one peer to the peers it watches.

Which peers a peer watches is the departures component's to say (see
:mod:`p2pcoll.departures.overlay`); this module only keeps the sockets. A probe is a
connection that carries ZMTP heartbeats and nothing else (``SocketFactory.mesh_probe``), so
a watched peer that dies is seen at once (its connection closes), one that freezes after the
heartbeat timeout, and one that is merely slow (its queue full) not at all. Each probe has
a monitor, followed by a task that reports the connection going down, and that same task
reads what comes on the probe: only the goodbye of a watched peer that has no link to this
one, which is answered back on the probe (see :meth:`Probes.answer`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from .sockets import LINGER_MS, SocketFactory, monitor

__all__ = ["Probes"]

_NOBLOCK = int(zmq.NOBLOCK)

# (peer, frames) of a message that came on the probe of ``peer``
ByeHandler = Callable[[int, list[zmq.Frame]], None]


class Probes:
    """The probes of one peer, by watched peer.

    Args:
        sockets: makes the probes.
        on_down: called with a watched peer whose probe's connection went down (or, for a
            ``late`` probe, never came up).
        on_bye: called with what a watched peer sent on the probe (its goodbye).
    """

    def __init__(self, sockets: SocketFactory, on_down: Callable[[int], None],
                 on_bye: ByeHandler) -> None:
        self.sockets = sockets
        self.on_down = on_down
        self.on_bye = on_bye
        self._probes: dict[int, tuple[zmq.asyncio.Socket, zmq.asyncio.Socket,
                                      asyncio.Task[None]]] = {}
        self._bye_on: set[int] = set()  # the watched peers whose goodbye came on a probe
        self._closed = False

    def __len__(self) -> int:
        return len(self._probes)

    def __contains__(self, peer: object) -> bool:
        return peer in self._probes

    def open(self, peer: int, endpoint: str, identity: bytes, *, late: bool = False) -> None:
        """Watch ``peer`` at ``endpoint``. A ``late`` probe, opened after the group formed to
        replace a watched peer that has gone, also reports the peer down when it cannot
        connect at all (its port is gone: every peer's was bound before the group formed)."""
        probe = self.sockets.mesh_probe(identity)
        events = zmq.EVENT_DISCONNECTED
        if late:
            events |= zmq.EVENT_CONNECTED | zmq.EVENT_CONNECT_RETRIED
        events_of = monitor(probe, events)
        task = asyncio.create_task(self._watch(peer, probe, events_of))
        self._probes[peer] = (probe, events_of, task)
        probe.connect(endpoint)

    def close(self, peer: int) -> asyncio.Task[None] | None:
        """Close ``peer``'s probe and its monitor, if it has one; returns the task that
        followed it (cancelled). The monitor is stopped while its PAIR socket is still
        open: libzmq sends a final event on stop, and a send to a PAIR whose reader has
        closed blocks forever. Closed here, not by its task: a task cancelled before it ran
        never runs its ``finally``."""
        entry = self._probes.pop(peer, None)
        if entry is None:
            return None
        probe, monitor, task = entry
        probe.disable_monitor()
        task.cancel()
        # a farewell answered on it (the peer said goodbye there) must still go out
        probe.close(linger=LINGER_MS if peer in self._bye_on else 0)
        monitor.close(linger=0)
        return task

    def answer(self, peer: int, frame: bytes) -> bool:
        """Send ``frame`` back on the probe of ``peer`` if ``peer``'s goodbye came on it;
        whether it did. Never waits.

        Raises:
            zmq.ZMQError: the send failed.
        """
        entry = self._probes.get(peer) if peer in self._bye_on else None
        if entry is None:
            return False
        zmq.Socket.shadow(entry[0].underlying).send(frame, _NOBLOCK)
        return True

    def close_all(self) -> list[asyncio.Task[None]]:
        """Close every probe; returns the tasks that followed them, to be awaited."""
        self._closed = True
        tasks = [self.close(peer) for peer in list(self._probes)]
        return [t for t in tasks if t is not None]

    async def _watch(self, peer: int, probe: zmq.asyncio.Socket,
                     monitor: zmq.asyncio.Socket) -> None:
        await asyncio.gather(self._follow(peer, monitor), self._hear(peer, probe))

    async def _hear(self, peer: int, probe: zmq.asyncio.Socket) -> None:
        try:
            while True:
                frames = await probe.recv_multipart(copy=False)
                self._bye_on.add(peer)  # its farewell goes back there (see answer)
                self.on_bye(peer, frames)
        except (asyncio.CancelledError, zmq.ZMQError, OSError):
            pass  # closed (an OSError: its descriptor was closed under the poller)

    async def _follow(self, peer: int, monitor: zmq.asyncio.Socket) -> None:
        connected = False
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())["event"]
                connected = connected or event == zmq.EVENT_CONNECTED
                down = event == zmq.EVENT_DISCONNECTED or (
                    event == zmq.EVENT_CONNECT_RETRIED and not connected)
                if down and not self._closed:
                    self.on_down(peer)
        except (asyncio.CancelledError, zmq.ZMQError, OSError):
            pass
