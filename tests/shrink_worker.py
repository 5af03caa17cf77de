"""One rank of tests/test_shrink_torch.py: dist.shrink_group on "p2pcoll".

    python tests/shrink_worker.py identical     # 4 ranks: rank 3 is SIGKILLed
    python tests/shrink_worker.py inflight FLAG # 3 ranks: rank 2 (alive) is left out
    python tests/shrink_worker.py abort         # 2 ranks: rank 1 stops itself
    python tests/shrink_worker.py second WHEN   # 4 ranks: 3 is SIGKILLed, 2 during the shrink

RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT come from the environment. Each rank prints
``KEY value`` lines the test reads:

identical: torch's ValueErrors and RuntimeError for bad ranks (``BAD ok``); then the
survivors run collectives on ``new_group([0, 1, 2])`` (formed fresh through the store),
rank 3 kills itself, the survivors shrink the default group without it and run the same
collectives there: ``FRESH <digest>`` and ``SHRUNK <digest>`` must be equal.

inflight: rank 0 has a receive in flight on the default group when ranks 0 and 1 shrink it
without rank 2 (with FLAG ``default`` or ``abort``): ``INFLIGHT <error class>`` says how it
ended; rank 2 calls shrink_group itself (``EXCLUDED RuntimeError``), then waits in a
barrier until the survivors leave (``LEFT <error class>``).

second: rank 3 kills itself; ranks 0, 1 and 2 shrink the default group without it, and
rank 2 SIGKILLs itself inside its shrink at WHEN (``offer`` or ``forming``, as in
tests/shrink_death_worker.py): ``SECOND <error class> <its rank attribute> <seconds>``.

abort: rank 1 SIGSTOPs itself while rank 0 has a receive from it in flight; rank 0's
``abort()`` of the group returns without waiting for the frozen peer: ``ABORT <seconds>
<error class of the receive>``.
"""

from __future__ import annotations

import hashlib
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import SHRINK_ABORT, SHRINK_DEFAULT


def say(line: str) -> None:
    os.write(1, f"{line}\n".encode())


def results(group: dist.ProcessGroup | None) -> str:
    """A digest of an all_reduce (two sizes), an all_gather and a reduce_scatter."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    g = torch.Generator().manual_seed(100 + rank)
    out = []
    for n in (7, 100_003):
        t = torch.randn(n, generator=g) * 10.0 ** (rank % 4)
        dist.all_reduce(t, group=group)
        out.append(t)
    x = torch.randn(12, generator=g)
    parts = [torch.empty(12) for _ in range(size)]
    dist.all_gather(parts, x, group=group)
    out += parts
    y = torch.randn(size * 5, generator=g)
    part = torch.empty(5)
    dist.reduce_scatter(part, list(y.chunk(size)), group=group)
    out.append(part)
    return hashlib.sha256(b"".join(t.numpy().tobytes() for t in out)).hexdigest()[:16]


def bad_inputs() -> None:
    me, size = dist.get_rank(), dist.get_world_size()
    for ranks in ([], [size], [-1], [1, 1], list(range(size))):
        try:
            dist.shrink_group(ranks)
        except ValueError:
            continue
        raise AssertionError(f"shrink_group({ranks}) did not raise ValueError")
    try:
        dist.shrink_group([me])
    except RuntimeError as exc:
        assert "exclusion list" in str(exc), exc
    else:
        raise AssertionError("an excluded rank's shrink_group did not raise")
    say("BAD ok")


def identical() -> None:
    me = dist.get_rank()
    bad_inputs()
    fresh = dist.new_group([0, 1, 2])  # every rank calls new_group, as torch requires
    if me != 3:
        say(f"FRESH {results(fresh)}")
    dist.barrier()
    if me == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        dist.barrier()
    except RuntimeError as exc:
        say(f"CAUGHT {type(exc).__name__}")
    dist.shrink_group([3])
    assert dist.get_world_size() == 3 and dist.get_rank() == me
    say(f"SHRUNK {results(None)}")
    dist.destroy_process_group()


def inflight(flag: str) -> None:
    me = dist.get_rank()
    if me == 2:
        try:
            dist.shrink_group([2])
        except RuntimeError:
            say("EXCLUDED RuntimeError")
        try:
            dist.barrier()  # ends when the survivors leave the old group
        except RuntimeError as exc:
            say(f"LEFT {type(exc).__name__}")
        os._exit(0)  # the old group is broken: nothing to close gracefully
    t = torch.zeros(4)
    work = dist.irecv(t, src=1, tag=5) if me == 0 else None  # rank 1 never sends it
    dist.shrink_group([2], shrink_flags=SHRINK_ABORT if flag == "abort" else SHRINK_DEFAULT)
    if work is not None:
        try:
            work.wait()
            say("INFLIGHT completed")
        except RuntimeError as exc:
            say(f"INFLIGHT {type(exc).__name__} {str(exc).splitlines()[0][:120]}")
    t = torch.ones(2) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    say(f"SUM {t[0].item():g} SIZE {dist.get_world_size()}")
    dist.destroy_process_group()


def abort() -> None:
    t = torch.zeros(3)
    dist.all_reduce(t)  # both ranks are there
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # the test kills it
    work = dist.irecv(t, src=1, tag=3)
    started = time.perf_counter()
    dist.group.WORLD.abort()  # type: ignore[union-attr]
    took = time.perf_counter() - started
    try:
        work.wait()
        say(f"ABORT {took:.3f} completed")
    except RuntimeError as exc:
        say(f"ABORT {took:.3f} {type(exc).__name__}")
    os._exit(0)


def second(when: str) -> None:
    me = dist.get_rank()
    dist.barrier()
    if me == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        dist.barrier()
    except RuntimeError:
        pass  # rank 3 is lost
    if me == 2:  # its own shrink's step replaced, in this process only: an exact moment
        from p2pcoll.session import shrink as shrinking

        def die(*args: object, **kwargs: object) -> None:
            os.kill(os.getpid(), signal.SIGKILL)

        setattr(shrinking, "_exchange" if when == "offer" else "handshake", die)
    started = time.monotonic()
    try:
        dist.shrink_group([3])
        say("SECOND none")
    except Exception as exc:  # whatever it is: the test says what it should be
        say(f"SECOND {type(exc).__name__} {getattr(exc, 'rank', None)} "
            f"{time.monotonic() - started:.2f} {str(exc).splitlines()[0][:200]}")
    os._exit(0)  # the old group is broken: nothing to close gracefully


def main() -> None:
    dist.init_process_group("p2pcoll")
    if sys.argv[1] == "identical":
        identical()
    elif sys.argv[1] == "abort":
        abort()
    elif sys.argv[1] == "second":
        second(sys.argv[2])
    else:
        inflight(sys.argv[2])


if __name__ == "__main__":
    main()
