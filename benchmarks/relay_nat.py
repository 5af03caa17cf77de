"""Peers behind NAT through the relay, against the same peers all reachable, one run.

    python benchmarks/relay_nat.py                       # 1 Gbit/s, no added delay
    python benchmarks/relay_nat.py --rate 1gbit --delay 0.025 --diloco-steps 100

Four hosts (tests/netns_nat.py): every site's cable a token bucket of ``--rate``; with
``--delay``, every TCP stream held that long each way (netns.Lab.delay_streams: the kernel
here has no netem). Three layouts: all public (direct), ranks 1 and 3 behind separate
MASQUERADE NATs, ranks 1-3 behind NATs (P2PCOLL_REACHABLE=0, the rendezvous host's relay,
a job key). Per layout: the median allreduce times of tests/relay_worker.py (4 KiB and
16 MiB) and, with ``--diloco-steps``, the training-loop wall time of
benchmarks/slow_training.py's ``diloco`` mode (H = 50, int8) on the same lab. Needs root,
``ip``, ``iptables``, ``nft`` (for a delay) and, for DiLoCo, torch and scikit-learn.
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

WORLD = 4
PORT = 29541
LAYOUTS = {"direct": (), "NAT 2 of 4": (1, 3), "NAT 3 of 4": (1, 2, 3)}


def env(lab: netns_nat.NatLab, rank: int, key: Path, port: int) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items()
         if not k.startswith(("P2PCOLL_", "MASTER_")) or k == "P2PCOLL_HEARTBEAT_TIMEOUT"}
    e.update(P2PCOLL_RENDEZVOUS=f"tcp://{lab.address(0)}:{port}", WORLD_SIZE=str(WORLD),
             RANK=str(rank), P2PCOLL_KEY_FILE=str(key), P2PCOLL_HOST_ID=f"h{rank}",
             P2PCOLL_JOIN_TIMEOUT="120", OMP_NUM_THREADS="1",
             PYTHONPATH=os.pathsep.join([str(ROOT), *sys.path]))
    if rank in lab.natted:
        e["P2PCOLL_REACHABLE"] = "0"
    return e


def run(lab: netns_nat.NatLab, argv: list[str], key: Path, port: int,
        stdin: str = "") -> list[dict[str, object]]:
    done = run_all([lab.command(r, argv) for r in range(WORLD)],
                   [env(lab, r, key, port) for r in range(WORLD)], 1800, cwd=ROOT, stdin=stdin)
    reports, errors = [], []
    for r, proc in enumerate(done):
        if proc.returncode != 0 and not proc.stdout.strip():  # a report counts, even so
            errors.append(f"rank {r}: " + next(
                (line for line in proc.stderr.splitlines() if "p2pcoll.errors" in line),
                proc.stderr[-300:]))
            continue
        reports.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    if errors:
        raise RuntimeError("\n".join(errors))
    return reports


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--delay", type=float, default=0.0, help="seconds each way")
    parser.add_argument("--diloco-steps", type=int, default=0)
    parser.add_argument("--heartbeat", type=float, default=None,
                        help="P2PCOLL_HEARTBEAT_TIMEOUT for every layout (default: 5 s)")
    args = parser.parse_args()
    if args.heartbeat:
        os.environ["P2PCOLL_HEARTBEAT_TIMEOUT"] = str(args.heartbeat)
    reason = netns_nat.unavailable()
    if reason:
        print(reason, file=sys.stderr)
        return 2
    key = Path("/tmp") / f"relay-nat-{os.getpid()}.key"
    subprocess.run([sys.executable, "-m", "p2pcoll", "keygen", str(key)], check=True,
                   capture_output=True)
    rows = []
    for i, (name, natted) in enumerate(LAYOUTS.items()):
        with netns_nat.NatLab(WORLD, natted) as lab:
            lab.shape(args.rate)
            if args.delay:
                lab.delay_streams(args.delay)
            reports = run(lab, [sys.executable, "tests/relay_worker.py", "collectives"], key,
                          PORT + 2 * i, stdin="done\n" * 1)
            row = {"layout": name,
                   "4KiB_ms": 1e3 * statistics.median(r["times"]["4KiB"] for r in reports),
                   "16MiB_ms": 1e3 * statistics.median(r["times"]["16MiB"] for r in reports),
                   "relayed_MB": sum(r["bytes_relayed"] for r in reports) / 1e6}
            if args.diloco_steps:
                trained = run(lab, [sys.executable, "benchmarks/slow_training.py", "--worker",
                                    "diloco", "--port", str(PORT + 2 * i + 1), "--steps",
                                    str(args.diloco_steps)], key, PORT + 2 * i + 1)
                row["diloco_s"] = max(float(r["wall"]) for r in trained)
            row["load"] = os.getloadavg()[0]
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
        time.sleep(1)
    key.unlink()
    print(f"\n{WORLD} hosts, {args.rate}, {args.delay * 1e3:g} ms one way, job key\n")
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for row in rows:
        print("| " + " | ".join(f"{v:.3g}" if isinstance(v, float) else str(v)
                                for v in row.values()) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
