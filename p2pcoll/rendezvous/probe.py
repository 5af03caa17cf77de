"""What answers at a rendezvous address, asked over a plain TCP connection.

The ZeroMQ socket of a rendezvous client says little when its handshake does not complete:
a server of another protocol that answers and keeps the connection open looks like a slow
host, and a CURVE server that closes the connection of a client without a key (before its
greeting got out, which depends on the load) looks like a port being rebound. So when the
handshake stalls or is cut, the client asks once more, itself: it sends a ZMTP 3.0 greeting
(ZeroMQ's first 64 bytes, RFC 23) offering its own security mechanism, and reads the
greeting that comes back. A ZeroMQ server sends its greeting whatever the mechanisms (it
closes only once it has read both), and every greeting names the server's mechanism, so
the answer does not depend on the load: a ZeroMQ greeting (and which mechanism: ``NULL``
for a plain rendezvous, ``CURVE`` for one secured with a job key), bytes of another
protocol (quoted), a connection closed with nothing said, or nothing within the wait. The
greeting goes in two parts, as ZeroMQ sends its own: the signature and version first, the
mechanism once the server's greeting has come (sent at once, a server whose mechanism
differs may close before its own greeting is out).

A plain rendezvous whose mechanism matches the probe's is sent the NULL mechanism's
``READY`` before the probe closes, so its server sees a connection that came and went,
not a failed handshake (which it would count as a refusal).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Literal

GREETING_BYTES = 64
_SIGNATURE = b"\xff" + bytes(8) + b"\x7f"
_READY = (b"\x04\x1a" + b"\x05READY" + b"\x0bSocket-Type" + (6).to_bytes(4, "big")
          + b"DEALER")  # a short command frame: flags, size, name, one property


def greeting(mechanism: str) -> bytes:
    """The ZMTP 3.0 greeting of a client offering ``mechanism`` (``NULL``, ``CURVE``)."""
    return (_SIGNATURE + b"\x03\x00" + mechanism.encode().ljust(20, b"\x00") + b"\x00"
            + bytes(31))


@dataclass(frozen=True)
class Answer:
    """What answered: ``kind`` is ``zmtp`` (a ZeroMQ server; ``mechanism`` says which),
    ``other`` (another protocol; ``sample`` is what it sent), ``closed`` (the connection was
    closed with nothing said) or ``silent`` (nothing within the wait), or ``unreachable``
    (no connection could be made)."""

    kind: Literal["zmtp", "other", "closed", "silent", "unreachable"]
    mechanism: str = ""
    sample: bytes = b""

    def quoted(self) -> str:
        """The first line of what another protocol sent, printable, at most 80 characters:
        e.g. ``'HTTP/1.1 400 Bad Request'``."""
        line = self.sample.split(b"\n", 1)[0].rstrip(b"\r")
        text = "".join(chr(b) if 32 <= b < 127 else f"\\x{b:02x}" for b in line[:80])
        return repr(text) + (" ..." if len(line) > 80 else "")


def read_greeting(data: bytes) -> Answer | None:
    """What ``data`` (the first bytes the server sent) says, or None if it may be the
    start of a greeting that has not all come yet."""
    if not data.startswith(_SIGNATURE[:1]) or (len(data) >= 10 and data[9:10] != b"\x7f"):
        return Answer("other", sample=data)
    if len(data) < 12 + 20:
        return None
    return Answer("zmtp", mechanism=data[12:32].rstrip(b"\x00").decode("ascii", "replace"))


def _so_far(data: bytes, otherwise: Answer) -> Answer:
    """What the bytes heard before the connection ended or the wait passed say: nothing, or
    the start of a greeting whose rest has not come (a round trip longer than the wait:
    ZeroMQ sends the rest after the client's part), proves nothing (``otherwise``)."""
    return (read_greeting(data) or otherwise) if data else otherwise


async def probe(host: str, port: int, mechanism: str, wait: float) -> Answer:
    """Ask what answers at ``host:port`` (see the module docstring); at most ``wait``
    seconds. Never raises for what the network does.

    Cancellation: the connection is closed.
    """
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), wait)
    except (OSError, TimeoutError):
        return Answer("unreachable")
    data = b""
    try:
        mine = greeting(mechanism)
        writer.write(mine[:11])  # the signature and the major version
        answer: Answer | None = None
        async with asyncio.timeout(wait):
            while answer is None:
                chunk = await reader.read(GREETING_BYTES)
                if not chunk:
                    answer = _so_far(data, Answer("closed"))
                    break
                data += chunk
                answer = read_greeting(data)
        if answer.kind == "zmtp" and answer.mechanism != mechanism:
            writer.write(mine[11:])  # the server counts the mismatch: it is one
            await writer.drain()
        elif answer.kind == "zmtp" and mechanism == "NULL":
            writer.write(mine[11:] + _READY)
            await writer.drain()
        return answer
    except TimeoutError:
        return _so_far(data, Answer("silent"))
    except OSError:
        return _so_far(data, Answer("closed"))
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()
