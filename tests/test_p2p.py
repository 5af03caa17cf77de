"""Point-to-point: ``Group.send`` / ``Group.recv``, matched per (sender, receiver, tag).

Most tests run over the in-memory transport (real groups, no sockets); one runs over zmq on
loopback with a message large enough to be cut into pipeline segments.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from conftest import groups_of

import p2pcoll
from p2pcoll.testing import run_ranks
from p2pcoll.transport.memory import Faults, MemoryNetwork


async def test_send_recv_values_tags_and_order() -> None:
    async with groups_of(3) as (a, b, c):
        # Posted before the receives: the messages wait at the receiver.
        await a.send(np.arange(5.0), dst=1, tag=3)
        await a.send({"x": np.ones(2, np.int32), "y": [np.zeros((2, 0))]}, dst=1)
        await a.send(np.array(7, np.int8), dst=1)  # second on tag 0: after the dict
        await c.send(np.array([1.5], np.float16), dst=1, tag=3)
        got0 = await b.recv(src=0)
        got0b = await b.recv(src=0)
        got3 = await b.recv(src=0, tag=3)  # tags are independent of each other
        got3c = await b.recv(src=2, tag=3)  # ... and so are senders
        assert got0["x"].dtype == np.int32 and got0["y"][0].shape == (2, 0)
        assert got0b.shape == () and got0b == 7
        assert np.array_equal(got3, np.arange(5.0))
        assert got3c.dtype == np.float16 and got3c[0] == 1.5


async def test_recv_posted_first_and_out() -> None:
    async with groups_of(2) as (a, b):
        out = np.zeros((3, 4), np.float32)
        recv = asyncio.create_task(b.recv(src=0, tag=9, out=out))
        await asyncio.sleep(0.01)
        await a.send(np.full((3, 4), 2.0, np.float32), dst=1, tag=9)
        assert await recv is out and (out == 2).all()
        # p2p does not disturb collectives in flight at the same time.
        sums = await asyncio.gather(a.allreduce(np.ones(2)), b.allreduce(np.ones(2)),
                                    a.send(np.ones(1), 1), b.recv(0))
        assert sums[0].tolist() == [2, 2] and sums[3].tolist() == [1]


async def test_exchange_both_ways_concurrently() -> None:
    async with groups_of(4) as gs:
        # Every rank sends to its right neighbour and receives from its left one.
        async def ring(g: p2pcoll.Group) -> np.ndarray:
            right, left = (g.rank + 1) % 4, (g.rank - 1) % 4
            _, got = await asyncio.gather(g.send(np.array([g.rank]), right), g.recv(left))
            return got  # type: ignore[no-any-return]

        got = await asyncio.gather(*(ring(g) for g in gs))
        assert [int(x[0]) for x in got] == [3, 0, 1, 2]


async def test_reordering_network_keeps_order_per_tag() -> None:
    net = MemoryNetwork(Faults(reorder=True, seed=3))
    async with groups_of(2, network=net) as (a, b):
        for i in range(20):
            await a.send(np.array([i]), dst=1, tag=i % 2)
        evens = [int((await b.recv(0, tag=0))[0]) for _ in range(10)]
        odds = [int((await b.recv(0, tag=1))[0]) for _ in range(10)]
        assert evens == list(range(0, 20, 2)) and odds == list(range(1, 20, 2))


async def test_bad_arguments_leave_the_group_usable() -> None:
    async with groups_of(2) as (a, b):
        with pytest.raises(ValueError, match="dst 0 is not another rank"):
            await a.send(np.ones(1), dst=0)
        with pytest.raises(ValueError, match="dst 2 is not another rank"):
            await a.send(np.ones(1), dst=2)
        with pytest.raises(ValueError, match="tag -1"):
            await a.send(np.ones(1), dst=1, tag=-1)
        with pytest.raises(ValueError, match="C-contiguous"):
            await b.recv(0, out=np.zeros((4, 4))[:, 0])
        with pytest.raises(TypeError):
            await a.send(np.array(["text"]), dst=1)
        await a.send(np.ones(1), dst=1)
        assert (await b.recv(0))[0] == 1
        assert a.state == b.state == "ready"


async def test_timeout_names_the_sender_and_breaks_every_group() -> None:
    async with groups_of(3) as (a, b, c):
        with pytest.raises(p2pcoll.CollectiveTimeout, match="recv #0 from rank 2") as info:
            await b.recv(src=2, tag=1, timeout=0.3)
        assert info.value.waiting_on == [2] and info.value.collective == "recv"
        assert b.state == "broken"
        while not a.state == c.state == "broken":  # until the abort reaches the others
            await asyncio.sleep(0.005)
        with pytest.raises(p2pcoll.GroupBroken):
            await a.send(np.ones(1), dst=1)


async def test_out_mismatch_names_both_layouts() -> None:
    async with groups_of(2) as (a, b):
        await a.send(np.ones(3, np.float32), dst=1)
        with pytest.raises(p2pcoll.CollectiveMismatch, match=r"float32\[3\].*float64\[3\]"):
            await b.recv(0, out=np.zeros(3))


async def test_waiting_recv_fails_when_sender_dies() -> None:
    net = MemoryNetwork()
    async with groups_of(2, network=net, collective_timeout=10) as (a, b):
        recv = asyncio.create_task(b.recv(src=0))
        await asyncio.sleep(0.01)
        net.cut(a.endpoint)
        with pytest.raises(p2pcoll.PeerLost, match="rank 0"):
            await asyncio.wait_for(recv, 5)


async def test_send_to_departed_peer_is_peer_lost() -> None:
    async with groups_of(2) as (a, b):
        await b.close()
        await asyncio.sleep(0.05)
        with pytest.raises(p2pcoll.PeerLost, match="rank 1"):
            await a.send(np.ones(1), dst=1)


async def test_segmented_over_zmq() -> None:
    big = np.random.default_rng(0).random(1_500_000)  # 12 MB: several pipeline segments

    async def fn(g: p2pcoll.Group) -> bool:
        if g.rank == 0:
            await g.send(big, dst=1, tag=5)
            return True
        got = await g.recv(src=0, tag=5)
        return bool(np.array_equal(got, big))

    assert await run_ranks(2, fn) == [True, True]


# --- receiving from any source (MPI_ANY_SOURCE, torch's recv(src=None)) ----------------------

async def test_recv_any_names_the_sender_and_keeps_each_senders_order() -> None:
    async with groups_of(3) as (a, b, c):
        await a.send(np.array([1]), dst=1, tag=4)
        await a.send(np.array([2]), dst=1, tag=4)
        await c.send(np.array([30.0]), dst=1, tag=4)
        await c.send(np.array([99]), dst=1, tag=5)  # another tag: not taken
        got = [await b.recv_any(tag=4) for _ in range(3)]
        by_src: dict[int, list[float]] = {}
        for src, value in got:
            by_src.setdefault(src, []).append(float(value[0]))
        assert by_src == {0: [1.0, 2.0], 2: [30.0]}
        # A receive posted before anything is sent, with out=.
        out = np.zeros(2, np.float32)
        pending = asyncio.create_task(b.recv_any(out=out))
        await asyncio.sleep(0.01)
        assert not pending.done()
        await c.send(np.full(2, 5.0, np.float32), dst=1)
        assert await pending == (2, out) and out.tolist() == [5.0, 5.0]
        # Mixed with receives from a named source: the counts per sender stay in step.
        await a.send(np.array([7]), dst=1, tag=6)
        await a.send(np.array([8]), dst=1, tag=6)
        assert int((await b.recv(0, tag=6))[0]) == 7
        src, value = await b.recv_any(tag=6)
        assert (src, int(value[0])) == (0, 8)
        assert int((await b.recv(2, tag=5))[0]) == 99
        assert a.state == b.state == c.state == "ready"


async def test_recv_any_timeout_takes_nothing_and_leaves_the_group_usable() -> None:
    async with groups_of(3) as (a, b, c):
        with pytest.raises(p2pcoll.CollectiveTimeout, match="recv_any with tag 2") as info:
            await b.recv_any(tag=2, timeout=0.2)
        assert info.value.waiting_on == [0, 2] and b.state == "ready"
        await c.send(np.array([3]), dst=1, tag=2)  # comes late: the next receive has it
        src, value = await b.recv_any(tag=2)
        assert (src, int(value[0])) == (2, 3)
        with pytest.raises(ValueError, match="tag -1"):
            await b.recv_any(tag=-1)


async def test_recv_any_skips_a_departed_sender_and_fails_when_all_have_gone() -> None:
    net = MemoryNetwork()
    async with groups_of(3, network=net, collective_timeout=10) as (a, b, c):
        pending = asyncio.create_task(b.recv_any())
        await asyncio.sleep(0.01)
        net.cut(a.endpoint)  # rank 0 is lost; rank 2 may still send
        await asyncio.sleep(0.05)
        assert not pending.done()
        await c.send(np.array([1]), dst=1)
        assert (await asyncio.wait_for(pending, 5))[0] == 2
        pending = asyncio.create_task(b.recv_any())
        await asyncio.sleep(0.01)
        net.cut(c.endpoint)
        with pytest.raises(p2pcoll.PeerLost, match="rank 0"):
            await asyncio.wait_for(pending, 5)


async def test_recv_any_over_zmq() -> None:
    async def fn(g: p2pcoll.Group) -> list[int]:
        if g.rank != 0:
            await g.send(np.full(100_000, g.rank), dst=0, tag=1)
            return []
        got = [await g.recv_any(tag=1) for _ in range(g.world_size - 1)]
        assert all((value == src).all() for src, value in got)
        return sorted(src for src, _ in got)

    assert (await run_ranks(3, fn))[0] == [1, 2]
