"""What hostile traffic costs a live peer: memory before and after, and how fast it is refused.

    python benchmarks/fuzz_peer.py                         # 100,000 messages
    python benchmarks/fuzz_peer.py --messages 20000 --seed 3
    python benchmarks/fuzz_peer.py --big-headers 5         # also 5 maximal (3.5 MB) headers

Not a test: it prints a table. The driver (this process) starts a group of two peers as
processes (this file again, with ``--worker``) over tcp on 127.0.0.1, talking to each over
its stdin/stdout. Once the group has formed and run a warm-up allreduce, the driver connects
a rogue DEALER (identity ``b"5"``, no member's) to rank 0's endpoint and sends it the hostile
messages: random bytes, random msgpack maps, valid headers of rank 0's group with one field
mutated, and valid headers with a spoofed or rogue source (with the payload frames they
announce), with 0 to 5 further frames; 1 in 100 carries a 16-64 KiB frame. Frames over
ZeroMQ's MAXMSGSIZE are left out: libzmq drops such a connection itself, with whatever it
still carried, so nothing could count them. With ``--big-headers K`` K maximal headers
follow (half a million layout leaves, 3.5 MB each, for another group).

Rank 0 samples its ``VmRSS`` (``/proc/self/status``) every 10 ms until its
``messages_dropped`` reaches the number sent (or stops moving for 15 s), then reports the
RSS before, right after, and after a ``gc.collect()`` and a second's rest; the peak is the
largest sample and ``VmHWM`` (the process's high-water mark). "handled per second" is the
number dropped divided by the time from the first drop to the last. WARNING and ERROR lines
are the records of logger ``p2pcoll.transport`` at those levels (an ERROR is a message the
library failed to handle, not merely refused). Finally both ranks run an allreduce and a
broadcast and check the results.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import random
import sys
import time
from pathlib import Path
from typing import Any

ROGUE_IDENTITY = b"5"


# --- the worker (one peer of the group) ---------------------------------------------------

def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return -1


class _Count(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.warnings = 0
        self.errors = 0
        self.first: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.ERROR:
            self.errors += 1
        else:
            self.warnings += 1
        if len(self.first) < 3:
            self.first.append(f"{record.levelname} {record.getMessage()[:160]}")


def _say(**event: Any) -> None:
    print(json.dumps(event), flush=True)


async def _command() -> list[str]:
    line = await asyncio.to_thread(sys.stdin.readline)
    return line.split()


async def _check(g: Any) -> bool:
    import numpy as np

    n = g.world_size
    total = await g.allreduce(np.arange(10_000, dtype=np.float64) * (g.rank + 1), timeout=30)
    ok = bool(np.array_equal(total, np.arange(10_000) * n * (n + 1) / 2))
    tree = {"w": np.arange(12, dtype=np.float32).reshape(3, 4)}
    got = await g.broadcast(tree if g.rank == 0 else None, root=0, timeout=30)
    return ok and bool(np.array_equal(got["w"], tree["w"])) and g.state == "ready"


async def worker(url: str, rank: int) -> None:
    import p2pcoll

    counter = _Count()
    logging.getLogger("p2pcoll.transport").addHandler(counter)
    async with p2pcoll.join(url, world_size=2, rank=rank, transport="tcp", timeout=60,
                            collective_timeout=120) as g:
        if not await _check(g):  # warm-up, and the baseline includes what a collective keeps
            raise SystemExit("warm-up collectives gave wrong results")
        gc.collect()
        _say(event="ready", rank=rank, endpoint=g.endpoint, group=g.membership.group_id,
             rss_kb=_status_kb("VmRSS"))
        while True:
            cmd = await _command()
            if not cmd or cmd[0] == "quit":
                return
            if cmd[0] == "expect":
                _say(event="handled", **await _watch(g, int(cmd[1]), counter))
            elif cmd[0] == "check":
                ok = await _check(g)
                _say(event="checked", rank=rank, ok=ok, rss_kb=_status_kb("VmRSS"),
                     dropped=g.stats()["messages_dropped"])


def _time_drops(g: Any) -> list[float]:
    """[time of the first drop, time of the last] from now on (wraps the transport's
    drop counter: instrumentation of this benchmark, not part of the library)."""
    drops = g.session.transport.drops
    times: list[float] = []
    count = drops.drop

    def drop(*args: Any, **kwargs: Any) -> None:
        now = time.perf_counter()
        if times:
            times[1] = now
        else:
            times.extend([now, now])
        count(*args, **kwargs)

    drops.drop = drop
    return times


async def _watch(g: Any, expected: int, counter: _Count) -> dict[str, Any]:
    """Sample RSS while the drops come in; the figures once they stop."""
    loop = asyncio.get_running_loop()
    before = _status_kb("VmRSS")
    start = g.stats()["messages_dropped"]
    times = _time_drops(g)
    _say(event="watching")
    peak, last_at, last_count = before, loop.time(), start
    while True:
        await asyncio.sleep(0.01)
        now, count = loop.time(), g.stats()["messages_dropped"]
        peak = max(peak, _status_kb("VmRSS"))
        if count != last_count:
            last_at, last_count = now, count
        if count - start >= expected or now - last_at > 15:
            break
    after = _status_kb("VmRSS")
    gc.collect()
    await asyncio.sleep(1.0)
    settled = _status_kb("VmRSS")
    dropped = last_count - start
    took = times[1] - times[0] if times else 0.0
    return {
        "dropped": dropped, "rss_before_kb": before, "rss_after_kb": after,
        "rss_settled_kb": settled, "rss_peak_kb": max(peak, after),
        "vm_hwm_kb": _status_kb("VmHWM"), "seconds": took,
        "per_second": dropped / took if took > 0 else float("inf"),
        "warnings": counter.warnings, "errors": counter.errors, "first_lines": counter.first,
    }


# --- the hostile messages -----------------------------------------------------------------

KEYS = ["v", "k", "g", "r", "q", "seg", "s", "sig", "n", "m", "d", "err", "meta", "strategy",
        "leaves", "tree", "ring", "zz", 1, -7, b"k", ""]


def _anything(rng: random.Random, depth: int = 0) -> Any:
    roll = rng.random()
    if depth < 4 and roll < 0.25:
        return [_anything(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    if depth < 4 and roll < 0.45:
        return {rng.choice(KEYS): _anything(rng, depth + 1) for _ in range(rng.randint(0, 4))}
    return rng.choice([
        None, True, False, 0, -1, 2, 1 << 62, (1 << 64) - 1, -(1 << 63),
        rng.randint(-(1 << 63), (1 << 64) - 1), float("nan"), float("inf"), 2.0,
        "", "data", "hello", "abort", "bye", "<f4", "*", "x" * rng.randint(0, 300),
        b"", bytes(8), rng.randbytes(rng.randint(0, 40)),
    ])


def _valid(rng: random.Random, gid: str, src: int) -> dict[str, Any]:
    from p2pcoll.wire import WIRE_VERSION

    seq = rng.randrange(1 << 40)  # every one a new collective, as a leak would want
    return rng.choice([
        {"v": WIRE_VERSION, "k": "data", "g": gid, "r": src, "q": seq, "seg": rng.randrange(64),
         "s": rng.randrange(64), "sig": rng.randbytes(8), "n": [16, 0],
         "d": ["allreduce", "ring", "sum", -1, "x"]},
        {"v": WIRE_VERSION, "k": "data", "g": gid, "r": src, "q": seq, "seg": 0, "s": 0,
         "sig": rng.randbytes(8), "n": [12],
         "meta": {"strategy": "binomial", "tree": "*", "leaves": [["<f4", [3]]]}},
        {"v": WIRE_VERSION, "k": "abort", "g": gid, "r": src, "q": seq,
         "err": ["CollectiveTimeout", "forged"],
         "meta": {"collective": "allreduce", "waiting_on": [0]}},
        {"v": WIRE_VERSION, "k": "hello", "g": gid, "r": src, "meta": {"ring": "p2pcoll-x"}},
        {"v": WIRE_VERSION, "k": "bye", "g": gid, "r": src, "q": seq},
    ])


def hostile(rng: random.Random, gid: str, count: int) -> list[list[bytes]]:
    import msgpack

    out = []
    for _ in range(count):
        roll = rng.random()
        src = rng.choice([0, 1, 5, 2, rng.randrange(1 << 20)])
        if roll < 0.2:
            header = rng.randbytes(rng.randint(0, 200))
        elif roll < 0.4:
            header = msgpack.packb({rng.choice(KEYS): _anything(rng)
                                    for _ in range(rng.randint(0, 8))})
        elif roll < 0.8:
            d = _valid(rng, gid, src)
            target = d["meta"] if "meta" in d and rng.random() < 0.3 else d
            key = rng.choice(list(target) + ["zz"])
            if rng.random() < 0.2:
                target.pop(key, None)
            else:
                target[key] = _anything(rng)
            header = msgpack.packb(d)
        else:
            d = _valid(rng, gid, src)
            out.append([msgpack.packb(d), *(bytes(n) for n in d.get("n", []))])
            continue
        frames = [rng.randbytes(rng.randint(0, 64)) for _ in range(rng.randint(0, 5))]
        if rng.random() < 0.01:
            frames.append(bytes(rng.randint(16 << 10, 64 << 10)))
        out.append([header, *frames])
    return out


def big_headers(gid: str, count: int) -> list[list[bytes]]:
    import msgpack

    from p2pcoll.wire import WIRE_VERSION

    d = {"v": WIRE_VERSION, "k": "data", "g": "not-" + gid, "r": 5, "q": 0, "seg": 0, "s": 0,
         "sig": bytes(8), "n": [], "meta": {"strategy": "binomial",
                                             "leaves": [["<f4", [1]]] * 500_000}}
    return [[msgpack.packb(d)]] * count


# --- the driver ---------------------------------------------------------------------------

class Peer:
    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    async def read(self, event: str) -> dict[str, Any]:
        assert self.proc.stdout is not None
        while True:
            line = await asyncio.wait_for(self.proc.stdout.readline(), 600)
            if not line:
                raise SystemExit(f"a peer exited (waiting for {event!r})")
            try:
                msg = json.loads(line)
            except ValueError:
                continue  # not ours
            if msg.get("event") == event:
                return msg

    def send(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text.encode() + b"\n")


async def drive(args: argparse.Namespace) -> int:
    import zmq
    import zmq.asyncio

    from p2pcoll.testing import free_port

    url = f"tcp://127.0.0.1:{free_port()}"
    procs = [await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--worker", "--rank", str(r), "--url", url,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE) for r in range(2)]
    peers = [Peer(p) for p in procs]
    try:
        ready = [await p.read("ready") for p in peers]
        gid, endpoint = ready[0]["group"], ready[0]["endpoint"]
        t = time.perf_counter()
        messages = hostile(random.Random(args.seed), gid, args.messages)
        messages += big_headers(gid, args.big_headers)
        print(f"generated {len(messages):,} messages in {time.perf_counter() - t:.1f}s; "
              f"sending to rank 0 at {endpoint}", file=sys.stderr)

        rogue = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        rogue.setsockopt(zmq.IDENTITY, ROGUE_IDENTITY)
        rogue.setsockopt(zmq.SNDHWM, 1000)
        rogue.connect(endpoint)
        peers[0].send(f"expect {len(messages)}")
        await peers[0].read("watching")
        t = time.perf_counter()
        for frames in messages:
            await rogue.send_multipart(frames)
        sent_in = time.perf_counter() - t
        handled = await peers[0].read("handled")
        rogue.close(linger=1000)

        for p in peers:
            p.send("check")
        checked = [await p.read("checked") for p in peers]
        for p in peers:
            p.send("quit")
        codes = [await p.wait() for p in procs]
    finally:
        for p in procs:
            if p.returncode is None:
                p.kill()
                await p.wait()

    mb = 1024.0
    ok = all(c["ok"] for c in checked) and codes == [0, 0]
    rows = [
        ("messages sent", f"{len(messages):,}"
                          + (f" ({args.big_headers} of 3.5 MB)" if args.big_headers else "")),
        ("messages dropped (rank 0 stats)", f"{handled['dropped']:,}"),
        ("RSS before", f"{handled['rss_before_kb'] / mb:.1f} MB"),
        ("RSS right after", f"{handled['rss_after_kb'] / mb:.1f} MB"),
        ("RSS after gc + 1 s", f"{handled['rss_settled_kb'] / mb:.1f} MB"),
        ("RSS peak (sampled / VmHWM)", f"{handled['rss_peak_kb'] / mb:.1f} MB / "
                                       f"{handled['vm_hwm_kb'] / mb:.1f} MB"),
        ("handled per second", f"{handled['per_second']:,.0f} "
                               f"({handled['dropped']:,} in {handled['seconds']:.2f}s; "
                               f"sender took {sent_in:.2f}s)"),
        ("WARNING / ERROR log lines", f"{handled['warnings']} / {handled['errors']}"),
        ("allreduce + broadcast afterwards", "correct" if ok else f"FAILED {checked} {codes}"),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    for line in handled["first_lines"]:
        print(f"  {line}")
    return 0 if ok and handled["dropped"] == len(messages) else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--big-headers", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        asyncio.run(worker(args.url, args.rank))
        return 0
    return asyncio.run(drive(args))


if __name__ == "__main__":
    sys.exit(main())
