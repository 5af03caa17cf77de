"""p2pcoll.blocking: the synchronous API over real peers on loopback.

Ranks of one group run as threads of this process (several blocking groups in one process
share the loop thread), or as child processes where the test is about a process: Ctrl-C
in a blocked call, a script that exits without closing, the example under the launcher.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import stop

import p2pcoll
from p2pcoll import blocking
from p2pcoll.api.loop_thread import LoopThread
from p2pcoll.testing import free_port

pytestmark = pytest.mark.processes

ROOT = Path(__file__).resolve().parents[1]
WAIT_S = 120  # the longest a thread or child may take before the test counts it as hung


def on_ranks(fns: Sequence[Callable[[], Any]]) -> list[Any]:
    """Run each function on a thread of its own (one per rank) and return their results;
    the first exception any of them raised is raised here."""
    results: list[Any] = [None] * len(fns)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = fns[i]()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    if errors:
        raise errors[0]
    return results


def join_pair(n: int = 2, **kwargs: Any) -> list[blocking.Group]:
    url = f"tcp://127.0.0.1:{free_port()}"
    return on_ranks([partial(blocking.join, url, world_size=n, rank=r, timeout=30, **kwargs)
                     for r in range(n)])


def each(groups: Sequence[blocking.Group], fn: Callable[[blocking.Group], Any]) -> list[Any]:
    return on_ranks([partial(fn, g) for g in groups])


@pytest.fixture(scope="module")
def pair() -> Iterator[list[blocking.Group]]:
    groups = join_pair()
    yield groups
    each(groups, lambda g: g.close())


def test_join_is_blocking_and_gives_a_formed_group(pair: list[blocking.Group]) -> None:
    g0, g1 = pair
    assert (g0.rank, g1.rank) == (0, 1) and g0.world_size == g1.world_size == 2
    assert g0.state == g1.state == p2pcoll.GroupState.READY
    assert g0.membership.world_size == 2 and g0.cause is None
    assert isinstance(g0.aio, p2pcoll.Group) and g0.timeout == g0.aio.timeout
    assert g0.endpoint == g0.aio.endpoint and "rank 0/2" in repr(g0)


def inputs(rank: int) -> np.ndarray:
    return (np.arange(10, dtype=np.float64) + 1) * (rank + 1)


@pytest.mark.parametrize("async_op", [False, True], ids=["blocking", "async_op"])
def test_every_collective_gives_the_async_apis_results(pair: list[blocking.Group],
                                                       async_op: bool) -> None:
    def done(x: Any) -> Any:
        if async_op:
            assert isinstance(x, blocking.Handle)
            return x.wait()
        assert not isinstance(x, blocking.Handle)
        return x

    def script(g: blocking.Group) -> dict[str, Any]:
        r = g.rank
        x = inputs(r)
        out: dict[str, Any] = {}
        out["allreduce"] = done(g.allreduce(x, async_op=async_op))
        out["avg"] = done(g.allreduce(x, "avg", async_op=async_op))
        buf = x.copy()
        assert done(g.allreduce(buf, "max", out=buf, async_op=async_op)) is buf
        out["inplace"] = buf
        out["tree"] = done(g.allreduce({"a": x, "b": [np.int32(r + 1) * np.ones(3, np.int32)]},
                                       async_op=async_op))
        out["reduce"] = done(g.reduce(x, 1, "prod", async_op=async_op))
        out["reduce_scatter"] = done(g.reduce_scatter(x, async_op=async_op))
        out["broadcast"] = done(g.broadcast(x if r == 0 else None, async_op=async_op))
        out["allgather"] = done(g.allgather(x, async_op=async_op))
        out["alltoall"] = done(g.alltoall([x[:r * 3], x[:4 + r]], async_op=async_op))
        out["gather"] = done(g.gather(x, root=1, async_op=async_op))
        parts = [np.full(3, 10.0), np.full(5, 20.0)] if r == 0 else None
        out["scatter"] = done(g.scatter(parts, async_op=async_op))
        assert done(g.barrier(async_op=async_op)) is None
        if r == 0:
            assert done(g.send(x, dst=1, tag=3, async_op=async_op)) is None
            assert done(g.send(x * 2, dst=1, tag=4, async_op=async_op)) is None
        else:
            out["recv"] = done(g.recv(src=0, tag=3, async_op=async_op))
            out["recv_any"] = done(g.recv_any(tag=4, async_op=async_op))
        return out

    r0, r1 = each(pair, script)
    x0, x1 = inputs(0), inputs(1)
    for res in (r0, r1):
        np.testing.assert_array_equal(res["allreduce"], x0 + x1)
        np.testing.assert_allclose(res["avg"], (x0 + x1) / 2)
        np.testing.assert_array_equal(res["inplace"], np.maximum(x0, x1))
        np.testing.assert_array_equal(res["tree"]["a"], x0 + x1)
        np.testing.assert_array_equal(res["tree"]["b"][0], np.full(3, 3, np.int32))
        np.testing.assert_array_equal(res["broadcast"], x0)
        assert [a.tolist() for a in res["allgather"]] == [x0.tolist(), x1.tolist()]
    assert [a.tolist() for a in r0["alltoall"]] == [[], x1[:3].tolist()]  # zero: 0 to 0
    assert [a.tolist() for a in r1["alltoall"]] == [x0[:4].tolist(), x1[:5].tolist()]
    assert r0["reduce"] is None and r0["gather"] is None
    np.testing.assert_array_equal(r1["reduce"], x0 * x1)
    assert [a.tolist() for a in r1["gather"]] == [x0.tolist(), x1.tolist()]
    np.testing.assert_array_equal(np.concatenate([r0["reduce_scatter"], r1["reduce_scatter"]]),
                                  x0 + x1)
    np.testing.assert_array_equal(r0["scatter"], np.full(3, 10.0))
    np.testing.assert_array_equal(r1["scatter"], np.full(5, 20.0))
    np.testing.assert_array_equal(r1["recv"], x0)
    src, value = r1["recv_any"]
    assert src == 0
    np.testing.assert_array_equal(value, x0 * 2)
    stats = pair[0].stats()
    assert stats["collectives"] > 0 and stats["collectives_by_strategy"]["allreduce"]


def test_async_op_handles_start_in_call_order_and_overlap(pair: list[blocking.Group]) -> None:
    """Many handles in flight at once, waited in reverse: each gets its own call's result."""

    def script(g: blocking.Group) -> list[np.ndarray]:
        handles = [g.allreduce(np.full(100, i + g.rank, np.int64), async_op=True)
                   for i in range(20)]
        return [h.wait() for h in reversed(handles)][::-1]

    for results in each(pair, script):
        assert [int(a[0]) for a in results] == [2 * i + 1 for i in range(20)]


def test_codecs_through_the_blocking_api(pair: list[blocking.Group]) -> None:
    """codec= on the three reductions, sync and async_op, as on the async API."""

    def script(g: blocking.Group) -> list[Any]:
        x = np.linspace(-1, 1, 3000, dtype=np.float32) * (g.rank + 1)
        coded = g.allreduce(x, "avg", codec="int8", async_op=True)
        half = g.allreduce(x, codec="fp16")
        part = g.reduce_scatter(x.reshape(2, 1500), codec="bf16")
        root = g.reduce(x, 1, codec="int8")
        return [coded.wait(), half, part, root]

    results = each(pair, script)
    want = np.linspace(-1, 1, 3000, dtype=np.float32) * 3
    for rank, (avg, total, part, root) in enumerate(results):
        np.testing.assert_allclose(avg, want / 2, atol=0.02)
        np.testing.assert_allclose(total, want, rtol=1e-3, atol=1e-3)
        np.testing.assert_allclose(part, want.reshape(2, 1500)[rank:rank + 1], rtol=1e-2,
                                   atol=1e-2)
        assert (root is None) == (rank == 0)
    np.testing.assert_allclose(results[1][3], want, atol=0.05)
    assert results[0][0].tobytes() == results[1][0].tobytes()  # the same bits on both


def test_wait_with_a_timeout_leaves_the_call_going(pair: list[blocking.Group]) -> None:
    g0, g1 = pair
    h = g1.recv(src=0, tag=9, async_op=True)
    assert not h.done() and "pending" in repr(h)
    with pytest.raises(TimeoutError, match="recv did not finish in 0.2s"):
        h.wait(timeout=0.2)
    g0.send(np.arange(4), dst=1, tag=9)
    np.testing.assert_array_equal(h.wait(timeout=WAIT_S), np.arange(4))
    assert h.done() and "done" in repr(h)
    np.testing.assert_array_equal(h.wait(), np.arange(4))  # again: the same result


def test_errors_are_the_async_apis_classes() -> None:
    g0, g1 = join_pair()
    try:
        # Bad input: raised in the caller (blocking) or by wait() (async_op); usable after.
        with pytest.raises(ValueError, match="root"):
            g0.broadcast(np.zeros(2), root=7)
        h = g0.send(np.zeros(2), dst=0, async_op=True)
        with pytest.raises(ValueError, match="dst 0 is not another rank"):
            h.wait(WAIT_S)
        # A timeout: CollectiveTimeout, which breaks the group (as in the async API): what
        # follows raises GroupBroken, from the call or from its handle, on every wait.
        with pytest.raises(p2pcoll.CollectiveTimeout, match="still waiting for ranks"):
            g1.recv(src=0, tag=1, timeout=0.3)
        h = g1.recv(src=0, tag=2, async_op=True)
        for _ in range(2):
            with pytest.raises(p2pcoll.GroupBroken, match="after an earlier failure"):
                h.wait(WAIT_S)
        assert g1.state == p2pcoll.GroupState.BROKEN
    finally:
        each([g0, g1], lambda g: g.close())


def test_a_peer_that_leaves_raises_peer_lost() -> None:
    g0, g1 = join_pair()
    try:
        h = g1.recv(src=0, tag=5, async_op=True)
        g0.close()
        with pytest.raises(p2pcoll.PeerLost, match="rank 0 left the group"):
            h.wait(WAIT_S)
    finally:
        each([g0, g1], lambda g: g.close())


def test_closed_group_raises_group_broken_and_close_is_idempotent() -> None:
    groups = join_pair()
    each(groups, lambda g: g.close())
    for g in groups:
        g.close()
        assert g.state == p2pcoll.GroupState.CLOSED
        with pytest.raises(p2pcoll.GroupBroken, match="allreduce: the group is closed"):
            g.allreduce(np.zeros(1))
        with pytest.raises(p2pcoll.GroupBroken):
            g.barrier(async_op=True)
        with pytest.raises(p2pcoll.GroupBroken):
            g.stats()


def test_context_manager_closes_and_the_loop_thread_stops_with_the_last_group() -> None:
    url = f"tcp://127.0.0.1:{free_port()}"

    def rank(r: int) -> float:
        with blocking.join(url, world_size=2, rank=r, timeout=30) as g:
            result = float(g.allreduce(np.array([r + 1.0]))[0])
        assert g.state == p2pcoll.GroupState.CLOSED
        return result

    # Other tests' module-scoped pair may still hold the loop: count the users instead.
    users = LoopThread._users
    assert on_ranks([lambda: rank(0), lambda: rank(1)]) == [3.0, 3.0]
    assert LoopThread._users == users
    if users == 0:
        assert LoopThread._instance is None
        assert not [t for t in threading.enumerate() if t.name == "p2pcoll-loop"]


def test_several_blocking_groups_in_one_process() -> None:
    """Two groups of two and one of three, all at once, on the one loop thread."""
    urls = [f"tcp://127.0.0.1:{free_port()}" for _ in range(3)]
    sizes = [2, 2, 3]

    def rank(i: int, r: int) -> list[int]:
        with blocking.join(urls[i], world_size=sizes[i], rank=r, timeout=30) as g:
            return [int(g.allreduce(np.array([(i + 1) * 100 + k]))[0]) for k in range(5)]

    jobs = [(i, r) for i in range(3) for r in range(sizes[i])]
    results = on_ranks([partial(rank, i, r) for i, r in jobs])
    for (i, _), got in zip(jobs, results, strict=True):
        assert got == [sizes[i] * ((i + 1) * 100 + k) for k in range(5)]


def test_blocking_inside_a_running_event_loop_is_a_clear_error(
        pair: list[blocking.Group]) -> None:
    g0, g1 = pair

    async def inside() -> tuple[Any, Any]:
        with pytest.raises(blocking.LoopBlocked, match="running an asyncio event loop"):
            g0.barrier()
        with pytest.raises(blocking.LoopBlocked):
            blocking.join("tcp://127.0.0.1:1", world_size=2, rank=0)
        # async_op is allowed; wait() on an unfinished call is not, but a thread may wait.
        h0 = g0.allreduce(np.ones(3), async_op=True)
        h1 = g1.allreduce(np.ones(3), async_op=True)
        received = g1.recv(src=0, tag=77, async_op=True)  # nothing sent yet
        with pytest.raises(blocking.LoopBlocked, match="recv's Handle.wait"):
            received.wait()
        g0.send(np.arange(2), dst=1, tag=77, async_op=True)
        results = [await asyncio.to_thread(h.wait) for h in (h0, h1, received)]
        assert received.wait() is results[2]  # done: wait() no longer blocks, so it may
        return results[0], results[1]

    a, b = asyncio.run(inside())
    np.testing.assert_array_equal(a, np.full(3, 2.0))
    np.testing.assert_array_equal(b, np.full(3, 2.0))

    # On p2pcoll's own loop thread (a coroutine of the aio group calling back into the
    # blocking one) it would deadlock: the error says so.
    async def on_the_loop() -> None:
        g0.barrier()

    with pytest.raises(blocking.LoopBlocked, match="p2pcoll's loop thread"):
        LoopThread.acquire().run(_released(on_the_loop()))
    assert g0.state == g1.state == p2pcoll.GroupState.READY


async def _released(coro: Any) -> Any:
    try:
        return await coro
    finally:
        LoopThread.release()


CHILD = """
import sys, numpy as np, p2pcoll.blocking
g = p2pcoll.blocking.join(sys.argv[1], world_size=2, rank=1, timeout=30)
g.barrier()
print("ready", flush=True)
if sys.argv[2] == "interrupt":
    g.recv(src=0)           # blocks until Ctrl-C
else:
    g.allreduce(np.ones(2)) # then exit without close()
print("done", flush=True)
"""


def start_child(url: str, mode: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", CHILD, url, mode], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})


def join_with_child(mode: str) -> tuple[blocking.Group, subprocess.Popen[str]]:
    url = f"tcp://127.0.0.1:{free_port()}"
    child = start_child(url, mode)
    try:
        g = blocking.join(url, world_size=2, rank=0, timeout=60, collective_timeout=300)
        g.barrier()
        assert child.stdout is not None
        assert child.stdout.readline() == "ready\n"
    except BaseException:
        stop(child)
        raise
    return g, child


def test_ctrl_c_in_a_blocked_call_is_not_swallowed() -> None:
    """SIGINT to a child blocked in recv(): KeyboardInterrupt ends it at once, and the peer
    learns at once (not at its 300 s deadline) that the child is gone."""
    g, child = join_with_child("interrupt")
    try:
        h = g.recv(src=1, async_op=True)   # what the child will never send
        threading.Event().wait(2)            # let it settle in its recv()
        child.send_signal(signal.SIGINT)
        with pytest.raises(p2pcoll.P2PCollError) as info:
            h.wait(timeout=WAIT_S)
        assert not isinstance(info.value, p2pcoll.CollectiveTimeout)
        assert "rank 1" in str(info.value)
        out, err = child.communicate(timeout=WAIT_S)
        code = child.returncode
        assert code == -signal.SIGINT, (code, out, err)
        assert err.rstrip().endswith("KeyboardInterrupt") and ", in recv\n" in err, err
        assert "done" not in out
    finally:
        stop(child)
        g.close()


def test_a_script_that_forgets_close_exits_and_says_goodbye() -> None:
    g, child = join_with_child("forget")
    try:
        g.allreduce(np.ones(2))
        h = g.recv(src=1, async_op=True)     # the child exits instead of sending
        with pytest.raises(p2pcoll.PeerLost, match="rank 1 left the group"):
            h.wait(timeout=WAIT_S)
        out, err = child.communicate(timeout=WAIT_S)
        assert (child.returncode, out) == (0, "done\n"), err
    finally:
        stop(child)
        g.close()


def test_example_under_the_launcher() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "p2pcoll", "launch", "-n", "2", "--", sys.executable,
         str(ROOT / "examples" / "blocking_allreduce.py")],
        check=False, cwd=ROOT, capture_output=True, text=True, timeout=WAIT_S,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "blocking allreduce on 2 ranks: sum of ranks 1, all ok" in proc.stdout


def test_p2pcoll_blocking_is_imported_on_first_use() -> None:
    code = ("import sys, p2pcoll\n"
            "assert 'p2pcoll.blocking' not in sys.modules\n"
            "from p2pcoll.blocking import join\n"
            "assert p2pcoll.blocking.join is join and 'blocking' in p2pcoll.__all__\n")
    proc = subprocess.run([sys.executable, "-c", code], check=False, cwd=ROOT,
                          capture_output=True, text=True, timeout=WAIT_S,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr


def test_a_forked_child_joins_with_a_loop_thread_of_its_own(pair: list[blocking.Group]) -> None:
    """The parent's loop thread (busy with ``pair``) does not survive a fork: a group the
    child joins must not wait on it forever."""
    assert LoopThread._instance is not None
    with warnings.catch_warnings():  # 3.12+ warns about forking a process with threads
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # the child: a group of one, one collective, then out without cleanup
        code = 1
        signal.alarm(WAIT_S)  # a child stuck on the parent's dead loop thread dies, not hangs
        try:
            with blocking.join(world_size=1, timeout=30) as g:
                code = 0 if float(g.allreduce(np.array([2.0]))[0]) == 2.0 else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    np.testing.assert_array_equal(each(pair, lambda g: g.allreduce(np.ones(1)))[0], [2.0])


def test_the_torch_backend_runs_on_the_same_loop_thread(pair: list[blocking.Group]) -> None:
    """One loop thread per process, whoever uses it: torch's process groups and these."""
    pytest.importorskip("torch")
    from p2pcoll.integrations.torch.runtime import Runtime

    runtime = Runtime.acquire()
    try:
        assert LoopThread._instance is not None
        assert runtime.loop is LoopThread._instance.loop
        assert runtime.run(_thread_name()) == "p2pcoll-loop"
    finally:
        Runtime.release()
    # torch letting go leaves the loop running for the blocking groups.
    np.testing.assert_array_equal(each(pair, lambda g: g.allreduce(np.ones(1)))[0], [2.0])


async def _thread_name() -> str:
    return threading.current_thread().name


def test_shrink_gives_a_blocking_group_of_the_survivors() -> None:
    groups = join_pair(3)
    new: list[blocking.Group] = []
    try:
        groups[1].close()  # rank 1 leaves; ranks 0 and 2 carry on as 0 and 1
        new = on_ranks([partial(g.shrink, [1]) for g in (groups[0], groups[2])])
        assert [g.rank for g in new] == [0, 1] and all(g.world_size == 2 for g in new)
        sums = each(new, lambda g: g.allreduce(np.arange(3.0) + g.rank))
        for s in sums:
            np.testing.assert_array_equal(s, [1.0, 3.0, 5.0])
        with pytest.raises(RuntimeError):
            new[0].shrink([0])
    finally:
        each([*groups, *new], lambda g: g.close())
