"""Kill and freeze peers at random moments under a link budget, and count what went wrong.

    python benchmarks/chaos.py                      # 20 trials, 12 peers, P2PCOLL_MAX_LINKS=4
    python benchmarks/chaos.py --trials 20 --peers 64 --actions kill --max-links 0 --nofile 256

Not a test: it prints one line per trial and a tally. Every peer is a process of its own (this
file again, with ``--worker``) on 127.0.0.1 with the default transport. The peers join, then
run allreduces back to back, each checked against the sum it must give. At a random moment
(0-1 s after every peer is ready) the driver SIGKILLs or SIGSTOPs one random peer; a stopped
peer is resumed (SIGCONT) once every survivor has raised. Per trial it counts:

    hang        a survivor (or a resumed peer) that had not raised within ``--bound`` seconds
    wrong       an allreduce whose result differed from the expected sum
    abort       a process that died of a signal it was not sent (libzmq's assertions abort)
    unnamed     a survivor whose error does not name the victim's rank
    malformed   messages dropped as malformed by any peer (stray frames on a link)
    unretrieved "Task exception was never retrieved" (or "exception was never retrieved")
                in any peer's stderr
    resumed     for a stopped peer: its own error once resumed (it should say that it was
                declared lost, not that some healthy neighbour is)

Targets (issue 34): 0 of each but ``resumed`` (which should name the victim itself).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import resource
import signal
import socket
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

ELEMENTS = 16 << 10  # 64 KiB of float32 per allreduce


def _say(**event: Any) -> None:
    print(json.dumps(event), flush=True)


async def worker(url: str, rank: int, size: int) -> None:
    """Join, then allreduce until one fails; report every round's correctness and the end."""
    import numpy as np

    import p2pcoll

    g = await p2pcoll.join(url, world_size=size, rank=rank, timeout=120)
    data = np.empty(ELEMENTS, np.float32)
    rounds = 0
    try:
        while True:
            data.fill(rank + 1 + rounds % 7)
            out = await g.allreduce(data)
            expected = size * (size + 1) / 2 + size * (rounds % 7)
            if not np.all(out == expected):
                _say(event="wrong", rank=rank, rounds=rounds)
            rounds += 1
            if rounds == 3:
                _say(event="ready", rank=rank, pid=os.getpid())
    except p2pcoll.P2PCollError as exc:
        _say(event="raised", rank=rank, rounds=rounds, type=type(exc).__name__,
             message=str(exc).splitlines()[0] if str(exc) else "")
    stats = g.stats()
    _say(event="stats", rank=rank, dropped=stats.get("messages_dropped_by_reason", {}))
    with contextlib.suppress(Exception):
        await asyncio.wait_for(g.close(), 30)
    _say(event="closed", rank=rank)


class Peer:
    def __init__(self, rank: int, proc: asyncio.subprocess.Process, stderr: Path) -> None:
        self.rank, self.proc, self.stderr = rank, proc, stderr
        self.events: list[dict[str, Any]] = []
        self.changed = asyncio.Event()
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        while line := await self.proc.stdout.readline():
            with contextlib.suppress(ValueError):
                self.events.append(json.loads(line))
                self.changed.set()

    def find(self, name: str) -> dict[str, Any] | None:
        return next((e for e in self.events if e.get("event") == name), None)

    async def wait_for(self, name: str, until: float) -> dict[str, Any] | None:
        while (found := self.find(name)) is None:
            if self.reader.done() or time.monotonic() >= until:
                return None
            self.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), until - time.monotonic())
        return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def trial(args: argparse.Namespace, n: int, tmp: Path) -> dict[str, Any]:
    url = f"tcp://127.0.0.1:{_free_port()}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("P2PCOLL_")}
    if args.max_links:
        env["P2PCOLL_MAX_LINKS"] = str(args.max_links)
    peers = []
    for rank in range(args.peers):
        err = tmp / f"t{n}-r{rank}.err"
        with err.open("wb") as fh:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, __file__, "--worker", url, str(rank), str(args.peers),
                env={**env, "P2PCOLL_HOST_ID": f"chaos-{rank}"} if args.own_hosts else env,
                stdout=asyncio.subprocess.PIPE, stderr=fh,
                stdin=asyncio.subprocess.DEVNULL)
        peers.append(Peer(rank, proc, err))
    result: dict[str, Any] = Counter()
    try:
        until = time.monotonic() + args.bound * 4
        ready = await asyncio.gather(*(p.wait_for("ready", until) for p in peers))
        if not all(ready):
            result["no_start"] += 1
            return result
        await asyncio.sleep(random.random())
        victim = random.choice(peers)
        action = random.choice(args.actions)
        victim.proc.send_signal(signal.SIGKILL if action == "kill" else signal.SIGSTOP)
        result["action"] = action
        result["victim"] = victim.rank
        survivors = [p for p in peers if p is not victim]
        until = time.monotonic() + args.bound
        raised = await asyncio.gather(*(p.wait_for("raised", until) for p in survivors))
        result["hang"] += sum(r is None for r in raised)
        result["unnamed"] += sum(r is not None and f"rank {victim.rank}" not in r["message"]
                                 for r in raised)
        if raised and raised[0] is not None:
            result["sample"] = f"{raised[0]['type']}: {raised[0]['message']}"[:160]
        if action == "stop":
            victim.proc.send_signal(signal.SIGCONT)
            own = await victim.wait_for("raised", time.monotonic() + args.bound)
            if own is None:
                result["hang"] += 1
            else:
                result["resumed"] = f"{own['type']}: {own['message']}"[:160]
        until = time.monotonic() + args.bound
        await asyncio.gather(*(p.wait_for("closed", until) for p in peers
                               if not (p is victim and action == "kill")))
    finally:
        for p in peers:
            if p.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    p.proc.kill()
            code = await p.proc.wait()
            await p.reader
            result["wrong"] += sum(e.get("event") == "wrong" for e in p.events)
            stats = p.find("stats")
            if stats is not None:
                result["malformed"] += stats["dropped"].get("malformed", 0)
            text = p.stderr.read_text(errors="replace")
            result["unretrieved"] += text.count("exception was never retrieved")
            if "exception was never retrieved" in text:
                at = text.index("exception was never retrieved")
                result["unretrieved_text"] = text[at:at + 1500]
            killed_by_us = p is victim and result.get("action") == "kill"
            if (code < 0 and not killed_by_us and code != -signal.SIGKILL) or (
                    "Assertion failed" in text):
                result["abort"] += 1
                result["abort_text"] = text[-300:]
    return result


async def drive(args: argparse.Namespace) -> None:
    tally: Counter[str] = Counter()
    with tempfile.TemporaryDirectory(prefix="p2pcoll-chaos-") as tmp:
        for n in range(args.trials):
            r = await trial(args, n, Path(tmp))
            line = " ".join(f"{k}={r[k]}" for k in ("action", "victim", "hang", "wrong",
                                                     "abort", "unnamed", "malformed",
                                                     "unretrieved") if k in r)
            print(f"trial {n + 1:3d}: {line}")
            for key in ("sample", "resumed", "abort_text", "unretrieved_text"):
                if r.get(key):
                    print(f"    {key}: {r[key]}")
            for key in ("hang", "wrong", "abort", "unnamed", "malformed", "unretrieved",
                        "no_start"):
                tally[key] += r.get(key, 0)
    print(f"{args.trials} trials of {args.peers} peers (max links {args.max_links or 'none'}): "
          + ", ".join(f"{k} {tally[k]}" for k in ("hang", "wrong", "abort", "unnamed",
                                                  "malformed", "unretrieved", "no_start")))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        url, rank, size = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
        asyncio.run(worker(url, rank, size))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--peers", type=int, default=12)
    parser.add_argument("--max-links", type=int, default=4, help="P2PCOLL_MAX_LINKS; 0: none")
    parser.add_argument("--actions", type=lambda s: s.split(","), default=["kill", "stop"],
                        help="comma-separated: kill, stop")
    parser.add_argument("--bound", type=float, default=60.0,
                        help="seconds a survivor may take to raise before it counts as a hang")
    parser.add_argument("--nofile", type=int, default=0, help="soft limit of open files")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--own-hosts", action="store_true",
                        help="each peer a host of its own (P2PCOLL_HOST_ID): tcp links and "
                             "TCP lanes between all")
    args = parser.parse_args()
    random.seed(args.seed)
    if args.nofile:
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (args.nofile, hard))
    asyncio.run(drive(args))


if __name__ == "__main__":
    main()
