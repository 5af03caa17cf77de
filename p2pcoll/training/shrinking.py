"""The survivors of a loss form their next elastic group by shrinking the old one.

When a round fails because a peer was lost, the survivors need not go back to the
rendezvous: each knows the old group's roster and who is gone, so they form the next
group among themselves with :meth:`p2pcoll.Group.shrink` (no rendezvous, no store; a tenth
of a second on loopback where a formation through the rendezvous waits for the peers to
arrive and then a second of quiet). Newcomers still come through the rendezvous: rank 0
of the shrunk group counts them there as in any group, and they are admitted at the next
round boundary.

The rule is the same on every survivor: the ranks to leave out are those this rank knows
to be gone, and the one the failure names (a peer that aborted a collective on its way out
breaks the group before its departure is known: a survivor waits up to
:data:`NEWS_S` for the news). Survivors that do not agree on them (one has
not heard of a second loss yet) get a CollectiveMismatch from the shrink; a survivor lost
meanwhile, a PeerLost; too few survivors for ``min_world_size``: no shrink; and no shrink
when nobody answers at the rendezvous (the peer that hosted it is among the lost): a
shrunk group would host no rendezvous, and newcomers would wait there alone. In each case
every survivor goes to the rendezvous instead, as before (one of them hosts it), expecting
the survivors and the peers counted waiting there: the group forms as soon as they are all
there, not a second after the last arrival (``expect`` of :func:`p2pcoll.join`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from ..errors import P2PCollError, PeerLost

if TYPE_CHECKING:
    from .. import Group

__all__ = ["NEWS_S", "SHRINK_TIMEOUT_S", "gone", "shrunk", "survivors"]

log = logging.getLogger("p2pcoll.training")

SHRINK_TIMEOUT_S = 5.0
"""How long the survivors wait for each other in a shrink before trying the rendezvous."""
NEWS_S = 1.0
"""How long a survivor waits to learn who went, when the failure does not say."""
_POLL_S = 0.02


def gone(group: Group) -> list[int]:
    """The ranks of ``group`` known to have gone, and the one named by the failure that
    broke it (a peer's abort may come before the news of the loss it names)."""
    ranks = set(group.session.peers.gone())
    if isinstance(group.cause, PeerLost) and group.cause.rank is not None:
        ranks.add(group.cause.rank)
    return sorted(ranks)


def survivors(group: Group) -> list[int]:
    """The ranks of ``group`` not known to have gone (see :func:`gone`)."""
    lost = set(gone(group))
    return [r for r in range(group.world_size) if r not in lost]


async def shrunk(group: Group, min_world_size: int,
                 served: Callable[[], Awaitable[int | None]]) -> Group | None:
    """The next group of the survivors of ``group``, or None where they go to the
    rendezvous instead (module docstring); ``served()``: the rendezvous' answer to a census,
    None if nobody answers. Never raises but for cancellation."""
    lost = gone(group)
    waited = 0.0
    while not lost and waited < NEWS_S:
        await asyncio.sleep(_POLL_S)
        waited += _POLL_S
        lost = gone(group)
    if not lost or group.rank in lost or group.world_size - len(lost) < min_world_size:
        return None
    # The rendezvous is asked while the survivors shrink, not before: its answer costs a
    # round trip to it, which the shrink need not wait for.
    answer = asyncio.ensure_future(served())
    try:
        try:
            smaller = await group.shrink(lost, timeout=SHRINK_TIMEOUT_S)
        except (P2PCollError, RuntimeError, ValueError) as exc:
            log.info("elastic: rank %d could not shrink the group without %s (%s: %s); "
                     "joining through the rendezvous", group.rank, lost, type(exc).__name__,
                     exc)
            return None
        try:
            answered = await answer
        except BaseException:
            await smaller.close()
            raise
    finally:
        if not answer.done():
            answer.cancel()
            await asyncio.gather(answer, return_exceptions=True)
    if answered is None:
        log.info("elastic: rank %d: nobody answers at the rendezvous; joining there (a "
                 "shrunk group would host no rendezvous for newcomers)", group.rank)
        await smaller.close()
        return None
    log.info("elastic: rank %d of %d shrank the group without %s", smaller.rank,
             smaller.world_size, lost)
    return smaller
