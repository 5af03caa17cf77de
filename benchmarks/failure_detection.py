"""How long survivors take to find out that a peer, or the rendezvous host, is gone.

    python benchmarks/failure_detection.py                 # 5 trials of every case
    python benchmarks/failure_detection.py --trials 3 --cases kill,stop2

Not a test: it prints a table. Every peer is a process of its own (this file again, with
``--worker``) on 127.0.0.1, with the default transport (ipc and shared memory between the
peers of one host), and prints what happens to it as JSON lines. The driver (this process)
waits until the peers are where the case needs them, sends the signal, and takes the time
(``time.monotonic()``, one clock for every process of the machine) from just after
``os.kill`` to the moment each survivor's call raised. A case counts as *named* when every
survivor raised the expected error and its message names the victim: ``rank R`` for a lost
peer, also its pid for a peer lost at the rendezvous, the rendezvous URL for a lost host.

The cases (``--cases``, comma-separated; all by default):

    kill      SIGKILL of rank 2 while 4 peers run 64 MiB allreduces back to back
    stop      SIGSTOP of rank 2 there, default heartbeat (P2PCOLL_HEARTBEAT_TIMEOUT unset: 5 s)
    stop2     the same with P2PCOLL_HEARTBEAT_TIMEOUT=2
    pause2    SIGSTOP of every peer for 1.25 x the heartbeat (P2PCOLL_HEARTBEAT_TIMEOUT=2),
              then SIGCONT: a crowded host that did not run the job's processes just past
              the heartbeat; "first"/"all" are then the seconds from the SIGCONT to each
              peer's next allreduce, and "named" counts the trials in which no peer raised
              (kept, not lost)
    join      SIGKILL of rank 1 once ranks 0-2 of 4 have registered (rank 0 hosts the
              rendezvous): the others fail, "registered and then stopped answering"
    join2     the same with P2PCOLL_HEARTBEAT_TIMEOUT=2
    server    SIGKILL of a standalone RendezvousServer process once ranks 1-3 of 4 have
              registered: "no rendezvous host at"
    failover  the same with ranks 0-2 registered: rank 0 (which tries to host all along)
              binds the port and hosts, the others register there again, and once rank 3
              starts (a second after the kill) the group forms; the time is to "formed"
    host      SIGKILL of rank 0, which hosts the rendezvous, once ranks 0-2 of 4 registered

"first" is the survivor that raised first, "all" the last one; "named" counts the trials in
which every survivor's message named the victim; ".rank" tallies the ``rank`` attribute of
the survivors' PeerLost (None where a survivor learned of the loss from another's abort).
After each trial every process of it is killed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import signal
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

WORLD = 4
VICTIM = 2  # mid-allreduce; at the rendezvous rank 1 (rank 0 hosts it)
MIB = 64
WAIT_S = 60.0  # any one wait of the driver longer than this is a failure of the case


def _say(**event: Any) -> None:
    print(json.dumps(event), flush=True)


# --- the processes of a trial -------------------------------------------------------------

async def _raised(exc: BaseException) -> None:
    """Report the error, then stay: a survivor that exited would be lost in its turn."""
    _say(event="raised", t=time.monotonic(), type=type(exc).__name__, message=str(exc),
         rank_attr=getattr(exc, "rank", None))
    await asyncio.Event().wait()


async def mesh_worker(url: str, rank: int, mib: int) -> None:
    """Join, then run allreduces of ``mib`` MiB back to back until one fails."""
    import numpy as np

    import p2pcoll

    data = np.full(mib << 18, rank + 1, np.float32)
    out = np.empty_like(data)
    try:
        g = await p2pcoll.join(url, world_size=WORLD, rank=rank, timeout=WAIT_S)
    except p2pcoll.P2PCollError as exc:
        await _raised(exc)
    await g.allreduce(data, out=out)
    _say(event="ready", pid=os.getpid(), rank=rank)
    rounds = 0
    try:
        while True:
            await g.allreduce(data, out=out)
            rounds += 1
            _say(event="round", rank=rank, rounds=rounds, t=time.monotonic())
    except p2pcoll.P2PCollError as exc:
        await _raised(exc)


async def join_worker(url: str, rank: int) -> None:
    """Join a group of WORLD that never completes; report how the join ends."""
    import p2pcoll

    _say(event="joining", pid=os.getpid(), rank=rank)
    try:
        g = await p2pcoll.join(url, world_size=WORLD, rank=rank, timeout=WAIT_S)
    except p2pcoll.P2PCollError as exc:
        await _raised(exc)
    _say(event="formed", t=time.monotonic(), rank=g.rank)
    await asyncio.Event().wait()


async def server_worker(url: str) -> None:
    from p2pcoll.rendezvous import RendezvousServer

    server = RendezvousServer(url)
    server.bind()
    _say(event="serving", pid=os.getpid())
    await asyncio.Event().wait()


# --- the driver ---------------------------------------------------------------------------

class Proc:
    """One process of a trial, read line by line in the background."""

    def __init__(self, proc: asyncio.subprocess.Process, name: str) -> None:
        self.proc, self.name = proc, name
        self.events: list[dict[str, Any]] = []
        self.changed = asyncio.Event()
        self._reader = asyncio.create_task(self._read())

    @classmethod
    async def start(cls, name: str, *args: str, env: dict[str, str]) -> Proc:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, __file__, *args, env=env, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL, stdin=asyncio.subprocess.DEVNULL)
        return cls(proc, name)

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        while line := await self.proc.stdout.readline():
            try:
                self.events.append(json.loads(line))
            except ValueError:
                continue
            self.changed.set()

    def find(self, event: str) -> dict[str, Any] | None:
        return next((e for e in self.events if e.get("event") == event), None)

    async def wait_for(self, event: str, timeout: float = WAIT_S) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while (found := self.find(event)) is None:
            if self._reader.done():
                raise RuntimeError(f"{self.name} exited before {event!r}: {self.events}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.name}: no {event!r} within {timeout:g}s")
            self.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), left)
        return found

    @property
    def pid(self) -> int:
        return self.proc.pid

    async def kill(self) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGKILL)
        await self.proc.wait()
        self._reader.cancel()


@dataclass
class Trial:
    first: float | None = None  # seconds from the signal to the first survivor's error
    last: float | None = None  # ... to the last one's
    named: bool = False
    errors: set[str] = field(default_factory=set)
    rank_attrs: list[Any] = field(default_factory=list)  # PeerLost.rank of each survivor
    sample: str = ""
    problem: str = ""


def _env(heartbeat: float | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("P2PCOLL_")}
    if heartbeat is not None:
        env["P2PCOLL_HEARTBEAT_TIMEOUT"] = f"{heartbeat:g}"
    return env


async def _registered(url: str, count: int) -> None:
    """Until ``count`` peers have registered at the rendezvous at ``url``."""
    from p2pcoll.rendezvous.client import waiting

    deadline = time.monotonic() + WAIT_S
    while await waiting(url, timeout=WAIT_S) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"fewer than {count} peers registered at {url}")
        await asyncio.sleep(0.05)


async def _outcome(survivors: list[Proc], sent_at: float, expect: Callable[[dict[str, Any]],
                   bool], event: str = "raised") -> Trial:
    trial = Trial()
    raised = [await p.wait_for(event) for p in survivors]
    times = [e["t"] - sent_at for e in raised]
    trial.first, trial.last = min(times), max(times)
    trial.errors = {e.get("type", event) for e in raised}
    trial.rank_attrs = [e.get("rank_attr") for e in raised]
    trial.named = all(expect(e) for e in raised)
    trial.sample = raised[times.index(trial.first)].get("message", event)
    if not trial.named:
        trial.problem = "; ".join(f"{p.name}: {e.get('type')}: {e.get('message')}"
                                  for p, e in zip(survivors, raised, strict=True)
                                  if not expect(e))
    return trial


async def _mesh(heartbeat: float | None, mib: int) -> list[Proc]:
    """WORLD mesh workers (allreduces of ``mib`` MiB) on a new rendezvous, started."""
    from p2pcoll.testing import free_port

    url = f"tcp://127.0.0.1:{free_port()}"
    return [await Proc.start(f"rank {r}", "--worker", "mesh", "--rank", str(r), "--url", url,
                             "--mib", str(mib), env=_env(heartbeat)) for r in range(WORLD)]


async def mesh_trial(sig: signal.Signals, heartbeat: float | None, mib: int) -> Trial:
    """4 peers in allreduces of ``mib`` MiB; ``sig`` to rank VICTIM mid-allreduce."""
    procs = await _mesh(heartbeat, mib)
    try:
        for p in procs:
            await p.wait_for("ready")
        for p in procs:
            await p.wait_for("round")  # every rank is in the loop of allreduces
        await asyncio.sleep(0.05)
        victim = procs[VICTIM]
        os.kill(victim.pid, sig)
        sent_at = time.monotonic()
        survivors = [p for r, p in enumerate(procs) if r != VICTIM]

        def expect(e: dict[str, Any]) -> bool:
            # "... lost the connection to rank 2", at the end of the message or not
            return e["type"] == "PeerLost" and \
                re.search(rf"to rank {VICTIM}\b", e["message"]) is not None

        return await _outcome(survivors, sent_at, expect)
    finally:
        for p in procs:
            await p.kill()


async def pause_trial(heartbeat: float, mib: int, factor: float = 1.25) -> Trial:
    """4 peers in allreduces; every one stopped for ``factor`` x the heartbeat, then
    continued: every peer should go on without an error."""
    procs = await _mesh(heartbeat, mib)
    try:
        for p in procs:
            await p.wait_for("round")
        for p in procs:
            os.kill(p.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        await asyncio.sleep(factor * heartbeat)
        for p in procs:
            os.kill(p.pid, signal.SIGCONT)
        resumed = time.monotonic()
        trial, times = Trial(), []
        for p in procs:
            deadline = resumed + 4 * heartbeat + 5
            while True:  # its next round after the SIGCONT, or its error since the SIGSTOP
                later = [e for e in p.events if e.get("t", 0) > resumed
                         or (e["event"] == "raised" and e["t"] > stopped)]
                if later or time.monotonic() > deadline:
                    break
                p.changed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(p.changed.wait(), 0.2)
            raised = [e for e in later if e["event"] == "raised"]
            if raised or not later:
                trial.errors.add(raised[0]["type"] if raised else "stuck")
                trial.problem += f"{p.name}: {raised[0]['message'] if raised else 'stuck'}; "
            else:
                times.append(later[0]["t"] - resumed)
        trial.named = not trial.errors
        trial.errors = trial.errors or {"none"}
        if times:
            trial.first, trial.last = min(times), max(times)
        trial.sample = trial.problem or "every peer went on"
        return trial
    finally:
        for p in procs:
            await p.kill()


async def join_trial(case: str, heartbeat: float | None) -> Trial:
    """Three of 4 peers register (one never comes), then the victim is SIGKILLed: rank 1
    (``join``; rank 0 hosts), rank 0, the host (``host``), or a standalone server, with
    ranks 1-3 registered (``server``) or ranks 0-2 (``failover``: rank 0 then hosts in its
    place, and the missing rank 3 is started a second after the kill)."""
    from p2pcoll.testing import free_port

    url = f"tcp://127.0.0.1:{free_port()}"
    env = _env(heartbeat)
    procs: list[Proc] = []
    standalone = case in ("server", "failover")
    ranks = [1, 2, 3] if case == "server" else [0, 1, 2]
    try:
        if standalone:
            server = await Proc.start("server", "--worker", "server", "--url", url, env=env)
            procs.append(server)
            await server.wait_for("serving")
        for r in ranks:
            procs.append(await Proc.start(f"rank {r}", "--worker", "join", "--rank", str(r),
                                          "--url", url, env=env))
        peers = [p for p in procs if p.name.startswith("rank")]
        for p in peers:
            await p.wait_for("joining")
        await _registered(url, len(peers))
        victim = {"server": procs[0], "failover": procs[0], "host": peers[0],
                  "join": peers[1]}[case]
        os.kill(victim.pid, signal.SIGKILL)
        sent_at = time.monotonic()
        survivors = [p for p in peers if p is not victim]
        if case == "failover":
            await asyncio.sleep(1.0)
            procs.append(await Proc.start("rank 3", "--worker", "join", "--rank", "3",
                                          "--url", url, env=env))
            survivors.append(procs[-1])
            return await _outcome(survivors, sent_at, lambda e: e["event"] == "formed",
                                  "formed")
        if case == "join":
            pid = victim.pid

            def expect(e: dict[str, Any]) -> bool:
                m = e["message"]
                return (e["type"] == "RendezvousError" and "stopped answering" in m
                        and f"pid {pid}, asking for rank 1)" in m)
        else:
            def expect(e: dict[str, Any]) -> bool:
                return (e["type"] == "RendezvousError"
                        and f"no rendezvous host at {url}:" in e["message"])

        return await _outcome(survivors, sent_at, expect)
    finally:
        for p in procs:
            await p.kill()


CASES: dict[str, tuple[str, Callable[[argparse.Namespace], Any]]] = {
    "kill": ("SIGKILL mid-allreduce ({mib} MiB, 4 peers)",
             lambda a: mesh_trial(signal.SIGKILL, None, a.mib)),
    "stop": ("SIGSTOP mid-allreduce, heartbeat 5 s (default)",
             lambda a: mesh_trial(signal.SIGSTOP, None, a.mib)),
    "stop2": ("SIGSTOP mid-allreduce, P2PCOLL_HEARTBEAT_TIMEOUT=2",
              lambda a: mesh_trial(signal.SIGSTOP, 2.0, a.mib)),
    "pause2": ("SIGSTOP of all for 1.25 x heartbeat 2 s, SIGCONT (kept: next round)",
               lambda a: pause_trial(2.0, a.mib)),
    "join": ("SIGKILL of a registered peer, group incomplete",
             lambda a: join_trial("join", None)),
    "join2": ("the same, P2PCOLL_HEARTBEAT_TIMEOUT=2", lambda a: join_trial("join", 2.0)),
    "server": ("SIGKILL of a standalone rendezvous server in join",
               lambda a: join_trial("server", None)),
    "failover": ("  the same, rank 0 joining: it hosts instead (formed)",
                 lambda a: join_trial("failover", None)),
    "host": ("SIGKILL of rank 0 hosting the rendezvous in join",
             lambda a: join_trial("host", None)),
}


def _figures(values: list[float]) -> str:
    if not values:
        return "-"
    return (f"{statistics.median(values):6.2f} s ({min(values):.2f}-{max(values):.2f})")


async def drive(args: argparse.Namespace) -> int:
    names = args.cases.split(",")
    unknown = [n for n in names if n not in CASES]
    if unknown:
        raise SystemExit(f"unknown cases {unknown}; choose from {sorted(CASES)}")
    rows: list[tuple[str, ...]] = []
    problems: list[str] = []
    samples: list[str] = []
    for name in names:
        title, run = CASES[name]
        title = title.format(mib=args.mib)
        trials: list[Trial] = []
        for i in range(args.trials):
            try:
                trials.append(await asyncio.wait_for(run(args), 3 * WAIT_S))
            except (TimeoutError, RuntimeError) as exc:
                problems.append(f"{name} trial {i + 1}: {exc}")
                trials.append(Trial(problem=str(exc)))
            t = trials[-1]
            print(f"  {name} trial {i + 1}: first {t.first}, all {t.last}, "
                  f"named {t.named}, {sorted(t.errors)}", file=sys.stderr)
        done = [t for t in trials if t.first is not None]
        named = sum(t.named for t in trials)
        errors = sorted(set().union(*(t.errors for t in done))) if done else []
        attrs = Counter(str(a) for t in done for a in t.rank_attrs)
        rows.append((title, _figures([t.first for t in done if t.first is not None]),
                     _figures([t.last for t in done if t.last is not None]),
                     f"{named}/{len(trials)}", ", ".join(errors),
                     " ".join(f"{a}:{n}" for a, n in sorted(attrs.items()))
                     if "PeerLost" in errors else ""))
        problems += [f"{name}: {t.problem}" for t in trials if t.problem]
        if done:
            samples.append(f"{name}: {done[0].sample}")
    head = ("case", "first survivor", "all survivors", "named", "raised", ".rank:count")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    print(f"{args.trials} trials each; median (range), seconds from the signal to the error")
    for r in [head, tuple("-" * w for w in widths), *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    print("\nA message of each case, from its first trial:")
    for s in samples:
        print(f"  {s}")
    if problems:
        print("\nProblems:")
        for p in problems:
            print(f"  {p}")
    return 1 if problems else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--mib", type=int, default=MIB, help="allreduce size (MiB)")
    parser.add_argument("--worker", choices=["mesh", "join", "server"], help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "mesh":
        asyncio.run(mesh_worker(args.url, args.rank, args.mib))
    elif args.worker == "join":
        asyncio.run(join_worker(args.url, args.rank))
    elif args.worker == "server":
        asyncio.run(server_worker(args.url))
    else:
        return asyncio.run(drive(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
