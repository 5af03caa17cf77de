"""A peer that leaves as soon as its part of a collective is done must not break the others.

The README allows it: "a rank whose part of a collective only sends (the root of a
broadcast) may return before a peer objects". So a root that closes its group the moment
``broadcast`` (or ``scatter``) returns is correct user code, and every other rank must still
get the root's data exactly, whichever rank forwards it (binomial, pipeline) and in whatever
order the peers started. Likewise a process may form a new group right after closing one.

Real peers over real sockets, as tasks of one event loop (spawned here, with start delays,
rather than through ``p2pcoll.testing.run_ranks``, which starts everyone together), and once
as processes under ``p2pcoll launch``.
"""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
import textwrap
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import p2pcoll
from p2pcoll.testing import free_port

ROOT = Path(__file__).resolve().parents[1]
JOIN_TIMEOUT = 30.0  # seconds; a peer that never forms becomes an error, not a hang
COLLECTIVE_TIMEOUT = 30.0
START_STEP = 0.02  # seconds between two peers' starts
KIB, MIB = 1 << 10, 1 << 20
LARGE = 3 * MIB  # above the 1 MiB pipeline segment, so the data goes as several segments

BROADCAST = sorted(p2pcoll.available_strategies()["broadcast"])
SCATTER = sorted(p2pcoll.available_strategies()["scatter"])
CASES = [("broadcast", s) for s in BROADCAST] + [("scatter", s) for s in SCATTER]
CASE_IDS = [f"{c}-{s}" for c, s in CASES]


def start_order(order: str, p: int, root: int, seed: str) -> list[int]:
    """The ranks in the order they start."""
    others = [r for r in range(p) if r != root]
    if order == "root_first":
        return [root, *others]
    if order == "root_last":
        return [*others, root]
    if order == "reverse":
        return list(range(p - 1, -1, -1))
    assert order == "random"
    ranks = list(range(p))
    random.Random(seed).shuffle(ranks)
    return ranks


async def spawn(
    p: int, order: Sequence[int], peer: Callable[[p2pcoll.Group], Awaitable[Any]],
    url: str | None = None,
) -> list[Any]:
    """Start rank ``order[i]`` after ``i * START_STEP`` seconds; each joins ``url`` (rank 0
    hosting the rendezvous, as users do), runs ``peer(group)`` and closes its group (again:
    ``close`` is idempotent). Returns each rank's result or exception, in rank order."""
    url = url or f"tcp://127.0.0.1:{free_port()}"
    delays = {rank: i * START_STEP for i, rank in enumerate(order)}

    async def one(rank: int) -> Any:
        await asyncio.sleep(delays[rank])
        g = await p2pcoll.join(url, world_size=p, rank=rank, timeout=JOIN_TIMEOUT,
                               collective_timeout=COLLECTIVE_TIMEOUT)
        try:
            return await peer(g)
        finally:
            await g.close()

    return list(await asyncio.gather(*(one(r) for r in range(p)), return_exceptions=True))


def failures(results: Sequence[Any]) -> list[str]:
    return [f"rank {r}: {type(x).__name__}: {x}" for r, x in enumerate(results)
            if isinstance(x, BaseException)]


async def root_leaves_at_once(
    collective: str, strategy: str, p: int, root: int, nbytes: int, order: str
) -> None:
    """The root closes its group right after its part; every other rank checks its data."""
    seed = f"{collective}-{strategy}-{p}-{root}-{nbytes}-{order}"
    rng = np.random.default_rng(list(seed.encode()))
    if collective == "broadcast":
        data: Any = rng.random(nbytes // 8)  # float64: exact bits are checked
    else:  # scatter: one part per rank, of differing lengths
        data = [rng.random(nbytes // 8 + r) for r in range(p)]

    async def peer(g: p2pcoll.Group) -> bool:
        if g.rank == root:
            if collective == "broadcast":
                await g.broadcast(data, root=root, strategy=strategy)
            else:
                await g.scatter(data, root=root, strategy=strategy)
            await g.close()  # leave at once, before anyone else has its data
            return True
        if collective == "broadcast":
            got, want = await g.broadcast(None, root=root, strategy=strategy), data
        else:
            got, want = await g.scatter(None, root=root, strategy=strategy), data[g.rank]
        assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape)
        assert np.array_equal(got, want), f"rank {g.rank} got other data than the root's"
        return True

    results = await spawn(p, start_order(order, p, root, seed), peer)
    assert not failures(results), (
        f"{collective} {strategy} p={p} root={root} {nbytes} B, started {order}: "
        + "; ".join(failures(results))
    )
    assert results == [True] * p


# The full matrix at 1 KiB with two start orders; the other orders and the large size on a
# subset of sizes, to keep the file well under a minute on two cores. Groups of more than
# DEFAULT_P peers go in the slow tier.
DEFAULT_P = 4
SMALL = [
    pytest.param(c, s, p, root, order, id=f"{cid}-p{p}-root{root}-{order}",
                 marks=() if p <= DEFAULT_P else pytest.mark.slow)
    for (c, s), cid in zip(CASES, CASE_IDS)
    for p in range(2, 9)
    for root in sorted({0, p - 1})
    for order in ("root_first", "root_last")
]
SMALL_ORDERS = [  # reverse with root p-1: the root starts first, the rendezvous host last
    pytest.param(c, s, p, root, order, id=f"{cid}-p{p}-root{root}-{order}",
                 marks=() if p <= DEFAULT_P else pytest.mark.slow)
    for (c, s), cid in zip(CASES, CASE_IDS)
    for p in (3, 5, 8)
    for root, order in ((p - 1, "reverse"), (0, "random"), (p - 1, "random"))
]
LARGE_CASES = [
    pytest.param(c, s, p, root, order, id=f"{cid}-p{p}-root{root}-{order}")
    for (c, s), cid in zip(CASES, CASE_IDS)
    for p, root, order in ((2, 1, "root_last"), (4, 0, "root_first"), (5, 4, "random"))
]


@pytest.mark.parametrize(("collective", "strategy", "p", "root", "order"), SMALL + SMALL_ORDERS)
async def test_root_leaves_right_after_small(
    collective: str, strategy: str, p: int, root: int, order: str
) -> None:
    await root_leaves_at_once(collective, strategy, p, root, KIB, order)


@pytest.mark.parametrize(("collective", "strategy", "p", "root", "order"), LARGE_CASES)
async def test_root_leaves_right_after_large(
    collective: str, strategy: str, p: int, root: int, order: str
) -> None:
    await root_leaves_at_once(collective, strategy, p, root, LARGE, order)


SCRIPT = textwrap.dedent(
    """
    import asyncio, sys

    import numpy as np
    import p2pcoll

    async def main() -> None:
        strategy = sys.argv[1]
        data = np.arange(128, dtype=np.float64) * 1.5  # 1 KiB
        g = await p2pcoll.join(timeout=30, collective_timeout=30)  # all from the launcher
        if g.rank == 0:
            await g.broadcast(data, root=0, strategy=strategy)
            await g.close()  # and the process exits at once
            return
        try:
            got = await g.broadcast(None, root=0, strategy=strategy)
            assert np.array_equal(got, data), f"rank {g.rank} got {got[:4]}..."
        finally:
            await g.close()

    asyncio.run(main())
    """
)


@pytest.mark.processes
@pytest.mark.parametrize("attempt", range(5))
@pytest.mark.parametrize("strategy", ["binomial", "pipeline"])
def test_root_process_exits_right_after_broadcast(
    tmp_path: Path, strategy: str, attempt: int
) -> None:
    """Four processes under ``p2pcoll launch``; rank 0 exits right after its broadcast. The
    bug is timing-dependent, so each strategy runs five times."""
    script = tmp_path / "early_exit.py"
    script.write_text(SCRIPT)
    run = subprocess.run(
        [sys.executable, "-m", "p2pcoll", "launch", "-n", "4", "--",
         sys.executable, str(script), strategy],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )
    assert run.returncode == 0, f"exit code {run.returncode}\n{run.stdout}\n{run.stderr}"


@pytest.mark.parametrize("port", ["new", "same"])
async def test_second_group_right_after_the_first(port: str) -> None:
    """Each of 3 peers forms a group, allreduces, closes and forms the next one at once, four
    groups in a row (rank 0 hosting each), on a new port each time or always the same one."""
    p, rounds = 3, 4
    ports = [free_port()] * rounds if port == "same" else [free_port() for _ in range(rounds)]

    async def peer(rank: int) -> list[str]:
        """What went wrong in each group, "" if nothing; stops at the first that failed."""
        outcomes = []
        for k in range(rounds):
            try:
                async with p2pcoll.join(f"tcp://127.0.0.1:{ports[k]}", world_size=p,
                                        rank=rank, timeout=10,  # 3 peers form in far less
                                        collective_timeout=COLLECTIVE_TIMEOUT) as g:
                    mine = np.arange(1000, dtype=np.float64) + 10.0 * rank + 100.0 * k
                    total = await g.allreduce(mine)
            except Exception as exc:
                outcomes.append(f"group {k + 1}: {type(exc).__name__}: {exc}")
                break
            want = 3 * np.arange(1000, dtype=np.float64) + 10.0 * (0 + 1 + 2) + 300.0 * k
            outcomes.append("" if np.array_equal(total, want) else f"group {k + 1}: wrong sum")
        return outcomes

    results = await asyncio.gather(*(peer(r) for r in range(p)))
    problems = [f"rank {r}, {o}" for r, out in enumerate(results) for o in out if o]
    assert not problems, f"{port} port: " + "; ".join(problems)
    assert results == [[""] * rounds] * p
