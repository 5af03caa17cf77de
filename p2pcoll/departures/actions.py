"""What :class:`~p2pcoll.departures.Departures` asks its peer to do: plain values, carried
out by the session and the transport (which never decide anything about departures).

- :class:`Post`: send a control message to a peer, ``via`` its link (opened if need be,
  unless the peer is leaving), the peer's probe of this one (a goodbye to a watcher this
  peer has no link to), or as an ``answer`` on the connection the peer's last message came
  on (opens nothing).
- :class:`Watch` / :class:`Unwatch`: open or close a heartbeat probe to a peer (``late``:
  opened after the group formed, to replace a watched peer that went, so a probe that
  cannot connect at all means a lost peer too).
- :class:`Forget`: a peer has gone: let go of what is kept for it (its links, its
  successions, what waits for it in the matcher).
- :class:`Leave`: this peer is leaving its group: open no link from now on (a goodbye goes
  on the links it has and over its watchers' probes) and read the answers on its links.
  The session gives it to the transport as the group closes, before the goodbyes.
- :class:`Fail`: fail a running operation with an error (each operation at most once).
- :class:`Degrade`: the group has lost a member (once; see ``GroupState.DEGRADED``).
- :class:`Aborted`: an abort (or a goodbye's cause, as one) reached this peer for the first
  time: the failure model applies it to the operation it names.
- :class:`DeclaredLost`: the others declared this peer lost (it froze, or was cut off):
  everything running fails with ``error`` and the group is broken here.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Literal

from ..errors import PeerLost
from ..wire.header import Header

__all__ = ["Aborted", "Action", "DeclaredLost", "Degrade", "Fail", "Forget", "Leave", "Post",
           "Unwatch", "Via", "Watch"]

Via = Literal["link", "probe", "answer"]


@dataclass(frozen=True, slots=True)
class Post:
    dst: int
    header: Header
    via: Via = "link"


@dataclass(frozen=True, slots=True)
class Watch:
    peer: int
    late: bool = False


@dataclass(frozen=True, slots=True)
class Unwatch:
    peer: int


@dataclass(frozen=True, slots=True)
class Forget:
    peer: int
    # It said goodbye (it closed its group, removing its own files); else it was lost,
    # maybe killed, leaving files that whoever forgets it on its host may remove.
    graceful: bool = False


@dataclass(frozen=True, slots=True)
class Leave:
    pass


@dataclass(frozen=True, slots=True)
class Fail:
    op: Hashable
    error: PeerLost


@dataclass(frozen=True, slots=True)
class Degrade:
    pass


@dataclass(frozen=True, slots=True)
class Aborted:
    header: Header  # the abort as the origin sent it (its "origin" in meta when relayed)
    origin: int
    message: str  # what the error it names says here


@dataclass(frozen=True, slots=True)
class DeclaredLost:
    by: int
    error: PeerLost


Action = Post | Watch | Unwatch | Forget | Fail | Degrade | Aborted | DeclaredLost
