"""The pipeline's window with real peers (p2pcoll.engine.window): three peers of this process,
each on a host of its own (``host_id``), over loopback tcp, in segments of 1 KiB.

- once the transport holds a long round trip to every peer (as a link's handshake over a
  100 ms path would measure it), every collective keeps the capped window in flight, and its
  results are bit-identical to the same collectives run one segment at a time
  (``pipeline_depth=1``) in a group of its own, for every allreduce strategy and for
  reduce_scatter, allgather and broadcast;
- ``pipeline_depth`` set: the depth, whatever the paths;
- peers of one host: no path is long (``Transport.path`` says nothing), today's window.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import p2pcoll
from p2pcoll.engine.executor import Executor
from p2pcoll.engine.window import MAX_WINDOW_BYTES
from p2pcoll.settings_env import DEFAULT_PIPELINE_DEPTH, MAX_PIPELINE_DEPTH
from p2pcoll.testing import run_ranks

PEERS = 3
SEGMENT = 1 << 10
HOSTS = [f"host-{r}" for r in range(PEERS)]
ALLREDUCE = ("ring", "rabenseifner", "direct", "recursive_doubling", "reduce_broadcast")
LONG_RTT = 0.1  # seconds: 125 MB in flight at the assumed 10 Gbit/s, far above the cap


@pytest.fixture
def depths(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The depth of every pipelined collective run in this test, in the order run (and
    segments of :data:`SEGMENT` bytes)."""
    monkeypatch.setenv("P2PCOLL_SEGMENT_BYTES", str(SEGMENT))
    seen: list[int] = []
    original = Executor.depth_for

    def depth_for(self: Executor, program: Any) -> int:
        depth = original(self, program)
        seen.append(depth)
        return depth

    monkeypatch.setattr(Executor, "depth_for", depth_for)
    return seen


async def collectives(g: p2pcoll.Group, long: bool) -> list[np.ndarray]:
    """Reductions and gathers of data whose sums depend on their order (float32 of mixed
    magnitudes), each cut into dozens of segments; with ``long``, after the transport has
    been told of a long path to every peer."""
    if long:
        await g.barrier()  # the links are open (and measured, on loopback: short)
        for peer in range(PEERS):
            if peer != g.rank:
                g.session.transport.routes.measure(peer, rtt_s=LONG_RTT)
    rng = np.random.default_rng(7 + g.rank)
    data = (rng.standard_normal(24_000) * 10.0 ** rng.integers(-6, 6, 24_000)
            ).astype(np.float32)
    out = []
    for strategy in ALLREDUCE:
        out.append(await g.allreduce(data.copy(), strategy=strategy))
    out.append(await g.reduce_scatter(data.copy()))
    out.extend(await g.allgather(data.copy(), strategy="ring"))
    out.append(await g.broadcast(data.copy(), root=1, strategy="pipeline"))
    return out


async def test_results_stay_bit_identical_with_the_window_open(
        depths: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    windowed = await run_ranks(PEERS, lambda g: collectives(g, True), host_ids=HOSTS,
                               transport="tcp")
    widest = min(MAX_WINDOW_BYTES // SEGMENT, MAX_PIPELINE_DEPTH)
    assert depths and set(depths) == {widest}, depths
    depths.clear()
    monkeypatch.setenv("P2PCOLL_PIPELINE_DEPTH", "1")
    serial = await run_ranks(PEERS, lambda g: collectives(g, False), host_ids=HOSTS,
                             transport="tcp")
    assert depths and set(depths) == {1}
    for rank in range(PEERS):
        for got, want in zip(windowed[rank], serial[rank], strict=True):
            assert got.dtype == want.dtype and got.tobytes() == want.tobytes()


async def test_a_set_depth_holds_whatever_the_paths(
        depths: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("P2PCOLL_PIPELINE_DEPTH", "2")

    async def run(g: p2pcoll.Group) -> None:
        await collectives(g, True)

    await run_ranks(PEERS, run, host_ids=HOSTS, transport="tcp")
    assert depths and set(depths) == {2}


async def test_peers_of_one_host_keep_the_default_window(depths: list[int]) -> None:
    async def run(g: p2pcoll.Group) -> list[Any]:
        await collectives(g, True)  # told of long paths: peers of this host have none
        return [g.session.transport.paths[peer] for peer in range(PEERS) if peer != g.rank]

    paths = await run_ranks(PEERS, run, transport="tcp")
    assert all(path == (None, None) for rank in paths for path in rank)
    assert depths and set(depths) == {DEFAULT_PIPELINE_DEPTH}
