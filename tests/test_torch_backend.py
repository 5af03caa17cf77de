"""The torch.distributed backend "p2pcoll", over real processes on loopback.

Each test starts one world of ``tests/torch_worker.py`` processes, which run many checks
each (every collective x op x dtype against Gloo on the same inputs, in one world), so the
whole file forms only a handful of worlds.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import finish, stop

from p2pcoll.testing import free_port

# The longest one world may take before it counts as a hang: four ranks of the "compare"
# world took 92 s at a load average of 17 on two cores (and got killed at the old 90 s).
WORLD_TIMEOUT = 240

pytestmark = [pytest.mark.processes, pytest.mark.timeout(WORLD_TIMEOUT + 60)]

pytest.importorskip("torch")

WORKER = Path(__file__).with_name("torch_worker.py")


def world(mode: str, size: int, timeout: float = WORLD_TIMEOUT) -> list[tuple[int, str]]:
    """Run ``size`` ranks of the worker in ``mode``; (exit code, output) per rank."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": str(size), "PYTHONWARNINGS": "ignore"}
    env.pop("TORCH_DEVICE_BACKEND_AUTOLOAD", None)
    procs = [subprocess.Popen([sys.executable, str(WORKER), mode], env={**env, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(size)]
    return finish(procs, timeout)


@pytest.mark.parametrize("size", [2, 3, 4])
def test_every_collective_matches_gloo(size: int) -> None:
    # World of `size` and, above 2, the subgroup [0, 1]: all ops, dtypes, async_op,
    # futures, send/recv; and Gloo's bits for random floats (its order of summing).
    for rank, (code, text) in enumerate(world("compare", size)):
        ok = code == 0 and text.splitlines()[-1].startswith("OK ")
        assert ok, f"rank {rank}:\n{text[-3000:]}"


@pytest.mark.parametrize("size", [2, 3])
def test_small_calls_on_the_callers_thread_keep_order_and_errors(size: int) -> None:
    # Small calls start on the caller's thread when the backend has nothing in flight,
    # large ones on the loop thread: mixed, sync and async, their results show they
    # started in the same order on every rank; an error in a call made on the caller's
    # thread comes from wait() (ValueError; a mismatch as CollectiveMismatch and
    # DistBackendError), and some calls did run on the caller's thread.
    for rank, (code, text) in enumerate(world("drive", size)):
        ok = code == 0 and text.splitlines()[-1].startswith("OK ")
        assert ok, f"rank {rank}:\n{text[-3000:]}"


def test_default_backend_through_the_entry_point() -> None:
    # init_process_group("p2pcoll") without importing p2pcoll; unsupported ops and dtypes
    # raise errors naming them; a new_group subgroup of ranks [2, 0].
    for rank, (code, text) in enumerate(world("default", 3)):
        ok = code == 0 and text.splitlines()[-1].startswith("OK ")
        assert ok, f"rank {rank}:\n{text[-3000:]}"


def test_killed_rank_raises_in_wait() -> None:
    results = world("kill", 3)
    for rank, (code, text) in enumerate(results[:-1]):
        assert code == 0 and "RAISED PeerLost" in text and "rank 2" in text, (
            f"rank {rank}:\n{text[-3000:]}")
    assert results[-1][0] == 3  # the rank that died


@pytest.mark.timeout(900)
def test_train_ddp_example_matches_gloo(tmp_path: Path) -> None:
    # examples/train_ddp.py at 4 ranks with each backend: DDP under torchrun and under
    # `p2pcoll launch`, FSDP2 (all_gather_into_tensor, reduce_scatter_tensor with AVG), DDP
    # with the fp16 hook (sums rounded to float16 at every add) and with the PowerSGD hook
    # (a nested collective waited on inside a future's callback). At 4 ranks the sums have
    # four terms, so only Gloo's order of adding them (gloo_ring, the backend's default)
    # gives Gloo's bits; the example itself checks the ranks agree.
    example = str(Path(__file__).resolve().parents[1] / "examples" / "train_ddp.py")
    # torchrun sets OMP_NUM_THREADS=1 where it is unset, `p2pcoll launch` does not: the
    # same here, so that the local maths (not the reductions) round alike.
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    env.pop("P2PCOLL_ALLREDUCE", None)
    env.pop("P2PCOLL_REDUCE_SCATTER", None)

    def torchrun(backend: str, *extra: str) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
                "--master-port", str(free_port()), example, "--backend", backend, *extra]

    runs = {
        "gloo": torchrun("gloo"),
        "p2pcoll": torchrun("p2pcoll"),
        "launch": [sys.executable, "-m", "p2pcoll", "launch", "-n", "4", "--", sys.executable,
                   example, "--backend", "p2pcoll"],
        "fsdp-gloo": torchrun("gloo", "--fsdp"),
        "fsdp-p2pcoll": torchrun("p2pcoll", "--fsdp"),
        "fp16-gloo": torchrun("gloo", "--hook", "fp16"),
        "fp16-p2pcoll": torchrun("p2pcoll", "--hook", "fp16"),
        "powersgd-gloo": torchrun("gloo", "--hook", "powersgd"),
        "powersgd-p2pcoll": torchrun("p2pcoll", "--hook", "powersgd"),
    }
    import torch

    saved = {}
    names = list(runs)
    for wave in (names[:3], names[3:6], names[6:]):  # a few worlds at once: they mostly
        procs = {name: subprocess.Popen([*runs[name], "--epochs", "1", "--save",  # start up
                                         str(tmp_path / f"{name}.pt")], env=env,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True)
                 for name in wave}
        try:
            for name, proc in procs.items():
                out, err = proc.communicate(timeout=240)
                assert proc.returncode == 0, f"{name}:\n{out[-2000:]}\n{err[-2000:]}"
                assert "identical on all 4 ranks: True" in out, f"{name}:\n{out[-2000:]}"
                saved[name] = torch.load(tmp_path / f"{name}.pt")
        finally:
            for proc in procs.values():
                stop(proc)
    for kind in ("", "fsdp-", "fp16-", "powersgd-"):
        assert torch.equal(saved[f"{kind}p2pcoll"], saved[f"{kind}gloo"]), kind
    assert torch.equal(saved["launch"], saved["gloo"])


def test_import_p2pcoll_torch_first_registers_the_backend_quietly() -> None:
    """A program whose first torch import is ``import p2pcoll.torch``: torch runs the
    backend's entry point while p2pcoll's torch package is half imported (0.6.0 failed with
    "Failed to load the backend extension: p2pcoll")."""
    import subprocess
    import sys

    code = ("import p2pcoll.torch, torch.distributed as dist; "
            "print(dist.Backend.P2PCOLL)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=False)
    assert (run.returncode, run.stdout.strip()) == (0, "p2pcoll"), run.stderr
    assert "could not register" not in run.stderr, run.stderr


# One rank of test_work_completion_paths: every way a Work ends (settled on the loop thread
# when nobody took its future, through the completer when somebody did).
COMPLETION_WORKER = r'''
import os, sys, threading, time
from datetime import timedelta

import torch
import torch.distributed as dist

from p2pcoll.errors import CollectiveTimeout, P2PCollError

dist.init_process_group("p2pcoll")
rank, size = dist.get_rank(), dist.get_world_size()
total = float(sum(range(1, size + 1)))
failures = []


def expect(name, ok):
    if not ok:
        failures.append(name)


def late():
    """Rank 1 starts its side a little late, so rank 0's waiters really block."""
    if rank == 1:
        time.sleep(0.3)


def allreduce_strategies():
    """How many allreduces ran with each strategy so far (the group's stats)."""
    pg = dist.group.WORLD
    stats = pg._runtime._loop_thread.call(pg.group.stats)
    found = []

    def walk(d):
        if isinstance(d, dict):
            if "collectives_by_strategy" in d:
                found.append(d["collectives_by_strategy"].get("allreduce", {}))
            for v in d.values():
                walk(v)

    walk(stats)
    return found[0] if found else {}


# At two ranks a SUM takes the group's own choice (the board, small tensors of one host)
# and MAX asks for Gloo's order; elsewhere both run gloo_ring.
before = allreduce_strategies()
s = torch.full((16,), float(rank + 1))
dist.all_reduce(s)
m = torch.full((16,), float(rank + 1))
dist.all_reduce(m, op=dist.ReduceOp.MAX)
after = allreduce_strategies()
ran = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
want_gloo = 1 if size == 2 else 2
expect(f"strategies {ran}", ran.get("gloo_ring") == want_gloo and sum(ran.values()) == 2
       and bool((s == total).all()) and bool((m == size).all()))

# A Work waited on from two threads at once (and then again): every waiter returns.
late()
x = torch.full((1024,), float(rank + 1))
work = dist.all_reduce(x, async_op=True)
returned = []
threads = [threading.Thread(target=lambda: returned.append(work.wait())) for _ in range(2)]
for t in threads:
    t.start()
for t in threads:
    t.join(60)
expect("two waiters", returned == [True, True] and work.wait() and work.is_completed()
       and work.is_success() and bool((x == total).all()))

# Its future asked for after it finished: complete at once, a callback runs in the caller.
late()
y = torch.full((16,), float(rank + 1))
work = dist.all_reduce(y, async_op=True)
work.wait()
future = work.get_future()
expect("future after wait", future.done() and torch.equal(future.value()[0], y))
seen = []
future.then(lambda f: seen.append(threading.current_thread().name))
expect("late callback in the caller", seen == [threading.current_thread().name])

# A callback added before the end that starts a collective and waits for it (as the
# PowerSGD hook does): it runs off the loop thread, and its collective completes.
late()
z = torch.full((64,), float(rank + 1))
inner = torch.full((8,), float(10 * (rank + 1)))
work = dist.all_reduce(z, async_op=True)


def nested(f):
    got = f.value()[0].clone()
    dist.all_reduce(inner)  # a synchronous collective inside the callback
    return [got, inner, threading.current_thread().name]


chained = work.get_future().then(nested)
got, reduced, where = chained.wait()
expect("nested collective", bool((got == total).all())
       and bool((reduced == 10 * total).all()) and where != "p2pcoll-loop")

# Many collectives in flight at once, issued from two threads in an agreed order (a lock
# passes the turn): each lands in its own tensors.
tensors = [torch.full((256,), float(rank + 1 + k)) for k in range(40)]
works = []
turn = threading.Condition()
nxt = [0]


def issue(parity):
    for k in range(parity, len(tensors), 2):
        with turn:
            turn.wait_for(lambda: nxt[0] == k, 60)
            works.append((k, dist.all_reduce(tensors[k], async_op=True)))
            nxt[0] += 1
            turn.notify_all()


issuers = [threading.Thread(target=issue, args=(p,)) for p in (0, 1)]
for t in issuers:
    t.start()
for t in issuers:
    t.join(60)
for k, w in works:
    w.wait()
expect("forty in flight", len(works) == len(tensors) and all(
    bool((t == total + size * k).all()) for k, t in enumerate(tensors)))

# Work.wait(timeout) that passes first raises CollectiveTimeout (a DistBackendError); the
# Work still completes, and a later wait() returns.
if rank == 1:
    time.sleep(1.5)
w = torch.ones(4)
work = dist.all_reduce(w, async_op=True)
if rank == 0:
    try:
        work.wait(timedelta(milliseconds=100))
        expect("wait timeout raised", False)
    except CollectiveTimeout as exc:
        expect("timeout is DistBackendError", isinstance(exc, dist.DistBackendError))
expect("wait after timeout", work.wait() and bool((w == size).all()))

# A failed collective (shapes that differ) raises the group's error as a DistBackendError,
# from wait() of a Work whose future nobody took and from the future of one whose did.
bad = torch.ones(4 + rank)
errors = []
w1 = dist.all_reduce(bad, async_op=True)
try:
    w1.wait()
except Exception as exc:
    errors.append(exc)
w2 = dist.all_reduce(torch.ones(3), async_op=True)
f2 = w2.get_future()
for waiter in (w2.wait, f2.wait):
    try:
        waiter()
    except Exception as exc:
        errors.append(exc)
expect(f"errors {[type(e).__name__ for e in errors]}", len(errors) == 3 and all(
    isinstance(e, P2PCollError) and isinstance(e, dist.DistBackendError) for e in errors))

print("FAIL " + "; ".join(failures) if failures else "OK completion", flush=True)
try:
    dist.destroy_process_group()
except Exception:
    pass
sys.exit(1 if failures else 0)
'''


@pytest.mark.parametrize("size", [2, 3])
def test_work_completion_paths(tmp_path: Path, size: int) -> None:
    # At two ranks sums take the group's own path, other ops gloo_ring (3: both gloo_ring).
    # Works finished on the loop thread (their future never taken, or taken afterwards)
    # and through the completer (a callback that starts a collective); two waiters of one
    # Work; many Works in flight issued from two threads; a timed-out wait(); errors.
    script = tmp_path / "completion_worker.py"
    script.write_text(COMPLETION_WORKER)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": str(size), "PYTHONWARNINGS": "ignore"}
    procs = [subprocess.Popen([sys.executable, str(script)], env={**env, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(size)]
    for rank, (code, text) in enumerate(finish(procs, 120)):
        assert code == 0 and "OK completion" in text, f"rank {rank}:\n{text[-3000:]}"
