"""Zero-copy sends: a caller may overwrite its arrays the moment a collective returns.

Payload pieces of 64 KiB and more (pyzmq's copy threshold) leave straight from the caller's
memory and are tracked until libzmq lets go of them; smaller ones are copied. Either way the
data the peers receive must be what the array held when the collective was called.
"""

from __future__ import annotations

import numpy as np
import pytest
import zmq

import p2pcoll
from p2pcoll.testing import run_ranks

SIZES = [256, zmq.COPY_THRESHOLD // 4 + 1, 3 * 2**20 // 4]  # float32: below, just above, 3 MiB


@pytest.mark.parametrize("transport", ["tcp", "ipc"])
async def test_overwriting_right_after_return_never_corrupts(transport: str) -> None:
    async def fn(g: p2pcoll.Group) -> list[str]:
        bad = []
        for n in SIZES:
            for it in range(4):
                value = float(it + 1)
                # Broadcast from a root that scribbles over its array as soon as it returns.
                root = it % g.world_size
                src = np.full(n, value + root, np.float32)
                got = await g.broadcast(src if g.rank == root else None, root=root,
                                        strategy="root" if it % 2 else "binomial")
                if g.rank == root:
                    src.fill(-1.0)
                elif not np.all(got == value + root):
                    bad.append(f"broadcast n={n} it={it}")
                # In-place allreduce, then overwrite the result before the next call.
                x = np.full(n, value, np.float32)
                for strategy in p2pcoll.available_strategies()["allreduce"]:
                    x.fill(value)
                    await g.allreduce(x, out=x, strategy=strategy)
                    if not np.all(x == value * g.world_size):
                        bad.append(f"allreduce {strategy} n={n} it={it}")
                    x.fill(-7.0)
                # Allgather sends the caller's own array zero-copy.
                mine = np.full(n, g.rank + value, np.float32)
                parts = await g.allgather(mine)
                mine.fill(-3.0)
                for r, part in enumerate(parts):
                    if not np.all(part == r + value):
                        bad.append(f"allgather n={n} it={it} part {r}")
        return bad

    for bad in await run_ranks(3, fn, transport=transport):
        assert bad == []


def test_which_sends_go_as_copies() -> None:
    """Ring allreduce, 2 peers: the reduce-scatter send is written again by the allgather
    (a snapshot in every segment); the allgather send is the last one (a copy only in the
    last segments, so the collective does not wait for its release)."""
    from p2pcoll.engine.plan import copies, plan
    from p2pcoll.registry import registry
    from p2pcoll.strategy import Context

    steps = plan(registry.get("allreduce", "ring"), Context(rank=0, size=2, root=0), 2)
    assert len(steps) == 2
    assert copies(steps, 2) == ({(0, 0)}, {(0, 0), (1, 0)})
    bcast = plan(registry.get("broadcast", "root"), Context(rank=1, size=3, root=1), 1)
    # the root never writes what it sends; its last sends are copied in the last segments
    assert copies(bcast, 1) == (frozenset(), {(0, 0), (0, 1)})
    leaf = plan(registry.get("broadcast", "root"), Context(rank=0, size=3, root=1), 1)
    assert copies(leaf, 1) == (frozenset(), frozenset())  # receives only


def test_a_chunk_sent_to_several_peers_in_one_step_is_one_send() -> None:
    """The root of a root broadcast hands each segment to the mesh once for all peers (so a
    same-host ring copies it in once); a ring step's sends stay apart."""
    from p2pcoll.engine.plan import plan, send_groups
    from p2pcoll.registry import registry
    from p2pcoll.strategy import ALL, Context

    root = plan(registry.get("broadcast", "root"), Context(rank=0, size=4, root=0), 1)
    assert send_groups(root) == (((ALL, ((0, 1), (1, 2), (2, 3))),),)
    ring = plan(registry.get("allreduce", "ring"), Context(rank=1, size=3, root=0), 3)
    for step, groups in zip(ring, send_groups(ring), strict=True):
        sends = [op for op in step if type(op).__name__ == "Send"]
        assert [len(g) for _, g in groups] == [1] * len(sends)
