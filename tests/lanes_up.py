"""The warm-up of the peer scripts whose peers talk over TCP lanes (tests/*_worker.py,
tests/sender_loss_peer.py): small allreduces until every rank has sent on its lanes.

A lane opens only after its receiver has read the sender's hello and connected, so the
first messages of a group go over the ZeroMQ link; how many depends on the machine's load
(twenty back-to-back allreduces were not always enough under the processes tier). The
warm-up asks the group, not the clock: every rank says whether it has sent on a lane, and
all stop together once every rank has (or after :data:`MOST` rounds, for groups without
lanes, which the scripts' own assertions then catch).
"""

from __future__ import annotations

from typing import Any

import numpy as np

AT_LEAST = 20  # allreduces of every warm-up
MOST = 500  # rounds at most


def _sent(g: Any) -> np.ndarray:
    return np.array([min(1, g.session.transport.counters.messages_sent_lane)], np.int32)


async def warm_up(g: Any) -> None:
    """The warm-up of an async group."""
    for i in range(MOST):
        await g.allreduce(np.ones(8))
        if i + 1 >= AT_LEAST and (await g.allreduce(_sent(g), op="min"))[0]:
            return


def warm_up_blocking(g: Any) -> None:
    """The same for a blocking group (:mod:`p2pcoll.blocking`)."""
    for i in range(MOST):
        g.allreduce(np.ones(8))
        if i + 1 >= AT_LEAST and g.allreduce(_sent(g.aio), op="min")[0]:
            return
