"""Eager credits between real peers (p2pcoll.engine.credit, .flow): a fast sender leaves at
most its window in a slow receiver, over the sockets, the TCP lanes between hosts and the
in-memory transport; collectives of every strategy that send each other far more than the
window do not deadlock; and a sender waiting for credit learns of its receiver's loss and
obeys its deadline."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import p2pcoll
from p2pcoll.engine.credit import MESSAGE_COST
from p2pcoll.testing import run_ranks

from conftest import groups_of

WINDOW = 64 << 10
ITEM = 8 << 10  # bytes of one message
COST = ITEM + MESSAGE_COST
COUNT = 120  # messages the sender sends: 15 windows


def _paths() -> list[object]:
    return [
        pytest.param({"transport": "tcp"}, id="tcp"),
        pytest.param({"transport": "tcp", "host_ids": ["host-0", "host-1"]},
                     id="tcp-lanes-between-hosts"),
        pytest.param({"transport": "ipc"}, id="ipc"),
    ]


@pytest.mark.parametrize("path", _paths())
def test_a_fast_sender_leaves_at_most_its_window_in_a_slow_receiver(
        path: dict[str, object], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("P2PCOLL_EAGER_WINDOW", str(WINDOW))

    async def fn(g: p2pcoll.Group) -> dict[str, int]:
        item = np.arange(ITEM // 4, dtype=np.float32)
        if g.rank == 0:
            for i in range(COUNT):
                await g.send(item + i, 1)
        else:
            out = np.empty_like(item)
            for i in range(COUNT):
                if i % 8 == 0:
                    await asyncio.sleep(0.01)  # slow: the sender runs ahead
                await g.recv(0, out=out)
                assert out[0] == i
        await g.barrier()
        return dict(g.stats())

    senders, receivers = asyncio.run(run_ranks(2, fn, **path))  # type: ignore[arg-type]
    assert senders["eager_waits"] > 0  # it ran into its window
    # What arrived before its receive: at most the window of earlier transfers, and the one
    # in hand.
    assert 2 * COST <= receivers["eager_held_peak"] <= WINDOW + COST, receivers
    # Credit went back in batches of about half a window, not per message.
    assert receivers["eager_reports"] <= COUNT * COST // (WINDOW // 2) + 2 * 8, receivers


def test_a_broadcast_root_runs_at_most_a_window_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("P2PCOLL_EAGER_WINDOW", str(WINDOW))
    monkeypatch.setenv("P2PCOLL_SHM", "0")  # through the matcher, not the board

    async def fn(g: p2pcoll.Group) -> dict[str, int]:
        item = np.zeros(ITEM // 4, dtype=np.float32)
        for i in range(COUNT):
            if g.rank == 0:
                item[:] = i
            elif i % 8 == 0:
                await asyncio.sleep(0.01)
            await g.broadcast(item, root=0, strategy="root")
            assert item[0] == i
        return dict(g.stats())

    out = asyncio.run(run_ranks(3, fn, transport="tcp"))
    assert out[0]["eager_waits"] > 0
    for stats in out[1:]:
        assert stats["eager_held_peak"] <= WINDOW + COST, stats


def test_collectives_much_larger_than_the_window_do_not_deadlock(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every strategy of every collective, between 4 peers over tcp whose window is 1 byte:
    each collective waits until its peers finished every earlier one, none for its own."""
    monkeypatch.setenv("P2PCOLL_EAGER_WINDOW", "1")
    monkeypatch.setenv("P2PCOLL_SHM", "0")  # through the matcher, not the board

    async def fn(g: p2pcoll.Group) -> int:
        for collective, names in sorted(p2pcoll.available_strategies().items()):
            for name in names:
                await _twice(g, collective, name)
        return int(g.stats()["eager_waits"])

    assert sum(asyncio.run(run_ranks(4, fn, transport="tcp", host_ids=[
        "host-0", "host-0", "host-1", "host-1"]))) > 0


async def _twice(g: p2pcoll.Group, collective: str, strategy: str) -> None:
    """Run ``collective`` with ``strategy`` twice in a row, on 64K floats per rank."""
    n, p = 1 << 16, g.world_size
    data = np.full(n, g.rank + 1, dtype=np.float32)
    for _ in range(2):
        if collective == "allreduce":
            out = await g.allreduce(data.copy(), strategy=strategy)
            assert out[0] == p * (p + 1) / 2
        elif collective == "broadcast":
            out = await g.broadcast(data.copy(), root=1, strategy=strategy)
            assert out[0] == 2
        elif collective == "reduce":
            await g.reduce(data.copy(), root=1, strategy=strategy)
        elif collective == "allgather":
            await g.allgather(data.copy(), strategy=strategy)
        elif collective == "reduce_scatter":
            await g.reduce_scatter(np.ones(n * p, np.float32), strategy=strategy)
        elif collective == "gather":
            await g.gather(data.copy(), root=1, strategy=strategy)
        elif collective == "scatter":
            chunks = [np.ones(n, np.float32)] * p if g.rank == 1 else None
            await g.scatter(chunks, root=1, strategy=strategy)
        elif collective == "alltoall":
            await g.alltoall([data.copy() for _ in range(p)], strategy=strategy)
        elif collective == "barrier":
            await g.barrier(strategy=strategy)
        else:
            pytest.fail(f"no call here for collective {collective!r}: add one")


def test_two_ranks_streaming_both_ways_with_receives_posted_do_not_deadlock() -> None:
    """Each rank sends the other 20 windows while receiving: the standard-mode rule."""

    async def main() -> None:
        async with groups_of(2, eager_window=WINDOW) as (a, b):
            async def side(g: p2pcoll.Group) -> None:
                peer, item = 1 - g.rank, np.ones(ITEM // 4, np.float32)
                async def sends() -> None:
                    for _ in range(20 * WINDOW // ITEM):
                        await g.send(item, peer)
                async def recvs() -> None:
                    for _ in range(20 * WINDOW // ITEM):
                        await g.recv(peer, out=np.empty_like(item))
                await asyncio.gather(sends(), recvs())
            await asyncio.gather(side(a), side(b))
            assert a.stats()["eager_held_peak"] <= WINDOW + COST

    asyncio.run(main())


def test_a_sender_waiting_for_credit_obeys_its_deadline_naming_the_receiver() -> None:
    async def main() -> None:
        async with groups_of(2, eager_window=WINDOW) as (a, _):
            item = np.ones(ITEM // 4, np.float32)
            with pytest.raises(p2pcoll.CollectiveTimeout) as caught:
                for _ in range(4 * WINDOW // ITEM):  # rank 1 never receives
                    await a.send(item, 1, timeout=0.5)
            assert "rank 1" in str(caught.value)
            assert a.stats()["eager_waits"] == 1

    asyncio.run(main())


def test_a_sender_waiting_for_credit_learns_its_receiver_was_lost() -> None:
    from p2pcoll.transport.memory import MemoryNetwork

    async def main() -> None:
        network = MemoryNetwork()
        async with groups_of(2, eager_window=WINDOW, network=network,
                             heartbeat_timeout=0.5, collective_timeout=60) as (a, _):
            item = np.ones(ITEM // 4, np.float32)

            async def flood() -> None:
                while True:
                    await a.send(item, 1)

            task = asyncio.create_task(flood())
            while not a.stats()["eager_waits"]:
                await asyncio.sleep(0.01)
            network.cut(1)  # rank 1 crashes while rank 0 waits for its credit
            with pytest.raises(p2pcoll.PeerLost) as caught:
                await asyncio.wait_for(task, 20)
            assert caught.value.rank == 1

    asyncio.run(main())
