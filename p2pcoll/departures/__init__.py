"""How peers learn that others have left: one state machine without I/O.

:class:`Departures` takes events (a probe or link lost, a goodbye, news of a loss, an
abort, this peer failing an operation or closing, the time) and returns :mod:`.actions`
(post a message, watch or forget a peer, fail an operation, degrade the group), which the
session and the transport carry out. :mod:`.suspects` decides what becomes of a peer whose
link or probe went down (lost, or only busy). :mod:`.overlay` is the arithmetic of who watches whom
and over which fingers news and aborts travel. Nothing here imports ZeroMQ, sockets or an
event loop.
"""

from . import overlay
from .actions import (
    Aborted,
    Action,
    DeclaredLost,
    Degrade,
    Fail,
    Forget,
    Leave,
    Post,
    Unwatch,
    Via,
    Watch,
)
from .machine import Departure, Departures
from .suspects import ALIVE, CHECK_WAIT, KILLED_WAIT, LINK_LOSS_GRACE

__all__ = ["ALIVE", "CHECK_WAIT", "KILLED_WAIT", "LINK_LOSS_GRACE", "Aborted", "Action",
           "DeclaredLost", "Degrade", "Departure", "Departures", "Fail", "Forget", "Leave",
           "Post", "Unwatch", "Via", "Watch", "overlay"]
