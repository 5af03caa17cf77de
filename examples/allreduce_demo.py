"""Broadcast and allreduce with every installed strategy, each result checked against numpy.

    p2pcoll launch -n 4 -- python examples/allreduce_demo.py
    python examples/allreduce_demo.py            # alone: a group of one

``p2pcoll.join()`` takes everything from the environment the launcher sets. Every rank can
compute every rank's input from the rank number, so each rank checks its own results with
numpy. The inputs are small integers, exact in every dtype used here, so a sum must match
bit for bit whatever order a strategy adds in. After each check the ranks allgather their
verdicts and rank 0 prints one line. Any mismatch makes every rank exit with status 1.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import numpy as np

import p2pcoll
from p2pcoll.pytree import named_leaves, replace_leaves

N = 1000


def inputs(rank: int) -> list[Any]:
    """Rank ``rank``'s two inputs: an array and a pytree (dict, list, 0-d array, float16)."""
    i = np.arange(N)
    array = ((i * (rank + 3) + rank) % 11).astype(np.float32)
    tree = {
        "weights": (np.arange(12).reshape(4, 3) % (rank + 2)).astype(np.float64),
        "bias": np.full(3, rank + 1, dtype=np.float32),
        "layers": [np.array(rank, dtype=np.float64), (np.arange(7) * rank % 5).astype(np.float16)],
    }
    return [array, tree]


def tree_map(fn: Any, *trees: Any) -> Any:
    """``fn`` applied leaf by leaf across trees of one structure (the same leaf order)."""
    columns = zip(*([leaf for _, leaf in named_leaves(t)] for t in trees), strict=True)
    return replace_leaves(trees[0], [fn(*column) for column in columns])


def leaves(tree: Any) -> list[tuple[str, Any]]:
    """The leaves with their paths ("layers.0"), in the order the collectives use."""
    return [(path or "array", leaf) for path, leaf in named_leaves(tree)]


def describe(value: Any) -> str:
    if isinstance(value, np.ndarray):
        return f"{value.dtype}{list(value.shape)}"
    return f"pytree({len(leaves(value))} arrays)"


def compare(got: Any, want: Any, exact: bool) -> str | None:
    """None if ``got`` equals ``want`` (or, unless ``exact``, is close to it); else what differs."""
    got_leaves, want_leaves = leaves(got), leaves(want)
    if [p for p, _ in got_leaves] != [p for p, _ in want_leaves]:
        return f"structure {[p for p, _ in got_leaves]}, expected {[p for p, _ in want_leaves]}"
    for (path, g), (_, w) in zip(got_leaves, want_leaves, strict=True):
        if not isinstance(g, np.ndarray) or g.dtype != w.dtype or g.shape != w.shape:
            return f"{path}: got {g!r}, expected {describe(w)}"
        rtol = 1e-3 if w.dtype == np.float16 else 1e-6
        same = np.array_equal(g, w) if exact else np.allclose(g, w, rtol=rtol, atol=0)
        if not same:
            err = np.max(np.abs(g.astype(np.float64) - w.astype(np.float64)), initial=0)
            return f"{path}: max abs error {err:g}"
    return None


def summary(stats: dict[str, Any]) -> str:
    """A line of ``Group.stats()`` (the whole dict is a page: counters by strategy, latency
    histograms, drops by reason)."""
    return (f"{stats['collectives']} collectives, {stats['messages_sent']} messages sent "
            f"({stats['bytes_sent'] / 1024:.0f} KiB), {stats['messages_dropped']} dropped")


async def main() -> int:
    async with p2pcoll.join(collective_timeout=60) as g:
        print(f"rank {g.rank} of {g.world_size} joined at {g.endpoint}")
        every = [inputs(r) for r in range(g.world_size)]
        mine = every[g.rank]
        failed: list[str] = []

        async def check(label: str, got: Any, want: Any, *, exact: bool) -> None:
            problem = compare(got, want, exact)
            if problem is not None:
                print(f"rank {g.rank}: MISMATCH {label}: {problem}", file=sys.stderr)
            verdicts = await g.allgather(np.array(problem is not None, dtype=np.uint8))
            bad = [r for r, v in enumerate(verdicts) if v]
            if bad:
                failed.append(label)
            if g.rank == 0:
                print(f"{label}: ok" if not bad else f"{label}: MISMATCH on ranks {bad}")

        strategies = p2pcoll.available_strategies()
        for name in strategies["broadcast"]:
            for k, value in enumerate(mine):
                got = await g.broadcast(value if g.rank == 0 else None, root=0, strategy=name)
                await check(f"broadcast {name} {describe(value)}", got, every[0][k], exact=True)

        for name in strategies["allreduce"]:
            for k, value in enumerate(mine):
                total = tree_map(lambda *xs: sum(xs[1:], xs[0].copy()), *(e[k] for e in every))
                mean = tree_map(lambda t: t / g.world_size, total)
                got = await g.allreduce(value, op="sum", strategy=name)
                await check(f"allreduce {name} sum {describe(value)}", got, total, exact=True)
                got = await g.allreduce(value, op="avg", strategy=name)
                await check(f"allreduce {name} avg {describe(value)}", got, mean, exact=False)

        total = await g.allreduce(mine[0], op="sum")  # what a collective returns, shown
        if g.rank == 0:
            print(f"sum of the ranks' arrays: {total[:6].tolist()} ... ({describe(total)})")
            print(f"stats: {summary(g.stats())}")
            if failed:
                print(f"FAILED: {len(failed)} checks: {', '.join(failed)}", file=sys.stderr)
            else:
                print(f"every check passed on all {g.world_size} ranks")
        return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
