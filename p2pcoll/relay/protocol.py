"""The relay's protocol, without I/O: what a connection to a relay says first, and the table
of registered targets (the names of targets, tags and relay endpoints are :mod:`.names`'s).

A relay (:mod:`.server`) listens on one TCP port and forwards the bytes of ZeroMQ (ZMTP)
connections between the peers of a group. A peer that cannot accept connections (behind
NAT, a firewall) is a *target*: it registers at the relay over one outbound connection (the
*control* connection) and advertises ``relay://HOST:PORT/TARGET`` instead of its own
address. Every connection to the relay starts with ``P2PR``, the protocol version (1), a
kind, and the kind's fields:

- **register** (``R``, then TARGET and TAG, 32 hex digits each): a target's control
  connection. The relay answers :data:`OK` and from then on sends :data:`OPEN` + a 16-byte
  id for each connection to forward to it, and :data:`PING` every :data:`PING_S` seconds (a
  target that hears nothing for its heartbeat has lost its relay).
- **connect** (``C``, then TARGET and TAG): a member's connection to a target, opened by
  its mesh's local entrance for that target (:mod:`.attach`). TAG is the member's group's
  (:func:`.names.tag_of`, a digest of the group's link secret, which only members have).
- **accept** (``A``, the 16-byte id): the target's answer to an ``OPEN``, a new outbound
  connection that the relay splices to the waiting member's. The relay then answers the
  member :data:`OK`, and from there on forwards bytes both ways and reads none of them: the
  ZMTP session, CurveZMQ included when the job has a key, is end to end between the two
  peers.

A connect for a target that is not registered, or registered with another tag (a member of
another group), is answered :data:`REFUSED`, closed and counted: a relay forwards only to a
connection a member of the group opened to it.

:class:`Preamble` parses what a connection says first, as its bytes come, with a bound on
its length; :class:`Targets` is the table of registered targets. Neither touches a socket,
so both are tested by feeding them bytes.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from typing import Literal

from .names import HEX

__all__ = ["ACCEPT", "CONNECT", "MAGIC", "OK", "OPEN", "PING", "REFUSED", "REGISTER",
           "Accept", "BadPreamble", "Connect", "Preamble", "Refused", "Register", "Targets",
           "accept_preamble", "connect_preamble", "register_preamble"]

MAGIC = b"P2PR\x01"  # the start of a peer's preamble: "P2PR" and the protocol version
REGISTER, CONNECT, ACCEPT = b"R", b"C", b"A"
OK = b"K"  # relay -> target: registered; relay -> member: forwarded from now on
REFUSED = b"N"  # relay -> member: no such target in its group (then closed)
OPEN = b"O"  # relay -> target: open an accept connection for this id (16 bytes follow)
PING = b"P"  # relay -> target: still here
PING_S = 1.0
ID_BYTES = 16
_HEX = re.compile(rb"[0-9a-f]{32}")


def register_preamble(target: str, tag: str) -> bytes:
    return MAGIC + REGISTER + target.encode() + tag.encode()


def connect_preamble(target: str, tag: str) -> bytes:
    return MAGIC + CONNECT + target.encode() + tag.encode()


def accept_preamble(conn: bytes) -> bytes:
    return MAGIC + ACCEPT + conn


class BadPreamble(ValueError):
    """What a connection said first is none of the relay's preambles: it is closed.
    Counted as ``garbage``."""


@dataclass(frozen=True)
class Connect:
    """A member asks to be forwarded to ``target``, as a member of the group ``tag``."""

    target: str
    tag: str


@dataclass(frozen=True)
class Register:
    """A target registers (its control connection)."""

    target: str
    tag: str


@dataclass(frozen=True)
class Accept:
    """A target's connection for the forward ``conn``."""

    conn: bytes


Request = Connect | Register | Accept


class Preamble:
    """What one connection says first, parsed as its bytes come (see the module docstring).

    :meth:`feed` takes the bytes read and returns the request once it is whole (None until
    then); what followed it in the same read is kept in :attr:`rest`.

    Raises (from :meth:`feed`):
        BadPreamble: anything else than a preamble of the relay's protocol.
    """

    def __init__(self) -> None:
        self._buf = b""
        self.rest = b""

    def feed(self, data: bytes) -> Request | None:
        self._buf += data
        buf = self._buf
        head = len(MAGIC) + 1
        if not MAGIC.startswith(buf[:len(MAGIC)]):
            raise BadPreamble(f"{buf[:8]!r}... is not the start of a relay preamble")
        if len(buf) < head:
            return None
        kind, body = buf[len(MAGIC):head], buf[head:]
        if kind in (REGISTER, CONNECT):
            if len(body) < 2 * HEX:
                return None
            target, tag = body[:HEX], body[HEX:2 * HEX]
            if not (_HEX.fullmatch(target) and _HEX.fullmatch(tag)):
                raise BadPreamble("a malformed target or tag")
            self.rest = body[2 * HEX:]
            made = Register if kind == REGISTER else Connect
            return made(target.decode(), tag.decode())
        if kind == ACCEPT:
            if len(body) < ID_BYTES:
                return None
            self.rest = body[ID_BYTES:]
            return Accept(bytes(body[:ID_BYTES]))
        raise BadPreamble(f"unknown relay request {kind!r}")


Refusal = Literal["unknown", "other-job"]


class Refused(Exception):
    """A forward the relay does not make; ``reason`` names the counter."""

    def __init__(self, message: str, reason: Refusal) -> None:
        super().__init__(message)
        self.reason: Refusal = reason


class Targets:
    """The targets registered at a relay: target -> (tag, control). ``control`` is
    whatever the server keeps for the control connection (it is handed back by
    :meth:`route`). A target registered again (its peer reconnected, or joined a new group)
    replaces the old registration, which the caller closes.

    Args:
        most: targets held at once; a registration beyond is refused.
    """

    def __init__(self, most: int) -> None:
        self.most = most
        self._held: dict[str, tuple[str, object]] = {}

    def __len__(self) -> int:
        return len(self._held)

    def register(self, target: str, tag: str, control: object) -> object | None:
        """Hold ``target``; returns the control it replaces, if any.

        Raises:
            Refused: the table is full (reason ``unknown``: nothing will reach it)."""
        old = self._held.get(target)
        if old is None and len(self._held) >= self.most:
            raise Refused(f"{self.most} targets are registered, this relay's bound",
                          reason="unknown")
        self._held[target] = (tag, control)
        return None if old is None else old[1]

    def unregister(self, target: str, control: object) -> None:
        """Forget ``target`` if ``control`` still holds it."""
        held = self._held.get(target)
        if held is not None and held[1] is control:
            del self._held[target]

    def route(self, target: str, tag: str) -> object:
        """The control connection of ``target``, for a member of the group ``tag``.

        Raises:
            Refused: no such target (``unknown``), or one of another group (``other-job``).
        """
        held = self._held.get(target)
        if held is None:
            raise Refused("no such target is registered", reason="unknown")
        if not secrets.compare_digest(held[0], tag):
            raise Refused("the target is not a member of the asking peer's group",
                          reason="other-job")
        return held[1]
