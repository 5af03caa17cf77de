"""Two peers behind NAT: a direct connection (the relay's dial) against the relay's
forward, one run.

    python benchmarks/relay_punch.py                  # 1 Gbit/s cables, 3 rounds
    python benchmarks/relay_punch.py --rate 200mbit --rounds 5

Three hosts (tests/netns_nat.py): rank 0 public (rendezvous and relay), ranks 1 and 2
behind separate MASQUERADE NATs (P2PCOLL_REACHABLE=0, a job key); every site's cable a
token bucket of ``--rate``. Layouts, interleaved round by round: all public (``public``);
NATs that drop an unexpected SYN (``NAT, drop``: the pair dials and connects directly);
NATs that answer it with a reset (``NAT, reset``: a lottery of attempts in this lab, see
p2pcoll.relay.punch); MASQUERADE --random-fully (``NAT, random``: no attempt, the relay
forwards). Per layout, medians over rounds of tests/relay_worker.py's: ``connect_s``
(join and the first allreduce), a 16 MiB allreduce, and the pair's exchange (16 MiB each
way, twice: what a DiLoCo round's outer step sends between two peers), with how many of
the pair's connections went direct and the bytes the pair sent through the relay. Needs
root, ``ip`` and ``iptables``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import netns_nat  # noqa: E402
from peer_processes import run_all  # noqa: E402

WORLD = 3
PORT = 29581
LAYOUTS = {"public": ((), "rst", False), "NAT, drop": ((1, 2), "drop", False),
           "NAT, reset": ((1, 2), "rst", False), "NAT, random": ((1, 2), "rst", True)}


def env(lab: netns_nat.NatLab, rank: int, key: Path, port: int) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("P2PCOLL_", "MASTER_"))}
    e.update(P2PCOLL_RENDEZVOUS=f"tcp://{lab.address(0)}:{port}", WORLD_SIZE=str(WORLD),
             RANK=str(rank), P2PCOLL_KEY_FILE=str(key), P2PCOLL_HOST_ID=f"h{rank}",
             P2PCOLL_JOIN_TIMEOUT="120", OMP_NUM_THREADS="1", RELAY_WORKER_PAIR="1,2",
             PYTHONPATH=os.pathsep.join([str(ROOT), *sys.path]))
    if rank in lab.natted:
        e["P2PCOLL_REACHABLE"] = "0"
    return e


def once(name: str, key: Path, rate: str, port: int) -> list[dict[str, object]]:
    natted, unexpected, random_fully = LAYOUTS[name]
    with netns_nat.NatLab(WORLD, natted, unexpected, random_fully) as lab:
        lab.shape(rate)
        argv = [sys.executable, "tests/relay_worker.py", "collectives"]
        done = run_all([lab.command(r, argv) for r in range(WORLD)],
                       [env(lab, r, key, port) for r in range(WORLD)], 600, cwd=ROOT,
                       stdin="done\n")
    reports = []
    for r, proc in enumerate(done):
        if not proc.stdout.strip():
            raise RuntimeError(f"{name}, rank {r}: {proc.stderr[-1500:]}")
        reports.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    return reports


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    reason = netns_nat.unavailable()
    if reason:
        print(reason, file=sys.stderr)
        return 2
    key = Path("/tmp") / f"relay-punch-{os.getpid()}.key"
    subprocess.run([sys.executable, "-m", "p2pcoll", "keygen", str(key)], check=True,
                   capture_output=True)
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in LAYOUTS}
    port = PORT
    for _ in range(args.rounds):
        for name in LAYOUTS:
            port += 1
            reports = once(name, key, args.rate, port)
            pair = [reports[1], reports[2]]
            times = [r["times"] for r in reports]
            sample = {
                "connect_s": max(t["connect"] for t in times),  # type: ignore[index]
                "16MiB_ms": 1e3 * statistics.median(t["16MiB"] for t in times),  # type: ignore[index]
                "pair_ms": 1e3 * max(r["times"]["pair_16MiB_x2"] for r in pair),  # type: ignore[index]
                "direct": sum(r["direct_punched"] for r in pair),  # type: ignore[misc]
                "fell_back": sum(r["punch_failed"] for r in pair),  # type: ignore[misc]
                "pair_relayed_MB": sum(r["pair_relayed"] for r in pair) / 1e6,  # type: ignore[misc]
                "load": os.getloadavg()[0]}
            samples[name].append(sample)
            print(name, json.dumps(sample), file=sys.stderr, flush=True)
            time.sleep(1)
    key.unlink()
    print(f"\n{WORLD} hosts, {args.rate} cables, job key, medians of {args.rounds} "
          "interleaved rounds\n")
    cols = list(samples["public"][0])
    print("| layout | " + " | ".join(cols) + " |\n|---|" + "---|" * len(cols))
    for name, rows in samples.items():
        print(f"| {name} | " + " | ".join(
            f"{statistics.median(r[c] for r in rows):.3g}" for c in cols) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
