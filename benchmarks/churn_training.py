"""Asynchronous DiLoCo through churn: one peer killed and a new one started every few rounds.

    python benchmarks/churn_training.py                      # 4 peers, 50 rounds, every 5
    python benchmarks/churn_training.py --rounds 20 --every 4 --params 500000
    python benchmarks/churn_training.py --min-world-size 2 --logs /tmp/churn
    python benchmarks/churn_training.py --rendezvous peer    # a peer hosts the rendezvous
    python benchmarks/churn_training.py --standby            # a spare started ahead

Not a test: it prints one markdown table and a verdict. Peers run on this host over loopback
(``P2PCOLL_HOST_ID`` differs per peer, so nothing goes through shared memory), each
``training.train_elastic(..., delay=1)`` with :class:`training.DiLoCoRounds` on a numpy
model of ``--params`` float32 parameters (inner step: a few matrix products over them, the
same work on every peer, and each round one weight moved by each peer's own amount) and
H = ``--inner``; a round's H steps run in one thread call (``--hop-every-step``: one call
per step, whose hand-overs a loaded machine makes slow). The driver SIGKILLs one peer
(never the one it measures) each time ``--every`` more rounds were applied, and starts a
new one at once.

Per round, each peer that applies it logs the state's digest (compared across the peers:
every replica must hold the same bits after every round). The *wait* of a round, on peer 0:
the wall time from the previous round's apply to its own, less the inner steps computed
meanwhile (the next round's, which overlap its reduction): how long it stalled beyond its
compute, re-formations included. Reported against the inner-step time, the issue's bound
being one inner step; the last round, with no next round to overlap, is shown apart. The
same wait against the slowest peer's compute over the round leaves out what peers sharing
a loaded machine lose to each other (a round ends when its slowest peer's step does).

``--logs DIR``: each peer's log, the kills and every applied round (``events.json``), the
standalone rendezvous's requests (``server.log``) and each peer's re-formation steps
(rendezvous, join, formation, agreement, heal, shrink: traced by this script, not logged by
the library), all on one clock; the run then prints each kill's path (shrink, rendezvous,
or an admission it interrupted), the times from the kill to what peer 0 logged, and the
worst of its two rounds in inner steps (``paths.json``). ``--tree DIR``: the peers and the
rendezvous run another checkout's p2pcoll (the old code, side by side).

The rendezvous runs as a standalone ``p2pcoll rendezvous`` process by default, as a swarm
whose peers come and go runs it (``--rendezvous peer``: the first peer hosts it, and the
kill of that peer sends the survivors through a new host). ``--min-world-size`` (default
peers - 1): survivors fewer than it wait at the rendezvous for a replacement.

Two ways to hold the issue's scenario (a kill and a new peer every ``--every`` rounds) to
its bound, since survivors below their minimum wait at the rendezvous by definition and a
newcomer's interpreter takes seconds to start on a loaded machine: ``--standby`` keeps one
replacement started ahead (a spare waits at the rendezvous from the first round on; each
kill starts the next spare, and only peers that applied a round are killed), as a job with
hot spares runs; or ``--min-world-size`` low enough that a kill never leaves too few.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
END_GRACE_S = 5.0  # seconds the others get to finish once peer 0 has
sys.path.insert(0, str(ROOT / "tests"))

WORKER = '''
import asyncio, concurrent.futures, hashlib, json, logging, os, sys, time
import numpy as np
from p2pcoll import training

logging.basicConfig(level=logging.INFO, format="%(created).3f %(message)s")  # the driver's clock

ROUNDS, H, N = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
PER_STEP = sys.argv[4] == "1"  # one thread hand-over per inner step, else one per round
PEER = int(os.environ["P2PCOLL_HOST_ID"].rsplit("-", 1)[1])


def traced(owner, name):
    """Log when the coroutine ``owner.name`` starts and ends (a benchmark's trace of a
    re-formation's steps, on the driver's clock; the library logs none of it)."""
    call = getattr(owner, name)

    async def wrapper(*args, **kwargs):
        logging.info("trace %s start", name)
        try:
            return await call(*args, **kwargs)
        finally:
            logging.info("trace %s end", name)
    setattr(owner, name, wrapper)


if os.environ.get("CHURN_TRACE") == "1":
    import p2pcoll.session.forming as forming
    import p2pcoll.training.elastic as elastic
    for owner, name in ((forming, "rendezvous"), (elastic._Run, "_join"),
                        (elastic._Run, "_sync"), (elastic, "heal"), (elastic, "agree_on"),
                        (elastic, "zeros_from_holder"), (elastic, "shrunk")):
        traced(owner, name)
    from p2pcoll.registry import registry
    load = registry.load

    def loading():  # the scan of the installed strategies (in a thread of join's)
        logging.info("trace registry.load start")
        load()
        logging.info("trace registry.load end")
    registry.load = loading


async def main() -> None:
    rng = np.random.default_rng(0)
    params = {"w": rng.standard_normal(N).astype(np.float32)}
    side = min(512, int(N ** 0.5))
    mix = rng.standard_normal((side, side)).astype(np.float32) / side
    inner_times = []

    def inner_step() -> None:  # a fixed amount of work, then a small move of the weights
        t = time.perf_counter()
        w = params["w"]
        x = w[: side * side].reshape(side, side)
        for _ in range(4):
            x = np.tanh(x @ mix)
        w -= np.float32(1e-3) * np.resize(x.reshape(-1), w.shape)
        inner_times.append(time.perf_counter() - t)

    def inner_steps():
        for _ in range(H):
            inner_step()
        # A move of this peer's own: a round's average then depends on who took part, so
        # two groups that ran the same round apart would log different digests.
        params["w"][PEER % N] -= np.float32(1e-3)

    async def inner(group, r, i):
        if PER_STEP:
            await asyncio.to_thread(inner_step)
            if i == H - 1:
                params["w"][PEER % N] -= np.float32(1e-3)
        elif i == 0:  # the round's H steps at once; the other calls only count
            await asyncio.to_thread(inner_steps)

    rounds = training.DiLoCoRounds(params, inner, inner_steps=H, outer_lr=0.7,
                                   outer_momentum=0.9, delay=1)
    async def step(group, r, state):
        return await rounds.step(group, r, state)

    # The digest of each round's state is hashed in a thread beside the next round's
    # steps (hashlib lets go of the GIL), not on the round's path; of a copy, which a
    # heal at the next formation cannot change meanwhile.
    hashing = concurrent.futures.ThreadPoolExecutor(1)

    def digest(r, leaves, fields):
        h = hashlib.blake2b(digest_size=8)
        for leaf in leaves:
            h.update(leaf.data)
        sys.stdout.write("APPLIED " + json.dumps({"round": r, "digest": h.hexdigest(),
                                                  **fields}) + "\\n")
        sys.stdout.flush()

    def apply(state, deltas, r):
        rounds.apply(state, deltas, r)
        leaves = [np.array(leaf, order="C") for _, leaf in training.named_leaves(state)]
        hashing.submit(digest, r, leaves, {"t": time.time(), "computed": sum(inner_times),
                                           "inner": statistics_median(inner_times)})

    result = await training.train_elastic(step, apply, rounds.state, rounds=ROUNDS,
                                          poll_every=0.2, delay=1,
                                          settings=rounds.settings)
    hashing.shutdown(wait=True)  # the last round's digest printed
    print("DONE " + json.dumps({"applied": result.applied, "joined_at": result.joined_at}),
          flush=True)


def statistics_median(xs):
    xs = sorted(xs[-50:])
    return xs[len(xs) // 2] if xs else 0.0


asyncio.run(main())
'''


# The standalone rendezvous with each request it handles logged (a benchmark's trace, not
# the library's): who joined or asked, what it expected, and how many were there.
TRACED_SERVER = '''
import logging, sys
import msgpack
from p2pcoll.cli import main
from p2pcoll.rendezvous import jobs

logging.basicConfig(level=logging.INFO, format="%(created).3f %(message)s")
handle = jobs.Jobs._handle

def traced(self, identity, msg, now):
    forming = self._forming.get(msg.get("job", ""))
    before = len(forming.entries) if forming is not None else 0
    again = forming is not None and identity in forming.entries
    handle(self, identity, msg, now)
    if msg.get("op") == "join" and again:
        return  # a re-sent join
    logging.info("request %s from %s (pid %s) expect %s order %s: %d there before",
                 msg.get("op"), identity.hex()[-6:], msg.get("pid"), msg.get("expect"),
                 msg.get("order"), before)

jobs.Jobs._handle = traced
sys.exit(main(["rendezvous", "--host", "127.0.0.1", "--port", sys.argv[1]]))
'''


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--every", type=int, default=5, help="rounds between kills")
    parser.add_argument("--inner", type=int, default=10, help="H, inner steps per round")
    parser.add_argument("--params", type=int, default=1_000_000)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--hop-every-step", action="store_true",
                        help="hand each inner step to a thread and back (as before), instead "
                             "of a round's steps at once")
    parser.add_argument("--logs", default=None,
                        help="a directory for each peer's log (formations, shrinks), the "
                             "kills and every peer's applied rounds (events.json), on one clock")
    parser.add_argument("--min-world-size", type=int, default=None,
                        help="the elastic minimum (default: peers - 1)")
    parser.add_argument("--standby", action="store_true",
                        help="keep one replacement started ahead: a spare waits at the "
                             "rendezvous from the first round on, each kill starts the next "
                             "spare, and only peers that applied a round are killed")
    parser.add_argument("--tree", default=None,
                        help="run the peers and the rendezvous with the p2pcoll of this "
                             "checkout (the old code of a side-by-side run)")
    parser.add_argument("--rendezvous", choices=("standalone", "peer"), default="standalone",
                        help="standalone: a `p2pcoll rendezvous` process that is never killed "
                             "(as a swarm runs one); peer: the first peer hosts it, and a "
                             "kill of that peer moves it")
    args = parser.parse_args(argv)

    from p2pcoll.testing import free_port

    script = Path("/tmp") / f"churn_worker_{os.getpid()}.py"
    script.write_text(WORKER)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("P2PCOLL_", "RANK", "WORLD_SIZE", "LOCAL_"))}
    port = free_port()
    low = args.peers - 1 if args.min_world_size is None else args.min_world_size
    env.update(P2PCOLL_RENDEZVOUS=f"tcp://127.0.0.1:{port}", PYTHONUNBUFFERED="1",
               P2PCOLL_MIN_WORLD_SIZE=str(low),
               P2PCOLL_MAX_WORLD_SIZE=str(args.peers), P2PCOLL_JOIN_TIMEOUT="60",
               OMP_NUM_THREADS="1")
    tree = Path(args.tree).resolve() if args.tree is not None else ROOT
    env["PYTHONPATH"] = str(tree)
    procs: list[subprocess.Popen[str]] = []
    logs: list[list[dict[str, Any]]] = []
    killed: list[int] = []
    kills: list[dict[str, Any]] = []  # when each kill happened, for the logs
    done: set[int] = set()
    server = None
    if args.rendezvous == "standalone":
        command = ["-m", "p2pcoll", "rendezvous", "--host", "127.0.0.1", "--port", str(port)]
        server_err: Any = subprocess.DEVNULL
        if args.logs is not None:  # traced: each request and group formed, on one clock
            Path(args.logs).mkdir(parents=True, exist_ok=True)
            server_err = open(Path(args.logs) / "server.log", "w")
            command = ["-c", TRACED_SERVER, str(port)]
        server = subprocess.Popen([sys.executable, *command], env=env, stdout=subprocess.PIPE,
                                  stderr=server_err, text=True, cwd=tree)
        assert server.stdout is not None
        server.stdout.readline()  # "serving at ...": it listens

    def start() -> None:
        env_i = {**env, "P2PCOLL_HOST_ID": f"host-{len(procs)}",
                 "CHURN_TRACE": "1" if args.logs is not None else "0"}
        err: Any = subprocess.DEVNULL
        if args.logs is not None:
            Path(args.logs).mkdir(parents=True, exist_ok=True)
            err = open(Path(args.logs) / f"peer{len(procs)}.log", "w")
        procs.append(subprocess.Popen(
            [sys.executable, str(script), str(args.rounds), str(args.inner), str(args.params),
             "1" if args.hop_every_step else "0"],
            env=env_i, text=True, stdout=subprocess.PIPE, stderr=err, cwd=tree))
        logs.append([])
        threading.Thread(target=read, args=(len(procs) - 1,), daemon=True).start()

    def read(i: int) -> None:
        """Peer i's lines, parsed into its log as they come."""
        stdout = procs[i].stdout
        assert stdout is not None
        for line in stdout:
            if line.startswith("APPLIED "):
                logs[i].append(json.loads(line[8:]))
            elif line.startswith("DONE "):
                done.add(i)

    for _ in range(args.peers):
        start()
    deadline = time.monotonic() + args.timeout
    next_kill = args.every
    ended: float | None = None  # when peer 0, the one measured, finished
    try:
        while time.monotonic() < deadline and len(done | set(killed)) < len(procs):
            if 0 in done:
                # A newcomer started near the end waits at the rendezvous for a group that
                # will not form (for its join timeout): nothing is measured on it.
                ended = time.monotonic() if ended is None else ended
                if time.monotonic() > ended + END_GRACE_S:
                    break
            for i, proc in enumerate(procs):
                if proc.poll() is not None and i not in killed:
                    time.sleep(0.1)  # its last lines
                    done.add(i)
            applied = max((e["round"] + 1 for log in logs for e in log), default=0)
            if args.standby and len(procs) == args.peers and applied >= 1:
                start()  # the spare, once the first group formed without it
            if applied >= next_kill and applied < args.rounds - 1:
                # kill the oldest live peer other than peer 0, the one measured (with a
                # spare: the oldest that applied a round, so a member of the group)
                live = [i for i in range(1, len(procs)) if i not in done and i not in killed
                        and (logs[i] or not args.standby)]
                if live:
                    victim = live[0]
                    procs[victim].send_signal(signal.SIGKILL)
                    kills.append({"peer": victim, "t": time.time(), "applied": applied})
                    killed.append(victim)
                    start()
                next_kill += args.every
            time.sleep(0.02)
    finally:
        for proc in procs + ([server] if server is not None else []):
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        script.unlink(missing_ok=True)
    if args.logs is not None:
        (Path(args.logs) / "events.json").write_text(json.dumps({"kills": kills, "applied": logs}))

    by_round: dict[int, set[str]] = {}
    for i, log in enumerate(logs):
        # A killed peer's last round may have completed on it alone: the survivors then
        # reduce it again without it (train_elastic's ambiguous case), so it is left out.
        for e in log[:-1] if i in killed else log:
            by_round.setdefault(e["round"], set()).add(e["digest"])
    equal = all(len(d) == 1 for d in by_round.values())
    measured = logs[0]
    # A round's wait: the wall time from the previous apply to its own, less the inner
    # steps computed meanwhile (the next round's, which overlap its reduction).
    for before, e in itertools.pairwise(measured):
        e["wait"] = max(0.0, (e["t"] - before["t"]) - (e["computed"] - before["computed"]))
    # The same against the slowest peer's compute over the round (peers that applied both
    # rounds): what the rounds stall beyond the group's compute, without the imbalance of
    # peers sharing a loaded machine.
    by_peer = [{e["round"]: e["computed"] for e in log} for log in logs]
    for e in measured:
        spans = [c[e["round"]] - c[e["round"] - 1] for c in by_peer
                 if e["round"] in c and e["round"] - 1 in c]
        own = by_peer[0][e["round"]] - by_peer[0].get(e["round"] - 1, 0.0)
        e["group_wait"] = max(0.0, e.get("wait", 0.0) + own - max(spans, default=own))
    last = measured[-1] if len(measured) == args.rounds else None
    measured = measured[1:-1] if last is not None else measured[1:]
    inner = statistics.median(e["inner"] for e in measured) if measured else 0.0
    # A kill's rounds: the first two peer 0 applies after it (the loss may stall either).
    hit = {e["round"] for k in kills
           for e in [e for e in measured if e["t"] > k["t"]][:2]}
    on_kills = [e["wait"] for e in measured if e["round"] in hit]
    over = [e["round"] for e in measured if e["wait"] > inner]
    print(f"{args.peers} peers on loopback, {args.rounds} rounds of H = {args.inner}, "
          f"{args.params / 1e6:.2g} M float32 parameters, one peer killed and one started every "
          f"{args.every} rounds ({len(killed)} kills), min_world_size {low}, rendezvous "
          f"{args.rendezvous}{', a spare started ahead' if args.standby else ''}; "
          f"load {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs\n")
    waits = [e["wait"] for e in measured]
    group_waits = [e["group_wait"] for e in measured]
    print("| rounds measured (peer 0) | median wait ms | median on kill rounds ms "
          "| max wait ms | median beyond the slowest peer's compute ms | inner step ms "
          "| rounds waiting > 1 inner step | digests equal every round |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| {len(measured)} | {statistics.median(waits) * 1e3 if waits else 0:.1f} | "
          f"{statistics.median(on_kills) * 1e3 if on_kills else 0:.1f} | "
          f"{max(waits, default=0) * 1e3:.1f} | "
          f"{statistics.median(group_waits) * 1e3 if group_waits else 0:.1f} | "
          f"{inner * 1e3:.1f} | {len(over)} {over[:10]} | "
          f"{'yes' if equal else 'NO'} ({len(by_round)} rounds compared) |")
    print("\nper-round wait of peer 0 (ms; * a kill's round; round 0 has no previous apply to count from, and "
          "the last no next round to overlap"
          + (f": it waited {last['wait'] * 1e3:.0f} ms" if last is not None else "") + "): "
          + ", ".join(f"{e['round']}{'*' if e['round'] in hit else ''}:{e['wait'] * 1e3:.0f}"
                   for e in measured))
    if args.logs is not None:
        print_paths(Path(args.logs), kills, logs[0], inner)
    return 0 if equal and last is not None else 1


# What peer 0's log says of a kill, in the order it happens (the driver's clock).
MARKS = (("admit", "peers wait to join"), ("lost", " lost "), ("lost", "PeerLost"),
         ("failed", " at round "), ("told", "lost on the way"),
         ("shrank", "shrank the group"), ("formed", "from round"))


def kill_paths(log: list[tuple[float, str]], kills: list[dict[str, Any]],
               applied: list[dict[str, Any]], inner: float) -> list[dict[str, Any]]:
    """Each kill's path as peer 0 saw it (``shrink``: its group shrank; ``rendezvous``: a
    round failed and it joined again; ``admission``: its group was admitting a newcomer, and
    no round failed), the times from the kill to what it logged (s), and the worst wait of the two
    rounds it applied after the kill, in inner steps."""
    out = []
    for k in kills:
        t = k["t"]
        # the events from just before the kill (an admission decided then) to the formation
        events: dict[str, float] = {}
        admit_before = [ts for ts, line in log if t - 1.5 <= ts < t and MARKS[0][1] in line]
        for ts, line in log:
            if ts < t:
                continue
            for name, text in MARKS:
                if text in line and name not in events:
                    events[name] = ts - t
            if "formed" in events:
                break
        if admit_before:
            events.setdefault("admit", admit_before[-1] - t)
        path = ("shrink" if "shrank" in events else
                "admission" if "admit" in events and "failed" not in events
                else "rendezvous" if "formed" in events else "none")
        waits = [e["wait"] for e in [e for e in applied if e["t"] > t and "wait" in e][:2]]
        out.append({"kill": t, "path": path, "events": events,
                    "worst": max(waits, default=0.0) / inner if inner else 0.0})
    return out


def print_paths(logs: Path, kills: list[dict[str, Any]], applied: list[dict[str, Any]],
                inner: float) -> None:
    log = []
    for line in (logs / "peer0.log").read_text().splitlines():
        stamp, _, text = line.partition(" ")
        try:
            log.append((float(stamp), text))
        except ValueError:
            continue
    paths = kill_paths(log, kills, applied, inner)
    (logs / "paths.json").write_text(json.dumps(paths))
    print("\nkills (peer 0's log, s after the kill; worst of the two rounds after it, in "
          "inner steps):")
    for p in paths:
        marks = ", ".join(f"{n} {v:+.2f}" for n, v in sorted(p["events"].items(),
                                                              key=lambda kv: kv[1]))
        print(f"- {p['path']}: {p['worst']:.2f}x ({marks})")


if __name__ == "__main__":
    raise SystemExit(main())
