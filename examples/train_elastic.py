"""Elastic training of the digits MLP: a peer is killed mid-round, the others go on, a
replacement joins and catches up, and every replica ends with the same bits.

    pip install -e '.[examples]'
    python examples/train_elastic.py --demo        # 4 workers; one SIGKILLs itself; restart

``--demo`` starts 4 worker processes of this script, the way a cluster manager would (with
``P2PCOLL_RENDEZVOUS``, ``P2PCOLL_MIN_WORLD_SIZE`` and ``P2PCOLL_MAX_WORLD_SIZE``; not
``p2pcoll launch``, which gives fixed ranks and stops every peer when one fails). Worker 2
kills itself with SIGKILL in the middle of round ``--die-at``, after computing its
gradients, while the others wait for them in the allreduce. The three survivors get
``PeerLost``, form a group of 3 and go on from the most advanced survivor's round and
weights. Once they train without it, the driver starts a replacement: rank 0 sees it
waiting at the rendezvous, the group of 3 closes at the next round boundary and forms a
group of 4, and the newcomer receives the weights and the round number. Each worker prints
a digest of its final weights; the driver checks that they are equal, and that they equal
one process training alone, to rounding (see below).

Without ``--demo`` this runs one worker; start several by hand with the same variables::

    export P2PCOLL_RENDEZVOUS=tcp://127.0.0.1:29500 P2PCOLL_MIN_WORLD_SIZE=2 \\
        P2PCOLL_MAX_WORLD_SIZE=4
    python examples/train_elastic.py & python examples/train_elastic.py & ...

The model, the data and the gradients are those of ``train_digits.py``. Round ``r`` is one
global batch, the same whatever the world size: rank ``k`` of ``p`` takes every ``p``-th
sample from the ``k``-th, the gradients are divided by the global batch size and summed
(``op="sum"``), so each update is the mean gradient of the whole batch and an elastic run
gives the weights of one process training alone, to rounding, however often the group
changed: a round applied twice or skipped would show. ``--round-time`` stands in for a
larger model's compute (each step sleeps that long), so the run lasts long enough for the
replacement to start.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import IO, Any

import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_digits import (
    accuracy,
    batches,
    gradients,
    init_params,
    max_relative_difference,
    sgd_step,
    train_alone,
)

from p2pcoll import training
from p2pcoll.testing import free_port

RTOL = 1e-6
PROGRESS_EVERY = 20  # rounds between progress lines
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID",
                 "SLURM_NTASKS", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--demo", action="store_true",
                        help="start the workers, kill one, start a replacement, check")
    parser.add_argument("--workers", type=int, default=4, help="--demo: how many to start")
    parser.add_argument("--min", type=int, default=2, help="--demo: min_world_size")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch", type=int, default=64, help="global batch size")
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--round-time", type=float, default=0.015, metavar="SECONDS",
                        help="simulated compute per step")
    parser.add_argument("--poll-every", type=float, default=0.5, metavar="SECONDS",
                        help="how often rank 0 looks for peers waiting to join")
    parser.add_argument("--die-at", type=int, default=None, metavar="ROUND",
                        help="SIGKILL this worker in that round (--demo: worker 2's)")
    return parser.parse_args(argv)


def digest(params: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    for name in sorted(params):
        h.update(name.encode())
        h.update(np.ascontiguousarray(params[name]).tobytes())
    return h.hexdigest()[:16]


def load(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    digits = load_digits()
    x, x_test, y, y_test = train_test_split(digits.data / 16.0, digits.target, test_size=0.2,
                                            random_state=seed, stratify=digits.target)
    return x, y, x_test, y_test


# --- one worker ------------------------------------------------------------------------------


async def worker(args: argparse.Namespace) -> dict[str, Any]:
    x, y, x_test, y_test = load(args.seed)
    rounds = [idx for epoch in range(args.epochs)
              for idx in batches(len(y), args.batch, epoch, args.seed)]

    peers = 0  # the world size of the round in progress, for the progress lines

    async def step(group: Any, r: int, params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Round r's gradients of this rank's share of the global batch."""
        nonlocal peers
        peers = group.world_size
        idx = rounds[r]
        mine = idx[group.rank::group.world_size]
        grads = gradients(params, x[mine], y[mine], len(idx))
        if r == args.die_at:  # mid-round: the others are waiting for these gradients
            os.kill(os.getpid(), signal.SIGKILL)
        await asyncio.sleep(args.round_time)
        return grads

    def apply(params: dict[str, np.ndarray], grads: dict[str, np.ndarray], r: int) -> None:
        sgd_step(params, grads, args.lr)  # "stats" (loss, hits) is not a parameter: ignored
        if r % PROGRESS_EVERY == 0:
            print(f"round {r}: {peers} peers, loss {grads['stats'][0]:.4f}", flush=True)

    params = init_params(args.hidden, args.seed)  # a newcomer's are overwritten at once
    result = await training.train_elastic(step, apply, params, rounds=len(rounds), op="sum",
                                          poll_every=args.poll_every)
    alone = train_alone(args, x, y)
    return {
        "pid": os.getpid(),
        "digest": digest(params),
        "joined_at": result.joined_at,
        "redone": result.redone,
        "groups": [{"rank": f.rank, "world_size": f.world_size, "round": f.round,
                    "source": f.source, "applied": f.applied, "ended": f.ended}
                   for f in result.formations],
        "accuracy": accuracy(params, x_test, y_test),
        "accuracy_alone": accuracy(alone, x_test, y_test),
        "difference": max_relative_difference(params, alone),
        "rounds": len(rounds),
    }


# --- the demo: start the workers, kill one, replace it, check the results ----------------------


def start_worker(argv: list[str], env: dict[str, str], stderr: IO[str] | None
                 ) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, __file__, *argv], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=stderr)


def report_of(out: str) -> dict[str, Any]:
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    if not lines:
        raise RuntimeError(f"a worker printed no result:\n{out}")
    return json.loads(lines[-1].removeprefix("RESULT "))  # type: ignore[no-any-return]


def demo(args: argparse.Namespace, *, stderr: IO[str] | None = None,
         timeout: float = 120.0) -> tuple[list[dict[str, Any]], int]:
    """Run the scenario; returns the finished workers' reports and the victim's exit code."""
    if args.workers < 3:
        raise SystemExit("--demo needs --workers 3 or more (worker 2 is the one that dies)")
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env.update(P2PCOLL_RENDEZVOUS=f"tcp://127.0.0.1:{free_port()}", PYTHONUNBUFFERED="1",
               P2PCOLL_MIN_WORLD_SIZE=str(args.min), P2PCOLL_MAX_WORLD_SIZE=str(args.workers),
               P2PCOLL_JOIN_TIMEOUT="30")
    common = ["--epochs", str(args.epochs), "--batch", str(args.batch), "--lr", str(args.lr),
              "--hidden", str(args.hidden), "--seed", str(args.seed),
              "--round-time", str(args.round_time), "--poll-every", str(args.poll_every)]
    die_at = args.die_at if args.die_at is not None else 60
    print(f"{args.workers} workers at {env['P2PCOLL_RENDEZVOUS']} (min {args.min}, max "
          f"{args.workers}); worker 2 kills itself in round {die_at}", flush=True)
    workers = [start_worker(common + (["--die-at", str(die_at)] if i == 2 else []), env,
                            stderr) for i in range(args.workers)]
    victim = workers.pop(2)
    try:
        code = victim.wait(timeout)
        print(f"worker 2 (pid {victim.pid}) exited with {code}", flush=True)
        # Worker 0 survives: once it reports a round of the smaller group, restart.
        first = workers[0]
        assert first.stdout is not None
        seen = []
        while line := first.stdout.readline():
            seen.append(line)
            m = re.match(r"round (\d+): (\d+) peers", line)
            if m and int(m[1]) > die_at and int(m[2]) < args.workers:
                print(f"the survivors are at round {m[1]} in a group of {m[2]}; starting a "
                      f"replacement", flush=True)
                break
        workers.append(start_worker(common, env, stderr))
        reports = []
        for proc in workers:
            out, _ = proc.communicate(timeout=timeout)
            out = "".join(seen) + out if proc is first else out
            if proc.returncode != 0:
                raise RuntimeError(f"worker pid {proc.pid} exited with {proc.returncode}:\n{out}")
            reports.append(report_of(out))
    finally:
        for proc in [victim, *workers]:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
    return reports, code


def show(reports: list[dict[str, Any]]) -> bool:
    """Print what each worker did; returns whether every check passed."""
    print(f"{'pid':>7} {'joined':>6} {'applied':>7} {'redone':>6}  digest            groups "
          f"(rank/size from round: how it ended)")
    for r in reports:
        groups = ", ".join(f"{g['rank']}/{g['world_size']} from {g['round']}: "
                           f"{g['ended'].split(':')[0]}" for g in r["groups"])
        applied = sum(len(g["applied"]) for g in r["groups"])
        print(f"{r['pid']:>7} {r['joined_at']:>6} {applied:>7} {r['redone']:>6}  "
              f"{r['digest']}  {groups}")
    digests = {r["digest"] for r in reports}
    worst = max(r["difference"] for r in reports)
    acc, alone = reports[0]["accuracy"], reports[0]["accuracy_alone"]
    print(f"replicas bit-identical: {'yes' if len(digests) == 1 else 'NO'} "
          f"({len(reports)} digests: {', '.join(sorted(digests))})")
    print(f"test accuracy {acc:.2%}; one process training alone, uninterrupted: {alone:.2%} "
          f"(weights differ by {worst:.1e} relative, tolerance {RTOL:g})")
    return len(digests) == 1 and worst <= RTOL


def main() -> int:
    args = parse_args()
    if args.demo:
        reports, code = demo(args)
        ok = show(reports) and code == -signal.SIGKILL
        ok = ok and any(r["joined_at"] > 0 for r in reports)  # the replacement caught up
        return 0 if ok else 1
    logging.basicConfig(format=f"[worker {os.getpid()}] %(message)s", level=logging.WARNING)
    logging.getLogger("p2pcoll.training").setLevel(logging.INFO)
    report = asyncio.run(worker(args))
    print(f"pid {report['pid']}: joined at round {report['joined_at']}, digest "
          f"{report['digest']}, test accuracy {report['accuracy']:.2%}")
    print("RESULT " + json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
