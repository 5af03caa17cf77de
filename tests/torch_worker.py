"""One rank of the torch backend tests (tests/test_torch_backend.py starts the ranks).

    python tests/torch_worker.py compare   every collective, op and dtype: p2pcoll's result
                                           against Gloo's on the same inputs
    python tests/torch_worker.py default   init_process_group("p2pcoll") with no p2pcoll
                                           import (the entry point), errors, subgroups
    python tests/torch_worker.py kill      the last rank dies; the others' wait() raises
    python tests/torch_worker.py bf16      one bfloat16 all_reduce through p2pcoll and Gloo:
                                           prints ``BITS <backend> <hex>`` of each result
    python tests/torch_worker.py drive     small calls on the caller's thread mixed with
                                           large ones on the loop thread: order, results,
                                           errors

The rank, world size and rendezvous come from the environment (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT). Each prints ``FAIL ...`` lines and finally ``OK <checks>``.
"""

# The per-check functions below close over the loop's variables on purpose: each is called
# at once, in the iteration that defines it.

from __future__ import annotations

import gc
import os
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

R = dist.ReduceOp
OPS = {"SUM": R.SUM, "PRODUCT": R.PRODUCT, "MIN": R.MIN, "MAX": R.MAX, "BAND": R.BAND,
       "BOR": R.BOR, "BXOR": R.BXOR}
FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INTS = [torch.int32, torch.int64, torch.int8, torch.uint8]
failures: list[str] = []
checks = 0


def check(name: str, got: object, want: object) -> None:
    global checks
    checks += 1
    same = (torch.equal(got, want) if isinstance(got, torch.Tensor)
            else len(got) == len(want) and all(torch.equal(a, b)  # type: ignore[arg-type]
                                               for a, b in zip(got, want)))  # type: ignore[call-overload]
    if not same:
        failures.append(f"{name}: got {got}, want {want}")


def data(rank: int, n: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    """Small integers, so float reductions are exact in any order."""
    return ((torch.arange(n) * 7 + rank * 3 + salt) % 5 + 1).to(dtype)


def both(fn: Callable[[dist.ProcessGroup], object], p2p: dist.ProcessGroup,
         gloo: dist.ProcessGroup) -> tuple[object, object]:
    return fn(p2p), fn(gloo)


def noise(rank: int, n: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    """Random floats, whose sums depend on the order the terms are added in."""
    gen = torch.Generator().manual_seed(1000 * rank + salt + n)
    return torch.randn(n, generator=gen, dtype=torch.float64).to(dtype)


def same_bits(p2p: dist.ProcessGroup, gloo: dist.ProcessGroup, tag: str) -> None:
    """The sums Gloo takes, in Gloo's order: sizes that cross its segments and blocks (and
    leave the last blocks short or empty), the ops and calls DDP and FSDP2 use."""
    rank, p = p2p.rank(), p2p.size()
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        for n in (1, 7, 1000, 300_001, 600_000):
            cell = f"{tag} {dtype} n={n}"
            def ar(g: dist.ProcessGroup) -> torch.Tensor:
                t = noise(rank, n, dtype)
                dist.all_reduce(t, group=g)
                return t
            gloo_sum = ar(gloo)
            check(f"bits all_reduce SUM {cell}", ar(p2p), gloo_sum)
            if dtype in (torch.float32, torch.float64):  # AVG: Gloo's SUM, divided by p
                t = noise(rank, n, dtype)
                dist.all_reduce(t, op=R.AVG, group=p2p)
                check(f"bits all_reduce AVG {cell}", t, gloo_sum / p)

            def rst(g: dist.ProcessGroup) -> torch.Tensor:
                out = torch.zeros(n, dtype=dtype)
                dist.reduce_scatter_tensor(out, noise(rank, n * p, dtype, salt=1), group=g)
                return out
            check(f"bits reduce_scatter_tensor {cell}", *both(rst, p2p, gloo))

            def red(g: dist.ProcessGroup) -> torch.Tensor:
                t = noise(rank, n, dtype, salt=9)
                dist.reduce(t, dst=dist.get_global_rank(g, n % p), group=g)
                return t
            a, b = both(red, p2p, gloo)
            if rank == n % p:
                check(f"bits reduce {cell}", a, b)
            if n <= 1000:
                def rsl(g: dist.ProcessGroup) -> torch.Tensor:
                    out = torch.zeros(n, dtype=dtype)
                    ins = [noise(rank, n, dtype, salt=2 + j) for j in range(p)]
                    dist.reduce_scatter(out, ins, group=g)
                    return out
                check(f"bits reduce_scatter {cell}", *both(rsl, p2p, gloo))


def compare(p2p: dist.ProcessGroup, gloo: dist.ProcessGroup, tag: str) -> None:
    rank, p = p2p.rank(), p2p.size()
    same_bits(p2p, gloo, tag)
    for op_name, op in OPS.items():
        for dtype in (INTS if op_name in ("BAND", "BOR", "BXOR") else FLOATS + INTS):
            cell = f"{tag} {op_name} {dtype}"
            for n in (0, 1, 13):
                def ar(g: dist.ProcessGroup) -> torch.Tensor:
                    t = data(rank, n, dtype)
                    dist.all_reduce(t, op=op, group=g)
                    return t
                check(f"all_reduce {cell} n={n}", *both(ar, p2p, gloo))

            def red(g: dist.ProcessGroup) -> torch.Tensor:
                t = data(rank, 5, dtype)
                dist.reduce(t, dst=dist.get_global_rank(g, p - 1), op=op, group=g)
                return t
            a, b = both(red, p2p, gloo)
            if rank == p - 1:
                check(f"reduce {cell}", a, b)

            def rst(g: dist.ProcessGroup) -> torch.Tensor:
                out = torch.zeros(3, dtype=dtype)
                dist.reduce_scatter_tensor(out, data(rank, 3 * p, dtype), op=op, group=g)
                return out
            check(f"reduce_scatter_tensor {cell}", *both(rst, p2p, gloo))

            def rsl(g: dist.ProcessGroup) -> torch.Tensor:
                out = torch.zeros(2, dtype=dtype)
                ins = [data(rank, 2, dtype, salt=j) for j in range(p)]
                dist.reduce_scatter(out, ins, op=op, group=g)
                return out
            check(f"reduce_scatter {cell}", *both(rsl, p2p, gloo))

    # AVG (Gloo has none) against Gloo's SUM / p; PREMUL_SUM against Gloo's SUM of the
    # multiplied input.
    for dtype in (torch.float32, torch.float64):
        t = data(rank, 6, dtype)
        dist.all_reduce(t, op=R.AVG, group=p2p)
        want = data(rank, 6, dtype)
        dist.all_reduce(want, group=gloo)
        check(f"{tag} all_reduce AVG {dtype}", t, want / p)
        factor = 0.5
        t = data(rank, 6, dtype)
        dist.all_reduce(t, op=dist._make_nccl_premul_sum(factor), group=p2p)
        want = data(rank, 6, dtype) * factor
        dist.all_reduce(want, group=gloo)
        check(f"{tag} all_reduce PREMUL_SUM {dtype}", t, want)
        out = torch.zeros(2, dtype=dtype)
        dist.reduce_scatter_tensor(out, data(rank, 2 * p, dtype), op=R.AVG, group=p2p)
        want = torch.zeros(2, dtype=dtype)
        dist.reduce_scatter_tensor(want, data(rank, 2 * p, dtype), group=gloo)
        check(f"{tag} reduce_scatter_tensor AVG {dtype}", out, want / p)

    for dtype in FLOATS + INTS + [torch.bool]:
        cell = f"{tag} {dtype}"
        for root in (0, p - 1):
            def bc(g: dist.ProcessGroup) -> torch.Tensor:
                t = data(rank, 7, dtype)
                dist.broadcast(t, src=dist.get_global_rank(g, root), group=g)
                return t
            check(f"broadcast {cell} root={root}", *both(bc, p2p, gloo))

        def ag(g: dist.ProcessGroup) -> list[torch.Tensor]:
            out = [torch.zeros(4, dtype=dtype) for _ in range(p)]
            dist.all_gather(out, data(rank, 4, dtype), group=g)
            return out
        check(f"all_gather {cell}", *both(ag, p2p, gloo))

        def agt(g: dist.ProcessGroup) -> torch.Tensor:
            out = torch.zeros(3 * p, dtype=dtype)
            dist.all_gather_into_tensor(out, data(rank, 3, dtype), group=g)
            return out
        check(f"all_gather_into_tensor {cell}", *both(agt, p2p, gloo))

        def ga(g: dist.ProcessGroup) -> list[torch.Tensor]:
            out = [torch.zeros(3, dtype=dtype) for _ in range(p)] if rank == 0 else None
            dist.gather(data(rank, 3, dtype), out, dst=dist.get_global_rank(g, 0), group=g)
            return out or []
        check(f"gather {cell}", *both(ga, p2p, gloo))

        def sc(g: dist.ProcessGroup) -> torch.Tensor:
            out = torch.zeros(2, dtype=dtype)
            parts = [data(j, 2, dtype, salt=5) for j in range(p)] if rank == p - 1 else None
            dist.scatter(out, parts, src=dist.get_global_rank(g, p - 1), group=g)
            return out
        check(f"scatter {cell}", *both(sc, p2p, gloo))

        def a2a(g: dist.ProcessGroup) -> list[torch.Tensor]:
            out = [torch.zeros(3, dtype=dtype) for j in range(p)]
            dist.all_to_all(out, [data(rank, 3, dtype, salt=j) for j in range(p)], group=g)
            return out
        check(f"all_to_all {cell}", *both(a2a, p2p, gloo))

        def a2s(g: dist.ProcessGroup) -> torch.Tensor:
            # Rank r sends (r + j) % 3 rows to rank j: zero rows between some pairs.
            ins = [(rank + j) % 3 for j in range(p)]
            outs = [(i + rank) % 3 for i in range(p)]
            out = torch.zeros(sum(outs), 2, dtype=dtype)
            dist.all_to_all_single(out, data(rank, 2 * sum(ins), dtype).reshape(-1, 2),
                                   outs, ins, group=g)
            return out
        check(f"all_to_all_single {cell}", *both(a2s, p2p, gloo))

    # async_op: several in flight, then waited in reverse; futures hold the outputs.
    ts = [data(rank, 5, torch.float32, salt=i) for i in range(4)]
    works = [dist.all_reduce(t, async_op=True, group=p2p) for t in ts]
    bw = torch.zeros(3)
    if rank == 0:
        bw += 9
    works.append(dist.broadcast(bw, src=dist.get_global_rank(p2p, 0), group=p2p,
                                async_op=True))
    for w in reversed(works):
        w.wait()
    for i, t in enumerate(ts):
        want = data(rank, 5, torch.float32, salt=i)
        dist.all_reduce(want, group=gloo)
        check(f"{tag} async all_reduce {i}", t, want)
        check(f"{tag} async future value {i}", works[i].get_future().value()[0], want)
    check(f"{tag} async broadcast", bw, torch.full((3,), 9.0))
    fut = dist.all_reduce(torch.ones(2), async_op=True, group=p2p).get_future()
    chained = fut.then(lambda f: f.value()[0] * 2)
    check(f"{tag} future then", chained.wait(), torch.full((2,), 2.0 * p))

    # send/recv around a ring, two tags in flight.
    right, left = (rank + 1) % p, (rank - 1) % p
    g_right, g_left = dist.get_global_rank(p2p, right), dist.get_global_rank(p2p, left)
    reqs = [dist.isend(torch.full((3,), float(rank)), g_right, group=p2p, tag=1),
            dist.isend(torch.full((2,), rank * 10, dtype=torch.int64), g_right, group=p2p,
                       tag=2)]
    got_i = torch.zeros(2, dtype=torch.int64)
    got_f = torch.zeros(3)
    dist.recv(got_i, g_left, group=p2p, tag=2)
    dist.recv(got_f, g_left, group=p2p, tag=1)
    for q in reqs:
        q.wait()
    check(f"{tag} send/recv float", got_f, torch.full((3,), float(left)))
    check(f"{tag} send/recv int", got_i, torch.full((2,), left * 10, dtype=torch.int64))

    # Split sizes that rank 0 (sender) and rank 1 (receiver) disagree on: an error naming
    # them on every rank, and the group still works.
    outs = [2 if rank == 1 and i == 0 else 1 for i in range(p)]
    try:
        dist.all_to_all_single(torch.zeros(sum(outs)), torch.ones(p), outs, [1] * p,
                               group=p2p)
        said = ""
    except Exception as exc:  # what torch makes of the backend's CollectiveMismatch
        said = str(exc)
    check(f"{tag} all_to_all_single split sizes that disagree",
          [torch.tensor("rank 0 sends rank 1 1 rows, rank 1 expects 2" in said)],
          [torch.tensor(True)])
    after = torch.zeros(p)
    dist.all_to_all_single(after, torch.full((p,), float(rank)), group=p2p)
    check(f"{tag} all_to_all_single after the mismatch", after, torch.arange(p).float())
    dist.barrier(group=p2p)


def main_compare() -> None:
    dist.init_process_group("gloo")
    p = dist.get_world_size()
    import p2pcoll.torch  # noqa: F401  (explicit registration works too)

    p2p = dist.new_group(backend="p2pcoll")
    compare(p2p, dist.group.WORLD, "world")
    # A subgroup of the first two ranks (every rank creates it, as torch requires).
    sub_p2p = dist.new_group([0, 1], backend="p2pcoll")
    sub_gloo = dist.new_group([0, 1], backend="gloo")
    if dist.get_rank() < 2 and p > 2:
        compare(sub_p2p, sub_gloo, "sub")
    dist.barrier()
    dist.destroy_process_group()


def main_default() -> None:
    t0 = time.monotonic()
    dist.init_process_group("p2pcoll")  # no p2pcoll import: the torch.backends entry point
    rank, p = dist.get_rank(), dist.get_world_size()
    t = torch.ones(3) * rank
    dist.all_reduce(t)
    check("default all_reduce", t, torch.full((3,), float(sum(range(p)))))
    for op, dtype, words in ((R.BAND, torch.float32, "BAND"), (R.AVG, torch.int64, "AVG"),
                             (R.SUM, torch.float8_e5m2, "float8_e5m2")):
        try:
            dist.all_reduce(torch.ones(2, dtype=dtype), op=op)
        except ValueError as exc:
            if words not in str(exc):
                failures.append(f"error for {op} {dtype} does not name it: {exc}")
        else:
            failures.append(f"{op} on {dtype} did not raise")
    # A tensor off the CPU (meta here; cuda alike) is an error naming its device.
    try:
        dist.all_reduce(torch.ones(2, device="meta"))
    except (RuntimeError, ValueError, TypeError) as exc:
        if "meta" not in str(exc):
            failures.append(f"the error for a meta tensor does not name its device: {exc}")
    else:
        failures.append("a meta tensor did not raise")
    sub = dist.new_group([p - 1, 0])
    if rank in (0, p - 1):
        x = torch.tensor([rank + 1.0])
        dist.all_reduce(x, group=sub)
        check("default subgroup", x, torch.tensor([float(p + 1)]))
    if dist.get_backend() != "p2pcoll":
        failures.append(f"backend is {dist.get_backend()}")
    dist.barrier()
    dist.destroy_process_group()
    del sub
    gc.collect()  # release the groups before exit (issue 12: exit aborts otherwise)
    print(f"took {time.monotonic() - t0:.2f}s", flush=True)


def main_kill() -> None:
    os.environ.setdefault("P2PCOLL_HEARTBEAT_TIMEOUT", "2")
    dist.init_process_group("p2pcoll")
    rank, p = dist.get_rank(), dist.get_world_size()
    dist.barrier()
    if rank == p - 1:
        os._exit(3)  # dies without a goodbye
    t0 = time.monotonic()
    work = dist.all_reduce(torch.ones(1000), async_op=True)
    try:
        work.wait()
    except Exception as exc:
        print(f"RAISED {type(exc).__name__} after {time.monotonic() - t0:.2f}s: {exc}",
              flush=True)
    else:
        failures.append("wait() returned although a rank died")
    os._exit(0 if not failures else 1)  # the group is broken: nothing left to close


def main_drive() -> None:
    """Small calls, which start on the caller's thread when nothing else is in flight
    (Runtime.drive), mixed with large ones, which go to the loop thread, sync and async:
    every rank must start them in the same order (else results or a mismatch betray it),
    and errors come from ``wait()`` as from the loop thread."""
    from p2pcoll.errors import CollectiveMismatch
    from p2pcoll.integrations.torch.backend import DRIVE_BYTES

    dist.init_process_group("p2pcoll")
    rank, p = dist.get_rank(), dist.get_world_size()
    pg = dist.group.WORLD
    assert pg is not None
    loop_thread = pg._runtime._loop_thread  # type: ignore[attr-defined]
    here: list[bool] = []
    drive = loop_thread.drive

    def counted(job: Callable[[], None], done: Callable[[], bool]) -> bool:
        ran: bool = drive(job, done)
        here.append(ran)
        return ran

    loop_thread.drive = counted
    total = sum(range(1, p + 1))
    large_n = DRIVE_BYTES // 4 + 1000  # over DRIVE_BYTES: the loop thread's
    for k in range(20):
        large = torch.full((large_n,), float(rank + 1 + k))
        small = [torch.full((j + 1,), float((rank + 1) * (j + 1) + k)) for j in range(3)]
        w_large = dist.all_reduce(large, async_op=True)
        w_small = [dist.all_reduce(t, async_op=True) for t in small]  # behind the large one
        b = torch.full((5,), float(rank))
        dist.broadcast(b, src=k % p)  # synchronous, with others in flight
        for w in reversed(w_small):
            w.wait()
        w_large.wait()
        check(f"drive {k} large", large, torch.full((large_n,), float(total + p * k)))
        for j, t in enumerate(small):
            check(f"drive {k} small {j}", t, torch.full((j + 1,), float(total * (j + 1)
                                                                         + p * k)))
        check(f"drive {k} broadcast", b, torch.full((5,), float(k % p)))
        alone = torch.full((7,), float(rank + 1))
        dist.all_reduce(alone)  # nothing in flight: on this thread if the loop is idle
        check(f"drive {k} alone", alone, torch.full((7,), float(total)))
    check("some calls ran on the caller's thread", [torch.tensor(any(here))],
          [torch.tensor(True)])

    # An error raised inside the call on this thread: from wait(), as torch expects.
    opts = dist.BroadcastOptions()
    opts.rootRank = p + 3
    work = pg.broadcast([torch.zeros(2)], opts)
    try:
        work.wait()
        said = ""
    except ValueError as exc:
        said = str(exc)
    check("drive bad root from wait()", [torch.tensor(f"root {p + 3}" in said)],
          [torch.tensor(True)])
    check("drive bad root is the Work's exception",
          [torch.tensor(work.is_completed() and not work.is_success()
                        and isinstance(work.exception(), ValueError))], [torch.tensor(True)])
    dist.barrier()  # the group is fine

    # Ranks that disagree on a small call: CollectiveMismatch from wait() on every rank,
    # as torch's error for backends.
    try:
        dist.all_reduce(torch.zeros(4 if rank == 0 else 6))
        raised: BaseException | None = None
    except Exception as exc:
        raised = exc
    check("drive mismatch raised", [torch.tensor(isinstance(raised, CollectiveMismatch)
                                                 and isinstance(raised,
                                                                dist.DistBackendError))],
          [torch.tensor(True)])
    dist.destroy_process_group()


BF16_N = 1000  # elements of main_bf16's tensors


def main_bf16() -> None:
    """The bits of one bfloat16 SUM of :func:`noise` through each backend, for
    tests/test_bf16_front_ends.py to compare with the other front ends'."""
    dist.init_process_group("gloo")
    import p2pcoll.torch  # noqa: F401

    p2p = dist.new_group(backend="p2pcoll")
    for name, group in (("p2pcoll", p2p), ("gloo", dist.group.WORLD)):
        t = noise(dist.get_rank(), BF16_N, torch.bfloat16)
        dist.all_reduce(t, group=group)
        print(f"BITS {name} {t.view(torch.int16).numpy().tobytes().hex()}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    {"compare": main_compare, "default": main_default, "kill": main_kill,
     "bf16": main_bf16, "drive": main_drive}[sys.argv[1]]()
    for f in failures:
        print("FAIL", f, flush=True)
    print(f"OK {checks}" if not failures else f"FAILED {len(failures)} of {checks}",
          flush=True)
    sys.exit(1 if failures else 0)
