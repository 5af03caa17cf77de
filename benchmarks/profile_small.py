"""Where a small collective's microseconds go: p2pcoll's layers against the bare floors.

    python benchmarks/profile_small.py                       # 4K, p = 2 and 4, asyncio and uvloop
    python benchmarks/profile_small.py --size 4K --iters 300 --world-size 2 --loop asyncio
    python benchmarks/profile_small.py --reps 5 --json profile.json
    python benchmarks/profile_small.py --insecure            # plain sockets instead of CurveZMQ

Not a test: it prints tables. ``--world-size`` and ``--loop`` take comma lists
(``--world-size 2,4 --loop asyncio,uvloop`` is the default; uvloop is skipped, with a note,
if it is not installed: ``pip install uvloop``). Every configuration runs ``--reps`` times
(3) in fresh processes, interleaved, because the machine is shared: the figures are medians
over the repetitions with their range (min-max of the per-repetition figures).

**p2pcoll.** The driver (this process) starts ``p`` peers as processes (this file again,
with ``--worker p2pcoll``) that join one group at a rendezvous on 127.0.0.1, as
``p2pcoll bench`` does: the default transport (ipc between the peers of this host), secured
with an ephemeral job key as the launcher does (``--insecure``: plain sockets), float32
data, ``allreduce(x, out=x)`` with strategy auto. Each peer sets its event loop (the uvloop
policy before ``asyncio.run`` with ``--loop uvloop``), warms up, then:

1. plain: ``--iters`` allreduces, each after ``await g.barrier()``, timed alone with
   ``perf_counter``; the iteration's time is its slowest rank's (as in ``p2pcoll bench``).
   Around each one it also reads the process CPU time (``time.process_time``: the event
   loop's thread plus libzmq's I/O thread), the main thread's CPU time
   (``time.thread_time``), the main thread's run-queue wait (``/proc/thread-self/schedstat``)
   and context switches (``getrusage``);
2. back to back: ``--iters`` allreduces in a row, no barrier: time and CPU per operation;
3. instrumented: ``--iters`` more, with functions of every layer wrapped (in this process
   only, monkeypatched here and restored afterwards; nothing in p2pcoll changes) by
   ``perf_counter_ns`` counters that keep *exclusive* time (a wrapped callee's time is
   taken out of its caller's). Coroutines are timed step by step (the time they run, not
   the time they wait). The layers: the API (``Group.allreduce``, strategy choice, layout
   and signature, failure model), planning, the executor's schedule walk, matching, the
   mesh's Python (send_many, _put_frames and _lane_put; _drain, _deliver and, for the
   shared-memory lanes, _on_wake), header encode, decode +
   validation, pyzmq's asyncio glue (only sends that meet a full queue still use it) and its
   socket calls into libzmq (send, recv, getsockopt(EVENTS)), numpy's reduction;
   "waiting" is the main thread off CPU (wall minus ``thread_time``: blocked in epoll, or
   runnable but not running), and "event loop" the main thread's CPU not in any wrapped
   function (the loop's own iteration, Task steps, callbacks, futures, coroutine frames).
   With the asyncio loop the selector's ``select()`` is wrapped too. Every message also gets
   timestamps on both sides (CLOCK_MONOTONIC is one clock for the processes of a host): the
   sender's call into libzmq, the receiver's last return from a blocking ``select()``
   (asyncio only), the reader's ``_deliver``, and the resumption of the receive that
   waited for it: one message's latency, split into libzmq (I/O threads and wake-up), pyzmq
   dispatch, and p2pcoll's receive path;
4. cProfile of ``--cprofile-iters`` allreduces on rank 0 (first repetition): the functions
   with the most own time, per collective (cProfile's overhead inflates them; read the
   ranking).

**Floors.** Two processes (``--worker floor``) ping-pong ``--size`` bytes (plus an
80-byte header where p2pcoll sends one) ``--floor-iters`` times over:

- ``zmq-async``: pyzmq asyncio, DEALER to the peer's ROUTER over ipc, one each way: the
  sockets p2pcoll's mesh uses; ``zmq-async-curve`` the same with CurveZMQ (what a keyed
  group runs); ``zmq-sync``: the same sockets blocking, no event loop;
- ``zmq-fd-async``: the same sockets without zmq.asyncio: blocking pyzmq sockets whose
  ZMQ_FD is registered once with ``loop.add_reader``, NOBLOCK sends and receives (what the
  mesh could do instead of awaiting zmq.asyncio futures);
- ``unix-async``: an asyncio Protocol on a unix stream socketpair (the selector loop's
  transport reads into a fresh 256 KiB buffer each time);
- ``pipe-async``: two pipes, ``loop.add_reader`` + ``os.read``;
- ``shm-eventfd-async``: the payload copied through a shared-memory mapping, an eventfd per
  direction registered with ``loop.add_reader``: a small-message fast path without
  ZeroMQ's I/O thread;
- ``pipe-blocking`` and ``shm-spin``: no event loop: blocking reads, and busy-polling a
  sequence number in shared memory (the lower bounds).

The one-way time is half the round trip. Floors that use no event loop run once per
repetition, with the asyncio runs.

Everything stays on 127.0.0.1 and ipc; the whole run takes one to three minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import inspect
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

pc = time.perf_counter_ns
HEADER_BYTES = 80  # a p2pcoll data header is 64-120 bytes of msgpack
SESSION_TIMEOUT = 150.0  # seconds one group of peers (or one floor pair) may take


# --- small helpers -------------------------------------------------------------------------

def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().rstrip("B")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def run_loop(kind: str, make: Callable[[], Any]) -> Any:
    """Run ``make()`` on an event loop of ``kind`` (the policy set before the loop starts)."""
    if kind == "uvloop":
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return asyncio.run(make())


def quantile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


class ThreadClock:
    """The main thread's CPU time, run-queue wait and context switches."""

    def __init__(self) -> None:
        try:
            self.fd: int | None = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        except OSError:
            self.fd = None

    def sample(self, before: bool = False) -> tuple[int, int, int, int, int, int]:
        """(thread CPU, process CPU, run-queue wait, thread vol. switches, process vol.
        and invol. switches). ``before``: the clocks are read last (just before the timed
        region); otherwise first (just after it)."""
        if not before:
            cpu, proc = time.thread_time_ns(), time.process_time_ns()
        runq = int(os.pread(self.fd, 128, 0).split()[1]) if self.fd is not None else 0
        th = resource.getrusage(resource.RUSAGE_THREAD)
        me = resource.getrusage(resource.RUSAGE_SELF)
        if before:
            proc, cpu = time.process_time_ns(), time.thread_time_ns()
        return (cpu, proc, runq, th.ru_nvcsw, me.ru_nvcsw, me.ru_nivcsw)


def delta(a: tuple[int, ...], b: tuple[int, ...]) -> list[int]:
    return [y - x for x, y in zip(a, b, strict=True)]


# --- instrumentation (installed in a peer process only, and restored) -----------------------

class Prof:
    """Exclusive perf_counter_ns time per category, and per-message timestamps."""

    def __init__(self) -> None:
        self.acc: defaultdict[str, int] = defaultdict(int)
        self.calls: defaultdict[str, int] = defaultdict(int)
        self.stack: list[list[Any]] = []
        self.sends: list[tuple[int, int, int, bytes]] = []
        self.delivers: list[tuple[int, int, int, Any]] = []
        self.gets: list[tuple[Any, int, int, bool]] = []
        self.block_enter = 0
        self.block_return = 0
        self.nblock = 0
        self.select_ns = 0
        self.recording = False

    def reset(self) -> None:
        self.acc.clear()
        self.calls.clear()
        self.nblock = 0
        self.select_ns = 0

    def close(self, frame: list[Any]) -> None:
        stack = self.stack
        stack.pop()
        elapsed = pc() - frame[1]
        self.acc[frame[0]] += elapsed - frame[2]
        self.calls[frame[0]] += 1
        if stack:
            stack[-1][2] += elapsed


PROF = Prof()


def sync_wrapper(fn: Callable[..., Any], cat: str) -> Callable[..., Any]:
    prof, stack, close = PROF, PROF.stack, PROF.close

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        frame = [cat, pc(), 0]
        stack.append(frame)
        try:
            return fn(*args, **kwargs)
        finally:
            close(frame)

    wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
    del prof
    return wrapper


class Stepper:
    """An awaitable that runs a coroutine and times each of its steps (not its waits)."""

    __slots__ = ("cat", "coro", "on_done")

    def __init__(self, coro: Any, cat: str, on_done: Callable[[int, bool], None] | None = None
                 ) -> None:
        self.coro, self.cat, self.on_done = coro, cat, on_done

    def __await__(self) -> Any:
        coro, cat, stack, close = self.coro, self.cat, PROF.stack, PROF.close
        value: Any = None
        error: BaseException | None = None
        suspended = False
        while True:
            frame = [cat, pc(), 0]
            stack.append(frame)
            try:
                yielded = coro.send(value) if error is None else coro.throw(error)
            except StopIteration as stop:
                close(frame)
                if self.on_done is not None:
                    self.on_done(pc(), suspended)
                return stop.value
            except BaseException:
                close(frame)
                raise
            close(frame)
            suspended = True
            try:
                value, error = (yield yielded), None
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:
                value, error = None, exc


def coro_wrapper(fn: Callable[..., Any], cat: str) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Stepper:
        return Stepper(fn(*args, **kwargs), cat)

    return wrapper


class Patches:
    """Attribute replacements, undone in reverse order."""

    def __init__(self) -> None:
        self.undo: list[tuple[Any, str, bool, Any]] = []

    def put(self, owner: Any, name: str, make: Callable[[Callable[..., Any]], Any]) -> None:
        own = vars(owner)
        had = name in own
        old = own[name] if had else getattr(owner, name)
        if isinstance(old, classmethod):
            new: Any = classmethod(make(old.__func__))
        elif isinstance(old, staticmethod):
            new = staticmethod(make(old.__func__))
        else:
            new = make(old)
        setattr(owner, name, new)
        self.undo.append((owner, name, had, old))

    def sync(self, owner: Any, name: str, cat: str) -> None:
        self.put(owner, name, lambda fn: sync_wrapper(fn, cat))

    def coro(self, owner: Any, name: str, cat: str) -> None:
        self.put(owner, name, lambda fn: coro_wrapper(fn, cat))

    def restore(self) -> None:
        for owner, name, had, old in reversed(self.undo):
            if had:
                setattr(owner, name, old)
            else:
                delattr(owner, name)
        self.undo.clear()


def install(group: Any) -> Patches:
    """Wrap the functions of every layer a small allreduce goes through."""
    import zmq
    from zmq import _future

    import p2pcoll.api.group as api
    import p2pcoll.transport.zmq_mesh as mesh
    from p2pcoll.api.activity import Activity
    from p2pcoll.engine import executor, matching
    from p2pcoll.engine.layout import Layout
    from p2pcoll.session import control, failure

    p = Patches()
    prof = PROF
    # API
    p.coro(api.Group, "allreduce", "api.call")
    p.sync(api.Group, "_choose", "api.choose")
    p.sync(Layout, "split", "api.layout")
    p.sync(api, "describe_data", "api.layout")
    p.sync(api.Group, "_sig", "api.layout")
    p.sync(failure.FailureModel, "collective", "api.guard")
    p.coro(failure.Collective, "__aenter__", "api.guard")
    p.coro(failure.Collective, "__aexit__", "api.guard")
    p.sync(Activity, "record", "api.guard")
    # planning and the executor
    for name in ("plan", "copies", "send_groups"):
        p.sync(executor, name, "plan")
    p.sync(Layout, "segment", "plan")
    p.coro(executor.Executor, "run", "exec.walk")
    p.sync(Layout, "pieces", "exec.walk")
    p.sync(executor, "_combine", "reduce")
    # matching (get is timed step by step and stamped when it completes)
    for name in ("put", "expect", "finish", "leftover", "failure"):
        p.sync(matching.Matcher, name, "match")
    p.sync(control, "dispatch", "match")

    def make_get(fn: Callable[..., Any]) -> Callable[..., Any]:
        def get(self: Any, key: Any) -> Stepper:
            started = pc()

            def done(t: int, suspended: bool) -> None:
                if prof.recording:
                    prof.gets.append((key, started, t, suspended))
            return Stepper(fn(self, key), "match", done)
        return get

    p.put(matching.Matcher, "get", make_get)
    # the mesh and the wire
    p.coro(mesh.ZmqMesh, "send_many", "mesh.send")
    p.coro(mesh.ZmqMesh, "_put_frames", "mesh.send")
    p.sync(mesh.ZmqMesh, "_pieces", "mesh.recv")
    p.sync(mesh.ZmqMesh, "_drain", "mesh.recv")
    p.sync(mesh.ZmqMesh, "_on_wake", "mesh.recv")  # a lane: the wake-up and the record read
    p.sync(mesh, "encode_header", "wire.encode")
    p.sync(mesh, "validate", "wire.decode")

    def make_deliver(fn: Callable[..., Any]) -> Callable[..., Any]:
        inner = sync_wrapper(fn, "mesh.recv")

        def _deliver(self: Any, frames: Any) -> None:
            if prof.recording and len(frames) > 1:
                prof.delivers.append((pc(), prof.block_enter, prof.block_return, frames[1]))
            inner(self, frames)
        return _deliver

    p.put(mesh.ZmqMesh, "_deliver", make_deliver)

    # The shared-memory lanes: a message put on a lane is stamped like a socket send, and
    # one read from a lane like a delivery (_on_wake was registered before the patches).
    def make_lane_put(fn: Callable[..., Any]) -> Callable[..., Any]:
        inner = sync_wrapper(fn, "mesh.send")

        def _lane_put(self: Any, dst: int, frames: Any) -> bool:
            t = pc()
            done = bool(inner(self, dst, frames))
            if done and prof.recording:
                prof.sends.append((t, pc(), dst, bytes(frames[0])))
            return done
        return _lane_put

    def make_accept(fn: Callable[..., Any]) -> Callable[..., Any]:
        inner = sync_wrapper(fn, "mesh.recv")

        def _accept(self: Any, source: int, head: Any, frames: Any, *, on_lane: bool) -> None:
            if on_lane and prof.recording:
                prof.delivers.append((pc(), prof.block_enter, prof.block_return, bytes(head)))
            inner(self, source, head, frames, on_lane=on_lane)
        return _accept

    p.put(mesh.ZmqMesh, "_lane_put", make_lane_put)
    p.put(mesh.ZmqMesh, "_accept", make_accept)
    # pyzmq: the asyncio glue, and the calls into libzmq on the shadow (blocking) socket
    for name in ("send_multipart", "recv_multipart", "_add_send_event", "_add_recv_event",
                 "_handle_events", "_handle_recv", "_handle_send",
                 "_schedule_remaining_events"):
        p.sync(_future._AsyncSocket, name, "zmq.glue")
    p.sync(_future._Async, "_get_loop", "zmq.glue")
    p.sync(zmq.Socket, "recv_multipart", "zmq.recv")
    p.sync(zmq.Socket, "recv", "zmq.recv")  # the mesh's reader: frame by frame (_drain)
    p.sync(zmq.Socket, "get", "zmq.events")
    links = {sock.underlying: peer for peer, sock in group.session.transport._links.items()}

    def stamp(t: int, sock: Any, head: Any) -> None:
        if prof.recording:
            prof.sends.append((t, pc(), links.get(sock.underlying, -1),
                               head if isinstance(head, bytes) else b""))

    def make_send_multipart(fn: Callable[..., Any]) -> Callable[..., Any]:
        inner = sync_wrapper(fn, "zmq.send")

        def send_multipart(self: Any, msg_parts: Any, *args: Any, **kwargs: Any) -> Any:
            t = pc()
            try:
                return inner(self, msg_parts, *args, **kwargs)
            finally:
                stamp(t, self, msg_parts[0])
        return send_multipart

    # The mesh's sends that find room are plain part-by-part sends (_put_frames): the first
    # part of a message, its header, is stamped.
    continuing: set[int] = set()

    def make_send(fn: Callable[..., Any]) -> Callable[..., Any]:
        inner = sync_wrapper(fn, "zmq.send")

        def send(self: Any, data: Any, flags: int = 0, *args: Any, **kwargs: Any) -> Any:
            t, first = pc(), self.underlying not in continuing
            result = inner(self, data, flags, *args, **kwargs)
            if flags & zmq.SNDMORE:
                continuing.add(self.underlying)
            else:
                continuing.discard(self.underlying)
            if first:
                stamp(t, self, data)
            return result
        return send

    p.put(zmq.Socket, "send_multipart", make_send_multipart)
    p.put(zmq.Socket, "send", make_send)
    # the event loop's wait (the asyncio loop's selector; uvloop has none to wrap)
    selector = getattr(asyncio.get_running_loop(), "_selector", None)
    if selector is not None:
        def make_select(fn: Callable[..., Any]) -> Callable[..., Any]:
            def select(timeout: float | None = None) -> Any:
                blocking = timeout is None or timeout > 0
                t = pc()
                if blocking:
                    prof.block_enter = t
                try:
                    return fn(timeout)
                finally:
                    now = pc()
                    prof.select_ns += now - t
                    if blocking:
                        prof.block_return = now
                        prof.nblock += 1
            return select

        p.put(selector, "select", make_select)
    return p


def wrapper_cost() -> float:
    """ns a wrapped call costs over a bare one (two counter reads and the bookkeeping)."""
    def noop() -> None:
        return None

    wrapped = sync_wrapper(noop, "calibration")
    n = 20000
    best = math.inf
    for _ in range(3):
        t0 = pc()
        for _ in range(n):
            noop()
        t1 = pc()
        for _ in range(n):
            wrapped()
        t2 = pc()
        best = min(best, ((t2 - t1) - (t1 - t0)) / n)
    PROF.reset()
    return best


# --- a p2pcoll peer ---------------------------------------------------------------------------

def header_key(raw: bytes) -> tuple[int, int, int, int] | None:
    """(src, seq, seg, index) of a data header, None for other kinds."""
    import msgpack

    try:
        d = msgpack.unpackb(raw, raw=False)
    except Exception:
        return None
    if not isinstance(d, dict) or d.get("k") != "data" or "t" in d:
        return None
    return (d["r"], d["q"], d["seg"], d["s"])


async def p2pcoll_peer(a: argparse.Namespace) -> dict[str, Any]:
    import numpy as np

    import p2pcoll

    g = await p2pcoll.join(a.url, world_size=a.world_size, rank=a.rank, timeout=90)
    try:
        return await _p2pcoll_phases(g, a, np)
    finally:
        with contextlib.suppress(Exception):  # the figures are safe; closing is best effort
            await asyncio.wait_for(g.close(), 10)


async def _p2pcoll_phases(g: Any, a: argparse.Namespace, np: Any) -> dict[str, Any]:
    count = max(1, a.size // 4)
    value = float(g.rank + 1)
    want = float(sum(range(1, g.world_size + 1)))
    x = np.full(count, value, np.float32)
    clock = ThreadClock()
    for _ in range(a.warmup):
        x.fill(value)
        await g.barrier()
        await g.allreduce(x, out=x)
    if not np.all(x == want):
        raise AssertionError(f"wrong allreduce result {x[:4]} (want {want})")

    # 1. plain, each after a barrier
    plain: dict[str, list[int]] = defaultdict(list)
    for _ in range(a.iters):
        x.fill(value)
        await g.barrier()
        s0 = clock.sample(before=True)
        t0 = pc()
        await g.allreduce(x, out=x)
        t1 = pc()
        d = delta(s0, clock.sample())
        for name, v in zip(("wall", "thread", "proc", "runq", "vcsw_thread", "vcsw",
                            "ivcsw"), (t1 - t0, *d), strict=True):
            plain[name].append(v)
    if not np.all(x == want):
        raise AssertionError("wrong allreduce result")

    # 2. back to back
    z = np.zeros(count, np.float32)
    await g.barrier()
    s0 = clock.sample(before=True)
    t0 = pc()
    for _ in range(a.iters):
        await g.allreduce(z, out=z)
    t1 = pc()
    d = delta(s0, clock.sample())
    b2b = {"wall": (t1 - t0) / a.iters, "thread": d[0] / a.iters, "proc": d[1] / a.iters,
           "vcsw": d[4] / a.iters}

    # 3. instrumented
    overhead = wrapper_cost()
    patches = install(g)
    iters: list[dict[str, Any]] = []
    seqs = []
    try:
        PROF.recording = True
        for _ in range(a.iters):
            x.fill(value)
            await g.barrier()
            seqs.append(g.session.seq)
            s0 = clock.sample(before=True)
            PROF.reset()
            t0 = pc()
            await g.allreduce(x, out=x)
            t1 = pc()
            cats, calls = dict(PROF.acc), dict(PROF.calls)
            select_ns, nblock = PROF.select_ns, PROF.nblock
            d = delta(s0, clock.sample())
            iters.append({"wall": t1 - t0, "thread": d[0], "proc": d[1], "runq": d[2],
                          "select": select_ns, "nblock": nblock, "cats": cats, "calls": calls})
        PROF.recording = False
    finally:
        patches.restore()
    if not np.all(x == want):
        raise AssertionError("wrong allreduce result (instrumented)")
    wanted = set(seqs)
    sends = []
    for t, t_exit, dst, raw in PROF.sends:
        key = header_key(raw)
        if key is not None and key[1] in wanted:
            sends.append([*key, dst, t, t_exit])
    delivers = []
    for t, b_enter, b_return, frame in PROF.delivers:
        key = header_key(frame if isinstance(frame, bytes) else frame.bytes)
        if key is not None and key[1] in wanted:
            delivers.append([*key, g.rank, t, b_enter, b_return])
    gets = [[k[2], g.rank, k[0], k[1], k[3], t0, t1, s] for k, t0, t1, s in PROF.gets
            if isinstance(k[0], int) and k[0] in wanted]

    # 4. cProfile (rank 0)
    profile = []
    if a.cprofile_iters and g.rank == 0:
        profile = await _cprofile(g, x, value, a.cprofile_iters)
    elif a.cprofile_iters:
        for _ in range(a.cprofile_iters):
            x.fill(value)
            await g.barrier()
            await g.allreduce(x, out=x)
    await g.barrier()
    stats = g.stats()
    return {
        "rank": g.rank, "world_size": g.world_size,
        "strategy": stats["collectives_by_strategy"].get("allreduce", {}),
        "plain": plain, "b2b": b2b, "iters": iters, "overhead_ns": overhead,
        "sends": sends, "delivers": delivers, "gets": gets, "cprofile": profile,
    }


async def _cprofile(g: Any, x: Any, value: float, n: int) -> list[list[Any]]:
    import cProfile
    import pstats

    prof = cProfile.Profile()
    for _ in range(n):
        x.fill(value)
        await g.barrier()
        prof.enable()
        await g.allreduce(x, out=x)
        prof.disable()
    st = pstats.Stats(prof)
    rows = []
    for (path, line, name), (_cc, nc, tt, ct, _callers) in st.stats.items():  # type: ignore[attr-defined]
        where = "/".join(path.split("/")[-2:])
        rows.append([f"{where}:{line}({name})", nc / n, tt / n * 1e6, ct / n * 1e6])
    rows.sort(key=lambda r: -r[2])
    return rows[:40]


# --- the floors ---------------------------------------------------------------------------------

class FloorChannel:
    """What the driver hands both floor processes: fds, paths, keys."""

    def __init__(self, spec: dict[str, Any], role: int) -> None:
        self.spec, self.role = spec, role
        self.me, self.peer = role, 1 - role

    def fd(self, name: str) -> int:
        return int(self.spec["fds"][name])


async def floor_peer(a: argparse.Namespace) -> dict[str, Any]:
    spec = json.loads(a.spec)
    ch = FloorChannel(spec, a.rank)
    n, warm = a.floor_iters, max(50, a.floor_iters // 10)
    payload = os.urandom(a.size)
    results: dict[str, Any] = {}
    floors: list[tuple[str, Callable[..., Any]]] = [
        ("zmq-async", lambda: _zmq_async(ch, n, warm, payload, curve=False)),
        ("zmq-async-curve", lambda: _zmq_async(ch, n, warm, payload, curve=True)),
        ("zmq-fd-async", lambda: _zmq_fd_async(ch, n, warm, payload)),
        ("unix-async", lambda: _unix_async(ch, n, warm, payload)),
        ("pipe-async", lambda: _pipe_async(ch, n, warm, payload)),
        ("shm-eventfd-async", lambda: _shm_eventfd_async(ch, n, warm, payload)),
    ]
    if a.loop == "asyncio" and a.loopless:
        floors += [
            ("zmq-sync", lambda: _blocking(_zmq_sync, ch, n, warm, payload)),
            ("pipe-blocking", lambda: _blocking(_pipe_blocking, ch, n, warm, payload)),
            ("shm-spin", lambda: _blocking(_shm_spin, ch, n, warm, payload)),
        ]
    for name, run in floors:
        try:
            results[name] = await asyncio.wait_for(run(), 40)
        except Exception as exc:
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
    return {"rank": a.rank, "floors": results}


async def _blocking(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)  # runs in the loop's thread on purpose: nothing else is running


def _timed_loop(ping: Callable[[], Any], pong: Callable[[], Any], role: int, n: int,
                warm: int) -> dict[str, Any] | None:
    """Blocking ping-pong; role 0 times it."""
    if role == 1:
        for _ in range(n + warm):
            pong()
        return None
    clock = ThreadClock()
    times = []
    for i in range(n + warm):
        if i == warm:
            s0 = clock.sample(before=True)
        t0 = pc()
        ping()
        times.append(pc() - t0)
    return _floor_row(times[warm:], delta(s0, clock.sample()), n)


def _floor_row(rtts: list[int], d: list[int], n: int) -> dict[str, Any]:
    return {"rtt": rtts, "thread": d[0] / n, "proc": d[1] / n, "vcsw": d[4] / n}


async def _async_loop(send: Callable[[], Any], recv: Callable[[], Any], role: int, n: int,
                      warm: int) -> dict[str, Any] | None:
    """Ping-pong ``n`` times after ``warm`` untimed: role 0 sends then receives (timed),
    role 1 receives then sends. ``send`` may return an awaitable (then it is awaited)."""
    async def put() -> None:
        sent = send()
        if inspect.isawaitable(sent):
            await sent

    if role == 1:
        for _ in range(n + warm):
            await recv()
            await put()
        return None
    clock = ThreadClock()
    times = []
    s0 = clock.sample(before=True)
    for i in range(n + warm):
        if i == warm:
            s0 = clock.sample(before=True)
        t0 = pc()
        await put()
        await recv()
        times.append(pc() - t0)
    return _floor_row(times[warm:], delta(s0, clock.sample()), n)


def _zmq_sockets(ctx: Any, ch: FloorChannel, name: str, curve: bool) -> tuple[Any, Any]:
    import zmq

    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    if curve:
        pub, sec = ch.spec["curve"]
        router.setsockopt(zmq.CURVE_SERVER, 1)
        router.setsockopt(zmq.CURVE_SECRETKEY, sec.encode())
        router.setsockopt(zmq.CURVE_PUBLICKEY, pub.encode())
        dealer.setsockopt(zmq.CURVE_SERVERKEY, pub.encode())
        dealer.setsockopt(zmq.CURVE_PUBLICKEY, pub.encode())
        dealer.setsockopt(zmq.CURVE_SECRETKEY, sec.encode())
    dealer.setsockopt(zmq.IDENTITY, b"%d@floor" % ch.me)
    router.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.LINGER, 1000)
    folder = ch.spec["dir"]
    router.bind(f"ipc://{folder}/{name}-{ch.me}")
    dealer.connect(f"ipc://{folder}/{name}-{ch.peer}")
    return router, dealer


async def _zmq_async(ch: FloorChannel, n: int, warm: int, payload: bytes, curve: bool
                     ) -> Any:
    import zmq.asyncio

    ctx = zmq.asyncio.Context()
    router, dealer = _zmq_sockets(ctx, ch, "za-curve" if curve else "za", curve)
    msg = [b"h" * HEADER_BYTES, payload]

    try:
        return await _async_loop(lambda: dealer.send_multipart(msg, copy=False),
                                 lambda: router.recv_multipart(copy=False), ch.role, n, warm)
    finally:
        router.close()
        dealer.close()
        ctx.term()


async def _zmq_fd_async(ch: FloorChannel, n: int, warm: int, payload: bytes) -> Any:
    """The same sockets, blocking ones, without zmq.asyncio: the ROUTER's ZMQ_FD registered
    once with ``loop.add_reader``, and NOBLOCK calls (what a mesh could do instead)."""
    import zmq

    loop = asyncio.get_running_loop()
    ctx = zmq.Context()
    router, dealer = _zmq_sockets(ctx, ch, "zf", False)
    msg = [b"h" * HEADER_BYTES, payload]
    noblock, events, pollin = int(zmq.NOBLOCK), int(zmq.EVENTS), int(zmq.POLLIN)
    inbox: list[Any] = []
    state: dict[str, asyncio.Future[None] | None] = {"waiter": None}

    def drain() -> None:
        # EVENTS (a plain int here) rather than EAGAIN: an exception per empty look costs.
        while int(router.get(events)) & pollin:
            inbox.append(router.recv_multipart(noblock, copy=False))
        waiter = state["waiter"]
        if inbox and waiter is not None and not waiter.done():
            waiter.set_result(None)

    loop.add_reader(router.getsockopt(zmq.FD), drain)

    async def recv() -> None:
        if not inbox:
            drain()  # ZMQ_FD is edge-triggered: look before waiting
        while not inbox:
            state["waiter"] = loop.create_future()
            await state["waiter"]  # type: ignore[misc]
        inbox.pop(0)

    def send() -> None:
        dealer.send_multipart(msg, noblock, copy=False)

    try:
        return await _async_loop(send, recv, ch.role, n, warm)
    finally:
        loop.remove_reader(router.getsockopt(zmq.FD))
        router.close()
        dealer.close()
        ctx.term()


def _zmq_sync(ch: FloorChannel, n: int, warm: int, payload: bytes) -> Any:
    import zmq

    ctx = zmq.Context()
    router, dealer = _zmq_sockets(ctx, ch, "zs", False)
    msg = [b"h" * HEADER_BYTES, payload]

    def ping() -> None:
        dealer.send_multipart(msg, copy=False)
        router.recv_multipart(copy=False)

    def pong() -> None:
        router.recv_multipart(copy=False)
        dealer.send_multipart(msg, copy=False)

    try:
        return _timed_loop(ping, pong, ch.role, n, warm)
    finally:
        router.close()
        dealer.close()
        ctx.term()


async def _unix_async(ch: FloorChannel, n: int, warm: int, payload: bytes) -> Any:
    import socket

    loop = asyncio.get_running_loop()
    need = len(payload) + HEADER_BYTES
    message = b"h" * HEADER_BYTES + payload

    class Proto(asyncio.Protocol):
        def __init__(self) -> None:
            self.buf = bytearray()
            self.waiter: asyncio.Future[None] | None = None

        def data_received(self, data: bytes) -> None:
            self.buf += data
            if len(self.buf) >= need and self.waiter is not None and not self.waiter.done():
                self.waiter.set_result(None)

    sock = socket.socket(fileno=ch.fd(f"unix{ch.me}"))
    sock.setblocking(False)
    transport, proto = await loop.create_unix_connection(Proto, sock=sock)

    async def recv() -> None:
        if len(proto.buf) < need:
            proto.waiter = loop.create_future()
            await proto.waiter
        del proto.buf[:need]

    try:
        return await _async_loop(lambda: transport.write(message), recv, ch.role, n, warm)
    finally:
        await asyncio.sleep(0.05)
        transport.close()


async def _pipe_async(ch: FloorChannel, n: int, warm: int, payload: bytes) -> Any:
    loop = asyncio.get_running_loop()
    rfd, wfd = ch.fd(f"apipe{ch.peer}{ch.me}r"), ch.fd(f"apipe{ch.me}{ch.peer}w")
    os.set_blocking(rfd, False)
    need = len(payload) + HEADER_BYTES
    message = b"h" * HEADER_BYTES + payload
    buf = bytearray()
    state: dict[str, asyncio.Future[None] | None] = {"waiter": None}

    def readable() -> None:
        try:
            buf.extend(os.read(rfd, 1 << 16))
        except BlockingIOError:
            return
        waiter = state["waiter"]
        if len(buf) >= need and waiter is not None and not waiter.done():
            waiter.set_result(None)

    loop.add_reader(rfd, readable)

    async def recv() -> None:
        if len(buf) < need:
            state["waiter"] = loop.create_future()
            await state["waiter"]  # type: ignore[misc]
        del buf[:need]

    try:
        return await _async_loop(lambda: os.write(wfd, message), recv, ch.role, n, warm)
    finally:
        loop.remove_reader(rfd)


def _shm_map(ch: FloorChannel) -> Any:
    import mmap

    fd = os.open(ch.spec["shm"], os.O_RDWR)
    try:
        return mmap.mmap(fd, int(ch.spec["shm_bytes"]))
    finally:
        os.close(fd)


async def _shm_eventfd_async(ch: FloorChannel, n: int, warm: int, payload: bytes) -> Any:
    import numpy as np

    loop = asyncio.get_running_loop()
    mm = _shm_map(ch)
    slot = int(ch.spec["slot"])
    area = np.frombuffer(mm, np.uint8)
    out = area[ch.me * slot: ch.me * slot + len(payload)]
    into = area[ch.peer * slot: ch.peer * slot + len(payload)]
    mine = np.frombuffer(payload, np.uint8)
    local = np.empty(len(payload), np.uint8)
    e_in, e_out = ch.fd(f"efd{ch.peer}{ch.me}"), ch.fd(f"efd{ch.me}{ch.peer}")
    state: dict[str, Any] = {"waiter": None, "ready": 0}

    def readable() -> None:
        try:
            state["ready"] += os.eventfd_read(e_in)
        except BlockingIOError:
            return
        waiter = state["waiter"]
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    loop.add_reader(e_in, readable)

    async def recv() -> None:
        if not state["ready"]:
            state["waiter"] = loop.create_future()
            await state["waiter"]
        state["ready"] -= 1
        np.copyto(local, into)  # take the piece out of the peer's slot

    def send() -> None:
        np.copyto(out, mine)
        os.eventfd_write(e_out, 1)

    try:
        return await _async_loop(send, recv, ch.role, n, warm)
    finally:
        loop.remove_reader(e_in)
        with contextlib.suppress(BufferError):  # numpy views may still hold it
            mm.close()


def _pipe_blocking(ch: FloorChannel, n: int, warm: int, payload: bytes) -> Any:
    rfd, wfd = ch.fd(f"bpipe{ch.peer}{ch.me}r"), ch.fd(f"bpipe{ch.me}{ch.peer}w")
    need = len(payload) + HEADER_BYTES
    message = b"h" * HEADER_BYTES + payload

    def recv() -> None:
        got = 0
        while got < need:
            got += len(os.read(rfd, need - got))

    def ping() -> None:
        os.write(wfd, message)
        recv()

    def pong() -> None:
        recv()
        os.write(wfd, message)

    return _timed_loop(ping, pong, ch.role, n, warm)


def _shm_spin(ch: FloorChannel, n: int, warm: int, payload: bytes) -> Any:
    import numpy as np

    mm = _shm_map(ch)
    slot = int(ch.spec["slot"])
    area = np.frombuffer(mm, np.uint8)
    counters = memoryview(mm)[4 * slot: 4 * slot + 16].cast("Q")
    out = area[(2 + ch.me) * slot: (2 + ch.me) * slot + len(payload)]
    into = area[(2 + ch.peer) * slot: (2 + ch.peer) * slot + len(payload)]
    mine = np.frombuffer(payload, np.uint8)
    local = np.empty(len(payload), np.uint8)
    seen = [0]

    def recv() -> None:
        spins = 0
        deadline = time.monotonic() + 5
        while counters[ch.peer] == seen[0]:
            spins += 1
            if spins % 100000 == 0 and time.monotonic() > deadline:
                raise TimeoutError("the peer stopped answering")
        seen[0] += 1
        np.copyto(local, into)

    def send() -> None:
        np.copyto(out, mine)
        counters[ch.me] += 1

    def ping() -> None:
        send()
        recv()

    def pong() -> None:
        recv()
        send()

    try:
        return _timed_loop(ping, pong, ch.role, n, warm)
    finally:
        counters.release()
        with contextlib.suppress(BufferError):  # numpy views may still hold it
            mm.close()


# --- the driver -----------------------------------------------------------------------------------

def _spawn(args: list[str], env: dict[str, str], pass_fds: tuple[int, ...] = ()
           ) -> subprocess.Popen[str]:
    """Start a peer; it writes its figures as JSON to the file named by ``--out``."""
    fd, out = tempfile.mkstemp(prefix="p2pcoll-profile-", suffix=".json")
    os.close(fd)
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), *args, "--out", out],
                            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, pass_fds=pass_fds)
    proc.out_path = out  # type: ignore[attr-defined]
    return proc


def _collect(procs: list[subprocess.Popen[str]], what: str) -> list[dict[str, Any]] | None:
    deadline = time.monotonic() + SESSION_TIMEOUT
    outs = []
    try:
        for proc in procs:
            try:
                _, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for q in procs:
                    if q.poll() is None:
                        q.kill()
                for q in procs:
                    q.wait()
                print(f"  {what}: timed out; killed its peers", file=sys.stderr)
                return None
            outs.append((proc.returncode, err, proc.out_path))  # type: ignore[attr-defined]
        results = []
        for code, err, path in outs:
            with open(path) as f:
                text = f.read()
            if code != 0 or not text:
                tail = "\n    ".join(err.strip().splitlines()[-6:])
                print(f"  {what}: a peer exited {code}:\n    {tail}", file=sys.stderr)
                return None
            results.append(json.loads(text))
        return results
    finally:
        for proc in procs:
            try:
                os.unlink(proc.out_path)  # type: ignore[attr-defined]
            except OSError:
                pass


def run_p2pcoll(p: int, loop: str, a: argparse.Namespace, env: dict[str, str], cprofile: bool
                ) -> list[dict[str, Any]] | None:
    from p2pcoll.testing import free_port

    url = f"tcp://127.0.0.1:{free_port()}"
    common = ["--worker", "p2pcoll", "--url", url, "--world-size", str(p), "--loop", loop,
              "--size", str(a.size), "--iters", str(a.iters), "--warmup", str(a.warmup),
              "--cprofile-iters", str(a.cprofile_iters if cprofile else 0)]
    procs = [_spawn([*common, "--rank", str(r)], env) for r in range(p)]
    results = _collect(procs, f"p2pcoll p={p} {loop}")
    return sorted(results, key=lambda r: r["rank"]) if results else None


def run_floors(loop: str, a: argparse.Namespace, env: dict[str, str], loopless: bool
               ) -> dict[str, Any] | None:
    import socket

    import zmq

    folder = tempfile.mkdtemp(prefix="p2pcoll-floor-")
    slot = 1 << max(12, (a.size + HEADER_BYTES - 1).bit_length())
    shm_path = f"/dev/shm/p2pcoll-floor-{os.getpid()}-{time.monotonic_ns()}"
    fds: dict[str, list[int]] = {"0": [], "1": []}
    names: dict[str, dict[str, int]] = {"0": {}, "1": {}}
    opened: list[int] = []

    def give(role: int, name: str, fd: int) -> None:
        names[str(role)][name] = fd
        fds[str(role)].append(fd)
        opened.append(fd)

    try:
        with open(shm_path, "wb") as f:
            f.truncate(6 * slot)
        s0, s1 = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        give(0, "unix0", s0.detach())
        give(1, "unix1", s1.detach())
        for kind in ("apipe", "bpipe"):
            for src, dst in ((0, 1), (1, 0)):
                r, w = os.pipe()
                give(dst, f"{kind}{src}{dst}r", r)
                give(src, f"{kind}{src}{dst}w", w)
        for src, dst in ((0, 1), (1, 0)):
            e = os.eventfd(0, os.EFD_NONBLOCK)
            give(0, f"efd{src}{dst}", e)
            names["1"][f"efd{src}{dst}"] = e
            fds["1"].append(e)
        for fd in opened:
            os.set_inheritable(fd, True)
        pub, sec = zmq.curve_keypair()
        procs = []
        for role in (0, 1):
            spec = {"fds": names[str(role)], "dir": folder, "shm": shm_path,
                    "shm_bytes": 6 * slot, "slot": slot, "curve": [pub.decode(), sec.decode()]}
            procs.append(_spawn(["--worker", "floor", "--rank", str(role), "--loop", loop,
                                 "--size", str(a.size), "--floor-iters", str(a.floor_iters),
                                 "--spec", json.dumps(spec)]
                                + (["--loopless"] if loopless else []), env,
                                pass_fds=tuple(sorted(set(fds[str(role)])))))
        results = _collect(procs, f"floors {loop}")
        return results[0]["floors"] if results else None
    finally:
        for fd in set(opened):
            try:
                os.close(fd)
            except OSError:
                pass
        for path in [shm_path, *(os.path.join(folder, x) for x in os.listdir(folder))]:
            try:
                os.unlink(path)
            except OSError:
                pass
        os.rmdir(folder)


# --- aggregation and the report ---------------------------------------------------------------------

LAYERS = [
    ("api.call", "API: Group.allreduce/_reduction/_execute (flatten, checks, seq)"),
    ("api.choose", "API: strategy choice (Group._choose -> registry, auto)"),
    ("api.layout", "API: Layout.split, describe_data, _sig (Signature)"),
    ("api.guard", "API: failure model (Collective enter/exit, deadline), Activity"),
    ("plan", "planning: plan/copies/send_groups (cached), Layout.segment"),
    ("exec.walk", "executor: schedule walk (run/_run/_segment, Header, pieces)"),
    ("match", "matching: Matcher expect/get/put/finish, dispatch"),
    ("mesh.send", "transport: ZmqMesh.send_many/_put_frames/_lane_put (Python)"),
    ("wire.encode", "wire: encode_header (msgpack)"),
    ("mesh.recv", "transport: ZmqMesh._drain/_deliver/_on_wake/_pieces (Python)"),
    ("wire.decode", "wire: validate + decode_header"),
    ("zmq.glue", "pyzmq asyncio glue (_add_*_event, _handle_*, futures; sends that wait)"),
    ("zmq.send", "pyzmq send/send_multipart -> libzmq send"),
    ("zmq.recv", "pyzmq recv/recv_multipart -> libzmq recv"),
    ("zmq.events", "pyzmq getsockopt(EVENTS) -> libzmq"),
    ("reduce", "numpy reduction (_combine)"),
    ("loop", "event loop + Task/future machinery (unattributed CPU)"),
    ("wait", "waiting: main thread off CPU (epoll idle, wake-up, runqueue)"),
]


LATENCY_ROWS = [
    ("send_call", "send call (sender: libzmq send, or lane write and wake-up)"),
    ("send_to_wake", "send call -> receiver's epoll returns (libzmq I/O threads or the "
     "pipe, wake-up)"),
    ("wake_to_deliver", "epoll return -> delivery (pyzmq dispatch and _deliver, or the lane "
     "read)"),
    ("send_to_deliver", "send call -> delivery"),
    ("deliver_to_resume", "delivery -> waiting receive resumes (validate, match, switch)"),
    ("total", "send call -> receive resumes"),
]


def us(ns: float) -> float:
    return ns / 1000.0


def fmt(v: float, digits: int = 1) -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{digits}f}"


def spread(values: list[float]) -> str:
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return "n/a"
    return f"{fmt(median(values))} [{fmt(min(values))}-{fmt(max(values))}]"


def rep_figures(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """One repetition's figures: slowest-rank times, CPU per process, back to back."""
    walls = [max(r["plain"]["wall"][i] for r in ranks) for i in range(len(ranks[0]["plain"]["wall"]))]
    n = len(walls)

    def per_proc(key: str) -> float:
        return median([sum(r["plain"][key]) / n for r in ranks])

    return {
        "median": us(median(walls)), "p10": us(quantile(walls, 0.1)),
        "p90": us(quantile(walls, 0.9)),
        "cpu_proc": us(per_proc("proc")), "cpu_main": us(per_proc("thread")),
        "runq": us(per_proc("runq")), "vcsw": per_proc("vcsw"),
        "b2b": us(max(r["b2b"]["wall"] for r in ranks)),
        "b2b_cpu": us(median([r["b2b"]["proc"] for r in ranks])),
        "strategy": ",".join(sorted(ranks[0]["strategy"])),
    }


def breakdown(rank: dict[str, Any]) -> dict[str, float]:
    """Mean per layer (us) over the typical unpreempted instrumented iterations.

    The counters are wall clock: an iteration in which the main thread waited in the run
    queue (another process had its core) charges that wait to whatever function it was in.
    So only the iterations whose run-queue wait is at most max(10 us, its 25th percentile)
    count, and of those the middle half by wall time."""
    iters = rank["iters"]
    cut = max(10_000, quantile([i["runq"] for i in iters], 0.25))
    calm = [i for i in iters if i["runq"] <= cut] or iters
    lo, hi = quantile([i["wall"] for i in calm], 0.25), quantile([i["wall"] for i in calm], 0.75)
    mid = [i for i in calm if lo <= i["wall"] <= hi] or calm
    out: dict[str, float] = defaultdict(float)
    calls = 0.0
    for it in mid:
        wrapped = 0
        for cat, ns in it["cats"].items():
            out[cat] += ns
            wrapped += ns
        out["wait"] += it["wall"] - it["thread"]
        out["loop"] += it["thread"] - wrapped
        out["wall"] += it["wall"]
        out["select"] += it["select"]
        out["nblock"] += it["nblock"] * 1000
        out["runq"] += it["runq"]
        out["proc"] += it["proc"]
        out["thread"] += it["thread"]
        calls += sum(it["calls"].values())
    res = {k: us(v / len(mid)) for k, v in out.items()}
    res["overhead"] = us(calls / len(mid) * rank["overhead_ns"])
    res["calls"] = calls / len(mid)
    res["kept"] = len(mid)
    res["calm"] = len(calm)
    res["all_wall"] = us(median([i["wall"] for i in iters]))
    return res


def latency(ranks: list[dict[str, Any]]) -> dict[str, list[float]]:
    """One-way message latency, split: send call -> receiver's epoll return -> _deliver ->
    the waiting receive resumed. Only messages whose receiver was already waiting."""
    sends = {(s[0], s[4], s[1], s[2], s[3]): s for r in ranks for s in r["sends"]}
    gets = {(g[0], g[1], g[2], g[3], g[4]): g for r in ranks for g in r["gets"]}
    out: dict[str, list[float]] = defaultdict(list)
    for r in ranks:
        for d in r["delivers"]:
            key = (d[0], d[4], d[1], d[2], d[3])  # src, dst, seq, seg, index
            s, got = sends.get(key), gets.get(key)
            if s is None or got is None:
                continue
            t_send, t_send_exit = s[5], s[6]
            t_deliver, b_enter, b_return = d[5], d[6], d[7]
            t_posted, t_done, suspended = got[5], got[6], got[7]
            if not suspended or t_posted > t_send:
                continue  # the receiver was not waiting yet: no wake-up to measure
            out["send_call"].append(us(t_send_exit - t_send))
            out["send_to_deliver"].append(us(t_deliver - t_send))
            out["deliver_to_resume"].append(us(t_done - t_deliver))
            out["total"].append(us(t_done - t_send))
            if b_enter and b_enter < t_send < b_return < t_deliver:
                out["send_to_wake"].append(us(b_return - t_send))
                out["wake_to_deliver"].append(us(t_deliver - b_return))
    return out


def report(a: argparse.Namespace, runs: dict[Any, list[Any]], floors: dict[str, list[Any]],
           notes: list[str]) -> dict[str, Any]:
    summary: dict[str, Any] = {"p2pcoll": {}, "breakdown": {}, "latency": {}, "floors": {},
                               "cprofile": {}}
    print(f"\n# profile_small: allreduce of {a.size} B float32, strategy auto, "
          f"{'plain sockets' if a.insecure else 'CurveZMQ (job key, as p2pcoll bench)'}, "
          f"{a.iters} iterations x {a.reps} repetitions")
    print(f"# load average at the end: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} "
          f"{os.getloadavg()[2]:.2f}; {os.cpu_count()} CPUs")
    for note in notes:
        print(f"# note: {note}")
    print("\n## p2pcoll allreduce (slowest rank per iteration; median [min-max over reps])\n")
    print("| p | loop | strategy | time us | p10-p90 us | back-to-back us/op | CPU us/op/process"
          " (main thread) | runqueue us | vol. ctx sw/op |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (p, loop), reps in sorted(runs.items()):
        figs = [rep_figures(r) for r in reps]
        if not figs:
            continue
        def col(k: str, figs: list[dict[str, Any]] = figs) -> list[float]:
            return [f[k] for f in figs]

        summary["p2pcoll"][f"p{p}-{loop}"] = figs
        print(f"| {p} | {loop} | {figs[0]['strategy']} | {spread(col('median'))} | "
              f"{fmt(median(col('p10')))}-{fmt(median(col('p90')))} | {spread(col('b2b'))} | "
              f"{fmt(median(col('cpu_proc')))} ({fmt(median(col('cpu_main')))}) | "
              f"{fmt(median(col('runq')))} | {fmt(median(col('vcsw')))} |")

    for (p, loop), reps in sorted(runs.items()):
        if not reps:
            continue
        parts = [breakdown(r[0]) for r in reps]
        summary["breakdown"][f"p{p}-{loop}"] = parts
        total = median([b["wall"] for b in parts])
        plain = median([us(median(r[0]["plain"]["wall"])) for r in reps])
        print(f"\n## Per layer, rank 0, p={p}, {loop}: us per collective (mean of the middle "
              f"half of iterations; median [min-max] over reps)\n")
        print(f"kept {fmt(median([b['calm'] for b in parts]), 0)} of {a.iters} iterations "
              f"with run-queue wait <= max(10 us, p25), the middle half of them by wall "
              f"({fmt(median([b['kept'] for b in parts]), 0)}); median of all instrumented "
              f"{fmt(median([b['all_wall'] for b in parts]))} us")
        print(f"instrumented wall {fmt(total)} us (plain rank-0 median {fmt(plain)} us); "
              f"{fmt(median([b['calls'] for b in parts]), 0)} wrapped calls/steps, "
              f"instrumentation est. {fmt(median([b['overhead'] for b in parts]))} us spread "
              f"over the Python rows")
        # The wrappers slow every Python row down; scale the CPU rows to the plain run's
        # main-thread CPU, and take the plain run's off-CPU time for "waiting".
        plain_cpu = [us(median(r[0]["plain"]["thread"])) for r in reps]
        plain_wall = [us(median(r[0]["plain"]["wall"])) for r in reps]
        est = []
        for b, cpu, wall in zip(parts, plain_cpu, plain_wall, strict=True):
            k = cpu / b["thread"] if b["thread"] > 0 else math.nan
            e = {cat: b.get(cat, 0.0) * k for cat, _ in LAYERS}
            e["wait"] = wall - cpu
            est.append(e)
        est_total = median([sum(e.values()) for e in est])
        print("\n| layer | us (instrumented) | % | us (scaled to plain) |\n|---|---|---|---|")
        for cat, label in LAYERS:
            vals = [b.get(cat, 0.0) for b in parts]
            print(f"| {label} | {spread(vals)} | {100 * median(vals) / total:.0f}% | "
                  f"{fmt(median([e[cat] for e in est]))} |")
        print(f"| total | {fmt(total)} | 100% | {fmt(est_total)} |")
        sel = median([b["select"] for b in parts])
        print(f"\nmain thread CPU {fmt(median([b['thread'] for b in parts]))} us, process CPU "
              f"{fmt(median([b['proc'] for b in parts]))} us (the rest: libzmq I/O thread), "
              f"runqueue wait {fmt(median([b['runq'] for b in parts]))} us"
              + (f"; select() {fmt(sel)} us over {fmt(median([b['nblock'] for b in parts]), 1)}"
                 f" blocking calls" if loop == "asyncio" else ""))
        lat = [latency(r) for r in reps]
        summary["latency"][f"p{p}-{loop}"] = {k: [median(x.get(k, [])) for x in lat]
                                              for k in lat[0]}
        print("\none message, one way (receiver already waiting; median over messages, "
              "[min-max] over reps):")
        for key, label in LATENCY_ROWS:
            vals = [median(x.get(key, [])) for x in lat]
            if any(not math.isnan(v) for v in vals):
                print(f"  {label}: {spread(vals)} us")

    print("\n## Floors: one-way us (half the round trip; median [min-max over reps]), "
          f"{a.size} B\n")
    print("| floor | loop | one-way us | p10-p90 us | CPU us/round trip (main thread) |"
          " vol. ctx sw/rt |")
    print("|---|---|---|---|---|---|")
    for key, reps in sorted(floors.items()):
        good = [r for r in reps if r and "error" not in r]
        if not good:
            errors = [r.get("error") for r in reps if r]
            print(f"| {key} | | failed: {errors[:1]} | | | |")
            continue
        one = [us(median(r["rtt"])) / 2 for r in good]
        summary["floors"][key] = {"one_way": one, "cpu": [us(r["proc"]) for r in good]}
        name, _, loop = key.rpartition("@")
        print(f"| {name} | {loop} | {spread(one)} | "
              f"{fmt(median([us(quantile(r['rtt'], 0.1)) / 2 for r in good]))}-"
              f"{fmt(median([us(quantile(r['rtt'], 0.9)) / 2 for r in good]))} | "
              f"{fmt(median([us(r['proc']) for r in good]))} "
              f"({fmt(median([us(r['thread']) for r in good]))}) | "
              f"{fmt(median([r['vcsw'] for r in good]), 2)} |")

    for (p, loop), reps in sorted(runs.items()):
        prof = [r[0]["cprofile"] for r in reps if r[0]["cprofile"]]
        if not prof:
            continue
        summary["cprofile"][f"p{p}-{loop}"] = prof[0]
        if p != min(pp for pp, _ in runs) or loop != a.loops[0]:
            continue
        print(f"\n## cProfile, rank 0, p={p}, {loop}: top own time per collective "
              f"(cProfile inflates every call)\n")
        print("| function | calls/op | own us/op | cum us/op |\n|---|---|---|---|")
        for row in prof[0][:a.cprofile_top]:
            print(f"| {row[0]} | {row[1]:.1f} | {row[2]:.1f} | {row[3]:.1f} |")
    return summary


# --- main -------------------------------------------------------------------------------------------

def options(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="4K", help="bytes per rank (K, M suffixes; default 4K)")
    ap.add_argument("--iters", type=int, default=300, help="iterations per phase (300)")
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--world-size", default="2,4", help="peers, comma list (default 2,4)")
    ap.add_argument("--loop", default="asyncio,uvloop", help="asyncio, uvloop or both")
    ap.add_argument("--reps", type=int, default=3, help="repetitions of each configuration")
    ap.add_argument("--floor-iters", type=int, default=2000, help="round trips per floor")
    ap.add_argument("--no-floors", action="store_true", help="skip the floors")
    ap.add_argument("--no-p2pcoll", action="store_true", help="only the floors")
    ap.add_argument("--cprofile-iters", type=int, default=100,
                    help="allreduces under cProfile on rank 0, first repetition (0: none)")
    ap.add_argument("--cprofile-top", type=int, default=20)
    ap.add_argument("--insecure", action="store_true",
                    help="plain sockets (default: a job key, CurveZMQ, as p2pcoll bench)")
    ap.add_argument("--json", help="write every figure to this file")
    # the peers' own options
    ap.add_argument("--worker", choices=("p2pcoll", "floor"), help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--url", help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    ap.add_argument("--loopless", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.size = parse_size(str(a.size))
    if a.worker:
        a.world_size = int(a.world_size.split(",")[0])
    else:
        a.world_sizes = [int(x) for x in a.world_size.split(",") if x.strip()]
        a.loops = [x.strip() for x in a.loop.split(",") if x.strip()]
        bad = [x for x in a.loops if x not in ("asyncio", "uvloop")]
        if bad:
            ap.error(f"unknown loop {bad[0]!r}: asyncio or uvloop")
    return a


def worker_main(a: argparse.Namespace) -> int:
    if a.worker == "p2pcoll":
        result = run_loop(a.loop, lambda: p2pcoll_peer(a))
    else:
        result = run_loop(a.loop, lambda: floor_peer(a))
    with open(a.out, "w") as f:
        json.dump(result, f)
    os._exit(0)  # a stuck libzmq close must not keep the numbers from the driver


def main(argv: list[str] | None = None) -> int:
    a = options(argv)
    if a.worker:
        return worker_main(a)
    notes = []
    if "uvloop" in a.loops:
        try:
            import uvloop  # noqa: F401
        except ImportError:
            a.loops.remove("uvloop")
            notes.append("uvloop is not installed (pip install uvloop): asyncio only")
    started = time.monotonic()
    runs: dict[tuple[int, str], list[Any]] = {(p, lp): [] for p in a.world_sizes for lp in a.loops}
    floors: dict[str, list[Any]] = defaultdict(list)
    with tempfile.TemporaryDirectory(prefix="p2pcoll-profile-") as tmp:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("P2PCOLL_KEY_FILE", None)
        for var in ("RANK", "WORLD_SIZE", "P2PCOLL_RENDEZVOUS", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(var, None)
        if not a.insecure:
            from p2pcoll.security import write_key_file

            key = os.path.join(tmp, "job.key")
            write_key_file(key)
            env["P2PCOLL_KEY_FILE"] = key
        for rep in range(a.reps):
            for p in ([] if a.no_p2pcoll else a.world_sizes):
                for loop in (a.loops if rep % 2 == 0 else a.loops[::-1]):
                    t = time.monotonic()
                    res = run_p2pcoll(p, loop, a, env, cprofile=rep == 0)
                    print(f"rep {rep + 1}/{a.reps} p2pcoll p={p} {loop}: "
                          f"{'ok' if res else 'failed'} ({time.monotonic() - t:.1f} s)",
                          file=sys.stderr)
                    if res:
                        runs[(p, loop)].append(res)
            if not a.no_floors:
                for loop in a.loops:
                    t = time.monotonic()
                    res = run_floors(loop, a, env, loopless=loop == "asyncio")
                    print(f"rep {rep + 1}/{a.reps} floors {loop}: "
                          f"{'ok' if res else 'failed'} ({time.monotonic() - t:.1f} s)",
                          file=sys.stderr)
                    for name, row in (res or {}).items():
                        loopless = name in ("zmq-sync", "pipe-blocking", "shm-spin")
                        floors[f"{name}@{'none' if loopless else loop}"].append(row)
    summary = report(a, runs, floors, notes)
    print(f"\n(total {time.monotonic() - started:.0f} s)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"config": {k: v for k, v in vars(a).items() if k != "spec"},
                       "summary": summary,
                       "raw_floors": floors}, f, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
