"""Run the 64-process SIGKILL scenario N times and count what went wrong.

    python benchmarks/kill_loop.py                       # 20 runs, 64 peers, ulimit -n 256
    python benchmarks/kill_loop.py --runs 5 --peers 20 --nofile 0

The scenario is ``tests/test_mesh_scale.py``'s (its worker, ``tests/mesh_worker.py``): the
peers join on 127.0.0.1, run every collective and check each result, then one peer (a
different one each run) is SIGKILLed and every survivor runs a ring allreduce, which must
fail with a ``PeerLost`` naming it, and leaves. Not a test: one line per run and a tally of

    abort     a survivor that died of a signal, or printed libzmq's "Assertion failed"
    hang      a survivor that had not reported within ``--bound`` seconds of the kill
    wrong     a survivor whose collectives before the kill gave a wrong result
    unnamed   a survivor whose error does not name the killed rank (or that raised nothing)
    failed    a run whose group did not form (the peers' stderr tail is printed)

Target (issue 34): 20 runs of 20 with none of these. Heavy (64 processes): run it when the
machine is quiet.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "mesh_worker.py"
sys.path.insert(0, str(ROOT / "tests"))

from peer_processes import PeerProcesses  # noqa: E402  # tests/, on the path above


class Run(PeerProcesses):
    """One run: ``n`` worker processes, their report lines, their stderr; unlike a test,
    it counts what went wrong rather than failing."""

    def __init__(self, tmp: Path, n: int, nofile: int) -> None:
        super().__init__(n, lambda r: [sys.executable, str(WORKER), str(tmp), "--collectives"],
                         nofile=nofile or None, tail=4000)

    @property
    def reports(self) -> list[dict[str, Any]]:
        """Each rank's reports so far, merged (a key's last report)."""
        return [{k: v for line in list(lines) for k, v in line.items()} for lines in self.lines]

    def wait(self, key: str, ranks: list[int], bound: float) -> list[int]:
        """Wait (at most ``bound`` s) until each of ``ranks`` reported ``key`` or exited;
        returns those that did neither."""
        def has(r: int) -> bool:
            return any(key in line for line in list(self.lines[r]))

        deadline = time.monotonic() + bound
        while time.monotonic() < deadline:
            if all(has(r) or self.procs[r].poll() is not None for r in ranks):
                break
            time.sleep(0.05)
        return [r for r in ranks if not has(r) and self.procs[r].poll() is None]

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            proc.wait()
        for t in self.readers:
            t.join(timeout=10)


def trial(n: int, victim: int, nofile: int, bound: float) -> tuple[Counter[str], str]:
    counts: Counter[str] = Counter()
    with tempfile.TemporaryDirectory(prefix="p2pkill-") as tmp:
        run = Run(Path(tmp), n, nofile)
        try:
            everyone = list(range(n))
            run.wait("ready", everyone, 600)
            reports = run.reports
            if not all("ready" in reports[r] for r in everyone):
                counts["failed"] += 1
                bad = [r for r in everyone if "ready" not in reports[r]]
                run.close()
                return counts, f"group did not form (ranks {bad[:8]}): " + next(
                    (run.errors[r][-300:] for r in bad if run.errors[r]), "")
            counts["wrong"] += sum(bool(reports[r]["ready"]["wrong"]) for r in everyone)
            run.procs[victim].send_signal(signal.SIGKILL)
            run.procs[victim].wait()
            (Path(tmp) / "go").touch()
            survivors = [r for r in everyone if r != victim]
            hung = run.wait("after", survivors, bound)
            counts["hang"] += len(hung)
            end = time.monotonic() + 30  # a survivor leaves once it has reported
            for r in survivors:
                if r not in hung:
                    try:
                        run.procs[r].wait(timeout=max(0.1, end - time.monotonic()))
                    except subprocess.TimeoutExpired:
                        pass
            lingering = {r for r in survivors if run.procs[r].poll() is None}
            run.close()  # (kills the lingering: not an abort)
            reports = run.reports
            seconds = []
            for r in survivors:
                code = run.procs[r].returncode
                if (r not in lingering and code < 0) or "Assertion failed" in run.errors[r]:
                    counts["abort"] += 1
                after = reports[r].get("after")
                if after is None:
                    if r not in hung:
                        counts["unnamed"] += 1
                    continue
                seconds.append(after["seconds"])
                if not (after["error"].startswith("PeerLost")
                        and f"rank {victim}" in after["error"]):
                    counts["unnamed"] += 1
            seconds.sort()
            note = (f"named after {seconds[len(seconds) // 2]:.2f} s median, "
                    f"{seconds[-1]:.2f} s last" if seconds else "")
            aborted = [r for r in survivors if "Assertion failed" in run.errors[r]]
            if aborted:
                note += f"; abort on rank {aborted[0]}: {run.errors[aborted[0]][-200:]}"
            return counts, note
        finally:
            run.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--peers", type=int, default=64)
    parser.add_argument("--nofile", type=int, default=256, help="soft limit (0: none)")
    parser.add_argument("--bound", type=float, default=60.0,
                        help="seconds a survivor has to report after the kill")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    total: Counter[str] = Counter()
    clean = 0
    for i in range(args.runs):
        victim = rng.randrange(args.peers)
        started = time.monotonic()
        counts, note = trial(args.peers, victim, args.nofile, args.bound)
        counts = +counts  # (without the zeros)
        total.update(counts)
        clean += not counts
        tally = " ".join(f"{k}={v}" for k, v in sorted(counts.items())) or "ok"
        print(f"run {i + 1}/{args.runs}: killed rank {victim}: {tally} "
              f"({time.monotonic() - started:.0f} s; load {os.getloadavg()[0]:.1f}) {note}",
              flush=True)
    keys = ("abort", "hang", "wrong", "unnamed", "failed")
    print(f"{clean} of {args.runs} runs clean; " + ", ".join(f"{k} {total[k]}" for k in keys))


if __name__ == "__main__":
    main()
