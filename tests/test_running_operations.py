"""What the departures machine reads of the operations a session runs (the failure model's
table, see FailureModel.running), and what it is asked as one starts: only once a member
has gone. Over the memory transport on the virtual clock."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import p2pcoll
from conftest import groups_of
from p2pcoll.testing import MemoryNetwork, run_virtual
from p2pcoll.types import OpKey


def test_collective_keys_are_op_keys_numbered_in_order() -> None:
    async def main() -> None:
        async with groups_of(1) as [g]:
            session = g.session
            keys = [session.next_seq() for _ in range(3)]
            assert keys == [OpKey(0), OpKey(1), OpKey(2)]
            assert all(type(k) is OpKey and not k.is_transfer for k in keys)
            assert {keys[1]: 1}[OpKey(1)] == 1  # hashes as the same value

    run_virtual(main())


def test_what_runs_is_read_with_what_each_operation_needs() -> None:
    async def main() -> None:
        async with groups_of(3) as groups:
            g = groups[0]
            failures = g.session.failures
            assert failures.running() == []
            blocked = asyncio.ensure_future(g.allreduce(np.ones(2)))
            receiving = asyncio.ensure_future(g.recv(src=2, tag=5))
            await asyncio.sleep(0)
            # a collective needs every member; a receive nobody (the matcher knows whether
            # its message can still come)
            assert set(failures.running()) == {(OpKey(0), None, 0),
                                               (OpKey(0, 5, 2, 0), frozenset(), None)}
            await asyncio.gather(*(h.allreduce(np.ones(2)) for h in groups[1:]),
                                 groups[2].send(np.ones(2), dst=0, tag=5))
            await asyncio.gather(blocked, receiving)
            assert failures.running() == []

    run_virtual(main())


def test_a_loss_while_nothing_runs_fails_the_next_call_that_needs_the_peer() -> None:
    # Nothing ran when rank 1 was lost: the group is degraded, and the next collective and
    # a send to rank 1 fail as they start (the machine is asked once a member has gone);
    # a transfer between the members still there works.
    async def main() -> None:
        network = MemoryNetwork()
        async with groups_of(3, network=network) as groups:
            network.cut(1)
            while groups[0].state != "degraded" or groups[2].state != "degraded":
                await asyncio.sleep(0.05)
            g = groups[0]
            await asyncio.gather(g.send(np.ones(2), dst=2, tag=1),
                                 groups[2].recv(src=0, tag=1))
            assert g.state == "degraded"
            with pytest.raises(p2pcoll.PeerLost) as lost:
                await g.send(np.ones(2), dst=1, tag=1)
            assert lost.value.rank == 1
            with pytest.raises(p2pcoll.PeerLost) as lost:
                await groups[2].allreduce(np.ones(2))
            assert lost.value.rank == 1 and groups[2].state == "broken"

    run_virtual(main())
