"""Relays: how peers that cannot accept connections (behind NAT, a firewall) are reached.

- :mod:`.protocol`: what a connection to a relay says first, target names, the table of
  registered targets (no I/O);
- :mod:`.pipe`: splicing two connections, with flow control;
- :mod:`.server`: :class:`Relay`, the server (the rendezvous host runs one; ``p2pcoll relay``
  runs one standalone);
- :mod:`.thread`: the loop, on a thread of its own, every splice of a process runs on;
- :mod:`.attach`: :class:`Attachment`, the registration of a peer behind a relay, and
  :class:`Entrance`, a peer's local way to one behind a relay.

See docs/relay.md.
"""

from .attach import Attachment, Entrance
from .server import Relay, RelayLimits

__all__ = ["Attachment", "Entrance", "Relay", "RelayLimits"]
