"""Point-to-point transfers as one-step schedules, so the executor runs them like any
collective: segmented, zero-copy, size-checked, under the matcher's rules.

The peer is the context's ``root``. These are not strategies a user picks (they are not
registered); :meth:`p2pcoll.Group.send` and :meth:`p2pcoll.Group.recv` use them.
"""

from __future__ import annotations

from ..strategy import ALL, Context, Recv, Schedule, Send, Strategy


class SendTo(Strategy):
    """Send the whole data to rank ``ctx.root``."""

    name = "send"
    collective = "send"

    def schedule(self, ctx: Context) -> Schedule:
        yield Send(ctx.root, ALL)


class RecvFrom(Strategy):
    """Receive the whole data from rank ``ctx.root``."""

    name = "recv"
    collective = "recv"

    def schedule(self, ctx: Context) -> Schedule:
        yield Recv(ctx.root, ALL)


SEND, RECV = SendTo(), RecvFrom()

__all__ = ["RECV", "SEND", "RecvFrom", "SendTo"]
