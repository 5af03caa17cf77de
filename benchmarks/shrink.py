"""How long DDP survivors take to get a working group after a rank is SIGKILLed: torch's
``dist.shrink_group`` on "p2pcoll" against ``destroy_process_group`` and a new
``init_process_group`` through a store.

    python benchmarks/shrink.py                       # 8 ranks, 5 worlds per way
    python benchmarks/shrink.py -n 4 --runs 3

Not a test: it prints a markdown table. Each world is ``-n`` processes of this script
training a small model with DDP; at step 3 the last rank SIGKILLs itself. Every survivor
catches DDP's error, then, timed from there:

- ``shrink``: ``dist.shrink_group(pg.lost_ranks())`` (the survivors' new default group is
  formed from the old roster, over the old links);
- ``reinit``: ``dist.destroy_process_group()``, then ``init_process_group("p2pcoll")`` of the
  survivors through a new TCPStore (hosted by the lowest survivor, on a port given in
  advance), as a job without shrink restarts its group in-process.

Both end with one ``all_reduce`` on the new group (so "working" is measured), and each
world's figure is its slowest survivor's. The table gives the median over worlds.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import time

KILL_AT = 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def world(n: int, way: str) -> list[float]:
    """One world of ``n`` ranks; each survivor's seconds to a working group."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("P2PCOLL_")}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(n),
               SHRINK_BENCH_PORT=str(free_port()), P2PCOLL_HEARTBEAT_TIMEOUT="10")
    procs = [subprocess.Popen([sys.executable, __file__, "--rank-of", way],
                              env={**env, "RANK": str(r)}, stdout=subprocess.PIPE, text=True)
             for r in range(n)]
    seconds = []
    for p in procs:
        out, _ = p.communicate(timeout=600)
        seconds += [float(line.split()[1]) for line in out.splitlines()
                    if line.startswith("SECONDS")]
    if len(seconds) != n - 1:
        raise RuntimeError(f"{way}: {len(seconds)} survivors of {n - 1} reported")
    return seconds


def rank_main(way: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("p2pcoll")
    me, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(),
                                torch.nn.Linear(256, 1))
    ddp = DDP(model)
    for step in range(KILL_AT + 1):
        if me == n - 1 and step == KILL_AT:
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            ddp(torch.randn(32, 64)).sum().backward()
        except RuntimeError:
            break
    else:
        raise SystemExit("no rank was lost")
    started = time.perf_counter()
    if way == "shrink":
        dist.shrink_group(dist.group.WORLD.lost_ranks())  # type: ignore[union-attr]
    else:
        dist.destroy_process_group()
        store = dist.TCPStore("127.0.0.1", int(os.environ["SHRINK_BENCH_PORT"]), n - 1,
                              is_master=me == 0, timeout=__import__("datetime").timedelta(60))
        dist.init_process_group("p2pcoll", store=store, rank=me, world_size=n - 1)
    t = torch.ones(8)
    dist.all_reduce(t)
    took = time.perf_counter() - started
    assert t[0].item() == n - 1
    os.write(1, f"SECONDS {took:.6f}\n".encode())
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-n", type=int, default=8)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--rank-of", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_of is not None:
        rank_main(args.rank_of)
        return
    slowest: dict[str, list[float]] = {"shrink": [], "reinit": []}
    for _ in range(args.runs):  # interleaved, so that load affects both alike
        for way in slowest:
            slowest[way].append(max(world(args.n, way)))
    load = os.getloadavg()[0]
    print(f"| {args.n} ranks, one SIGKILLed | median s (slowest survivor) | runs (s) |")
    print("|---|---|---|")
    for way, label in (("shrink", "dist.shrink_group"),
                       ("reinit", "destroy_process_group + init through a store")):
        runs = ", ".join(f"{s:.3f}" for s in slowest[way])
        print(f"| {label} | {statistics.median(slowest[way]):.3f} | {runs} |")
    print(f"\nload average at the end: {load:.1f}")


if __name__ == "__main__":
    main()
