"""Timeouts, mismatches, malformed input and lost peers: errors, never hangs or wrong data."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time

import msgpack
import numpy as np
import pytest

import p2pcoll
from conftest import ROGUE_RANK, Inject, groups_of
from p2pcoll.testing import free_port, run_ranks
from p2pcoll.wire import WIRE_VERSION


async def test_rank_that_never_calls_makes_others_time_out() -> None:
    timed_out = asyncio.Semaphore(0)  # released by each of the three that call

    async def fn(g: p2pcoll.Group) -> object:
        if g.rank == 2:
            for _ in range(3):  # never calls the collective; stays until the others are done
                await timed_out.acquire()
            return None
        start = time.monotonic()
        with pytest.raises(p2pcoll.CollectiveTimeout) as info:
            await g.allreduce(np.ones(8, np.float32), strategy="ring", timeout=0.5)
        timed_out.release()
        return time.monotonic() - start, info.value

    results = await run_ranks(4, fn)
    for rank in (0, 1, 3):
        elapsed, err = results[rank]
        # It does not hang (a loaded machine may hold the loop for seconds).
        assert elapsed < 20 * 0.5, f"rank {rank} took {elapsed:.2f}s for a 0.5s timeout"
        assert err.collective == "allreduce" and err.seq == 0
        assert "allreduce #0" in str(err)
        assert "timed out after 0.5s" in str(err)
    # In the ring rank 3 waits on rank 2 (the one that never came), even when another
    # rank's timeout reached it first.
    assert results[3][1].waiting_on == [2]


async def test_group_is_broken_after_a_failure() -> None:
    checked = asyncio.Event()

    async def fn(g: p2pcoll.Group) -> object:
        if g.rank == 0:
            with pytest.raises(p2pcoll.CollectiveTimeout):
                await g.allreduce(np.ones(4), timeout=0.3)
            with pytest.raises(p2pcoll.GroupBroken) as info:
                await g.allreduce(np.ones(4))
            assert isinstance(info.value.__cause__, p2pcoll.CollectiveTimeout)
            checked.set()
        else:
            await checked.wait()  # never calls, and stays in the group until rank 0 is done
        return True

    assert await run_ranks(2, fn) == [True, True]


@pytest.mark.parametrize("strategy", ["ring", "recursive_doubling", "reduce_broadcast"])
async def test_shape_mismatch_raises_on_every_rank(strategy: str) -> None:
    async def fn(g: p2pcoll.Group) -> object:
        n = 10 if g.rank != 1 else 11
        start = time.monotonic()
        with pytest.raises(p2pcoll.P2PCollError) as info:
            await g.allreduce(np.ones(n, np.float32), strategy=strategy, timeout=10)
        return time.monotonic() - start, info.value

    for elapsed, err in await run_ranks(4, fn):
        assert isinstance(err, p2pcoll.CollectiveMismatch), repr(err)
        assert "float32[10]" in str(err) and "float32[11]" in str(err)
        assert elapsed < 10 / 2, "a mismatch must be reported long before the timeout"


@pytest.mark.parametrize(
    "field, call",
    [
        ("data", lambda g: g.allreduce(np.ones(6, np.float32 if g.rank else np.float64))),
        ("op", lambda g: g.allreduce(np.ones(6), op="max" if g.rank == 2 else "sum")),
        ("collective", lambda g: g.allreduce(np.ones(6)) if g.rank else g.allgather(np.ones(6))),
        ("strategy", lambda g: g.allreduce(np.ones(6), strategy="ring" if g.rank else
                                           "recursive_doubling")),
    ],
)
async def test_signature_mismatches_name_the_field(field: str, call: object) -> None:
    async def fn(g: p2pcoll.Group) -> object:
        with pytest.raises(p2pcoll.CollectiveMismatch) as info:
            await asyncio.wait_for(call(g), 10)  # type: ignore[operator]
        return str(info.value)

    for message in await run_ranks(3, fn):
        assert f"{field}:" in message or "did not expect" in message, message


async def test_broadcast_with_disagreeing_roots_is_not_silent() -> None:
    async def fn(g: p2pcoll.Group) -> object:
        root = 0 if g.rank == 0 else 1
        try:
            await g.broadcast(np.full(4, g.rank), root=root, strategy="binomial", timeout=5)
            await asyncio.sleep(0.3)  # let stray messages arrive
            await g.barrier(timeout=5)
        except p2pcoll.P2PCollError as exc:
            return exc
        return None

    errors = await run_ranks(4, fn)
    assert all(isinstance(e, p2pcoll.P2PCollError) for e in errors), errors
    assert any(isinstance(e, p2pcoll.CollectiveMismatch)
               or isinstance(e.__cause__, p2pcoll.CollectiveMismatch) for e in errors), errors


async def test_broadcast_buffer_of_wrong_shape() -> None:
    async def fn(g: p2pcoll.Group) -> object:
        if g.rank == 0:  # the root only sends; it may finish before rank 1 objects
            await g.broadcast(np.zeros(5), timeout=5)
            return True
        with pytest.raises(p2pcoll.CollectiveMismatch, match=r"\[5\].*\[6\]"):
            await g.broadcast(np.zeros(6), timeout=5)
        return True

    assert await run_ranks(2, fn) == [True, True]


async def test_malformed_messages_are_dropped_and_counted(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, inject: Inject
) -> None:
    monkeypatch.setenv("P2PCOLL_MAX_MESSAGE_BYTES", str(1 << 20))
    caplog.set_level(logging.DEBUG, logger="p2pcoll.transport")
    injected = asyncio.Event()

    async def fn(g: p2pcoll.Group) -> object:
        if g.rank == 0:
            gid = g.membership.group_id
            header = {"v": WIRE_VERSION, "k": "data", "g": gid, "r": ROGUE_RANK, "q": 0,
                      "seg": 0, "s": 0, "sig": b"\0" * 8, "n": [8]}
            dropped = await inject(g, [
                [b"\xc1 not msgpack"],
                [msgpack.packb([1, 2, 3])],
                [msgpack.packb({**header, "v": 99}), b"12345678"],
                [msgpack.packb({**header, "g": "another-group"}), b"12345678"],
                [msgpack.packb(header), b"123"],  # frame shorter than the header says
                [msgpack.packb(header)],  # missing frame
                [msgpack.packb({**header, "r": 2}), b"12345678"],  # spoofed source
                [msgpack.packb({**header, "k": "exec"})],
                [msgpack.packb(header), b"12345678"],  # well-formed, but rank 5 is no member
                # last: ZeroMQ's MAXMSGSIZE may drop the connection, and with it whatever
                # followed on it that was not read yet
                [msgpack.packb({**header, "n": [2 << 20]}), bytes(2 << 20)],  # oversize
            ])
            injected.set()
        else:
            await injected.wait()
            dropped = None
        out = await g.allreduce(np.arange(5.0) * (g.rank + 1), timeout=10)
        return dropped, out

    results = await run_ranks(2, fn)
    # The oversize message is cut by ZeroMQ's MAXMSGSIZE (which drops the connection) or by
    # our own check; everything else is counted and logged. A stranger's link is refused
    # before its header is even decoded (each reason of a member's message is checked
    # against the validation point itself in tests/test_wire.py).
    assert results[0][0] >= 9
    assert "link identity b'5' is not a member of this group" in caplog.text
    # Each drop is logged at DEBUG; WARNING lines are limited to one per source and interval.
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "dropped" in r.msg]
    assert len(warnings) <= 2, [r.getMessage() for r in warnings]
    for _, out in results:
        np.testing.assert_array_equal(out, np.arange(5.0) * 3)


async def test_peer_that_closes_is_reported_promptly() -> None:
    async def fn(g: p2pcoll.Group) -> object:
        if g.rank == 1:
            return None  # leaves the group (close() sends bye) without calling allreduce
        start = time.monotonic()
        with pytest.raises(p2pcoll.PeerLost) as info:
            await g.allreduce(np.ones(3), strategy="ring", timeout=30)
        return time.monotonic() - start, info.value

    results = await run_ranks(3, fn)
    for rank in (0, 2):
        elapsed, err = results[rank]
        assert elapsed < 30 / 2  # not at the timeout
        # Whether a survivor heard the goodbye itself or the other survivor's abort first,
        # the error names the rank that left.
        assert err.rank == 1 and "rank 1" in str(err), repr(err)


CHILD = """
import asyncio, sys, p2pcoll
async def main():
    g = await p2pcoll.join(sys.argv[1], world_size=3, rank=2, timeout=20)
    print("joined", flush=True)
    await asyncio.sleep(60)
asyncio.run(main())
"""


@pytest.mark.processes
async def test_killed_process_is_reported_as_peer_lost() -> None:
    url = f"tcp://127.0.0.1:{free_port()}"
    child = subprocess.Popen([sys.executable, "-c", CHILD, url], stdout=subprocess.DEVNULL)
    try:
        async def peer(rank: int) -> object:
            async with p2pcoll.join(url, world_size=3, rank=rank, timeout=20) as g:
                await asyncio.sleep(0.5)
                if rank == 0:
                    os.kill(child.pid, signal.SIGKILL)
                start = time.monotonic()
                with pytest.raises(p2pcoll.P2PCollError) as info:
                    await g.allreduce(np.ones(4), strategy="ring", timeout=30)
                return time.monotonic() - start, info.value

        results = await asyncio.gather(peer(0), peer(1))
    finally:
        child.kill()
        child.wait()
    for elapsed, err in results:
        assert elapsed < 30 / 2, f"took {elapsed:.1f}s to notice a killed peer"
        assert isinstance(err, p2pcoll.PeerLost) or "rank 2" in str(err), repr(err)


async def test_cancelling_a_collective_aborts_the_others() -> None:
    cancelled = asyncio.Event()  # the ranks share this event loop (run_ranks)

    async def fn(g: p2pcoll.Group) -> object:
        if g.rank == 0:
            task = asyncio.ensure_future(g.allreduce(np.ones(4), strategy="ring", timeout=30))
            await asyncio.sleep(0.2)  # the allreduce is under way, waiting for the others
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            cancelled.set()
            with pytest.raises(p2pcoll.GroupBroken):
                await g.barrier()
            return "cancelled"
        await cancelled.wait()  # rank 0 is cancelled while it waits for us
        start = time.monotonic()
        # In the ring no rank can finish without rank 0's later steps (a strategy in which
        # rank 0 had sent all it had to before the cancel may complete here).
        with pytest.raises(p2pcoll.P2PCollError, match="rank 0"):
            await g.allreduce(np.ones(4), strategy="ring", timeout=30)
        with pytest.raises(p2pcoll.GroupBroken):
            await g.barrier(timeout=30)
        return time.monotonic() - start

    results = await run_ranks(3, fn)
    assert results[0] == "cancelled"
    assert all(t < 30 / 2 for t in results[1:])  # not at the timeout


async def test_local_argument_errors() -> None:
    async def fn(g: p2pcoll.Group) -> object:
        with pytest.raises(ValueError, match="avg"):
            await g.allreduce(np.ones(3, np.int32), op="avg")
        with pytest.raises(ValueError, match="unknown reduce op"):
            await g.allreduce(np.ones(3), op="mean")
        with pytest.raises(TypeError, match="cannot be communicated"):
            await g.allreduce(np.array(["a", "b"]))
        with pytest.raises(TypeError):
            await g.allreduce(np.array([object()]))
        with pytest.raises(ValueError, match="root"):
            await g.broadcast(np.ones(2), root=5)
        with pytest.raises(ValueError, match="scatter root"):
            await g.scatter([np.ones(1)], root=g.rank)
        with pytest.raises(p2pcoll.UnknownStrategy, match="ring"):
            await g.allreduce(np.ones(3), strategy="nope")
        # None of these consumed a sequence number: the group still works.
        return await g.allreduce(np.ones(3), timeout=10)

    for out in await run_ranks(2, fn):
        np.testing.assert_array_equal(out, [2, 2, 2])


async def test_allreduce_out_in_place_and_validation() -> None:
    async def fn(g: p2pcoll.Group) -> object:
        x = np.arange(6, dtype=np.float32) + g.rank
        same = await g.allreduce(x, out=x)  # in place
        assert same is x
        tree = {"a": np.ones(3), "b": [np.zeros(2, np.int32) + g.rank]}
        out = {"a": np.empty(3), "b": [np.empty(2, np.int32)]}
        got = await g.allreduce(tree, out=out)
        assert got is out and tree["a"][0] == 1.0  # the input is untouched
        with pytest.raises(ValueError, match="does not match"):
            await g.allreduce(x, out=np.empty(6, np.float64))
        with pytest.raises(ValueError, match="structure"):
            await g.allreduce(tree, out=[np.empty(3)])
        with pytest.raises(ValueError, match="contiguous"):
            await g.allreduce(x, out=np.empty(12, np.float32)[::2])
        return x, out

    for x, out in await run_ranks(3, fn):
        np.testing.assert_array_equal(x, np.arange(6) * 3 + 3)
        np.testing.assert_array_equal(out["a"], [3, 3, 3])
        np.testing.assert_array_equal(out["b"][0], [3, 3])


async def test_non_root_waiting_for_a_broadcast_names_the_root() -> None:
    timed_out = asyncio.Semaphore(0)  # released by each of the two that call

    async def fn(g: p2pcoll.Group) -> object:
        if g.rank == 1:
            for _ in range(2):  # the root never calls; it stays until the others are done
                await timed_out.acquire()
            return None
        with pytest.raises(p2pcoll.CollectiveTimeout) as info:
            await g.broadcast(None, root=1, timeout=0.5)
        timed_out.release()
        return info.value.waiting_on

    assert (await run_ranks(3, fn))[0] == [1]


async def test_non_root_of_a_departed_root_fails_fast() -> None:
    async def fn(g: p2pcoll.Group) -> object:
        if g.rank == 1:
            return None  # the root leaves
        start = time.monotonic()
        with pytest.raises(p2pcoll.PeerLost):
            await g.scatter(None, root=1, timeout=20)
        return time.monotonic() - start

    elapsed = await run_ranks(3, fn)
    assert elapsed[0] < 20 / 2 and elapsed[2] < 20 / 2  # not at the timeout


async def test_a_members_list_kind_header_is_dropped_and_the_peer_keeps_answering() -> None:
    """The header that once killed a peer's reader ({"v": ..., "k": [1]}: a TypeError out of
    the decoder), sent on a member's own link (the in-memory network lets a test do that;
    over ZeroMQ a stranger's link is refused before decoding)."""
    from p2pcoll.testing import memory_groups

    groups = await memory_groups(2, collective_timeout=10)
    try:
        net = groups[0].session.transport.network  # type: ignore[attr-defined]
        ends = groups[0].membership.endpoints
        for bad in ({"v": WIRE_VERSION, "k": [1]}, {"v": WIRE_VERSION, "k": {"x": 1}},
                    {"v": [WIRE_VERSION], "k": "data"}):
            net.deliver(ends[1], ends[0], [msgpack.packb(bad)], data=False)
        await asyncio.sleep(0.05)
        assert groups[0].stats()["messages_dropped"] == 3
        outs = await asyncio.gather(*(g.allreduce(np.full(3, g.rank + 1.0)) for g in groups))
        for out in outs:
            np.testing.assert_array_equal(out, np.full(3, 3.0))
        assert groups[0].state == "ready"
    finally:
        for g in groups:
            await g.close()


async def test_an_abort_of_a_finished_collective_fails_the_running_ones_at_once() -> None:
    # Rank 0 reports collective #0 failed after ranks 1 and 2 had finished it and gone on
    # to #1, which needs rank 0: they must fail now, not at #1's deadline.
    from p2pcoll.wire import Header

    async with groups_of(3) as (g0, g1, g2):
        await asyncio.gather(*(g.barrier() for g in (g0, g1, g2)))
        running = [asyncio.ensure_future(g.allreduce(np.ones(4), timeout=30))
                   for g in (g1, g2)]
        await asyncio.sleep(0.05)
        abort = Header("abort", g0.membership.group_id, 0, 0,
                       err=["GroupBroken", "rank 0 went wrong"])
        for peer in (1, 2):
            g0.session.transport.post(peer, abort)
        t0 = time.monotonic()
        for task in running:
            with pytest.raises(p2pcoll.GroupBroken, match="rank 0 failed collective #0: rank 0 went wrong"):
                await task
        assert time.monotonic() - t0 < 30 / 2  # at once, not at the 30 s deadline
        assert g1.state == g2.state == "broken"
