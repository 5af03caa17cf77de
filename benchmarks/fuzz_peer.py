"""What hostile traffic costs a live peer: memory before and after, and how fast it is refused.

    python benchmarks/fuzz_peer.py                         # 100,000 messages over tcp
    python benchmarks/fuzz_peer.py --transport ipc
    python benchmarks/fuzz_peer.py --key                   # a secured group: refused at the door
    python benchmarks/fuzz_peer.py --messages 20000 --seed 3
    python benchmarks/fuzz_peer.py --big-headers 5         # also 5 maximal (3.5 MB) headers
    python benchmarks/fuzz_peer.py --messages 0 --probe stranger   # the issue's probe
    python benchmarks/fuzz_peer.py --messages 0 --probe twin

Not a test: it prints a table. The driver (this process) starts a group of two peers as
processes (this file again, with ``--worker``) over tcp (or ``--transport ipc``) on this
machine, talking to each over its stdin/stdout. Once the group has formed and run a warm-up
allreduce, the driver connects a rogue DEALER (identity ``b"5"``, no member's) to rank 0's
endpoint and sends it the hostile messages: random bytes, random msgpack maps, valid headers
of rank 0's group with one field mutated, and valid headers with a spoofed or rogue source
(with the payload frames they announce), with 0 to 5 further frames; 1 in 100 carries a
16-64 KiB frame. A member's link identity is ``b"<rank>@<secret>@<nonce>"``, so every one of them
comes from a stranger and is dropped as such before its header is decoded. Frames over
ZeroMQ's MAXMSGSIZE are left out: libzmq drops such a connection itself, with whatever it
still carried, so nothing could count them. With ``--big-headers K`` K maximal headers
follow (half a million layout leaves, 3.5 MB each, for another group).

With ``--key`` the group runs CurveZMQ with a fresh job key, and the rogue knows the job's
public key but holds a key pair of its own: the ZAP gate refuses its handshake, nothing it
sends is read (0 dropped), and once libzmq's queue for it is full its sends are pushed back
(sent without blocking: the table counts the messages queued and refused).

``--probe stranger`` then sends the issue's probe: a DEALER with rank 1's identity in the
old format (``b"1"``), while rank 1 is live, sends 8 messages of 50 MiB; they come from a
stranger and are read and dropped. ``--probe twin`` sends the same 8 messages on a second
connection with the identity of a first one (any identity: ``b"twin"``), to show whether
libzmq reads them at all; the RSS is read again after the rogue has gone.

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
import tempfile
import time
from pathlib import Path
from typing import Any

ROGUE_IDENTITY = b"5"
PROBE_MESSAGES, PROBE_BYTES = 8, 50 << 20


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


async def worker(url: str, rank: int, transport: str, key: str | None) -> None:
    import zmq.asyncio

    import p2pcoll
    from p2pcoll.security import Gate, JobKey

    counter = _Count()
    logging.getLogger("p2pcoll.transport").addHandler(counter)

    def refused() -> int:
        return Gate.refusals(zmq.asyncio.Context.instance(), JobKey.load(key)) if key else 0

    async with p2pcoll.join(url, world_size=2, rank=rank, transport=transport, timeout=60,
                            collective_timeout=120, key_file=key) as g:
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
                watched = await _watch(g, int(cmd[1]), float(cmd[2]), counter)
                _say(event="handled", refused=refused(), **watched)
            elif cmd[0] == "rss":
                gc.collect()
                await asyncio.sleep(1.0)
                _say(event="rss", rss_kb=_status_kb("VmRSS"),
                     dropped=g.stats()["messages_dropped"])
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


async def _watch(g: Any, expected: int, at_least: float, counter: _Count) -> dict[str, Any]:
    """Sample RSS while the drops come in (for ``at_least`` seconds); the figures once they
    stop."""
    loop = asyncio.get_running_loop()
    before = _status_kb("VmRSS")
    start = g.stats()["messages_dropped"]
    reasons = dict(g.stats().get("messages_dropped_by_reason", {}))
    times = _time_drops(g)
    _say(event="watching")
    began = loop.time()
    peak, last_at, last_count = before, began, start
    while True:
        await asyncio.sleep(0.01)
        now, count = loop.time(), g.stats()["messages_dropped"]
        peak = max(peak, _status_kb("VmRSS"))
        if count != last_count:
            last_at, last_count = now, count
        if now - began >= at_least and (count - start >= expected or now - last_at > 15):
            break
    after = _status_kb("VmRSS")
    gc.collect()
    await asyncio.sleep(1.0)
    settled = _status_kb("VmRSS")
    dropped = last_count - start
    took = times[1] - times[0] if times else 0.0
    by_reason = g.stats().get("messages_dropped_by_reason", {})
    return {
        "dropped": dropped,
        "by_reason": {k: n - reasons.get(k, 0) for k, n in by_reason.items()
                      if n != reasons.get(k, 0)}, "rss_before_kb": before, "rss_after_kb": after,
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
            key = rng.choice([*target, "zz"])
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


async def _send(rogue: Any, messages: list[list[bytes]], blocking: bool) -> tuple[int, int]:
    """Send every message; (queued, pushed back). Without blocking a full queue (a
    secured peer that never completes the handshake) refuses a message at once."""
    import zmq

    queued = refused = 0
    for frames in messages:
        try:
            await rogue.send_multipart(frames, 0 if blocking else zmq.NOBLOCK)
            queued += 1
        except zmq.Again:
            refused += 1
    return queued, refused


def _rogue(endpoint: str, identity: bytes, public_key: bytes | None) -> Any:
    import zmq
    import zmq.asyncio

    rogue = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    rogue.setsockopt(zmq.IDENTITY, identity)
    rogue.setsockopt(zmq.SNDHWM, 1000)
    if public_key is not None:  # knows the job's public key, holds a key pair of its own
        rogue.curve_serverkey = public_key
        rogue.curve_publickey, rogue.curve_secretkey = zmq.curve_keypair()
    rogue.connect(endpoint)
    return rogue


def _memory_rows(handled: dict[str, Any]) -> list[tuple[str, str]]:
    mb = 1024.0
    return [
        ("RSS before", f"{handled['rss_before_kb'] / mb:.1f} MB"),
        ("RSS right after", f"{handled['rss_after_kb'] / mb:.1f} MB"),
        ("RSS after gc + 1 s", f"{handled['rss_settled_kb'] / mb:.1f} MB"),
        ("RSS peak (sampled / VmHWM)", (f"{handled['rss_peak_kb'] / mb:.1f} MB / "
                                        f"{handled['vm_hwm_kb'] / mb:.1f} MB")),
    ]


async def _probe(args: argparse.Namespace, peer: Peer, endpoint: str
                 ) -> tuple[bool, list[tuple[str, str]]]:
    """The big-message probe: whether the memory came back, and the rows it adds."""
    identity = b"1" if args.probe == "stranger" else b"twin"
    first = _rogue(endpoint, identity, None)
    rogues = [first]
    if args.probe == "twin":
        await asyncio.sleep(0.5)  # the first connection holds the identity
        rogues.append(_rogue(endpoint, identity, None))
    payload = bytes(PROBE_BYTES)
    peer.send(f"expect {PROBE_MESSAGES} 0")
    await peer.read("watching")
    for _ in range(PROBE_MESSAGES):
        await rogues[-1].send(payload, copy=False)
    handled = await peer.read("handled")
    for rogue in rogues:
        rogue.close(linger=0)
    peer.send("rss")
    gone = await peer.read("rss")
    how = ("one DEALER with rank 1's old identity b'1'" if args.probe == "stranger" else
           "a second connection with a first one's identity b'twin'")
    rows = [("probe", f"{PROBE_MESSAGES} x {PROBE_BYTES >> 20} MiB from {how}"),
            ("  messages dropped (rank 0 stats)",
             f"{handled['dropped']:,} {handled['by_reason'] or ''}".rstrip())]
    rows += [(f"  {k}", v) for k, v in _memory_rows(handled)]
    rows.append(("  RSS 1 s after the rogue left", f"{gone['rss_kb'] / 1024:.1f} MB"))
    back = gone["rss_kb"] - handled["rss_before_kb"] <= PROBE_BYTES >> 10
    return back and handled["dropped"] == PROBE_MESSAGES, rows


async def drive(args: argparse.Namespace) -> int:
    from p2pcoll.security import write_key_file
    from p2pcoll.testing import free_port

    url = f"tcp://127.0.0.1:{free_port()}"
    tmp = tempfile.TemporaryDirectory(prefix="fuzz-peer-")
    key_file = None
    extra: list[str] = []
    public_key = None
    if args.key:
        key_file = str(Path(tmp.name) / "job.key")
        public_key = write_key_file(key_file).public
        extra = ["--key-file", key_file]
    procs = [await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--worker", "--rank", str(r), "--url", url,
        "--transport", args.transport, *extra,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE) for r in range(2)]
    peers = [Peer(p) for p in procs]
    probe_rows: list[tuple[str, str]] = []
    probe_ok = True
    try:
        ready = [await p.read("ready") for p in peers]
        gid, endpoint = ready[0]["group"], ready[0]["endpoint"]
        t = time.perf_counter()
        messages = hostile(random.Random(args.seed), gid, args.messages)
        messages += big_headers(gid, args.big_headers)
        print(f"generated {len(messages):,} messages in {time.perf_counter() - t:.1f}s; "
              f"sending to rank 0 at {endpoint}", file=sys.stderr)

        rogue = _rogue(endpoint, ROGUE_IDENTITY, public_key)
        # A secured group never reads the rogue: expect nothing, but watch for 3 s.
        peers[0].send(f"expect {0 if args.key else len(messages)} {3 if args.key else 0}")
        await peers[0].read("watching")
        t = time.perf_counter()
        queued, refused = await _send(rogue, messages, blocking=not args.key)
        sent_in = time.perf_counter() - t
        handled = await peers[0].read("handled")
        rogue.close(linger=0 if args.key else 1000)
        if args.probe:
            probe_ok, probe_rows = await _probe(args, peers[0], endpoint)

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
        tmp.cleanup()

    ok = all(c["ok"] for c in checked) and codes == [0, 0]
    secured = f", secured (CurveZMQ, ZAP refusals: {handled['refused']})" if args.key else ""
    rows = [
        ("group", f"2 peers over {args.transport}{secured}"),
        ("messages sent", f"{len(messages):,}"
                          + (f" ({args.big_headers} of 3.5 MB)" if args.big_headers else "")
                          + (f": {queued:,} queued by libzmq, {refused:,} refused"
                             if args.key else "")),
        ("messages dropped (rank 0 stats)",
         f"{handled['dropped']:,} {handled['by_reason'] or ''}".rstrip()),
        *_memory_rows(handled),
        ("handled per second", (f"{handled['per_second']:,.0f} "
                                f"({handled['dropped']:,} in {handled['seconds']:.2f}s; "
                                f"sender took {sent_in:.2f}s)") if handled["dropped"] else
         f"- (none read; sender took {sent_in:.2f}s)"),
        ("WARNING / ERROR log lines", f"{handled['warnings']} / {handled['errors']}"),
        *probe_rows,
        ("allreduce + broadcast afterwards", "correct" if ok else f"FAILED {checked} {codes}"),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    for line in handled["first_lines"]:
        print(f"  {line}")
    expected = 0 if args.key else len(messages)
    return 0 if ok and probe_ok and handled["dropped"] == expected else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--big-headers", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--transport", choices=["tcp", "ipc"], default="tcp")
    parser.add_argument("--key", action="store_true",
                        help="secure the group with a fresh job key (the rogue has none)")
    parser.add_argument("--probe", choices=["stranger", "twin"],
                        help="then 8 messages of 50 MiB: from b'1', or on a twin connection")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--key-file", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        asyncio.run(worker(args.url, args.rank, args.transport, args.key_file))
        return 0
    return asyncio.run(drive(args))


if __name__ == "__main__":
    sys.exit(main())
