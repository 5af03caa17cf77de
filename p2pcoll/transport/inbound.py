"""The one inbound path of every transport: validate, count, dispatch, drop.

Whatever carried a message (a ZeroMQ link, a lane, the in-memory network), once the
transport knows which member's link it came on, the same steps follow, here:

1. **Validate** it (:func:`p2pcoll.wire.validate`): a message with no header frame, or one
   that fails, is dropped; so is one of a kind this path does not carry (``unexpected``:
   what comes back on a link is answers only, see :meth:`~.base.Transport.post`).
2. **Dispatch** by kind: a kind the transport *keeps* (a lane marker) goes to its handler
   and no further, and what the handler returns goes back to the caller; a kind the
   transport *watches* (a hello naming shared memory) goes to its handler and then on.
3. **Resolve** the payload pieces (the frames, or pieces in a peer's shared-memory ring).
4. **Count** a data message (``messages_received``, ``bytes_received``) and call the
   ``delivered`` hook.
5. **Hand it on** (``on_message``).

Anything that raises on the way drops the message and counts it (:class:`~.base.Drops`):
by its ``reason`` for a :class:`~p2pcoll.errors.ProtocolError`, as ``error`` for anything
else (a bug of ours, which must not stop the reader). Nothing is raised to the caller.

The transport keeps its ``on_message``, ``delivered``, ``counters`` and ``drops``
attributes (instrumentation sets ``delivered`` on the transport at any time); the inbound
path reads them at each message (:class:`Host`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Protocol

from ..errors import ProtocolError
from ..wire import Header, Limits, validate
from .base import Counters, Drops, MessageHandler, MessageHook, Piece

Resolve = Callable[[Header, Sequence[Piece]], list[Piece]]


class Host(Protocol):
    """What the inbound path reads from its transport, at each message."""

    on_message: MessageHandler
    delivered: MessageHook | None
    counters: Counters
    drops: Drops


class Inbound:
    """A transport's inbound path (see the module docstring).

    Args:
        host: the transport (its handler, hook, counters and drops).
        limits: what messages must agree with (this peer's group, rank, size, cap); None
            until the group has formed (see :attr:`limits`).
        keep: handlers of the kinds the transport consumes itself; what one returns is
            returned by :meth:`accept`.
        watch: handlers of the kinds the transport looks at before they are handed on.
            Neither may name ``data``.
        resolve: the payload pieces of a valid message (None: its frames).
        kinds: the kinds this path carries (None: every kind); a message of another kind
            is dropped as ``unexpected``.
    """

    def __init__(
        self,
        host: Host,
        limits: Limits | None = None,
        *,
        keep: Mapping[str, Callable[[Header], bool | None]] | None = None,
        watch: Mapping[str, Callable[[Header], None]] | None = None,
        resolve: Resolve | None = None,
        kinds: Collection[str] | None = None,
    ) -> None:
        self.host = host
        self.limits = limits
        self.keep = dict(keep or {})
        self.watch = dict(watch or {})
        if "data" in self.keep or "data" in self.watch:
            raise ValueError("data messages always go through: keep and watch other kinds")
        self.resolve = resolve
        self.kinds = None if kinds is None else frozenset(kinds)

    def accept(self, source: int, head: bytes | memoryview | None,
               frames: Sequence[Piece] = (), sizes: list[int] | None = None) -> bool | None:
        """Take one message that came on the link of member ``source`` (-1: no member's).

        Args:
            source: the rank whose link it came on (what ``validate`` checks the header's
                source against); -1 for a link that is no member's.
            head: the header frame; None if the message had none.
            frames: the payload frames.
            sizes: each frame's byte length, if the caller knows them (None: asked).

        Returns:
            What the handler of a kept kind returned; else None (handed on or dropped).
        """
        host = self.host
        try:
            if head is None:
                raise ProtocolError("message has no header frame")
            if self.limits is None:
                raise ProtocolError("message before this peer joined a group",
                                    reason="stranger")
            if sizes is None:
                sizes = list(map(len, frames))
            header = validate(source, head, sizes, self.limits)
            kind = header.kind
            if self.kinds is not None and kind not in self.kinds:
                raise ProtocolError(f"a {kind!r} message where only {sorted(self.kinds)} "
                                    f"may come", reason="unexpected")
            if kind != "data":  # (data is never kept or watched: one compare on the hot path)
                kept = self.keep.get(kind)
                if kept is not None:
                    return kept(header)
                watched = self.watch.get(kind)
                if watched is not None:
                    watched(header)
            resolve = self.resolve
            payload = list(frames) if resolve is None else resolve(header, frames)
            if kind == "data":
                nbytes = sum(header.nbytes)
                counters = host.counters
                counters.messages_received += 1
                counters.bytes_received += nbytes
                if host.delivered is not None:
                    host.delivered(source, header, nbytes)
        except ProtocolError as exc:
            host.drops.drop(source, exc)
            return None
        except Exception as exc:
            host.drops.drop(source, exc, bug=True)
            return None
        try:
            host.on_message(header, payload)
        except ProtocolError as exc:
            host.drops.drop(source, exc)
        except Exception as exc:
            host.drops.drop(source, exc, bug=True)
        return None


__all__ = ["Host", "Inbound", "Resolve"]
