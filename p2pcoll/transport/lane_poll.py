"""What a receive calls before it parks: the mesh's ROUTER and its TCP lanes, read now.

A receive whose message has not come polls the transport once before it parks in the
event loop (:meth:`~p2pcoll.engine.matching.Matcher.get`): a message that came meanwhile
is then taken without a turn of the loop (the descriptor's callback, a future, the task's
wake-up). The ROUTER's drain (:meth:`.router.RouterReader.poll`) sees only what came over
ZeroMQ; small messages to and from the peers of other hosts go on TCP lanes
(:mod:`.tcp_lane`), which the loop reads in their own callbacks. :class:`LanePoll` reads
both, in the order the loop would (the ROUTER first: a lane marker comes over it, see
:mod:`.ordering`), and offers a receive that waits for one peer a cheaper poll of that
peer alone (:meth:`LanePoll.poll_from`) for a hybrid wait (:mod:`p2pcoll.engine.polling`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from .tcp_lane import TcpLanes

__all__ = ["LanePoll"]


class Far(Protocol):
    """Where a peer's TCP lanes are: its ``far`` (None once closed, or if none are open)."""

    far: TcpLanes | None


class LanePoll:
    """The ROUTER's poll and the TCP lanes', as one callable.

    Args:
        router: the ROUTER's poll (never raises).
        paths: what holds the peer's TCP lanes now (read at each poll).
    """

    def __init__(self, router: Callable[[], None], paths: Far) -> None:
        self._router, self._paths = router, paths
        #: Polls that read a lane (for tests: the poll path was taken).
        self.lane_polls = 0

    def __call__(self) -> None:
        """Read whatever waits in the ROUTER and on every TCP lane; never raises."""
        self._router()
        far = self._paths.far
        if far is not None and far.into:
            self.lane_polls += 1
            far.poll()

    def polled(self, peer: int) -> bool:
        """Whether :meth:`poll_from` reads what ``peer`` sends (it has a lane here and
        runs in another process): a receive may poll for it."""
        far = self._paths.far
        return far is not None and far.polled(peer)

    def poll_from(self, peer: int) -> None:
        """Read whatever waits in the ROUTER and on ``peer``'s TCP lane; never raises."""
        self._router()
        far = self._paths.far
        if far is not None:
            self.lane_polls += 1
            far.poll(peer)
