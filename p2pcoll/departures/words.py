"""The words of a departure: what a peer's loss or goodbye says of how it went."""

from __future__ import annotations

from ..errors import CLOSED, KILLED, UNRESPONSIVE, PeerLost

__all__ = ["GONE_HOW", "LOST", "left"]

# What a lost link says of its peer when nothing tells a kill from a freeze.
GONE_HOW = ("its process was killed or crashed, or it stopped answering (frozen, overloaded "
            "or cut off)")
# The first words of a loss, by how the peer went (see Departures.classified).
LOST = {
    KILLED: "ended without a word: its process was killed or crashed hard (it did not close "
            "the group, and nothing listens at its address any more; its own output or "
            "log says why)",
    UNRESPONSIVE: "stopped answering: its process is there but silent past the heartbeat "
                  "timeout (stopped, frozen, overloaded or cut off; raise "
                  "$P2PCOLL_HEARTBEAT_TIMEOUT if it is only busy)",
    "": f"is gone without closing the group: {GONE_HOW}",
}


def left(rank: int) -> PeerLost:
    """The departure of a peer that said goodbye after a healthy run."""
    return PeerLost(f"rank {rank} left the group: it closed it normally", rank, how=CLOSED)
