"""Peers behind NAT (tests/netns_nat.py: iptables MASQUERADE, no port forwarded in) reach
the group through a relay: every collective gives the same bytes as the direct run, with
a job key; nothing listens on a NATed host's network; a relay that dies is a PeerLost
naming the peers behind it. Root, ``ip`` and ``iptables``: skipped with the reason where
missing (a failure under CI)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import netns_nat

pytestmark = pytest.mark.slow

HERE = Path(__file__).parent
WORLD = 4
PORT = 29531
RELAY_PORT = 29532


@pytest.fixture(scope="module")
def key(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("key") / "job.key"
    subprocess.run([sys.executable, "-m", "p2pcoll", "keygen", str(path)], check=True,
                   capture_output=True)
    return path


def _lab(natted: tuple[int, ...]) -> netns_nat.NatLab:
    reason = netns_nat.unavailable()
    if reason is not None:
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    return netns_nat.NatLab(WORLD, natted)


def _env(lab: netns_nat.NatLab, rank: int, key: Path, declared: bool = True,
         **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("P2PCOLL_", "RANK",
                                                                     "WORLD_SIZE", "MASTER_"))}
    env.update(P2PCOLL_RENDEZVOUS=f"tcp://{lab.address(0)}:{PORT}", WORLD_SIZE=str(WORLD),
               RANK=str(rank), P2PCOLL_KEY_FILE=str(key), P2PCOLL_HOST_ID=f"h{rank}",
               P2PCOLL_JOIN_TIMEOUT="40", PYTHONPATH=os.pathsep.join(sys.path), **extra)
    if rank in lab.natted and declared:
        env["P2PCOLL_REACHABLE"] = "0"
    return env


async def _start(lab: netns_nat.NatLab, mode: str, key: Path,
                 extra: dict[str, str] | None = None, declared: bool = True
                 ) -> list[asyncio.subprocess.Process]:
    procs = []
    for r in range(WORLD):
        procs.append(await asyncio.create_subprocess_exec(
            *lab.command(r, [sys.executable, str(HERE / "relay_worker.py"), mode]),
            env=_env(lab, r, key, declared, **(extra or {})), stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE))
    return procs


async def _line(proc: asyncio.subprocess.Process, timeout: float = 90) -> dict[str, object]:
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), timeout)
    if not line:
        assert proc.stderr is not None
        raise AssertionError((await proc.stderr.read()).decode()[-3000:])
    result: dict[str, object] = json.loads(line)
    return result


async def _stop(procs: list[asyncio.subprocess.Process]) -> None:
    for proc in procs:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()


async def _run(natted: tuple[int, ...], key: Path, declared: bool = True
               ) -> tuple[list[dict[str, object]], dict[int, list[str]]]:
    with _lab(natted) as lab:
        procs = await _start(lab, "collectives", key, declared=declared)
        try:
            reports = [await _line(p) for p in procs]
            listening = {r: lab.listening(r) for r in natted}
            for p in procs:
                assert p.stdin is not None
                p.stdin.write(b"done\n")
            return reports, listening
        finally:
            await _stop(procs)


@pytest.fixture(scope="module")
def direct(key: Path) -> list[dict[str, object]]:
    return asyncio.run(_run((), key))[0]


@pytest.mark.parametrize("natted, declared", [((1, 3), True), ((1, 2, 3), True),
                                              ((1, 3), False)],
                         ids=["2-of-4", "3-of-4", "2-of-4-detected"])
def test_every_collective_behind_nat_equals_the_direct_run(
        natted: tuple[int, ...], declared: bool, key: Path,
        direct: list[dict[str, object]]) -> None:
    """Declared (P2PCOLL_REACHABLE=0), or found by the rendezvous (it cannot connect back:
    the peer then stops listening on its network address)."""
    reports, listening = asyncio.run(_run(natted, key, declared))
    for mine, theirs in zip(reports, direct, strict=True):
        assert mine["digests"] == theirs["digests"]
    for r, report in enumerate(reports):
        links = {int(k): v for k, v in report["peer_links"].items()}  # type: ignore[union-attr]
        for peer, how in links.items():
            if r in natted and peer in natted:  # they dial: direct if it went so
                assert how in ("direct", "relayed"), links  # (test_relay_punch.py)
            else:
                assert how == ("relayed" if r in natted or peer in natted else "direct"), links
        assert report["bytes_relayed"] > 0
    for r, addresses in listening.items():  # nothing listens on a NATed host's network
        assert all(a.startswith("127.0.0.1:") for a in addresses), (r, addresses)
    print("\nNAT", natted, [r["times"] for r in reports], "\ndirect",
          [r["times"] for r in direct])


def test_a_relay_that_dies_is_a_peer_lost_naming_the_peers_behind_it(key: Path) -> None:
    async def run() -> list[dict[str, object]]:
        with _lab((1, 3)) as lab:
            relay = await asyncio.create_subprocess_exec(
                *lab.command(2, [sys.executable, "-m", "p2pcoll", "relay", "--port",
                                 str(RELAY_PORT)]),
                env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            procs = await _start(lab, "until-lost", key,
                                 {"P2PCOLL_RELAY": f"tcp://{lab.address(2)}:{RELAY_PORT}"})
            try:
                assert relay.stdout is not None
                assert b"relaying" in await asyncio.wait_for(relay.stdout.readline(), 30)
                for p in procs:
                    assert "formed" in await _line(p)
                await asyncio.sleep(0.5)
                relay.kill()
                return [await _line(p, timeout=60) for p in procs]
            finally:
                await _stop([*procs, relay])

    ends = asyncio.run(run())
    print("\n" + "\n".join(json.dumps(end) for end in ends))
    for end in ends:
        assert end["error"] in ("PeerLost", "GroupBroken"), end
    for r in (0, 2):  # the public ranks name a peer behind the relay
        assert ends[r]["error"] == "PeerLost" and ends[r]["lost"] in (1, 3), ends[r]
