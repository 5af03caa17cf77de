"""The board's all-to-all copies its part of each peer's parts out in the shifted rounds
of a pairwise exchange (rank r from r + 1, then r + 2, ...), at every size class: parts in
the slot, in the rank's window, and read from the peer's own arrays. Results bit-exact
with uneven lengths and zeros; nothing here is timed."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import p2pcoll
from p2pcoll.engine import board_alltoall
from p2pcoll.engine.board_alltoall import shifted
from p2pcoll.testing import run_ranks
from p2pcoll.transport import cross_memory

from test_alltoall import lengths
from test_alltoall_board import _check


def test_shifted_is_every_peer_once_starting_after_the_rank() -> None:
    assert shifted(0, 1) == []
    assert shifted(1, 4) == [2, 3, 0]
    assert shifted(3, 4) == [0, 1, 2]
    for p in range(1, 10):
        for r in range(p):
            order = shifted(r, p)
            assert sorted(order) == [q for q in range(p) if q != r]
            assert order[:1] == ([(r + 1) % p] if p > 1 else [])


async def _rounds(g: p2pcoll.Group, tops: tuple[int, ...]) -> list[list[int]]:
    """Alltoalls of lengths up to each of ``tops`` (rows of float32 / int64), each checked
    bit for bit; the order of the peers of each call's agreed round."""
    p, orders = g.world_size, []
    for n, top in enumerate(tops):
        rows = lengths(p, 500 + n, top)
        rows[0, p - 1] = 0  # a zero part at every p
        await _check(g, rows, (np.float32, np.int64)[n % 2], width=3 * (n % 3 == 2),
                     into=n % 2 == 1)
        exchange = g.session.runner._alltoall
        if exchange is not None:  # (p = 1: no board)
            agreed = [a for a in exchange._agreed if a is not None]
            orders.append(list(agreed[-1].spans) if agreed else [])
    return orders


@pytest.mark.parametrize("p", [1, 2, 3, 4, 7, 9])
async def test_slot_and_window_rounds_copy_out_in_shifted_order(p: int) -> None:
    """In the slot (up to 6 rows), in a 1 MiB window (3,000) and a larger one (40,000)."""
    async def fn(g: p2pcoll.Group) -> list[list[int]]:
        return await _rounds(g, (6, 3000, 40000, 5, 2000, 40000))

    for rank, orders in enumerate(await run_ranks(p, fn, transport="ipc")):
        assert all(order == shifted(rank, p) for order in orders), (rank, orders)


@pytest.mark.parametrize("p", [2, 3, 4, 7])
async def test_parts_read_where_they_are_are_read_in_shifted_order(
        p: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every size over the direct threshold: each peer's part read from its arrays."""
    if not cross_memory.available():
        pytest.skip("no process_vm_readv on this platform")
    monkeypatch.setattr(board_alltoall, "DIRECT_BYTES", 1)
    reads: list[int] = []
    real = cross_memory.read

    def read(pid: int, address: int, into: np.ndarray) -> None:
        reads.append(into.nbytes)
        real(pid, address, into)

    monkeypatch.setattr(cross_memory, "read", read)

    async def fn(g: p2pcoll.Group) -> tuple[list[list[int]], bool]:
        orders = await _rounds(g, (20000, 30000, 25000, 20000))
        exchange: Any = g.session.runner._alltoall
        return orders, exchange._read_by_all

    for rank, (orders, read_by_all) in enumerate(await run_ranks(p, fn, transport="ipc")):
        assert read_by_all
        assert all(order == shifted(rank, p) for order in orders), (rank, orders)
    assert sum(reads) > 20000 * p  # the parts came that way, not only the probes
