"""256 peers as tasks of one process over ``transport="inproc"`` (real ZeroMQ sockets, the
real rendezvous, the sparse mesh), under a soft limit of 4,096 open files: every
collective right on every rank, and the join time printed (``pytest -s``; the issue's
target is 5 s, but speed is the benchmarks' business, so it is not asserted).

Without a bound, the roots of gather and scatter link to every peer and a peer of
recursive doubling, Rabenseifner and the dissemination barrier to about 3 log2 p others:
some 6,400 descriptors in all, over the limit. With ``P2PCOLL_MAX_LINKS=8`` a peer keeps at
most 8 links open (checked after every collective: ``links_opened - links_closed``), closing
the least recently used one and opening it again when needed, and the whole group fits.

Each rank closes its group as soon as it has finished, while the others still run their
collectives: leaving opens no link (the goodbye goes on the links a peer has, the farewell
comes back on the same connection, see ``Transport.leaving`` and ``Transport.answer``), so
closing competes with nobody for descriptors. The most descriptors the process held,
sampled from the join to the last close, stay under the limit, every rank closes, and none
opens a link while closing; the time from the first rank that closed to the last, and the
goodbyes left unanswered (sent to a peer that had closed already), are printed.

The peers run in a child process, so that its descriptor limit is its own and nothing it
leaves behind outlives the test. It prints one JSON line of results.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow

P = 256
NOFILE = 4096
MAX_LINKS = 8

CHILD = textwrap.dedent("""
    import asyncio, json, os, resource, sys, time
    import numpy as np
    import p2pcoll
    from p2pcoll.testing import run_ranks

    P, NOFILE = int(sys.argv[1]), int(sys.argv[2])
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, hard))
    joined = []
    fds = []  # descriptors of the process, before and after the barrier
    reached = {}  # rank -> the last collective it finished (told if the run fails)
    most_links = [0]  # the most links any peer held open after a collective
    closed = [0]  # links closed for the budget, in all
    opened_closing = [0]  # the most links a peer opened while closing its group
    fds_at = {}  # collective -> the most descriptors the process held when a rank finished it

    def note(g, name):
        stats = g.stats()
        most_links[0] = max(most_links[0], stats["links_opened"] - stats["links_closed"])
        reached[g.rank] = name
        fds_at[name] = max(fds_at.get(name, 0), len(os.listdir("/proc/self/fd")))

    finished_at = []  # when each rank finished and closed its group
    unanswered = {}  # rank -> the peers that did not answer its goodbye

    async def every_collective(g):
        joined.append(time.monotonic())
        n, r = g.world_size, g.rank
        x = np.arange(13, dtype=np.int64) + r
        total = sum(np.arange(13, dtype=np.int64) + q for q in range(n))
        checked = []
        for name in ("recursive_doubling", "rabenseifner", None):
            out = await g.allreduce(x, strategy=name)
            assert (out == total).all(), (name, out)
            checked.append(f"allreduce/{name or 'auto'}")
            note(g, checked[-1])
        red = await g.reduce(x, root=n - 1)
        assert red is None if r != n - 1 else (red == total).all()
        checked.append("reduce")
        note(g, "reduce")
        got = await g.broadcast(np.arange(5) * 3 if r == 7 else None, root=7)
        assert (got == np.arange(5) * 3).all()
        checked.append("broadcast")
        note(g, "broadcast")
        parts = await g.allgather(np.array([r, -r]))
        assert all((p == [q, -q]).all() for q, p in enumerate(parts))
        checked.append("allgather")
        note(g, "allgather")
        rows = np.stack([np.arange(n) + r] * 2, axis=1)  # (n, 2)
        part = await g.reduce_scatter(rows)
        whole = sum(np.stack([np.arange(n) + q] * 2, axis=1) for q in range(n))
        assert (part == np.array_split(whole, n, axis=0)[r]).all()
        checked.append("reduce_scatter")
        note(g, "reduce_scatter")
        gathered = await g.gather(np.array([r * 2]), root=3)
        if r == 3:
            assert [int(a[0]) for a in gathered] == [2 * q for q in range(n)]
        else:
            assert gathered is None
        checked.append("gather")
        note(g, "gather")
        mine = await g.scatter([np.array([q + 100]) for q in range(n)] if r == 5 else None,
                               root=5)
        assert int(mine[0]) == r + 100
        checked.append("scatter")
        note(g, "scatter")
        fds.append(len(os.listdir("/proc/self/fd")))
        await g.barrier()
        checked.append("barrier")
        fds.append(len(os.listdir("/proc/self/fd")))
        note(g, "barrier")
        stats = g.stats()
        closed[0] += stats["links_closed"]
        # Close at once, the others still running: leaving opens no link.
        session = g.session
        finished_at.append(time.monotonic())
        await g.close()
        unanswered[r] = sorted(session.unanswered())
        opened_closing[0] = max(opened_closing[0],
                                session.transport.counters.links_opened - stats["links_opened"])
        return checked

    peak = [0]  # the most descriptors seen, sampled, from the join to the last close

    def sample():
        while True:
            try:
                peak[0] = max(peak[0], len(os.listdir("/proc/self/fd")))
            except OSError:  # out of descriptors: the listing itself needs one
                peak[0] = NOFILE
            time.sleep(0.02)

    async def main():
        import threading
        threading.Thread(target=sample, daemon=True).start()
        start = time.monotonic()
        try:
            results = await run_ranks(P, every_collective, transport="inproc",
                                      join_timeout=120)
        except BaseException:
            import collections
            print("last finished:", collections.Counter(reached.values()),
                  f"joined {len(joined)}, descriptors {max(fds, default=0)}, by call {fds_at}",
                  file=sys.stderr)
            raise
        closing = time.monotonic() - min(finished_at)
        print(json.dumps({"unanswered": {r: u for r, u in unanswered.items() if u},
                          "closes": len(unanswered), "opened_closing": opened_closing[0],
                          "join": max(joined) - start, "checked": results[0],
                          "closing": closing, "peak": peak[0],
                          "all": all(r == results[0] for r in results),
                          "seconds": time.monotonic() - start, "fds": max(fds),
                          "most_links": most_links[0], "closed": closed[0],
                          "fds_at": fds_at}))

    asyncio.run(main())
""")


@pytest.mark.scale
def test_two_hundred_fifty_six_inproc_peers_under_4096_descriptors() -> None:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("P2PCOLL_") and k not in ("RANK", "WORLD_SIZE")}
    env["P2PCOLL_MAX_LINKS"] = str(MAX_LINKS)
    proc = subprocess.run([sys.executable, "-c", CHILD, str(P), str(NOFILE)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"\n{P} inproc peers under ulimit -n {NOFILE}, P2PCOLL_MAX_LINKS={MAX_LINKS}: joined "
          f"in {result['join']:.2f} s, every collective in {result['seconds']:.1f} s in all, "
          f"{result['fds']} descriptors, at most {result['most_links']} links a peer, "
          f"{result['closed']} closed for the budget; descriptors by call {result['fds_at']}; "
          f"closing the groups (each as its rank finished) took {result['closing']:.1f} s from "
          f"the first, with up to {result['peak']} descriptors (sampled) in the whole run")
    assert result["all"], "the ranks ran different collectives"
    assert result["checked"] == [
        "allreduce/recursive_doubling", "allreduce/rabenseifner", "allreduce/auto", "reduce",
        "broadcast", "allgather", "reduce_scatter", "gather", "scatter", "barrier"]
    assert result["most_links"] <= MAX_LINKS, result
    assert result["closed"] > 0, result  # the budget was needed
    assert result["peak"] < NOFILE, result
    assert result["closes"] == P, result  # every rank closed its group
    # A goodbye to a peer that closed first stays unanswered when this peer's link to it
    # was opened after that peer's goodbye went out (news of another departure posted to
    # it): printed, not asserted; the close still completes at its deadline.
    print(f"goodbyes unanswered: {sum(map(len, result['unanswered'].values()))}")
    assert result["opened_closing"] == 0, result  # leaving opens no link
