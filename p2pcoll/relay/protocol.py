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

Version 2 adds a direct attempt between two peers behind NAT (TCP simultaneous open, the
relay telling each the other's address), which falls back to the relayed forward:

- **dial** (``D``, then TARGET, TAG, the member's bound PORT (2 bytes) and FROM, the
  member's own target name or 32 ``0``): a connect that asks to go direct. It is sent from
  a port the member bound, so the relay sees the address the member's NAT maps that port
  to. The relay checks it as a connect; if the target registered with version 2 it sends
  the target :data:`PUNCH` + a 16-byte id + FROM (else :data:`OPEN`, and it is a connect).
- **answer** (``B``, the 16-byte id, the target's bound PORT): the target's connection for
  that id, from a port it bound too.

If both NATs kept the bound ports and the two addresses differ (:func:`punchable`), the
relay sends each side :data:`HOLE` and a :class:`Hole` (the other's address, two nonces,
its retry interval, the deadline); else it answers both :data:`OK` and forwards, as for a
connect. After a hole, each side dials the other from its bound port until the deadline
(:mod:`.punch`), sends its nonce on the connection it got and checks the other's, then
says :data:`DIRECT` or :data:`FAILED` to the relay (:class:`Verdicts`): both direct, the
relay closes both; both failed, it answers both :data:`OK` and forwards between them;
mixed, it closes both (the member's mesh connects again).

:class:`Preamble` parses what a connection says first, as its bytes come, with a bound on
its length; :class:`Targets` is the table of registered targets. Neither touches a socket,
so both are tested by feeding them bytes.
"""

from __future__ import annotations

import re
import secrets
import socket
from dataclasses import dataclass
from typing import Literal

from .names import HEX

__all__ = ["ACCEPT", "ANSWER", "CONNECT", "DIAL", "DIRECT", "FAILED", "HOLE", "MAGIC",
           "MAGIC2", "OK", "OPEN", "PING", "PUNCH", "REFUSED", "REGISTER", "Accept", "Answer",
           "BadPreamble", "Connect", "Dial", "Hole", "Preamble", "Refused", "Register",
           "Targets", "Verdicts", "accept_preamble", "answer_preamble", "connect_preamble",
           "dial_preamble", "punchable", "register_preamble"]

MAGIC = b"P2PR\x01"  # the start of a peer's preamble: "P2PR" and the protocol version
MAGIC2 = b"P2PR\x02"  # version 2: the kinds of version 1, and dial and answer
REGISTER, CONNECT, ACCEPT = b"R", b"C", b"A"
DIAL, ANSWER = b"D", b"B"
PUNCH = b"T"  # relay -> target (version 2): a member dials; answer from a bound port
HOLE = b"H"  # relay -> both sides of a dial: go direct (a Hole follows)
DIRECT, FAILED = b"Y", b"F"  # a side's verdict, to the relay
NOBODY = "0" * HEX  # the FROM of a dial from a member that is no target
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


def register2_preamble(target: str, tag: str) -> bytes:
    """A registration that can be asked to dial (version 2)."""
    return MAGIC2 + REGISTER + target.encode() + tag.encode()


def dial_preamble(target: str, tag: str, port: int, sender: str = NOBODY) -> bytes:
    return MAGIC2 + DIAL + target.encode() + tag.encode() + port.to_bytes(2, "big") + \
        sender.encode()


def answer_preamble(conn: bytes, port: int) -> bytes:
    return MAGIC2 + ANSWER + conn + port.to_bytes(2, "big")


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
    """A target registers (its control connection); ``version`` 2: it can be asked to
    dial."""

    target: str
    tag: str
    version: int = 1


@dataclass(frozen=True)
class Dial:
    """A member asks to reach ``target`` directly if it can (else through the relay), from
    its bound ``port``; ``sender`` is its own target name (:data:`NOBODY` if none)."""

    target: str
    tag: str
    port: int
    sender: str = NOBODY


@dataclass(frozen=True)
class Accept:
    """A target's connection for the forward ``conn``."""

    conn: bytes


@dataclass(frozen=True)
class Answer:
    """A target's connection for the dial ``conn``, from its bound ``port``."""

    conn: bytes
    port: int


Request = Connect | Register | Accept | Dial | Answer


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
        if not (MAGIC.startswith(buf[:len(MAGIC)]) or MAGIC2.startswith(buf[:len(MAGIC)])):
            raise BadPreamble(f"{buf[:8]!r}... is not the start of a relay preamble")
        if len(buf) < head:
            return None
        version = buf[len(MAGIC) - 1]
        kind, body = buf[len(MAGIC):head], buf[head:]
        if kind in (REGISTER, CONNECT) or (kind == DIAL and version == 2):
            size = 2 * HEX + (2 + HEX if kind == DIAL else 0)
            if len(body) < size:
                return None
            target, tag = body[:HEX], body[HEX:2 * HEX]
            sender = body[2 * HEX + 2:size] if kind == DIAL else NOBODY.encode()
            if not (_HEX.fullmatch(target) and _HEX.fullmatch(tag) and _HEX.fullmatch(sender)):
                raise BadPreamble("a malformed target, tag or sender")
            self.rest = body[size:]
            if kind == DIAL:
                port = int.from_bytes(body[2 * HEX:2 * HEX + 2], "big")
                return Dial(target.decode(), tag.decode(), port, sender.decode())
            if kind == REGISTER:
                return Register(target.decode(), tag.decode(), version)
            return Connect(target.decode(), tag.decode())
        if kind == ACCEPT or (kind == ANSWER and version == 2):
            size = ID_BYTES + (2 if kind == ANSWER else 0)
            if len(body) < size:
                return None
            self.rest = body[size:]
            if kind == ANSWER:
                return Answer(bytes(body[:ID_BYTES]), int.from_bytes(body[ID_BYTES:size], "big"))
            return Accept(bytes(body[:ID_BYTES]))
        raise BadPreamble(f"unknown relay request {kind!r} (version {version})")


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


# --- a direct attempt (version 2) -------------------------------------------------------

HOLE_BYTES = 4 + 2 + 2 * ID_BYTES + 2 + 2  # what follows HOLE
PUNCH_BYTES = ID_BYTES + HEX  # what follows PUNCH: the id and the dialling member's FROM


@dataclass(frozen=True)
class Hole:
    """What the relay tells each side of a dial: dial ``host:port`` (the other side's
    address as the relay saw it) every ``interval_s`` until ``deadline_s`` from now; send
    ``mine`` first on the connection, expect ``theirs``."""

    host: str
    port: int
    mine: bytes
    theirs: bytes
    interval_s: float
    deadline_s: float

    def pack(self) -> bytes:
        return (HOLE + socket.inet_aton(self.host) + self.port.to_bytes(2, "big") + self.mine
                + self.theirs + round(self.interval_s * 1e3).to_bytes(2, "big")
                + round(self.deadline_s * 1e3).to_bytes(2, "big"))

    @classmethod
    def unpack(cls, body: bytes) -> Hole:
        """From the :data:`HOLE_BYTES` after :data:`HOLE`.

        Raises:
            BadPreamble: not that many bytes, or a zero port, interval or deadline."""
        if len(body) != HOLE_BYTES:
            raise BadPreamble(f"a hole of {len(body)} bytes, not {HOLE_BYTES}")
        at = 6 + 2 * ID_BYTES
        hole = cls(socket.inet_ntoa(body[:4]), int.from_bytes(body[4:6], "big"),
                   bytes(body[6:6 + ID_BYTES]), bytes(body[6 + ID_BYTES:at]),
                   int.from_bytes(body[at:at + 2], "big") / 1e3,
                   int.from_bytes(body[at + 2:at + 4], "big") / 1e3)
        if not (hole.port and hole.interval_s and hole.deadline_s):
            raise BadPreamble(f"a hole with a zero port, interval or deadline: {hole}")
        return hole


Address = tuple[str, int]


def punchable(bound: int, seen: Address, other_bound: int, other_seen: Address
              ) -> str | None:
    """Why two sides that bound ports ``bound`` and ``other_bound``, seen by the relay at
    ``seen`` and ``other_seen``, cannot try a direct connection (None: they can).

    A NAT that did not keep a side's port (MASQUERADE ``--random-fully``, most carrier-grade
    NATs) maps its next connection to yet another: the relay cannot tell the other side
    where to dial. Two sides behind one address (one NAT) would need the NAT to hairpin,
    which few do (loopback excepted: the relay's own tests)."""
    for port, (host, seen_port) in ((bound, seen), (other_bound, other_seen)):
        try:
            socket.inet_aton(host)
        except OSError:
            return "not IPv4"
        if ":" in host or host.count(".") != 3:
            return "not IPv4"
        if port != seen_port:
            return "port changed by a NAT"
    if seen[0] == other_seen[0] and not seen[0].startswith("127."):
        return "one address"
    return None


Outcome = Literal["direct", "relayed", "mixed"]


class Verdicts:
    """The two sides' verdicts on one direct attempt (side 0: the member, 1: the target):
    both :data:`DIRECT`, ``direct``; both :data:`FAILED`, ``relayed`` (the relay forwards
    between their connections); else ``mixed`` (both closed)."""

    def __init__(self) -> None:
        self.said: list[bytes | None] = [None, None]

    def say(self, side: int, verdict: bytes) -> Outcome | None:
        """Take ``side``'s verdict; the outcome once both have said theirs.

        Raises:
            BadPreamble: ``verdict`` is neither DIRECT nor FAILED, or ``side`` said one
                already."""
        if verdict not in (DIRECT, FAILED) or self.said[side] is not None:
            raise BadPreamble(f"verdict {verdict!r} from side {side} (said: {self.said})")
        self.said[side] = verdict
        mine, theirs = self.said
        if mine is None or theirs is None:
            return None
        if mine == theirs:
            return "direct" if mine == DIRECT else "relayed"
        return "mixed"
