"""The time per message of allreduce over the in-memory transport, against the world size.

    python benchmarks/scale_memory.py                    # p = 16, 64, 256, 1024
    python benchmarks/scale_memory.py --sizes 16 256 --strategies ring --calls 3

``memory_groups(p)`` forms p groups in this process (no sockets); each strategy runs a
4 KiB float32 allreduce once to build its programs, then ``--calls`` more are timed. The
messages are the data messages every rank sent (``stats()['messages_sent']``, summed), so
the time per message is wall time over messages: every message costs one turn of the one
event loop here, so it stays flat in p when nothing does O(p) work per message. The ratio
is to the same strategy's time per message at the smallest size; the CPU time (this
process's) is printed beside the wall time, as it is less disturbed by other work on the
machine. Also printed: the time to form the p groups, and the process's peak resident set
after each size (what p ranks' groups and compiled programs take: a ring's 2(p-1) steps per
rank). The machine's load changes the figures (this is one core's work); run the sizes
more than once when they matter.

``--peers N`` is the control: at each size p it runs N // p separate groups of p at once
(all in this process, every call of each), so that every size has N peers in the process.
What then still grows with p is the group's size; what grew without it was the number of
peers one process simulates (each message touches its receiver's state; a thousand peers'
state does not stay in the CPU's caches, sixteen peers' does).
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import time

import numpy as np

from p2pcoll.testing import memory_groups

STRATEGIES = ("ring", "recursive_doubling", "rabenseifner", "reduce_broadcast", "gloo_ring")


async def measure(p: int, strategies: list[str], calls: int, nelem: int,
                  copies: int = 1) -> dict[str, tuple[float, float, int]]:
    """(wall and CPU seconds per call, messages per call) of each strategy at world size ``p``,
    with ``copies`` groups of ``p`` calling at once (their messages summed)."""
    started = time.perf_counter()
    groups = [g for _ in range(copies)
              for g in await memory_groups(p, collective_timeout=600.0)]
    print(f"p = {p}{f' x {copies} groups' if copies > 1 else ''}: formed in "
          f"{time.perf_counter() - started:.2f} s", flush=True)
    data = [np.full(nelem, r + 1, np.float32) for r in range(p)]
    expected = np.full(nelem, p * (p + 1) / 2, np.float32)
    results: dict[str, tuple[float, float, int]] = {}
    try:
        for name in strategies:
            async def once(name: str = name) -> None:
                outs = await asyncio.gather(*(g.allreduce(data[g.rank], strategy=name)
                                              for g in groups))
                for out in outs:
                    np.testing.assert_array_equal(out, expected)

            await once()  # builds the programs
            sent = sum(g.stats()["messages_sent"] for g in groups)
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(calls):
                await once()
            seconds = (time.perf_counter() - t0) / calls
            cpu = (time.process_time() - c0) / calls
            messages = (sum(g.stats()["messages_sent"] for g in groups) - sent) // calls
            results[name] = (seconds, cpu, messages)
    finally:
        await asyncio.gather(*(g.close() for g in groups))
    return results


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[16, 64, 256, 1024])
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES))
    parser.add_argument("--calls", type=int, default=2, help="timed calls per strategy")
    parser.add_argument("--bytes", type=int, default=4096, help="allreduce size (float32)")
    parser.add_argument("--peers", type=int, default=0,
                        help="peers in the process at every size: N // p groups of p at once")
    args = parser.parse_args()
    table: dict[int, dict[str, tuple[float, float, int]]] = {}
    for p in args.sizes:
        copies = max(1, args.peers // p)
        table[p] = await measure(p, args.strategies, args.calls, max(1, args.bytes // 4),
                                 copies)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
        print(f"p = {p}: peak RSS so far {peak:.0f} MiB", flush=True)
    print()
    print(f"{'strategy':20} {'p':>5} {'seconds':>9} {'messages':>9} {'us/message':>11} "
          f"{'ratio':>6} {'cpu us/msg':>11} {'ratio':>6}")
    for name in args.strategies:
        base = cpu_base = None
        for p in args.sizes:
            seconds, cpu, messages = table[p][name]
            per, cpu_per = (seconds / max(messages, 1) * 1e6, cpu / max(messages, 1) * 1e6)
            base = base if base is not None else per
            cpu_base = cpu_base if cpu_base is not None else cpu_per
            print(f"{name:20} {p:5d} {seconds:9.3f} {messages:9d} {per:11.1f} "
                  f"{per / base:6.2f} {cpu_per:11.1f} {cpu_per / cpu_base:6.2f}")


if __name__ == "__main__":
    asyncio.run(main())
