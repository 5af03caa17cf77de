"""The instrumentation seam: the executor's primitives (``executor.wire``) and the
transports' ``sent``/``delivered`` hooks, which the timeline and the profiler use instead
of patching private names."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import p2pcoll
from p2pcoll.engine.executor import Wire, combine
from p2pcoll.testing import memory_groups, run_ranks
from p2pcoll.wire import Header

ROOT = Path(__file__).resolve().parents[1]
Record = list[tuple[str, int, int, int, int]]  # (event, rank, peer, seq, nbytes)


def hook(record: Record, event: str, rank: int) -> Callable[[int, Header, int], None]:
    """A hook that records each call as ``(event, rank, peer, seq, nbytes)``."""
    def called(peer: int, header: Header, nbytes: int) -> None:
        assert header.kind == "data" and sum(header.nbytes) == nbytes
        record.append((event, rank, peer, header.seq, nbytes))
    return called


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
@pytest.mark.parametrize("n", [2, 3])
def test_hooks_see_each_data_message_once_with_its_peer_and_size(transport: str, n: int) -> None:
    record: Record = []
    elements = 12  # float64: the ring's chunks are 12/n elements

    async def work(g: p2pcoll.Group) -> np.ndarray:
        t = g.session.transport
        t.sent, t.delivered = hook(record, "sent", g.rank), hook(record, "delivered", g.rank)
        await g.barrier()  # every rank's hooks are in before the first message
        x = np.full(elements, g.rank + 1.0)
        out: np.ndarray = await g.allreduce(x, strategy="ring")
        await g.barrier(strategy="dissemination")  # every message of the allreduce has been handed on
        t.sent = t.delivered = None
        return out

    results = asyncio.run(run_ranks(n, work, transport=transport))
    assert all((r == n * (n + 1) / 2).all() for r in results)
    ring = [e for e in record if e[3] == 1]  # the allreduce's messages (seq 1)
    chunk = elements // n * 8
    # A ring of n: 2(n-1) messages from each rank to its right, each one chunk.
    expected_sent = sorted(("sent", r, (r + 1) % n, 1, chunk)
                           for r in range(n) for _ in range(2 * (n - 1)))
    expected_delivered = sorted(("delivered", (r + 1) % n, r, 1, chunk)
                                for r in range(n) for _ in range(2 * (n - 1)))
    assert sorted(e for e in ring if e[0] == "sent") == expected_sent
    assert sorted(e for e in ring if e[0] == "delivered") == expected_delivered


def test_small_collectives_on_the_board_send_no_data_messages() -> None:
    record: Record = []

    async def work(g: p2pcoll.Group) -> None:
        t = g.session.transport
        t.sent, t.delivered = hook(record, "sent", g.rank), hook(record, "delivered", g.rank)
        for _ in range(3):
            await g.allreduce(np.ones(16))
        t.sent = t.delivered = None

    asyncio.run(run_ranks(2, work, transport="ipc"))
    assert record == []


def test_tracing_off_wraps_nothing() -> None:
    async def work(g: p2pcoll.Group) -> None:
        session = g.session
        transport, executor = session.transport, session.executor
        assert transport.sent is None and transport.delivered is None
        assert executor.timeline is None
        wire = executor.wire
        # The primitives are the transport's and the matcher's own methods, unwrapped.
        assert wire.send_many == transport.send_many
        assert wire.send_many.__func__ is type(transport).send_many  # type: ignore[attr-defined]
        assert wire.get == session.matcher.get
        assert wire.combine is combine
        await g.allreduce(np.ones(1000), strategy="ring")
        assert executor.wire is wire and transport.sent is None

    asyncio.run(run_ranks(2, work, transport="tcp"))


def test_executor_runs_over_primitives_it_is_handed() -> None:
    async def main() -> None:
        groups = await memory_groups(3)
        calls: dict[str, int] = {"send_many": 0, "get": 0, "combine": 0}

        def counted(wire: Wire) -> Wire:
            async def send_many(*args, **kwargs):  # type: ignore[no-untyped-def]
                calls["send_many"] += 1
                return await wire.send_many(*args, **kwargs)

            async def get(key):  # type: ignore[no-untyped-def]
                calls["get"] += 1
                return await wire.get(key)

            def combine_(*args):  # type: ignore[no-untyped-def]
                calls["combine"] += 1
                wire.combine(*args)

            return Wire(send_many, get, combine_)

        for g in groups:
            g.session.executor.wire = counted(g.session.executor.wire)
        out = await asyncio.gather(*(g.allreduce(np.full(9, g.rank + 1.0), strategy="ring")
                                     for g in groups))
        assert all((o == 6.0).all() for o in out)
        # A ring of 3: each rank sends 4 messages and receives and folds in 4.
        assert calls == {"send_many": 12, "get": 12, "combine": 12}
        await asyncio.gather(*(g.close() for g in groups))

    asyncio.run(main())


def test_memory_transport_hooks() -> None:
    async def main() -> None:
        groups = await memory_groups(2)
        record: Record = []
        for g in groups:
            t = g.session.transport
            t.sent, t.delivered = hook(record, "sent", g.rank), hook(record, "delivered", g.rank)
        await asyncio.gather(*(g.allreduce(np.ones(8, np.float32), strategy="ring")
                               for g in groups))
        await asyncio.gather(*(g.close() for g in groups))
        assert sorted(record) == sorted(
            [("sent", r, 1 - r, 0, 16) for r in (0, 1) for _ in range(2)]
            + [("delivered", r, 1 - r, 0, 16) for r in (0, 1) for _ in range(2)])

    asyncio.run(main())


@pytest.mark.processes
def test_profile_script_prints_its_table() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "profile_small.py"), "--iterations", "30"],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    for line in ("world of one", "wall us/call", "main-thread CPU us/call", "board",
                 "executor", "API"):
        assert line in out, out


@pytest.mark.processes
def test_floors_script_prints_its_table() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "floors.py"), "--iterations", "50"],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    for floor in ("pyzmq blocking", "pyzmq asyncio", "p2pcoll lane", "p2pcoll board",
                  "numpy copy", "numpy add"):
        assert f"| {floor}" in done.stdout, done.stdout


@pytest.mark.parametrize("fold", [np.add, None])
def test_a_fold_ignores_floating_point_errors_and_leaves_numpys_state_as_it_was(
        fold: np.ufunc | None) -> None:
    # An overflow to inf is the sum (no warning, which the tests turn into an error), and
    # the error state set for the fold is the caller's again after it, also after a
    # mismatch it raises.
    class Piece:
        def __init__(self, data: bytes) -> None:
            self.buffer = memoryview(data)

    before = np.geterr()
    with np.errstate(over="raise", invalid="raise"):
        dst = np.full(4, 3e38, np.float32)
        combine(Header("data", "g", 0), [dst], [Piece(dst.tobytes())], fold)
        assert np.isinf(dst).all() if fold is not None else (dst == np.float32(3e38)).all()
        with pytest.raises(FloatingPointError):  # the caller's state again
            np.multiply(np.full(4, 3e38, np.float32), 10)
        with pytest.raises(ValueError):  # two targets, one piece
            combine(Header("data", "g", 0), [dst, dst], [Piece(dst.tobytes())], fold)
        assert np.geterr()["over"] == "raise"
    assert np.geterr() == before
