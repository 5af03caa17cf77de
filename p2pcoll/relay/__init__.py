"""Relays: how peers that cannot accept connections (behind NAT, a firewall) are reached.

- :mod:`.names`: target names, group tags and ``relay://`` endpoints (no I/O: what every
  peer needs to form a group, relayed or not);
- :mod:`.protocol`: what a connection to a relay says first, the table of registered
  targets, and a dial's messages and verdicts (no I/O);
- :mod:`.punch`: a dial's direct attempt between two peers behind NAT (TCP simultaneous
  open from the ports the relay saw);
- :mod:`.pipe`: splicing two connections, with flow control;
- :mod:`.server`: :class:`Relay`, the server (the rendezvous host runs one; ``p2pcoll relay``
  runs one standalone);
- :mod:`.thread`: the loop, on a thread of its own, every splice of a process runs on;
- :mod:`.attach`: :class:`Attachment`, the registration of a peer behind a relay, and
  :class:`Entrance`, a peer's local way to one behind a relay.

The names below are imported on first use, so that a peer that reaches nobody through a
relay loads neither the server nor the splicing. See docs/relay.md.
"""

from typing import TYPE_CHECKING

from ..lazy import lazy_names

if TYPE_CHECKING:
    from .attach import Attachment, Entrance
    from .server import Relay, RelayLimits

__all__ = ["Attachment", "Entrance", "Relay", "RelayLimits"]

_HOMES = {"Attachment": ".attach", "Entrance": ".attach",
          "Relay": ".server", "RelayLimits": ".server"}


__getattr__, __dir__ = lazy_names(__name__, globals(), _HOMES)
