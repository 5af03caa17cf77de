"""``P2PCOLL_HOST_ID``: peers that name different hosts never share memory or ipc.

Peers of one machine are one host to p2pcoll (same hostname, boot id, /tmp and /dev/shm):
``auto`` reaches them over ipc, large pieces go through shared-memory rings, messages
through lanes and small collectives over the board. Network namespaces and containers that
share /dev/shm are such peers, though they stand for separate hosts; ``P2PCOLL_HOST_ID``
says so. These tests start real peers, each a process of its own (this file run as a
script) with its own environment, joined at a rendezvous on 127.0.0.1, and look at what
each one used: the endpoints it chose for the others, its traffic counters (bytes through
shared memory, messages through lanes, collectives on the board: strategy ``"shm"``), and
the p2pcoll files of /dev/shm it has mapped.

- different values: every link is tcp, nothing goes through shared memory, no file mapped;
- equal values: as without the variable, ipc, rings, lanes and the board;
- two hosts of two peers each: ipc and rings within a host, tcp between, no board;
- a bad value: the peer fails before joining, and the error names the variable;
- last, peers on hosts of their own (network namespaces of ``tests/netns.py``, which share
  /dev/shm and so are one host to detection) with their own values: what they sent crossed
  their cables (needs root and ``ip``, as tests/test_netns.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

import netns
import pytest
from peer_processes import peer_environment, run_to_end

from p2pcoll import SettingsError
from p2pcoll.settings import Settings
from p2pcoll.testing import free_port
from p2pcoll.transport import host_identity

COUNT = 1 << 18  # float32 elements: 1 MiB, whose pieces go through the rings on one host
SMALL = 16  # elements: a collective the board takes on one host
WAIT = 120.0  # seconds for the peers of one test (the machine may be busy)
# A p2pcoll file of /dev/shm in /proc/self/maps: rings, lanes and boards are unlinked as
# soon as every peer has mapped them, and then show as "(deleted)".
MAPPED = re.compile(r"\s/dev/shm/(p2pcoll-[0-9]+-[0-9a-f]{16})(?: \(deleted\))?$")


# --- the peer (this file run as a script) ----------------------------------------------------

async def peer() -> None:
    """Join, run a large and a small allreduce, report what went where as one JSON line."""
    import numpy as np

    import p2pcoll

    async with p2pcoll.join() as g:
        r, p = g.rank, g.world_size
        # Three times: the first large collective after join may find a peer's ring not yet
        # attached and go over the socket; the later ones go through the ring.
        for _ in range(3):
            big = await g.allreduce(np.full(COUNT, r + 1, np.float32))
        small = await g.allreduce(np.full(SMALL, r + 1, np.float32))
        await g.barrier()
        total = p * (p + 1) / 2
        with open("/proc/self/maps") as f:  # what this process maps while the group is open
            mapped = sorted({m.group(1) for line in f if (m := MAPPED.search(line.rstrip()))})
        stats = g.stats()
        print(json.dumps({
            "rank": r,
            "endpoints": list(g.membership.endpoints),
            "sums": bool((big == total).all() and (small == total).all()),
            "bytes_sent": stats["bytes_sent"],
            "bytes_sent_shm": stats["bytes_sent_shm"],
            "messages_sent_lane": stats["messages_sent_lane"],
            # shared-memory lanes opened (messages on TCP lanes count as on a lane too)
            "shm_lanes": g.session.transport._lanes is not None,
            "strategies": stats["collectives_by_strategy"],
            "mapped": mapped,
        }), flush=True)


# --- the driver ------------------------------------------------------------------------------

def _environment(rank: int, world: int, port: int, host_id: str | None,
                 address: str = "127.0.0.1") -> dict[str, str]:
    own = {} if host_id is None else {"P2PCOLL_HOST_ID": host_id}
    return peer_environment(f"tcp://{address}:{port}", world, rank,
                            P2PCOLL_JOIN_TIMEOUT="60", **own)


def run_peers(host_ids: Sequence[str | None], lab: netns.Lab | None = None
              ) -> list[dict[str, Any]]:
    """Run one peer per entry of ``host_ids`` (its ``P2PCOLL_HOST_ID``, None: unset), on
    this machine or each on its host of ``lab``; returns their reports in rank order. Fails
    the test if a peer fails."""
    port = free_port() if lab is None else 29500
    address = "127.0.0.1" if lab is None else netns.address(0)
    argv = [sys.executable, __file__]
    ranks = range(len(host_ids))
    reports = run_to_end([argv if lab is None else lab.command(r, argv) for r in ranks],
                         [_environment(r, len(host_ids), port, host_ids[r], address)
                          for r in ranks], WAIT)
    assert [rep["rank"] for rep in reports] == list(range(len(host_ids)))
    assert all(rep["sums"] for rep in reports)
    return reports


def _board_calls(report: dict[str, Any]) -> int:
    return sum(by.get("shm", 0) for by in report["strategies"].values())


@pytest.mark.processes
@pytest.mark.parametrize("world", [2, 4])
def test_different_hosts_never_share_memory(world: int) -> None:
    reports = run_peers([f"node-{r}" for r in range(world)])
    for rep in reports:
        others = [e for q, e in enumerate(rep["endpoints"]) if q != rep["rank"]]
        assert others and all(e.startswith("tcp://") for e in others), rep["endpoints"]
        assert rep["bytes_sent_shm"] == 0
        assert not rep["shm_lanes"]  # (small messages go on TCP lanes: on by default)
        assert _board_calls(rep) == 0, rep["strategies"]
        assert rep["mapped"] == []
        # The 1 MiB allreduce went over the sockets: at least its share of the ring.
        assert rep["bytes_sent"] >= 4 * COUNT * (world - 1) // world


@pytest.mark.processes
def test_equal_host_ids_share_memory_as_without_them() -> None:
    for host_ids in (["rack1-node7"] * 2, [None] * 2):
        reports = run_peers(host_ids)
        for rep in reports:
            other = rep["endpoints"][1 - rep["rank"]]
            assert other.startswith("ipc://"), (host_ids, rep["endpoints"])
            assert rep["bytes_sent_shm"] > 0, host_ids
            assert _board_calls(rep) > 0, (host_ids, rep["strategies"])
            assert rep["mapped"], host_ids


@pytest.mark.processes
def test_two_hosts_of_two_peers() -> None:
    """Ranks 0 and 1 on host a, 2 and 3 on host b: ipc and rings within a host, tcp
    between hosts, and no board (which needs every peer on one host)."""
    reports = run_peers(["a", "a", "b", "b"])
    for rep in reports:
        r = rep["rank"]
        for q, endpoint in enumerate(rep["endpoints"]):
            if q != r:
                same = q // 2 == r // 2
                assert endpoint.startswith("ipc://" if same else "tcp://"), (r, q, endpoint)
        assert rep["bytes_sent_shm"] > 0
        assert _board_calls(rep) == 0, rep["strategies"]


@pytest.mark.processes
def test_set_and_unset_are_different_hosts() -> None:
    """A peer that names its host and one that leaves it to detection do not share memory:
    only equal values (or both unset) say "same host"."""
    for rep in run_peers(["node-0", None]):
        assert rep["endpoints"][1 - rep["rank"]].startswith("tcp://")
        assert rep["bytes_sent_shm"] == 0 and rep["mapped"] == []


@pytest.mark.parametrize("value", ["two words", "-leading-dash", "x" * 65, "nöde", "a/b"])
def test_bad_value_is_refused_naming_the_variable(value: str) -> None:
    with pytest.raises(SettingsError, match=r"\$P2PCOLL_HOST_ID") as caught:
        Settings.resolve({"P2PCOLL_HOST_ID": value})
    assert caught.value.name == "$P2PCOLL_HOST_ID"
    with pytest.raises(SettingsError, match="host_id="):
        Settings.resolve({}, host_id=value)


@pytest.mark.parametrize("value", [3, b"node", ""])
def test_bad_argument_is_refused(value: object) -> None:
    with pytest.raises(SettingsError, match="host_id="):
        Settings.resolve({}, host_id=value)


def test_good_values_and_unset() -> None:
    for value in ("node-1", "ip-10-0-1-23.us-west-2.compute.internal", "0f3c:pod_a", "x" * 64):
        assert Settings.resolve({"P2PCOLL_HOST_ID": value}).host_id == value
    assert Settings.resolve({"P2PCOLL_HOST_ID": "  node-1 "}).host_id == "node-1"
    assert Settings.resolve({}).host_id is None
    assert Settings.resolve({"P2PCOLL_HOST_ID": ""}).host_id is None  # empty: unset


async def test_join_host_id_argument_makes_peers_of_other_hosts() -> None:
    """``join(host_id=...)``, the argument over the variable: two peers of one process that
    name different hosts reach each other over tcp and carry their hosts in the roster."""
    import numpy as np

    import p2pcoll

    url = f"tcp://127.0.0.1:{free_port()}"

    async def one(rank: int, host: str) -> tuple[tuple[str, ...], tuple[str, ...], int]:
        async with p2pcoll.join(url, world_size=2, rank=rank, host_id=host,
                                timeout=WAIT) as g:
            await g.allreduce(np.ones(COUNT, np.float32))
            return (g.membership.hosts, g.membership.endpoints,
                    g.stats()["bytes_sent_shm"])

    (hosts, ends, shm0), (_, _, shm1) = await asyncio.gather(one(0, "node-a"),
                                                              one(1, "node-b"))
    assert hosts[0] != hosts[1] and "node-a" in hosts[0] and "node-b" in hosts[1]
    assert ends[1].startswith("tcp://") and shm0 == shm1 == 0
    with pytest.raises(SettingsError, match="host_id="):
        p2pcoll.join(url, world_size=2, host_id="bad value")


async def test_ipc_between_peers_of_different_hosts_is_refused_naming_them() -> None:
    """``transport="ipc"`` reaches only peers of one host: with host ids that differ, every
    peer gets a RendezvousError naming the ranks on other hosts, at once."""
    import p2pcoll

    url = f"tcp://127.0.0.1:{free_port()}"

    async def one(rank: int, host: str) -> BaseException:
        with pytest.raises(p2pcoll.RendezvousError) as refused:
            async with p2pcoll.join(url, world_size=3, rank=rank, host_id=host,
                                    transport="ipc", timeout=WAIT):
                pass
        return refused.value

    errors = await asyncio.gather(one(0, "node-a"), one(1, "node-a"), one(2, "node-b"))
    for rank, error in enumerate(errors):
        others = "[2]" if rank < 2 else "[0, 1]"
        assert f"ranks {others} are on other hosts" in str(error), error
        assert "P2PCOLL_TRANSPORT=ipc" in str(error) and error.permanent


def test_identity_keeps_detection_behind_the_value() -> None:
    detected = host_identity()
    assert host_identity(None) == detected
    assert host_identity("a") != host_identity("b")
    assert host_identity("a") == host_identity("a") != detected
    assert host_identity("a").endswith(detected)
    # The identity travels in the rendezvous's join request, whose host field holds 256.
    assert len(host_identity("x" * 64).encode()) <= 256


def test_peer_with_a_bad_value_fails_before_joining() -> None:
    env = _environment(0, 2, free_port(), "bad value")
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                          timeout=WAIT)
    assert done.returncode != 0
    assert "SettingsError" in done.stderr and "$P2PCOLL_HOST_ID='bad value'" in done.stderr


@pytest.mark.slow
def test_namespaces_with_their_own_host_ids_use_their_cables() -> None:
    reason = netns.unavailable()
    if reason is not None:
        if os.environ.get("CI") == "true" and os.geteuid() == 0:
            pytest.fail(reason)
        pytest.skip(reason)
    with netns.Lab(3) as lab:
        before = [lab.counters(r) for r in range(3)]
        reports = run_peers(["host-0", "host-1", "host-2"], lab)
        after = [lab.counters(r) for r in range(3)]
    for rep, b, a in zip(reports, before, after, strict=True):
        others = [e for q, e in enumerate(rep["endpoints"]) if q != rep["rank"]]
        assert all(e.startswith("tcp://198.18.") for e in others), rep["endpoints"]
        assert rep["bytes_sent_shm"] == 0 and not rep["shm_lanes"]  # (TCP lanes: on)
        assert _board_calls(rep) == 0 and rep["mapped"] == []
        assert a[0] - b[0] >= rep["bytes_sent"]  # sent over its own cable (frames: more)


if __name__ == "__main__":
    asyncio.run(peer())
