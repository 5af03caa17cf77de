"""The measured topology on hosts of their own (network namespaces, tests/netns.py): one
slow pair, a ring that avoids it, and the rank-order ring's bits.

Four hosts on a switch, every cable at 1 Gbit/s, the pair of hosts 0 and 1 at 10 Mbit/s
each way (``Lab.limit_pair``). Each peer joins with a host id of its own (so the group
probes, by default), prints ``g.topology()`` and the bytes of a ``ring`` allreduce of
float32 values whose sums round differently in every order. The ring must avoid both
directions of the slow pair, every rank must report the same topology, and every result
must equal, bit for bit, the ring in rank order computed here with numpy. A second run
with ``P2PCOLL_PROBE=0`` measures nothing and sends nothing for it.

Needs root and ``ip`` (iproute2) and ``tc``; without them it skips (under ``CI=true`` a
missing ``ip`` fails). Run as a script, this file is the peer.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import netns
import numpy as np
import pytest
from peer_processes import peer_environment, run_to_end

pytestmark = pytest.mark.slow

WORLD = 4
PORT = 29510
COUNT = 100_003  # float32 elements: not a multiple of 4, chunks of unequal sizes


def inputs(rank: int) -> np.ndarray:
    rng = np.random.default_rng(1000 + rank)
    return (rng.standard_normal(COUNT) * 10.0 ** rng.uniform(-4, 4, COUNT)).astype(np.float32)


def digest(a: np.ndarray) -> str:
    """The bits of ``a`` in a line (the peers print it to a pipe the test reads in turn)."""
    return hashlib.sha256(a.tobytes()).hexdigest()


def rank_order_ring(xs: list[np.ndarray]) -> np.ndarray:
    """The ring in rank order's result: chunk c folded x_c + x_{c+1} + ... (ranks mod p)."""
    p = len(xs)
    out = np.empty_like(xs[0])
    for c, idx in enumerate(np.array_split(np.arange(xs[0].size), p)):
        acc = xs[c][idx].copy()
        for k in range(1, p):
            acc += xs[(c + k) % p][idx]
        out[idx] = acc
    return out


# --- the peer -----------------------------------------------------------------------------

async def peer() -> None:
    import p2pcoll

    async with p2pcoll.join() as g:
        x = inputs(g.rank)
        result = await g.allreduce(x, strategy="ring")
        print(json.dumps({"topology": g.topology(), "result": digest(result),
                          "stats": g.stats()["collectives_by_strategy"]}), flush=True)
        await g.barrier()


# --- the test -----------------------------------------------------------------------------

def _environment(rank: int, extra: dict[str, str]) -> dict[str, str]:
    return peer_environment(f"tcp://{netns.address(0)}:{PORT}", WORLD, rank,
                            P2PCOLL_HOST_ID=f"host-{rank}", P2PCOLL_TRANSPORT="tcp",
                            P2PCOLL_JOIN_TIMEOUT="120", P2PCOLL_TIMEOUT="120", **extra)


def _run(lab: netns.Lab, extra: dict[str, str]) -> list[dict[str, Any]]:
    argv = [sys.executable, str(Path(__file__).resolve())]
    return run_to_end([lab.command(r, argv) for r in range(WORLD)],
                      [_environment(r, extra) for r in range(WORLD)], 240)


@pytest.fixture
def lab() -> Any:
    reason = netns.unavailable()
    if reason is not None:
        if os.environ.get("CI") == "true" and shutil.which("ip") is None:
            pytest.fail(f"CI must run the network namespace tests: {reason}")
        pytest.skip(reason)
    made = netns.Lab(WORLD)
    try:
        made.create()
        made.shape("1gbit", burst="512kbit")
        made.limit_pair(0, 1, "10mbit", "1gbit")
    except netns.LabError as exc:
        made.close()
        pytest.skip(f"the lab cannot be made here: {exc}")
    try:
        yield made
    finally:
        made.close()


def test_the_ring_avoids_the_slow_pair_with_the_rank_order_bits(lab: netns.Lab) -> None:
    expected = digest(rank_order_ring([inputs(r) for r in range(WORLD)]))
    reports = _run(lab, {})
    top = reports[0]["topology"]
    assert all(r["topology"] == top for r in reports)  # agreed
    ring = top["ring"]
    hops = {(ring[k], ring[(k + 1) % WORLD]) for k in range(WORLD)}
    assert not hops & {(0, 1), (1, 0)}, f"ring {ring} crosses the slow pair"
    bw = top["bandwidth_Bps"]
    assert max(bw[0][1], bw[1][0]) < min(bw[0][2], bw[2][1], bw[1][3], bw[3][0])
    assert all(r["result"] == expected for r in reports)
    # Without the probe: nothing measured, rank order, the same bits.
    plain = _run(lab, {"P2PCOLL_PROBE": "0"})
    assert plain[0]["topology"]["measured_at"] is None
    assert plain[0]["topology"]["ring"] == [0, 1, 2, 3]
    assert all(r["result"] == expected for r in plain)


if __name__ == "__main__":
    asyncio.run(peer())
