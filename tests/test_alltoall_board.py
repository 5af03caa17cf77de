"""All-to-all on the board (peers of one host, no strategy asked for): one round, the
lengths agreed in it, the parts in the slot or, beyond it, in each rank's shm window.

Real peers: tasks of this process over ipc, so they share the host and the board. Every
result is checked bit for bit against the blocks sent; ``stats()`` shows that no
agreement allreduce ran.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import numpy as np
import pytest

import p2pcoll
from p2pcoll.engine import board_alltoall
from p2pcoll.testing import run_ranks
from p2pcoll.transport import cross_memory
from p2pcoll.transport.board import DEPTH

from test_alltoall import block, lengths


def _ran(g: p2pcoll.Group) -> dict[str, dict[str, int]]:
    return {k: dict(v) for k, v in g.stats()["collectives_by_strategy"].items()}


async def _check(g: p2pcoll.Group, rows: np.ndarray, dtype: Any, width: int = 0,
                 into: bool = False) -> None:
    """One alltoall of ``rows`` (rank i sends rank j ``rows[i, j]`` rows), checked."""
    p, r = g.world_size, g.rank
    parts = [block(r, j, rows[r, j], dtype, width) for j in range(p)]
    out = None
    if into:
        out = [np.full(block(i, r, rows[i, r], dtype, width).shape, 99, dtype)
               for i in range(p)]
    got = await g.alltoall(parts, out=out)
    if into:
        assert got == out or all(a is b for a, b in zip(got, out, strict=True))
    for i in range(p):
        want = block(i, r, rows[i, r], dtype, width)
        assert got[i].dtype == want.dtype and got[i].shape == want.shape, (p, r, i)
        assert got[i].tobytes() == want.tobytes(), (p, r, i)


@pytest.mark.parametrize("p", [2, 3, 5, 8])
async def test_slot_and_window_sizes_are_bit_exact_in_one_round(p: int) -> None:
    """Lengths with zeros, four dtypes, 2-D rows, out= or not; small calls in the slot,
    large ones (a rank's parts over 64 KiB) in its window; no agreement allreduce."""
    async def fn(g: p2pcoll.Group) -> dict[str, dict[str, int]]:
        n = 0
        for top in (6, 3000, 40000):  # the slot; a 1 MiB window; a larger one
            for dtype in (np.float32, np.int64, np.uint8, np.float64):
                rows = lengths(p, 100 + n, top)
                await _check(g, rows, dtype, into=n % 2 == 1)
                n += 1
        await _check(g, lengths(p, 7, 500), np.float32, width=3)
        await _check(g, np.zeros((p, p), np.int64), np.float32)  # nothing at all moves
        return _ran(g)

    for ran in await run_ranks(p, fn, transport="ipc"):
        assert ran["alltoall"] == {"shm": 14}, ran
        assert "allreduce" not in ran, ran


async def test_a_changed_shape_on_one_rank_is_a_new_round_not_the_kept_one() -> None:
    """The same call twice on each parity (the kept table is used), then one rank alone
    changes a length, a dtype's width, its window's size: each result still exact."""
    p = 4

    async def fn(g: p2pcoll.Group) -> None:
        rows = lengths(p, 1, 50)
        for _ in range(4):
            await _check(g, rows, np.float32)
        changed = rows.copy()
        changed[2, 1] += 7  # rank 2 sends rank 1 more: only rank 2's header changes
        await _check(g, changed, np.float32)
        await _check(g, changed, np.float32)
        await _check(g, rows, np.float32)
        big = rows.copy()
        big[3, :] = 100_000  # rank 3 alone outgrows the slot, then its window
        await _check(g, big, np.float32)
        big[3, :] = 400_000
        await _check(g, big, np.float32)
        await _check(g, big, np.float32)
        await _check(g, rows, np.float32)  # and back into the slot
        await _check(g, rows, np.float64)

    await run_ranks(p, fn, transport="ipc")


async def test_a_loop_of_one_call_agrees_each_board_buffer_s_round_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The same call again and again, in the slot and in windows: each board buffer's round
    is agreed (its table checked, its windows mapped) on its first calls only, then kept
    (a buffer's new round once dropped the other rounds of its side, which then missed in
    turn, and every call was agreed anew)."""
    p, calls = 3, 8 * DEPTH
    agreed = [0] * p
    agree = board_alltoall.BoardAlltoall._agree

    def counting(self: board_alltoall.BoardAlltoall, *args: Any) -> Any:
        agreed[self.rank] += 1
        return agree(self, *args)

    monkeypatch.setattr(board_alltoall.BoardAlltoall, "_agree", counting)

    async def fn(g: p2pcoll.Group) -> None:
        for top in (6, 40000):  # the slot; windows
            rows = lengths(p, 3, top)
            for _ in range(calls):
                await _check(g, rows, np.float32)

    await run_ranks(p, fn, transport="ipc")
    # (the first rounds differ: a rank's header says whether it reads its peers directly
    # once it has tried)
    assert all(0 < n <= 2 * 2 * DEPTH for n in agreed), (agreed, 2 * calls)


async def test_a_round_kept_gives_new_arrays_in_the_shape_of_each_call() -> None:
    """The same lengths again (the kept round) with another row shape of as many elements,
    or another dtype of the same width: each result in its call's shape, bit for bit, and
    never a view of the board: a later call leaves earlier results as they were."""
    p = 3

    async def fn(g: p2pcoll.Group) -> None:
        r = g.rank
        rows = lengths(p, 5, 6)
        kept = []
        for n, (dtype, shape) in enumerate([(np.float32, (6,)), (np.float32, (2, 3)),
                                            (np.int32, (6,)), (np.float32, (6,)),
                                            (np.float32, (3, 2))] * 2):
            parts = [(block(r, j, rows[r, j] * 6, dtype) + n).reshape(-1, *shape)
                     for j in range(p)]
            got = await g.alltoall(parts)
            want = [(block(i, r, rows[i, r] * 6, dtype) + n).reshape(-1, *shape)
                    for i in range(p)]
            assert [(a.dtype, a.shape) for a in got] == [(a.dtype, a.shape) for a in want]
            assert [a.tobytes() for a in got] == [a.tobytes() for a in want], n
            kept.append((got, [a.copy() for a in want]))
        for got, want in kept:
            assert [a.tobytes() for a in got] == [a.tobytes() for a in want]
            assert all(a.flags.writeable and a.flags.c_contiguous for a in got)

    await run_ranks(p, fn, transport="ipc")


async def _outcome(aw: Any) -> Any:
    try:
        return await aw
    except p2pcoll.P2PCollError as exc:
        return exc


@pytest.mark.parametrize("case", ["lengths", "dtype", "parts", "after_kept"])
async def test_a_mismatch_is_found_in_the_round_itself_and_named_on_every_rank(
        case: str) -> None:
    """No agreement allreduce runs, yet every rank raises the same CollectiveMismatch
    naming the pair before reading any data; the group goes on (a correct call after)."""
    p = 3

    async def fn(g: p2pcoll.Group) -> tuple[Any, dict[str, dict[str, int]]]:
        r = g.rank
        parts = [np.ones(2, np.float32) for _ in range(p)]
        out = None
        if case == "lengths":
            out = [np.empty(2, np.float32) for _ in range(p)]
            if r == 2:
                out[0] = np.full(5, 7, np.float32)  # rank 0 sends 2
        elif case == "dtype" and r == 1:
            parts = [np.ones(2, np.int32) for _ in range(p)]
        elif case == "parts" and r == 2:
            parts = parts[:2]
        elif case == "after_kept":
            for _ in range(3):  # both parities keep this call's table
                await g.alltoall(parts)
            if r == 1:
                parts[2] = np.ones(3, np.float32)  # rank 2 expects 2 from rank 1
            out = [np.empty(2, np.float32) for _ in range(p)] if r == 2 else None
        got = await _outcome(g.alltoall(parts, out=out))
        if case == "lengths" and r == 2:
            assert out is not None and np.all(out[0] == 7)  # nothing was read
        await _check(g, lengths(p, 5), np.float32)  # the group is usable
        return got, _ran(g)

    words = {"lengths": "rank 0 sends rank 2 2 rows, rank 2 expects 5 from rank 0",
             "dtype": "rank 0 sends float32, rank 1 sends int32",
             "parts": "rank 2 passed 2 parts",
             "after_kept": "rank 1 sends rank 2 3 rows, rank 2 expects 2 from rank 1"}[case]
    for exc, ran in await run_ranks(p, fn, transport="ipc"):
        assert isinstance(exc, p2pcoll.CollectiveMismatch), exc
        assert words in str(exc)
        assert "allreduce" not in ran and set(ran["alltoall"]) == {"shm"}, ran


async def test_a_peer_that_leaves_mid_exchange_is_peer_lost_naming_it() -> None:
    """Rank 1 writes nothing and leaves: the others, waiting in the round, are told."""
    async def fn(g: p2pcoll.Group) -> Any:
        await _check(g, lengths(3, 2, 30000), np.float32)  # windows in place
        if g.rank == 1:
            await g.close("going away")
            return None
        started = time.monotonic()
        with pytest.raises(p2pcoll.PeerLost) as info:
            await g.alltoall([np.ones(30000, np.float32)] * 3, timeout=30)
        return time.monotonic() - started, info.value

    results = await run_ranks(3, fn, transport="ipc", return_exceptions=True)
    for rank in (0, 2):
        elapsed, err = results[rank]
        assert err.rank == 1 and elapsed < 30 / 2, (rank, elapsed, err)  # not the deadline


async def test_a_window_name_that_is_not_ours_is_a_protocol_error_naming_the_rank() -> None:
    """A hostile rank 1 names a file outside /dev/shm's own as its window: its peers map
    nothing and raise ProtocolError naming it."""
    async def fn(g: p2pcoll.Group) -> Any:
        rows = np.full((3, 3), 30000)
        for _ in range(2):  # a window of each parity
            await _check(g, rows, np.float32)
        if g.rank == 1:
            exchange = g.session.runner._alltoall
            assert exchange is not None
            for tail in exchange._tails:
                tail[board_alltoall.NAME:] = np.frombuffer(
                    b"../../etc/passwd".ljust(8 * board_alltoall.NAME_WORDS, b"\0"), np.int64)
        return await _outcome(g.alltoall([np.ones(30000, np.float32)] * 3, timeout=20))

    results = await run_ranks(3, fn, transport="ipc")
    for rank in (0, 2):
        assert isinstance(results[rank], p2pcoll.ProtocolError), results[rank]
        assert "rank 1's alltoall window" in str(results[rank]), results[rank]
    # Rank 1 read good headers: its round may end before the others' errors reach it.
    assert isinstance(results[1], (list, p2pcoll.P2PCollError)), results[1]


async def test_windows_are_unlinked_once_mapped_and_gone_after_close() -> None:
    async def fn(g: p2pcoll.Group) -> tuple[list[str], list[bool]]:
        await _check(g, np.full((3, 3), 30000), np.float32)  # a window of each parity
        await _check(g, np.full((3, 3), 30000), np.float32)
        exchange = g.session.runner._alltoall
        assert exchange is not None
        names = [w.name for w in exchange._own if w is not None]
        assert len(names) == 2
        await _check(g, np.full((3, 3), 30000), np.float32)  # each mapped by every peer
        await _check(g, np.full((3, 3), 30000), np.float32)
        await g.barrier()  # every rank's fourth call is over
        return names, [os.path.exists(os.path.join("/dev/shm", n)) for n in names]

    named = await run_ranks(3, fn, transport="ipc")
    names = [name for names, _ in named for name in names]
    assert len(set(names)) == 6
    assert not any(exists for _, linked in named for exists in linked), named
    assert not [n for n in names if os.path.exists(os.path.join("/dev/shm", n))]


@pytest.mark.parametrize("p", [2, 3, 5])
async def test_parts_read_where_they_are_are_bit_exact(p: int,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """With every size over the direct threshold, a rank's parts for others are read from
    its own arrays (cross-memory attach) once every peer said it can: no window is made,
    and each result is exact, also with out=, zeros and a change of shape."""
    if not cross_memory.available():
        pytest.skip("no process_vm_readv on this platform")  # the shm path is tested above
    monkeypatch.setattr(board_alltoall, "DIRECT_BYTES", 1)
    reads = []
    real = cross_memory.read

    def read(pid: int, address: int, into: np.ndarray) -> None:
        reads.append(into.nbytes)
        real(pid, address, into)

    monkeypatch.setattr(cross_memory, "read", read)

    async def fn(g: p2pcoll.Group) -> tuple[bool, list[Any]]:
        for n in range(8):
            rows = lengths(p, 60 + n, 20000 if n % 3 else 5)
            await _check(g, rows, (np.float32, np.int64)[n % 2], into=n % 4 == 1)
        exchange = g.session.runner._alltoall
        assert exchange is not None
        return exchange._read_by_all, exchange._own

    for read_by_all, own in await run_ranks(p, fn, transport="ipc"):
        assert read_by_all
        # The first round (before any rank knew) may have made one window, no more.
        assert sum(w is not None for w in own) <= 1, own
    assert sum(reads) > 20000 * p, reads  # the parts came that way, not only the probes


async def test_peers_that_attach_to_the_board_late_are_still_read_where_they_are(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer maps the board when rank 0's hello reaches it, which may be after a rank
    made its exchange: made while every other rank's pid still read 0, the exchange
    still reads them directly (it takes their pids at its first round, not when made)."""
    if not cross_memory.available():
        pytest.skip("no process_vm_readv on this platform")  # the shm path is tested above
    monkeypatch.setattr(board_alltoall, "DIRECT_BYTES", 1)
    made = board_alltoall.BoardAlltoall.__init__
    attached = board_alltoall.ATTACHED

    def made_before_the_others_attached(self: Any, path: Any) -> None:
        pids = path.board.words[:, attached].copy()
        path.board.words[:, attached] = 0
        path.board.words[path.rank, attached] = pids[path.rank]
        try:
            made(self, path)  # synchronous: no other rank runs meanwhile
        finally:
            path.board.words[:, attached] = pids

    monkeypatch.setattr(board_alltoall.BoardAlltoall, "__init__",
                        made_before_the_others_attached)

    async def fn(g: p2pcoll.Group) -> bool:
        for n in range(3):
            await _check(g, lengths(3, 70 + n, 20000), np.float32)
        exchange = g.session.runner._alltoall
        assert exchange is not None
        return exchange._read_by_all

    assert await run_ranks(3, fn, transport="ipc") == [True, True, True]


async def test_calls_in_flight_together_keep_their_order_on_the_board() -> None:
    async def fn(g: p2pcoll.Group) -> None:
        p = g.world_size
        await asyncio.gather(*(_check(g, lengths(p, s, 20000 if s % 2 else 5), np.int64)
                               for s in range(6)))

    await run_ranks(4, fn, transport="ipc")


async def test_lengths_that_change_every_call_reuse_one_program_and_stay_bit_exact() -> None:
    """1,000 calls, new random lengths each (zeros among them; every 50th call in windows;
    int64 with out= every 7th): every result bit for bit against numpy, the flight record
    naming each call's own bytes and shapes, and nothing kept grows with the calls: one
    prepared program for all of them (each new set of lengths once built its own, 256 of
    them pushing the session's other programs out), at most MAX_SHAPES shapes, DEPTH
    rounds and two windows per peer. (The flight record checked every 100th call: it
    lists the whole record.)"""
    p, calls = 4, 1000

    async def fn(g: p2pcoll.Group) -> list[int]:
        r = g.rank
        await g.allreduce(np.ones(3))  # a program of another collective, kept throughout
        programs = len(g.session.runner.programs)
        sizes = []
        for n in range(calls):
            rows = lengths(p, 10_000 + n, 20000 if n % 50 == 49 else 300)
            dtype = np.int64 if n % 7 == 0 else np.float32
            parts = [block(r, j, rows[r, j], dtype) + n % 97 for j in range(p)]
            out = ([np.empty(rows[i, r], dtype) for i in range(p)] if n % 7 == 0 else None)
            got = await g.alltoall(parts, out=out)
            for i in range(p):
                want = block(i, r, rows[i, r], dtype) + n % 97
                assert got[i].dtype == want.dtype and got[i].tobytes() == want.tobytes(), n
            if n % 100 == 0:
                entry = g.flight_record()[-1]
                assert entry["bytes"] == sum(a.nbytes for a in parts), (n, entry)
                assert entry["shapes"] == [[int(rows[r, j])] for j in range(p)], (n, entry)
            sizes.append(len(g.session.runner.programs) - programs)
        on_board = g.session.runner._alltoall
        assert on_board is not None
        assert len(on_board._shapes) <= board_alltoall.MAX_SHAPES
        assert len(on_board._agreed) == DEPTH and len(on_board._theirs) <= 2 * (p - 1)
        await g.allreduce(np.ones(3))
        assert len(g.session.runner.programs) == programs + 1
        return sizes

    for sizes in await run_ranks(p, fn, transport="ipc"):
        assert max(sizes) == 1, sizes[:20]


async def test_calls_in_flight_together_each_record_their_own_lengths() -> None:
    """The one program's flight entry is set per call just before the runner reads it:
    calls started together (each takes its number before the next starts) still record
    their own bytes and shapes."""
    p = 3

    async def fn(g: p2pcoll.Group) -> None:
        r = g.rank
        tables = [lengths(p, 50 + s, 400) for s in range(4)]
        calls = [[block(r, j, rows[r, j], np.float32) for j in range(p)] for rows in tables]
        await asyncio.gather(*(g.alltoall(parts) for parts in calls))
        record = [e for e in g.flight_record() if e["collective"] == "alltoall"][-4:]
        assert [e["bytes"] for e in record] == [sum(a.nbytes for a in parts)
                                                for parts in calls]
        assert [e["shapes"] for e in record] == [[list(a.shape) for a in parts]
                                                 for parts in calls]

    await run_ranks(p, fn, transport="ipc")
