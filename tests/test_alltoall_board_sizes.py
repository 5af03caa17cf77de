"""The board's all-to-all, bit-exact at every size class (parts in the slot, in the rank's
window, read from the peer's own arrays) at the group sizes that test_alltoall_board.py
leaves out (1, 4, 7, 9), with uneven lengths, zero-length parts and 2-D rows; nothing here
is timed."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import p2pcoll
from p2pcoll.engine import board_alltoall
from p2pcoll.testing import run_ranks
from p2pcoll.transport import cross_memory

from test_alltoall import lengths
from test_alltoall_board import _check


async def _rounds(g: p2pcoll.Group, tops: tuple[int, ...]) -> int:
    """Alltoalls of lengths up to each of ``tops`` (rows of float32 / int64), each checked
    bit for bit; how many of them ran on the board."""
    p = g.world_size
    for n, top in enumerate(tops):
        rows = lengths(p, 500 + n, top)
        rows[0, p - 1] = 0  # a zero part at every p
        await _check(g, rows, (np.float32, np.int64)[n % 2], width=3 * (n % 3 == 2),
                     into=n % 2 == 1)
    ran = g.stats()["collectives_by_strategy"].get("alltoall", {})
    return int(ran.get("shm", 0))


@pytest.mark.parametrize("p", [1, 2, 3, 4, 7, 9])
async def test_slot_and_window_sizes_are_bit_exact(p: int) -> None:
    """In the slot (up to 6 rows), in a 1 MiB window (3,000) and a larger one (40,000)."""
    async def fn(g: p2pcoll.Group) -> int:
        return await _rounds(g, (6, 3000, 40000, 5, 2000, 40000))

    for on_board in await run_ranks(p, fn, transport="ipc"):
        assert on_board == (6 if p > 1 else 0), on_board


@pytest.mark.parametrize("p", [2, 3, 4, 7])
async def test_parts_read_where_they_are_are_bit_exact(
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

    async def fn(g: p2pcoll.Group) -> bool:
        await _rounds(g, (20000, 30000, 25000, 20000))
        exchange: Any = g.session.runner._alltoall
        return bool(exchange._read_by_all)

    assert all(await run_ranks(p, fn, transport="ipc"))
    assert sum(reads) > 20000 * p  # the parts came that way, not only the probes
