"""The shared-memory board: small collectives among peers of one host without messages.

Real peers (tasks of this process over ipc, so they share the host and the board is used,
and processes where a peer is killed); every result is checked against numpy or against
the same collective sent as messages.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from typing import Any

import numpy as np
import pytest

import p2pcoll
from conftest import finish
from p2pcoll.engine.board_path import BoardPath
from p2pcoll.testing import free_port, run_ranks
from p2pcoll.transport.board import (
    COUNT,
    DEPTH,
    FIELDS,
    NBYTES,
    PARITY,
    SLEEPING,
    WANTS,
    WORDS,
    Board,
)


def _ran(g: p2pcoll.Group, collective: str) -> dict[str, int]:
    return dict(g.stats()["collectives_by_strategy"].get(collective, {}))


async def test_small_collectives_go_on_the_board_with_every_rank_the_same_bits() -> None:
    async def fn(g: p2pcoll.Group) -> Any:
        rng = np.random.default_rng(g.rank)
        x = rng.standard_normal(1000).astype(np.float32)
        ints = rng.integers(-1000, 1000, size=(7, 3), dtype=np.int64)
        tree = {"w": x[:10].astype(np.float64), "b": [np.int32(g.rank), np.ones(3, np.int16)]}
        got = {
            "sum": await g.allreduce(x),
            "max": await g.allreduce(x, op="max"),
            "avg": await g.allreduce(x, op="avg"),
            "ints": await g.allreduce(ints),
            "ints_ring": await g.allreduce(ints, strategy="ring"),
            "tree": await g.allreduce(tree),
            "reduce": await g.reduce(ints, root=2),
            "bcast": await g.broadcast(tree if g.rank == 1 else None, root=1),
            "scalar": await g.allreduce(np.float64(g.rank + 0.5)),
        }
        await g.barrier()
        return got, x, ints, _ran(g, "allreduce"), _ran(g, "broadcast"), _ran(g, "barrier")

    results = await run_ranks(3, fn, transport="ipc")
    xs = [r[1] for r in results]
    ints = [r[2] for r in results]
    first = results[0][0]
    for got, _, _, allreduce, broadcast, barrier in results:
        # Every rank the same bits (the board folds the slots in rank order everywhere).
        assert got["sum"].tobytes() == first["sum"].tobytes()
        assert got["avg"].tobytes() == first["avg"].tobytes()
        np.testing.assert_allclose(got["sum"], xs[0] + xs[1] + xs[2], rtol=1e-5)
        assert np.array_equal(got["max"], np.maximum(np.maximum(xs[0], xs[1]), xs[2]))
        # Integer sums equal every other strategy's.
        assert np.array_equal(got["ints"], got["ints_ring"])
        assert np.array_equal(got["ints"], ints[0] + ints[1] + ints[2])
        assert got["tree"]["b"][0] == 3 and got["tree"]["b"][0].dtype == np.int32
        assert np.array_equal(got["tree"]["b"][1], np.full(3, 3, np.int16))
        assert got["bcast"]["b"][0] == 1 and np.array_equal(got["bcast"]["w"], xs[1][:10])
        assert got["scalar"] == 4.5 and np.shape(got["scalar"]) == ()
        assert allreduce == {"shm": 6, "ring": 1} and broadcast == {"shm": 1}
        assert barrier == {"shm": 1}
    assert np.array_equal(results[2][0]["reduce"], ints[0] + ints[1] + ints[2])
    assert results[0][0]["reduce"] is None


async def test_sizes_above_the_slot_and_asked_strategies_go_as_messages() -> None:
    async def fn(g: p2pcoll.Group) -> Any:
        big = np.full(20_000, g.rank + 1.0)  # 160 KB: over the 64 KiB slot
        total = await g.allreduce(big)
        value = await g.broadcast(big if g.rank == 0 else None)
        small = await g.allreduce(np.ones(4), strategy="recursive_doubling")
        return (float(total[0]), float(value[-1]), float(small[0]), _ran(g, "allreduce"),
                _ran(g, "broadcast"))

    for total, value, small, allreduce, broadcast in await run_ranks(2, fn, transport="ipc"):
        assert (total, value, small) == (3.0, 1.0, 2.0)
        assert "shm" not in allreduce and sum(allreduce.values()) == 2
        assert "shm" not in broadcast  # the root put "as messages" on the board


async def test_no_board_without_shared_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("P2PCOLL_SHM", "0")

    async def fn(g: p2pcoll.Group) -> Any:
        await g.allreduce(np.ones(4))
        return _ran(g, "allreduce"), g.session.board

    for ran, board in await run_ranks(2, fn, transport="ipc"):
        assert "shm" not in ran and board is None


async def test_non_roots_record_their_collectives() -> None:
    """Regression (issue 21): a non-root's broadcast and scatter, and every send and recv,
    were never recorded in stats() and /metrics."""
    async def fn(g: p2pcoll.Group) -> Any:
        await g.broadcast(np.ones(4) if g.rank == 0 else None)
        await g.broadcast(np.ones(4) if g.rank == 0 else None, strategy="binomial")
        await g.scatter([np.ones(2)] * 3 if g.rank == 0 else None)
        if g.rank == 0:
            await g.send(np.ones(2), dst=1)
        elif g.rank == 1:
            await g.recv(src=0)
        return g.stats()

    stats = await run_ranks(3, fn, transport="ipc")
    for rank, s in enumerate(stats):
        by = s["collectives_by_strategy"]
        assert by["broadcast"] == {"shm": 1, "binomial": 1}, (rank, by)
        assert sum(by["scatter"].values()) == 1, (rank, by)
        assert s["collective_seconds"]["broadcast"]["count"] == 2
    assert stats[0]["collectives_by_strategy"]["send"] == {"send": 1}
    assert stats[1]["collectives_by_strategy"]["recv"] == {"recv": 1}


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
async def test_allreduce_against_broadcast_is_a_mismatch(transport: str) -> None:
    """Regression (issue 21): rank 0 calls allreduce while the others call broadcast(None):
    they got a ProtocolError about a missing layout instead of a CollectiveMismatch."""
    async def fn(g: p2pcoll.Group) -> BaseException:
        with pytest.raises(p2pcoll.P2PCollError) as info:
            if g.rank == 0:
                await g.allreduce(np.ones(4, np.float32), timeout=10)
            else:
                await g.broadcast(None, root=0, timeout=10)
        return info.value

    for rank, err in enumerate(await run_ranks(3, fn, transport=transport)):
        assert isinstance(err, p2pcoll.CollectiveMismatch), (rank, repr(err))
        assert "allreduce" in str(err) and "broadcast" in str(err), (rank, str(err))


async def test_a_size_that_goes_as_messages_on_one_rank_is_a_mismatch_not_a_hang() -> None:
    async def fn(g: p2pcoll.Group) -> Any:
        n = 100_000 if g.rank == 1 else 100  # rank 1's data is over the slot
        started = time.monotonic()
        with pytest.raises(p2pcoll.P2PCollError) as info:
            await g.allreduce(np.ones(n, np.float32), timeout=20)
        return time.monotonic() - started, info.value

    for elapsed, err in await run_ranks(2, fn, transport="ipc"):
        assert isinstance(err, p2pcoll.CollectiveMismatch), repr(err)
        assert elapsed < 20 / 2, "a mismatch must be found long before the deadline"


async def test_a_board_timeout_names_the_rank_that_never_came() -> None:
    async def fn(g: p2pcoll.Group) -> Any:
        if g.rank == 2:
            await asyncio.sleep(1.5)
            return None
        with pytest.raises(p2pcoll.CollectiveTimeout) as info:
            await g.allreduce(np.ones(8, np.float32), timeout=0.5)
        return info.value

    results = await run_ranks(3, fn, transport="ipc")
    for rank in (0, 1):
        assert results[rank].waiting_on == [2], (rank, results[rank])
        assert results[rank].collective == "allreduce"


async def test_a_peer_that_leaves_while_others_wait_on_the_board_is_named() -> None:
    async def fn(g: p2pcoll.Group) -> Any:
        if g.rank == 1:
            await g.close("going away")
            return None
        started = time.monotonic()
        with pytest.raises(p2pcoll.PeerLost) as info:
            await g.allreduce(np.ones(8), timeout=30)
        return time.monotonic() - started, info.value

    results = await run_ranks(3, fn, transport="ipc", return_exceptions=True)
    for rank in (0, 2):
        elapsed, err = results[rank]
        assert err.rank == 1 and elapsed < 30 / 2, (rank, elapsed, err)  # not the deadline


async def test_concurrent_board_collectives_keep_their_order() -> None:
    async def fn(g: p2pcoll.Group) -> Any:
        calls = [g.allreduce(np.full(5, g.rank * 10 + i, np.int64)) for i in range(6)]
        calls.append(g.broadcast(np.arange(3) if g.rank == 0 else None))
        calls.append(g.barrier())
        return await asyncio.gather(*calls)

    for results in await run_ranks(3, fn, transport="ipc"):
        for i in range(6):
            assert np.array_equal(results[i], np.full(5, 30 + 3 * i))
        assert np.array_equal(results[6], np.arange(3))


async def test_a_broadcast_root_runs_ahead_of_a_late_reader_and_every_call_arrives() -> None:
    """The root of a loop of broadcasts fills every buffer of its line before the reader
    has read one (DEPTH buffers), then waits for it; the reader gets each call's data."""
    calls = 3 * DEPTH

    async def fn(g: p2pcoll.Group) -> Any:
        board = g.session.board
        assert board is not None
        if g.rank == 0:
            for i in range(calls):
                await g.broadcast(np.full(16, i, np.int64))
            return board.board.count
        # The root runs DEPTH - 1 ahead: it publishes counts 1..DEPTH, then waits for 2.
        deadline = time.monotonic() + 30
        while board.board.words[0, COUNT] < DEPTH and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        ahead = int(board.board.words[0, COUNT])
        got = [await g.broadcast(np.empty(16, np.int64)) for _ in range(calls)]
        return ahead, got, _ran(g, "broadcast")

    count, (ahead, got, ran) = await run_ranks(2, fn, transport="ipc")
    assert count == calls and ahead == DEPTH
    assert all(np.array_equal(a, np.full(16, i)) for i, a in enumerate(got))
    assert ran == {"shm": calls}


async def test_a_receiver_learns_each_new_layout_from_the_board_and_checks_its_buffer() -> None:
    """A loop of broadcasts whose layout changes (and comes back) is learned anew each
    time; a buffer that does not fit the root's layout is a mismatch after a layout the
    receiver learned before, as before it."""
    shapes = [(4,), (4,), (2, 3), {"a": (5,), "b": (1,)}, (4,), (2, 3)]

    def value(shape: Any, k: int) -> Any:
        if isinstance(shape, dict):
            return {key: np.full(s, k, np.float32) for key, s in shape.items()}
        return np.full(shape, k, np.float32)

    async def fn(g: p2pcoll.Group) -> Any:
        got = [await g.broadcast(value(shape, k) if g.rank == 0 else None)
               for k, shape in enumerate(shapes)]
        err = None
        if g.rank == 0:
            await g.broadcast(value((4,), 9))
        else:
            with pytest.raises(p2pcoll.CollectiveMismatch) as info:
                await g.broadcast(np.empty(5, np.float32))
            err = info.value
        return got, err

    for rank, (got, err) in enumerate(await run_ranks(2, fn, transport="ipc")):
        for k, (shape, a) in enumerate(zip(shapes, got, strict=True)):
            want = value(shape, k)
            if isinstance(shape, dict):
                assert a.keys() == want.keys()
                assert all(np.array_equal(a[key], want[key]) for key in want), (rank, k)
            else:
                assert np.array_equal(a, want) and a.shape == want.shape, (rank, k)
        assert (err is None) == (rank == 0), (rank, err)
        assert err is None or "float32[4]" in str(err), err


async def test_a_corrupt_line_on_the_board_is_an_error_naming_the_rank() -> None:
    async def fn(g: p2pcoll.Group) -> Any:
        await g.allreduce(np.ones(4))  # count 1 done everywhere
        await g.barrier()  # count 2
        if g.rank == 1:
            board = g.session.board
            assert board is not None
            # Rank 1 publishes count 3 with a size no slot holds: a hostile peer.
            words = board.board.words
            words[1, PARITY + FIELDS * (3 % DEPTH) + NBYTES] = 1 << 40
            words[1, COUNT] = 3
            await asyncio.sleep(1)
            return None
        with pytest.raises(p2pcoll.P2PCollError) as info:
            await g.allreduce(np.ones(4), timeout=10)
        return info.value

    results = await run_ranks(2, fn, transport="ipc", return_exceptions=True)
    err = results[0]
    assert isinstance(err, p2pcoll.ProtocolError) and "rank 1" in str(err), repr(err)
    assert PARITY + FIELDS * DEPTH <= WORDS


class _NothingToReport:
    """A board path's matcher where nothing fails and no message comes."""

    def note_waiting(self, op: object, ranks: object) -> None:
        pass

    def failure(self, op: object) -> None:
        return None

    def stray(self, op: object) -> None:
        return None


async def test_a_sleeper_is_woken_once_by_the_peer_that_completes_its_wait() -> None:
    # Three ranks' paths on one board in this process (so none polls: each wait looks
    # once, then sleeps); the wake-ups each rank writes are recorded, not sent.
    owner = Board.create(0, 3, tag=11)
    boards = [owner, *(Board.attach(owner.name, r, 3, 11) for r in (1, 2))]
    woken: list[tuple[int, int]] = []
    for board in boards:
        board.wake = lambda q, by=board.rank: woken.append((by, q))
    paths = [BoardPath(board, _NothingToReport(), 50e-6) for board in boards]  # type: ignore[arg-type]
    try:
        # Rank 0 waits for every other rank's count 1 (an allreduce).
        sleeper = asyncio.create_task(paths[0]._wait(1, [1, 2], seq=1))
        await asyncio.sleep(0)
        assert boards[0].words[0, SLEEPING] == 1
        paths[1]._publish(1)
        assert woken == []  # rank 2 is not there yet: nothing to wake rank 0 for
        paths[2]._publish(1)
        assert woken == [(2, 0)]
        paths[1]._publish(2)  # the next collective, before rank 0 has run: once a nap
        paths[2]._publish(2)
        assert woken == [(2, 0)]
        boards[0].on_wake()  # the byte arrives
        await asyncio.wait_for(sleeper, 10)

        # A broadcast's receiver waits for its root (rank 2) only; a wake-up for
        # something else (a lane's message) finds it incomplete: it sleeps again, and
        # the root's publication wakes that nap.
        sleeper = asyncio.create_task(paths[0]._wait(3, [2], seq=3))
        await asyncio.sleep(0)
        paths[1]._publish(3)
        boards[0].on_wake()
        await asyncio.sleep(0)
        assert woken == [(2, 0)] and not sleeper.done()
        paths[2]._publish(3)
        assert woken == [(2, 0), (2, 0)]
        boards[0].on_wake()
        await asyncio.wait_for(sleeper, 10)
        assert boards[0].words[0, SLEEPING] == 0

        # A line whose WANTS does not add up is woken by any publication.
        sleeper = asyncio.create_task(paths[0]._wait(4, [1, 2], seq=4))
        await asyncio.sleep(0)
        boards[0].words[0, WANTS] = 7
        paths[1]._publish(4)
        assert woken[-1] == (1, 0)
        paths[2]._publish(4)
        boards[0].on_wake()
        await asyncio.wait_for(sleeper, 10)
    finally:
        for path in paths:
            path.close()
        for board in boards:
            board.close()


_KILLED = textwrap.dedent("""
    import asyncio, os, sys, time
    import numpy as np
    import p2pcoll

    async def main():
        async with p2pcoll.join() as g:
            x = np.ones(1024, np.float32)
            for _ in range(50):
                await g.allreduce(x)
            if g.rank == 1:
                os.kill(os.getpid(), 9)  # SIGKILL: no goodbye
            started = time.monotonic()
            try:
                await g.allreduce(x, timeout=60)
            except p2pcoll.PeerLost as exc:
                print("LOST", exc.rank, round(time.monotonic() - started, 2), flush=True)
                sys.exit(0)
            print("NO ERROR", flush=True)
            sys.exit(3)

    asyncio.run(main())
""")


@pytest.mark.processes
def test_a_killed_peer_is_named_by_ranks_waiting_on_the_board(tmp_path: Any) -> None:
    script = tmp_path / "killed.py"
    script.write_text(_KILLED)
    port = free_port()
    procs = [subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env={**os.environ, "P2PCOLL_HEARTBEAT_TIMEOUT": "2", "RANK": str(rank),
                        "WORLD_SIZE": "3", "P2PCOLL_RENDEZVOUS": f"tcp://127.0.0.1:{port}"})
        for rank in range(3)]
    outcomes = finish(procs, timeout=120)
    assert outcomes[1][0] == -signal.SIGKILL
    for rank in (0, 2):
        code, out = outcomes[rank]
        assert code == 0 and "LOST 1 " in out, (rank, code, out)
        assert float(out.split("LOST 1 ")[1].split()[0]) < 5, out


def test_spin_is_a_setting_with_bounds() -> None:
    assert p2pcoll.Settings.resolve({}).spin_us == 50
    assert p2pcoll.Settings.resolve({"P2PCOLL_SPIN": "0"}).spin_us == 0
    for bad in ("-1", "20000", "fast"):
        with pytest.raises(p2pcoll.SettingsError, match="P2PCOLL_SPIN"):
            p2pcoll.Settings.resolve({"P2PCOLL_SPIN": bad})


_SPIN = textwrap.dedent("""
    import asyncio
    import numpy as np
    import p2pcoll

    async def main():
        async with p2pcoll.join() as g:
            board = g.session.board
            total = 0.0
            for i in range(200):
                total += float((await g.allreduce(np.full(16, i, np.float64)))[0])
            print("RESULT", g.rank, total, board is not None and board.spin > 0,
                  g.stats()["collectives_by_strategy"]["allreduce"], flush=True)

    asyncio.run(main())
""")


@pytest.mark.processes
@pytest.mark.parametrize("spin", ["0", "50"])
def test_processes_on_the_board_with_and_without_polling(tmp_path: Any, spin: str) -> None:
    script = tmp_path / "spin.py"
    script.write_text(_SPIN)
    port = free_port()
    procs = [subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env={**os.environ, "P2PCOLL_SPIN": spin, "RANK": str(rank),
                        "WORLD_SIZE": "2", "P2PCOLL_RENDEZVOUS": f"tcp://127.0.0.1:{port}"})
        for rank in range(2)]
    for code, out in finish(procs, timeout=120):
        assert code == 0, out
        _, _, total, polled, ran = out.split("\n")[0].split(" ", 4)
        assert float(total) == 2 * sum(range(200)) and ran == "{'shm': 200}"
        assert polled == str(spin != "0")  # whatever the cores: it yields between polls


async def test_the_board_file_is_gone_once_every_peer_has_mapped_it() -> None:
    async def fn(g: p2pcoll.Group) -> Any:
        board = g.session.board
        assert board is not None
        name = board.board.name
        await g.allreduce(np.ones(4))
        await g.barrier()
        return name, os.path.exists(os.path.join("/dev/shm", name))

    results = await run_ranks(3, fn, transport="ipc")
    assert len({name for name, _ in results}) == 1
    assert not any(exists for _, exists in results)


async def test_a_message_collective_after_a_board_one_finds_its_ring_released() -> None:
    """A board collective whose peers are there never yields to the event loop, so the
    shared-memory ring's releases of what the previous large collective sent are still
    queued; the runner turns the loop once before a message collective that follows a board
    one (BoardPath.owes_turn), and the 1 MiB pieces go through the ring every time, not
    over the socket."""
    big = np.ones(1 << 18, np.float32)  # 1 MiB

    async def fn(g: p2pcoll.Group) -> Any:
        board = g.session.board
        assert board is not None
        counters = g.session.transport.counters
        owed = []
        for _ in range(10):
            await g.barrier()
            owed.append(board.owes_turn)
            before = (counters.bytes_sent, counters.bytes_sent_shm)
            total = await g.allreduce(big, strategy="ring")
            assert (total == 2.0).all()
            owed.append(board.owes_turn)
            sent, shm = counters.bytes_sent - before[0], counters.bytes_sent_shm - before[1]
            assert sent >= big.nbytes // 2 and shm == sent, (sent, shm)
        return owed

    for owed in await run_ranks(2, fn, transport="ipc"):
        assert owed == [True, False] * 10
