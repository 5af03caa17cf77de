"""A slow receiver: does a sender's memory stay bounded while one peer stalls?

    python benchmarks/slow_receiver.py                      # 4 x 64 MiB allreduces, 10 s stall
    python benchmarks/slow_receiver.py --together           # the 4 started at once
    python benchmarks/slow_receiver.py --collective broadcast   # rank 0 broadcasts instead
    python benchmarks/slow_receiver.py --mib 16 --count 2 --stall 3 --configs tcp --json rows.json

Not a test: it prints a table (tests/test_slow_receiver.py runs a small version of it and
asserts). For each configuration, stall mode and strategy, the driver (this process) starts
three peers as processes (this file again, with ``--worker``) on 127.0.0.1, which form a new
group. The configurations:

- ``tcp``: transport tcp over loopback;
- ``ipc``: transport ipc, ``P2PCOLL_SHM=0`` (every payload through the socket);
- ``shm``: transport ipc with shared-memory rings (the default between peers of a host).

Each peer allocates (and touches) its data and reports its RSS, the baseline; runs one
warm-up collective of the full size, and reports its RSS again. The driver then tells them
to go: the senders (ranks 0 and 1) call ``--count`` collectives of ``--mib`` MiB of float32
in a row (each awaited; ``--together`` starts them all at once with ``asyncio.gather``),
while the receiver (rank 2) first stalls for ``--stall`` seconds, then calls the same ones:

- ``block``: ``time.sleep`` in its event loop, so nothing of p2pcoll runs in it, only
  libzmq's I/O threads (which read into the socket's queue up to its high-water mark);
- ``sleep``: ``await asyncio.sleep``, so its loop reads and buffers what arrives for
  collectives it has not called yet.

The driver samples every peer's ``VmRSS`` (``/proc/PID/status``, or psutil if installed)
every 20 ms from "go" until all are done; each peer also reports its ``VmHWM``, the peak
since the baseline (reset through ``/proc/self/clear_refs``). The table gives, for each
sender and the receiver, the peak RSS above the baseline in MiB (so what a collective keeps
in buffers and libzmq's and malloc's pools counts, warm-up included), and in parentheses the
peak after "go" above the RSS at "go" (what the stall added); the time from "go" until the
last peer finished; and whether every result was exact (the inputs are small integers, so
float32 sums are exact in any order), or "failed" if a peer raised, with its error below.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

WORLD = 3
SLOW = 2  # the receiver's rank
CONFIGS = {
    "tcp": {"P2PCOLL_TRANSPORT": "tcp"},
    "ipc": {"P2PCOLL_TRANSPORT": "ipc", "P2PCOLL_SHM": "0"},
    "shm": {"P2PCOLL_TRANSPORT": "ipc", "P2PCOLL_SHM": "1"},
}
MODES = ("block", "sleep")
DEFAULT_STRATEGIES = {"allreduce": "auto,ring", "broadcast": "root,pipeline"}
STEP = 1 << 20  # elements per slice: no helper here allocates more than a few MiB


# --- one peer -----------------------------------------------------------------------------

def _say(**event: Any) -> None:
    print(json.dumps(event), flush=True)


def _pattern(n: int) -> Any:
    """``n`` float32 values ``k % 1000``: small integers, so every sum is exact."""
    import numpy as np

    out = np.empty(n, np.float32)
    for at in range(0, n, STEP):
        out[at:at + STEP] = np.arange(at, min(at + STEP, n)) % 1000
    return out


def _fill(x: Any, pattern: Any, rank: int, i: int) -> None:
    """Rank ``rank``'s input to collective ``i``: ``pattern * (rank + 1) + i``, in place."""
    import numpy as np

    np.multiply(pattern, rank + 1, out=x)
    x += i


def _exact(got: Any, pattern: Any, factor: int, offset: int) -> bool:
    """Whether ``got == pattern * factor + offset`` exactly (compared slice by slice)."""
    import numpy as np

    for at in range(0, got.size, STEP):
        if not np.array_equal(got[at:at + STEP], pattern[at:at + STEP] * factor + offset):
            return False
    return True


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _reset_peak() -> None:
    """Make VmHWM start again from the current RSS (Linux >= 4.0; else it stays)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


async def worker(args: argparse.Namespace) -> None:
    import gc

    import numpy as np

    import p2pcoll

    n = (args.mib << 20) // 4
    kwargs: dict[str, Any] = {"timeout": 120}
    if args.strategy != "auto":
        kwargs["strategy"] = args.strategy
    async with p2pcoll.join(args.url, world_size=WORLD, rank=args.rank, timeout=60,
                            collective_timeout=300) as g:
        rank = g.rank
        if args.collective == "allreduce":
            factor, offset = WORLD * (WORLD + 1) // 2, WORLD  # the sum: pattern * 6 + 3i

            async def collective(x: Any, out: Any) -> None:
                await g.allreduce(x, out=out, **kwargs)
        else:
            factor, offset = 1, 1  # rank 0's input: pattern + i

            async def collective(x: Any, out: Any) -> None:
                if rank == 0:
                    await g.broadcast(x, root=0, **kwargs)
                    out[:] = x
                else:
                    await g.broadcast(out, root=0, **kwargs)  # filled in place

        pattern = _pattern(n)
        inputs = [np.empty(n, np.float32) for _ in range(args.count if args.together else 1)]
        outs = [np.empty(n, np.float32) for _ in inputs]
        for x in [*inputs, *outs]:
            x.fill(0)  # touch every page now, so that the baseline counts them
        gc.collect()
        _reset_peak()
        _say(event="armed", rss_kb=_status_kb("VmRSS"))  # the baseline: no collective yet
        _fill(inputs[0], pattern, rank, 0)  # the warm-up
        await collective(inputs[0], outs[0])
        ok = _exact(outs[0], pattern, factor, 0)
        gc.collect()
        _say(event="ready", ok=ok, rss_kb=_status_kb("VmRSS"))
        await asyncio.to_thread(sys.stdin.readline)  # "go"
        if rank == SLOW:
            if args.mode == "block":
                time.sleep(args.stall)  # the loop stops: nothing of p2pcoll runs here
            else:
                await asyncio.sleep(args.stall)
        if args.together:
            for i, x in enumerate(inputs, 1):
                _fill(x, pattern, rank, i)
            await asyncio.gather(*(collective(x, o) for x, o in zip(inputs, outs)))
            ok = ok and all(_exact(o, pattern, factor, offset * i)
                            for i, o in enumerate(outs, 1))
        else:
            for i in range(1, args.count + 1):
                _fill(inputs[0], pattern, rank, i)
                await collective(inputs[0], outs[0])
                ok = ok and _exact(outs[0], pattern, factor, offset * i)
        _say(event="done", rank=rank, ok=ok, hwm_kb=_status_kb("VmHWM"),
             shm=g.stats()["bytes_sent_shm"])
        await g.barrier(timeout=60)


# --- the driver ---------------------------------------------------------------------------

def rss_kb(pid: int) -> int:
    """A process's resident set size in KiB (psutil if installed, else /proc/PID/status)."""
    try:
        import psutil
    except ImportError:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        return 0
    return int(psutil.Process(pid).memory_info().rss) >> 10


async def _event(proc: asyncio.subprocess.Process, event: str) -> dict[str, Any] | None:
    """The next message ``event`` from a peer, or None if it exits first."""
    assert proc.stdout is not None
    while True:
        line = await proc.stdout.readline()
        if not line:
            return None
        try:
            msg = json.loads(line)
        except ValueError:
            continue
        if isinstance(msg, dict) and msg.get("event") == event:
            return msg


def _last_error(log: Path) -> str:
    """The last line of a peer's stderr that names an exception (how it failed)."""
    lines = [line for line in log.read_text(errors="replace").splitlines()
             if line and not line.startswith(" ") and ("Error" in line or "Lost" in line)]
    return lines[-1][:200] if lines else "exited without a result"


async def run_one(config: str, mode: str, strategy: str, args: argparse.Namespace,
                  ) -> dict[str, Any]:
    """One group of three peers: the figures of one row."""
    import tempfile

    from p2pcoll.testing import free_port

    url = f"tcp://127.0.0.1:{free_port()}"
    env = {**os.environ, **CONFIGS[config]}
    command = [sys.executable, __file__, "--worker", "--url", url, "--mode", mode,
               "--collective", args.collective, "--strategy", strategy, "--mib", str(args.mib),
               "--count", str(args.count), "--stall", str(args.stall)]
    if args.together:
        command.append("--together")
    with tempfile.TemporaryDirectory() as logs:
        errs = [Path(logs, f"rank{r}.err") for r in range(WORLD)]
        procs = []
        for r in range(WORLD):
            with errs[r].open("wb") as err:
                procs.append(await asyncio.create_subprocess_exec(
                    *command, "--rank", str(r), env=env, stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE, stderr=err))
        try:
            row = await _measure(procs)
        finally:
            for p in procs:
                if p.returncode is None:
                    p.kill()
                await p.wait()
        failed = [r for r, p in enumerate(procs) if p.returncode != 0]
        row["errors"] = {r: _last_error(errs[r]) for r in failed}
        row["exact"] = row["exact"] and not failed
    row.update(config=config, mode=mode, collective=args.collective, strategy=strategy,
               mib=args.mib, count=args.count, together=args.together, stall_s=args.stall)
    return row


async def _measure(procs: list[asyncio.subprocess.Process]) -> dict[str, Any]:
    """Baselines, go, samples until every peer is done (or has exited), the figures."""
    armed = [await asyncio.wait_for(_event(p, "armed"), 120) for p in procs]
    ready = [await asyncio.wait_for(_event(p, "ready"), 120) for p in procs]
    if None in armed + ready:
        nan = [math.nan] * WORLD
        return {"exact": False, "growth_mib": nan, "stall_growth_mib": nan, "base_mib": nan,
                "seconds": math.nan, "bytes_sent_shm": [0] * WORLD}
    base = [m["rss_kb"] for m in armed if m is not None]
    at_go = [m["rss_kb"] for m in ready if m is not None]
    peak = list(at_go)
    start = time.perf_counter()
    for p in procs:
        assert p.stdin is not None
        p.stdin.write(b"go\n")
    waits = [asyncio.ensure_future(_event(p, "done")) for p in procs]
    while not all(w.done() for w in waits):
        await asyncio.wait(waits, timeout=0.02)
        for r, p in enumerate(procs):
            try:
                peak[r] = max(peak[r], rss_kb(p.pid))
            except (OSError, ValueError):  # it has just exited
                pass
        if time.perf_counter() - start > 600:
            raise RuntimeError("no result within 600 s")
    seconds = time.perf_counter() - start
    done = [w.result() for w in waits]
    for p in procs:
        await asyncio.wait_for(p.wait(), 120)
    # The peak of the whole run: the larger of the samples and the high-water mark a peer
    # read at the end (reset when it was armed).
    whole = [max(pk, m["hwm_kb"]) if m else pk for pk, m in zip(peak, done)]
    return {
        "base_mib": [b / 1024 for b in base],
        "growth_mib": [(pk - b) / 1024 for pk, b in zip(whole, base)],
        "stall_growth_mib": [(pk - b) / 1024 for pk, b in zip(peak, at_go)],
        "seconds": seconds, "bytes_sent_shm": [m["shm"] if m else 0 for m in done],
        "exact": all(m is not None and m["ok"] for m in ready + done),
    }


def table(rows: list[dict[str, Any]]) -> str:
    head = ("config", "stall", "strategy", "rank 0 +MiB", "rank 1 +MiB", "receiver +MiB",
            "seconds", "exact")
    lines = [head]
    for row in rows:
        cells = [f"{g:.1f} ({a:.1f})" for g, a in zip(row["growth_mib"], row["stall_growth_mib"])]
        lines.append((row["config"], row["mode"], row["strategy"], *cells[:2], cells[SLOW],
                      f"{row['seconds']:.1f}",
                      "failed" if row["errors"] else "yes" if row["exact"] else "NO"))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(cell.ljust(w) if i < 3 else cell.rjust(w)
                               for i, (cell, w) in enumerate(zip(line, widths)))
                     for line in lines)


async def drive(args: argparse.Namespace) -> int:
    strategies = args.strategies or DEFAULT_STRATEGIES[args.collective]
    rows = []
    for config in args.configs.split(","):
        for mode in args.modes.split(","):
            for strategy in strategies.split(","):
                row = await run_one(config, mode, strategy, args)
                rows.append(row)
                print(f"{config} {mode} {strategy}: +" + " / +".join(
                    f"{g:.1f}" for g in row["growth_mib"]) + f" MiB, {row['seconds']:.1f}s",
                    file=sys.stderr, flush=True)
    issued = "at once (asyncio.gather)" if args.together else "in a row"
    root = ", root 0" if args.collective == "broadcast" else ""
    print(f"{args.count} {args.collective}s of {args.mib} MiB float32{root}, issued {issued}; "
          f"3 peers on one host, rank {SLOW} stalls {args.stall:g}s first.\n"
          f"+MiB: peak RSS above the RSS before the first collective (its data allocated); in "
          f"parentheses, after 'go' above the RSS at 'go' (after a warm-up {args.collective}).")
    print(table(rows))
    for row in rows:
        for rank, error in row["errors"].items():
            print(f"  {row['config']} {row['mode']} {row['strategy']}: rank {rank}: {error}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0 if all(row["exact"] for row in rows) else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=64, help="tensor size (MiB of float32)")
    parser.add_argument("--count", type=int, default=4, help="collectives after the stall")
    parser.add_argument("--stall", type=float, default=10.0, help="seconds the receiver stalls")
    parser.add_argument("--together", action="store_true",
                        help="start the collectives at once (asyncio.gather), not one by one")
    parser.add_argument("--configs", default="tcp,ipc,shm", help=f"of {', '.join(CONFIGS)}")
    parser.add_argument("--modes", default="block,sleep", help=f"of {', '.join(MODES)}")
    parser.add_argument("--collective", choices=sorted(DEFAULT_STRATEGIES),
                        default="allreduce")
    parser.add_argument("--strategies", help="comma-separated (default: "
                        + "; ".join(f"{c} {s}" for c, s in DEFAULT_STRATEGIES.items()) + ")")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="block", help=argparse.SUPPRESS)
    parser.add_argument("--strategy", default="auto", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        asyncio.run(worker(args))
        return 0
    return asyncio.run(drive(args))


if __name__ == "__main__":
    sys.exit(main())
