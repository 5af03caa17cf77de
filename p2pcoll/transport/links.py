"""Link identities, and the order of a peer's messages across the links it opens in turn.

A peer sends to another over a link (a ZeroMQ DEALER) that it opens on demand and may
close again to stay within its link budget (``P2PCOLL_MAX_LINKS``, see :mod:`.route`); the
next send opens a new one. Each link of a group has its own routing identity::

    b"<rank>@<link secret>@<nonce>@<generation>"

The secret (:attr:`~p2pcoll.types.Membership.secret`) is known only to the members, so an
outsider cannot pass for one even if it knows the group id. The nonce is the sending
peer's own (never sent anywhere but in its links' handshakes), so even someone who has the
secret cannot name a live member's link. The generation counts the links a peer has opened
to one other: 0 for the first, one more each time it opens the link again.

The links of one sender arrive as separate connections, and what the new one carries may
be read before the tail of the old one. :class:`Successions` keeps the sender's order: the
last message on a link that is closed for the budget is an ``end`` message, and the
messages of generation ``g + 1`` wait until the ``end`` of generation ``g`` has been read.
The first connection that speaks for a rank fixes its nonce for the group; any other nonce
claiming the rank is an ``impostor`` and is dropped, as is a message on a link that has
already ended. Everything here is bookkeeping on identities: no sockets.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

from ..errors import ProtocolError

__all__ = ["MAX_HELD", "MAX_HELD_BYTES", "Successions", "link_identity", "parse_identity"]

Message = TypeVar("Message")

MAX_HELD = 1 << 16
"""Messages of later links held for one sender, at most (beyond: dropped and counted)."""
MAX_HELD_BYTES = 256 << 20
"""Their bytes, at most. A later link's messages are held only while the tail of the one
before is read, which the receiver reads as fast (one ROUTER reads its connections in
turn): about a link's queue of them (its high-water mark)."""


def link_identity(rank: int, secret: str, nonce: str, generation: int = 0) -> bytes:
    """The routing identity of one of ``rank``'s links (see the module docstring). Never
    log one: it holds the group's secret.

    >>> link_identity(3, "s3cret", "ab12", 2)
    b'3@s3cret@ab12@2'
    """
    return b"%d@%s@%s@%d" % (rank, secret.encode(), nonce.encode(), generation)


def parse_identity(identity: bytes) -> tuple[bytes, bytes, int] | None:
    """``(b"<rank>@<secret>", nonce, generation)`` of a link identity, or None if it has
    not that form. The secret may itself hold ``@``: the nonce and the generation are the
    last two fields.

    >>> parse_identity(b"3@s3cret@ab12@2")
    (b'3@s3cret', b'ab12', 2)
    >>> parse_identity(b"3@s3cret@ab12") is None, parse_identity(b"3@s@n@-1") is None
    (True, True)
    """
    parts = identity.rsplit(b"@", 2)
    if len(parts) != 3 or not parts[1] or not parts[2].isdigit() or len(parts[2]) > 18:
        return None
    return parts[0], parts[1], int(parts[2])


class _Sender(Generic[Message]):
    """What this peer knows of one member's links: its nonce, the generation being read,
    and the messages of later generations waiting for their turn."""

    __slots__ = ("held", "held_bytes", "nonce", "reading")

    def __init__(self, nonce: bytes) -> None:
        self.nonce = nonce
        self.reading = 0  # the generation whose messages are handed on now
        self.held: dict[int, tuple[bytes, deque[Message]]] = {}  # generation -> its messages
        self.held_bytes = 0


class Successions(Generic[Message]):
    """The order of each member's messages across the links it opened one after another.

    A message comes with the identity of the link it arrived on. :meth:`arrive` says what
    to do with one whose identity is not yet known as the current link of a rank: its rank
    (it is the current link now: the caller remembers the identity and hands the message
    on), or None (it was held for its turn, or dropped and counted through ``drop``).
    :meth:`end` is called with the ``end`` message of a rank's current link: the next
    generation becomes current and its held messages are handed to ``release`` in order.

    Args:
        claims: ``b"<rank>@<secret>"`` -> rank, for every other member.
        release: ``release(rank, identity, messages)``: a later link's turn has come (its
            identity is now the rank's current link); hand these on in order.
        drop: ``drop(source, error)``: count and log a dropped message (source: a rank, or
            a short name of a link that is no member's).
        size: the bytes of a message (for the bound on what is held).
    """

    def __init__(
        self,
        claims: dict[bytes, int],
        release: Callable[[int, bytes, list[Message]], None],
        drop: Callable[[object, ProtocolError], None],
        size: Callable[[Message], int] = lambda message: 0,
    ) -> None:
        self.claims = claims
        self.release = release
        self.drop = drop
        self.size = size
        self._senders: dict[int, _Sender[Message]] = {}
        self.current: dict[int, bytes] = {}  # rank -> the identity of its link read now
        self.later_links = 0  # links heard of members' later generations (not their first)

    def rank_of(self, identity: bytes) -> int | None:
        """The member an identity claims (whatever its nonce and generation), if any."""
        parsed = parse_identity(identity)
        return None if parsed is None else self.claims.get(parsed[0])

    def nonce(self, rank: int) -> bytes | None:
        """The nonce of ``rank``'s links (None: none of them has spoken yet)."""
        sender = self._senders.get(rank)
        return None if sender is None else sender.nonce

    def arrive(self, identity: bytes, message: Message) -> int | None:
        """A message on a link that is not the current link of any rank (see the class)."""
        parsed = parse_identity(identity)
        rank = None if parsed is None else self.claims.get(parsed[0])
        if parsed is None or rank is None:
            self.drop(identity[:8], ProtocolError(
                f"link identity {identity[:8]!r} is not a member of this group",
                reason="stranger"))
            return None
        _, nonce, generation = parsed
        sender = self._senders.get(rank)
        if sender is None:
            sender = self._senders[rank] = _Sender(nonce)
        elif nonce != sender.nonce:
            self.drop(f"a link claiming rank {rank}", ProtocolError(
                f"a second connection claims rank {rank}'s link (only the first is read)",
                reason="impostor"))
            return None
        if generation < sender.reading or (generation == sender.reading
                                           and rank in self.current):
            self.drop(rank, ProtocolError(
                f"rank {rank} sent on its link {generation} after that link ended"))
            return None
        if generation == sender.reading:
            self.current[rank] = identity
            self.later_links += generation > 0
            return rank
        held = sender.held.get(generation)
        if held is None:
            held = sender.held[generation] = (identity, deque())
            self.later_links += 1
        elif held[0] != identity:  # cannot be: the generation is in the identity
            raise AssertionError("one generation, two identities")
        nbytes = self.size(message)
        if (sum(len(q) for _, q in sender.held.values()) >= MAX_HELD
                or sender.held_bytes + nbytes > MAX_HELD_BYTES):
            self.drop(rank, ProtocolError(
                f"rank {rank} sent more than {MAX_HELD} messages or {MAX_HELD_BYTES >> 20} "
                f"MiB on later links before its link {sender.reading} ended",
                reason="oversize"))
            return None
        held[1].append(message)
        sender.held_bytes += nbytes
        return None

    def end(self, rank: int) -> None:
        """Rank's current link has ended (its ``end`` message was read): the next generation
        becomes current; what it sent meanwhile goes to ``release``."""
        sender = self._senders.get(rank)
        if sender is None or self.current.pop(rank, None) is None:
            return
        sender.reading += 1
        held = sender.held.pop(sender.reading, None)
        if held is not None:
            identity, messages = held
            sender.held_bytes -= sum(self.size(m) for m in messages)
            self.current[rank] = identity
            self.release(rank, identity, list(messages))

    def forget(self, rank: int) -> None:
        """Rank has gone: what it left held is let go."""
        sender = self._senders.get(rank)
        if sender is not None:
            sender.held.clear()
            sender.held_bytes = 0
