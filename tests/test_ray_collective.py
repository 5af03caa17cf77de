"""p2pcoll.integrations.ray: the "P2PCOLL" backend of ray.util.collective, on a local Ray.

One Ray instance for the module (``ray.init(num_cpus=4)``, a few seconds); 2 or 3 actors per
test, each a real process whose group meets through Ray's key-value store and talks over
p2pcoll's own sockets on 127.0.0.1. Every call of Ray's API, every ReduceOp on every dtype
that Ray's GLOO backend accepts (the matrix is GLOO's own answer, asked in the same actors,
and p2pcoll's results must equal GLOO's and numpy's), named groups side by side, destroy and
create again, an async actor that keeps serving, and a rank killed mid-collective.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import sys
import time
from typing import Any

import numpy as np
import pytest

if importlib.util.find_spec("ray") is None:  # pragma: no cover - the ray extra is in dev
    if os.environ.get("CI") == "true":
        raise RuntimeError("ray is missing: CI installs it with the dev extra (p2pcoll[ray])")
    pytest.skip("ray not installed: pip install 'p2pcoll[ray]'", allow_module_level=True)

import ray
import ray.util.collective as col
from ray.util.collective.types import ReduceOp

from p2pcoll.integrations import ray as p2pcoll_ray

pytestmark = pytest.mark.slow

HEARTBEAT = 2.0
DTYPES = ["bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16",
          "float32", "float64", "complex64", "complex128"]
OPS = [ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX]
NP_OPS = {ReduceOp.SUM: np.add, ReduceOp.PRODUCT: np.multiply, ReduceOp.MIN: np.minimum,
          ReduceOp.MAX: np.maximum}


@pytest.fixture(scope="module", autouse=True)
def local_ray() -> Any:
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # keep Ray on 127.0.0.1
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # actors can't import tests
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, runtime_env={
        "env_vars": {"P2PCOLL_HEARTBEAT_TIMEOUT": str(HEARTBEAT),
                     "P2PCOLL_JOIN_TIMEOUT": "60", "OMP_NUM_THREADS": "1"}})
    p2pcoll_ray.register()
    p2pcoll_ray.register()  # twice is harmless
    yield
    ray.shutdown()


def _torch(values: np.ndarray, dtype: str) -> Any:
    import torch

    if dtype == "bfloat16":
        return torch.from_numpy(values.astype(np.float32)).to(torch.bfloat16)
    return torch.from_numpy(values.astype(dtype))


def _numpy(tensor: Any) -> np.ndarray:
    if isinstance(tensor, np.ndarray):
        return tensor
    import torch

    if tensor.dtype == torch.bfloat16:
        return tensor.float().numpy()
    return tensor.numpy()


def _make(lib: str, values: np.ndarray, dtype: str = "float32") -> Any:
    return values.astype(dtype) if lib == "numpy" else _torch(values, dtype)


def _inputs(rank: int, dtype: str) -> np.ndarray:
    """Small values every dtype and op hold exactly: products stay under 128."""
    if dtype == "bool":
        return np.array([rank % 2, 1, 0, (rank + 1) % 2], dtype=bool)
    base = np.array([1, 2, 3, 1], dtype=np.int64)
    values = (base + rank) * (1 if rank % 2 else -1) if not dtype.startswith("uint") else \
        base + rank
    return values.astype(np.float64) if "complex" in dtype else values


@ray.remote(num_cpus=0)
class Worker:
    def __init__(self) -> None:
        p2pcoll_ray.register()
        p2pcoll_ray.register()

    def init(self, world_size: int, rank: int, group: str, backend: str = "p2pcoll") -> None:
        col.init_collective_group(world_size, rank, backend=backend, group_name=group)

    def destroy(self, group: str) -> None:
        col.destroy_collective_group(group)

    def every_call(self, group: str, lib: str) -> dict[str, Any]:
        """Each call of Ray's API once; what every buffer held afterwards."""
        rank, size = col.get_rank(group), col.get_collective_group_size(group)
        out: dict[str, Any] = {}
        x = _make(lib, np.arange(5) * (rank + 1))
        col.allreduce(x, group_name=group)
        out["allreduce"] = _numpy(x).copy()
        x = _make(lib, np.full(4, rank))
        col.broadcast(x, src_rank=1, group_name=group)
        out["broadcast"] = _numpy(x).copy()
        x = _make(lib, np.arange(3) + rank)
        col.reduce(x, dst_rank=size - 1, group_name=group, op=ReduceOp.MAX)
        out["reduce"] = _numpy(x).copy()
        parts = [_make(lib, np.zeros(3)) for _ in range(size)]
        col.allgather(parts, _make(lib, np.full(3, rank)), group_name=group)
        out["allgather"] = [_numpy(p).copy() for p in parts]
        pieces = [_make(lib, np.full(2, 10 * rank + i)) for i in range(size)]
        x = _make(lib, np.zeros(2))
        col.reducescatter(x, pieces, group_name=group)
        out["reducescatter"] = _numpy(x).copy()
        out["reducescatter_inputs"] = [_numpy(p).copy() for p in pieces]
        col.barrier(group_name=group)
        col.send(_make(lib, np.full(2, rank)), (rank + 1) % size, group_name=group)
        x = _make(lib, np.zeros(2))
        col.recv(x, (rank - 1) % size, group_name=group)
        out["recv"] = _numpy(x).copy()
        # Ray has no all-to-all call; the group's own: rank r sends rank j j + r elements.
        outputs = [_make(lib, np.zeros(rank + i)) for i in range(size)]
        col.get_group_handle(group).alltoall(
            outputs, [_make(lib, np.full(j + rank, 10 * rank + j)) for j in range(size)])
        out["alltoall"] = [_numpy(o).copy() for o in outputs]
        return out

    def matrix(self, group: str, lib: str) -> dict[tuple[str, str], Any]:
        """allreduce of every dtype under every op: the result, or the error's type."""
        rank = col.get_rank(group)
        results: dict[tuple[str, str], Any] = {}
        for dtype in DTYPES:
            if lib == "numpy" and dtype == "bfloat16":
                continue
            for op in OPS:
                x = _make(lib, _inputs(rank, dtype), dtype)
                try:
                    col.allreduce(x, group_name=group, op=op)
                except Exception as exc:
                    results[dtype, op.name] = type(exc).__name__
                else:
                    results[dtype, op.name] = _numpy(x).copy()
        return results

    def allreduce(self, group: str, value: float) -> np.ndarray:
        x = np.full(3, value)
        col.allreduce(x, group_name=group)
        return x

    def from_the_object_store(self, group: str) -> dict[str, Any]:
        """In-place calls on arrays Ray hands out read-only (1 MiB: from its object store)."""
        rank, size = col.get_rank(group), col.get_collective_group_size(group)
        x = ray.get(ray.put(np.full(1 << 17, rank + 1.0)))
        out: dict[str, Any] = {"read_only": not x.flags.writeable}
        col.allreduce(x, group_name=group)
        out["allreduce"] = x.copy()
        y = ray.get(ray.put(np.full(1 << 17, float(rank))))
        col.broadcast(y, src_rank=size - 1, group_name=group)
        out["broadcast"] = y.copy()
        return out

    def pid(self) -> int:
        return os.getpid()

    def stream(self, group: str, count: int) -> dict[str, Any]:
        """``count`` small allreduces, or fewer if one fails: what failed, when, and how
        many messages this rank sent on TCP lanes."""
        out: dict[str, Any] = {"error": None}
        try:
            for _ in range(count):
                col.allreduce(np.ones(256), group_name=group)
        except Exception as exc:
            out = {"error": type(exc).__name__, "message": str(exc),
                   "rank": getattr(exc, "rank", None)}
        counters = col.get_group_handle(group)._group.aio.session.transport.counters
        return {**out, "failed_at": time.time(), "on_lane": counters.messages_sent_lane}


@ray.remote(num_cpus=0)
class AsyncWorker:
    def __init__(self) -> None:
        p2pcoll_ray.register()

    async def init(self, world_size: int, rank: int, group: str) -> None:
        col.init_collective_group(world_size, rank, backend="p2pcoll", group_name=group)

    async def allreduce_direct(self, group: str, value: float) -> np.ndarray:
        x = np.full(3, value)
        col.allreduce(x, group_name=group)  # blocking, from the actor's event loop
        return x

    async def allreduce_in_thread(self, group: str, value: float) -> np.ndarray:
        x = np.full(3, value)
        await asyncio.to_thread(col.allreduce, x, group_name=group)
        return x

    async def ping(self) -> str:
        return "pong"


def _group(actors: list[Any], name: str, backend: str = "p2pcoll") -> None:
    ray.get([a.init.remote(len(actors), r, name, backend) for r, a in enumerate(actors)],
            timeout=120)


@pytest.fixture(scope="module")
def trio() -> list[Any]:
    """Three actors (a size that is not a power of two) in groups "p3" (p2pcoll) and "g3"
    (Ray's GLOO)."""
    actors = [Worker.remote() for _ in range(3)]
    _group(actors, "p3")
    _group(actors, "g3", backend="gloo")
    return actors


@pytest.mark.timeout(300)
@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_every_call(trio: list[Any], lib: str) -> None:
    size = len(trio)
    results = ray.get([a.every_call.remote("p3", lib) for a in trio], timeout=120)
    for rank, got in enumerate(results):
        np.testing.assert_array_equal(got["allreduce"], np.arange(5) * sum(range(1, size + 1)))
        np.testing.assert_array_equal(got["broadcast"], np.full(4, 1))
        np.testing.assert_array_equal(
            got["reduce"], np.arange(3) + (size - 1 if rank == size - 1 else rank))
        for i, part in enumerate(got["allgather"]):
            np.testing.assert_array_equal(part, np.full(3, i))
        np.testing.assert_array_equal(
            got["reducescatter"], np.full(2, sum(10 * r + rank for r in range(size))))
        for i, part in enumerate(got["reducescatter_inputs"]):  # left as they were
            np.testing.assert_array_equal(part, np.full(2, 10 * rank + i))
        np.testing.assert_array_equal(got["recv"], np.full(2, (rank - 1) % size))
        for i, part in enumerate(got["alltoall"]):  # zero elements from rank 0 to rank 0
            np.testing.assert_array_equal(part, np.full(rank + i, 10 * i + rank))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_every_op_and_dtype_gloo_accepts(trio: list[Any], lib: str) -> None:
    gloo = ray.get([a.matrix.remote("g3", lib) for a in trio], timeout=180)
    ours = ray.get([a.matrix.remote("p3", lib) for a in trio], timeout=180)
    accepted = [k for k, v in gloo[0].items() if not isinstance(v, str)]
    assert len(accepted) >= 30, gloo[0]  # GLOO takes most of the matrix
    for key in accepted:
        dtype, op = key
        inputs = [_inputs(r, dtype).astype(np.float64 if dtype == "bfloat16" else dtype)
                  for r in range(len(trio))]
        expected = inputs[0]
        for more in inputs[1:]:
            expected = NP_OPS[ReduceOp[op]](expected, more)
        for rank in range(len(trio)):
            assert not isinstance(ours[rank][key], str), (key, ours[rank][key])
            np.testing.assert_array_equal(ours[rank][key], expected, err_msg=str(key))
            np.testing.assert_array_equal(ours[rank][key], gloo[rank][key], err_msg=str(key))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_read_only_arrays_from_the_object_store_get_the_result_as_with_gloo(
        trio: list[Any]) -> None:
    size = len(trio)
    for group in ("g3", "p3"):  # Ray's GLOO first: what p2pcoll must do as well
        results = ray.get([a.from_the_object_store.remote(group) for a in trio], timeout=120)
        for got in results:
            assert got["read_only"]  # what the test is about: Ray handed out read-only arrays
            np.testing.assert_array_equal(got["allreduce"],
                                          np.full(1 << 17, sum(range(1, size + 1))))
            np.testing.assert_array_equal(got["broadcast"], np.full(1 << 17, size - 1.0))


@pytest.mark.timeout(300)
def test_named_groups_side_by_side_then_destroy_and_create_again() -> None:
    a, b = Worker.remote(), Worker.remote()
    _group([a, b], "left")
    _group([b, a], "right")  # the other way round: b is rank 0 here
    for round_ in range(2):
        # each actor runs its calls in order: both call "left" first, then "right"
        refs = [a.allreduce.remote("left", 1.0), b.allreduce.remote("left", 2.0),
                b.allreduce.remote("right", 10.0), a.allreduce.remote("right", 20.0)]
        left_a, left_b, right_b, right_a = ray.get(refs, timeout=60)
        for got, want in ((left_a, 3.0), (left_b, 3.0), (right_a, 30.0), (right_b, 30.0)):
            np.testing.assert_array_equal(got, np.full(3, want))
        ray.get([a.destroy.remote("left"), b.destroy.remote("left")], timeout=60)
        _group([a, b] if round_ else [b, a], "left")  # same name, new group
    last = ray.get([a.allreduce.remote("left", 5.0), b.allreduce.remote("left", 6.0)],
                   timeout=60)
    for got in last:
        np.testing.assert_array_equal(got, np.full(3, 11.0))


@pytest.mark.timeout(300)
def test_group_declared_by_the_driver() -> None:
    actors = [Worker.remote(), Worker.remote()]
    col.create_collective_group(actors, 2, [1, 0], backend="p2pcoll", group_name="declared")
    got = ray.get([a.allreduce.remote("declared", r + 1.0) for r, a in enumerate(actors)],
                  timeout=120)
    for x in got:
        np.testing.assert_array_equal(x, np.full(3, 3.0))


@pytest.mark.timeout(300)
def test_async_actor_serves_while_a_collective_waits() -> None:
    fast, slow = AsyncWorker.remote(), AsyncWorker.remote()
    ray.get([fast.init.remote(2, 0, "async"), slow.init.remote(2, 1, "async")], timeout=120)
    pending = fast.allreduce_in_thread.remote("async", 1.0)  # its peer has not called yet
    for _ in range(3):
        assert ray.get(fast.ping.remote(), timeout=30) == "pong"
    ready, _ = ray.wait([pending], timeout=0.5)
    assert not ready  # still waiting for rank 1, and the actor answered meanwhile
    done = ray.get([pending, slow.allreduce_direct.remote("async", 2.0)], timeout=60)
    for x in done:
        np.testing.assert_array_equal(x, np.full(3, 3.0))


@pytest.mark.timeout(300)
def test_a_killed_rank_is_a_peer_lost_naming_it() -> None:
    actors = [Worker.remote() for _ in range(3)]
    _group(actors, "doomed")
    survivors = [a.allreduce.remote("doomed", 1.0) for a in actors[:2]]
    ready, _ = ray.wait(survivors, timeout=1.0)
    assert not ready  # both are inside the allreduce, waiting for rank 2
    ray.kill(actors[2])
    for ref in survivors:
        with pytest.raises(Exception) as caught:
            # the heartbeat bound (2 s here) with slack for busy cores; the collective's
            # own deadline, 300 s, would end in a GetTimeoutError here instead
            ray.get(ref, timeout=60)
        assert "PeerLost" in type(caught.value).__name__ or "PeerLost" in str(caught.value), \
            str(caught.value)
        assert "rank 2" in str(caught.value), str(caught.value)


@pytest.mark.timeout(300)
def test_a_rank_killed_mid_stream_on_hosts_of_their_own_is_named_over_tcp_lanes() -> None:
    """The default path between hosts: each actor on a host of its own (P2PCOLL_HOST_ID),
    a stream of small allreduces on TCP lanes; rank 2 is killed in the middle of it."""
    actors = [Worker.options(runtime_env={"env_vars": {
        "P2PCOLL_HOST_ID": f"host-{r}", "P2PCOLL_HEARTBEAT_TIMEOUT": str(HEARTBEAT),
        "P2PCOLL_JOIN_TIMEOUT": "60", "OMP_NUM_THREADS": "1"}}).remote() for r in range(3)]
    _group(actors, "hosts")
    ray.get([a.stream.remote("hosts", 20) for a in actors], timeout=60)  # lanes connected
    streams = [a.stream.remote("hosts", 10**9) for a in actors]
    time.sleep(1.0)
    killed_at = time.time()
    ray.kill(actors[2])
    for rank, out in enumerate(ray.get(streams[:2], timeout=60)):
        assert out["on_lane"] > 0, (rank, out)
        assert (out["error"], out["rank"]) == ("PeerLost", 2), (rank, out)
        assert "rank 2" in out["message"], (rank, out)
        assert out["failed_at"] - killed_at < HEARTBEAT + 10, (rank, out)
