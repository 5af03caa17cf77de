"""Members that leave their group to admit newcomers, and a loss on the way.

When rank 0 finds peers waiting at the rendezvous, every member of the group goes there at
the next round boundary to form a group with them (:mod:`.elastic`). They know who is
coming: themselves and the peers rank 0 counted waiting (the count rides in the round's
reduction), so each joins expecting that many, and the group forms as soon as they are
there (``expect`` of :func:`p2pcoll.join`) instead of once ``max_world_size`` are there or a
second after the last arrival.

A member killed meanwhile never comes. The old group stays open while its members join,
and its session finds the loss as it finds any (about a tenth of a second after a kill);
each member that learns of it tells the rendezvous to expect one fewer (a ``waiting``
question with ``expect``, :func:`p2pcoll.rendezvous.client.waiting`), and the group forms
with those there, where it waited for a second of quiet before. The lowest expectation
said wins, and a group still needs ``min_world_size`` peers to form.

What this can cost: a member whose old group reports a peer lost that is in fact on its
way (never seen on loopback) forms the group without it if the others are there first;
it joins the next one, as a peer that arrives late always did. A member killed after it
registered is in the count already, and forms in the group as before (whose formation then
fails with the loss, and is tried again).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from .census import Census

if TYPE_CHECKING:
    from .. import Group

__all__ = ["live", "watch"]

log = logging.getLogger("p2pcoll.training")


def live(group: Group) -> list[int]:
    """The ranks of ``group`` not known to be lost (a member that said goodbye counts: it
    closed its old group once it was in the next one)."""
    lost = {r for r, d in group.session.peers.gone().items() if not d.graceful}
    return [r for r in range(group.world_size) if r not in lost]


async def watch(old: Group, census: Census, waiting: int) -> None:
    """While this member joins after an admission: each member of ``old`` lost meanwhile
    lowers what the group forming expects to the live members and the ``waiting`` peers.
    Runs until cancelled (when the join ends); raises nothing else."""
    others = [r for r in range(old.world_size) if r != old.rank]
    while others:
        rank, _ = await old.session.peers.first_lost(others)
        members = live(old)
        others = [r for r in others if r in members]
        expect = len(members) + waiting
        log.info("elastic: rank %d: rank %d of the group left to admit peers was lost on "
                 "the way; the next group expects %d", old.rank, rank, expect)
        await census.ask(expect=expect)
