"""The timeline: Chrome trace events of every collective and of each send, receive and
reduction in it, one file per rank, merged by ``p2pcoll launch`` and ``p2pcoll timeline``."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

import p2pcoll
from p2pcoll.engine.timeline import TRACKS, events, merge, rank_file, rank_files
from p2pcoll.testing import memory_groups, run_ranks

ROOT = Path(__file__).resolve().parents[1]

RING_JOB = textwrap.dedent("""
    import asyncio, sys
    import numpy as np
    import p2pcoll

    async def main():
        async with p2pcoll.join(strategies={"allreduce": "ring"}) as g:
            x = np.full(int(sys.argv[1]), g.rank + 1.0, dtype=np.float32)
            for _ in range(3):
                y = await g.allreduce(x)
            assert y[0] == sum(range(1, g.world_size + 1))
            await g.broadcast(x, root=0)
            if len(sys.argv) > 2 and g.rank == 1:
                import os, signal
                os.kill(os.getpid(), signal.SIGKILL)  # dies with its file open
            await g.barrier()

    asyncio.run(main())
""")


def xs(trace: list[dict], **match: object) -> list[dict]:
    return [e for e in trace if e.get("ph") == "X"
            and all(e.get(k) == v for k, v in match.items())]


def launch_job(tmp_path: Path, n: int, *args: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    job = tmp_path / "job.py"
    job.write_text(RING_JOB)
    trace = tmp_path / "trace.json"
    env = {**os.environ, "P2PCOLL_TIMELINE": str(trace)}
    done = subprocess.run(
        [sys.executable, "-m", "p2pcoll", "launch", "-n", str(n), "--", sys.executable,
         str(job), *args], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    return done, trace


@pytest.mark.processes
def test_launch_merges_one_track_per_rank_with_every_step(tmp_path: Path) -> None:
    n, elements = 4, 1 << 16  # 256 KiB: one segment per chunk
    done, trace = launch_job(tmp_path, n, str(elements))
    assert done.returncode == 0, done.stderr
    assert f"timeline of {n} ranks in {trace}" in done.stderr
    assert rank_files(trace) == [], "the rank files are removed once merged"
    merged = json.loads(trace.read_text())  # a plain JSON object, as chrome://tracing wants
    events_ = merged["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events_ if e.get("name") == "process_name"}
    assert sorted(names.values()) == [f"rank {r}" for r in range(n)]
    threads = {(e["pid"], e["args"]["name"]) for e in events_ if e.get("name") == "thread_name"}
    assert threads == {(pid, t) for pid in names for t in TRACKS}
    by_rank = {int(v.split()[1]): pid for pid, v in names.items()}
    for rank, pid in by_rank.items():
        colls = xs(events_, pid=pid, tid=0)
        assert [c["name"] for c in colls] == [
            "allreduce #0", "allreduce #1", "allreduce #2", "broadcast #3", "barrier #4"]
        assert all(c["args"]["strategy"] == "ring" for c in colls[:3])
        assert colls[0]["args"]["bytes"] == elements * 4
        first = colls[0]
        inside = [e for e in xs(events_, pid=pid) if e["tid"] != 0
                  and first["ts"] <= e["ts"] <= first["ts"] + first["dur"]]
        kinds = Counter(e["name"] for e in inside)
        # The ring: p-1 steps folding in, p-1 steps copying, one send and receive each.
        assert kinds == {"send": 2 * (n - 1), "recv": 2 * (n - 1), "reduce": n - 1,
                         "copy": n - 1}, kinds
        sends = sorted((e for e in inside if e["name"] == "send"), key=lambda e: e["ts"])
        assert [e["args"]["step"] for e in sends] == list(range(2 * (n - 1)))
        assert all(e["args"]["to"] == [(rank + 1) % n] for e in sends)
        assert all(e["args"]["bytes"] == elements for e in sends)  # a quarter of 4 B each
        recvs = [e for e in inside if e["name"] == "recv"]
        assert all(e["args"]["from"] == (rank - 1) % n for e in recvs)
        assert all(e["dur"] >= 0 for e in inside)
    # Every message's arrow starts on its sender and ends on its receiver.
    starts = {e["id"]: e["pid"] for e in events_ if e["ph"] == "s"}
    ends = {e["id"]: e["pid"] for e in events_ if e["ph"] == "f"}
    assert starts and starts.keys() == ends.keys()
    assert all(starts[i] != ends[i] for i in starts)


@pytest.mark.processes
def test_rank_killed_mid_run_leaves_a_readable_file(tmp_path: Path) -> None:
    done, trace = launch_job(tmp_path, 3, "4096", "die")
    assert done.returncode == 128 + signal.SIGKILL, done.stderr
    merged = list(events(trace))
    names = {e["pid"]: e["args"]["name"] for e in merged if e.get("name") == "process_name"}
    assert sorted(names.values()) == ["rank 0", "rank 1", "rank 2"]
    for pid, name in names.items():
        # Every rank finished these before rank 1 died (the survivors are stopped by the
        # launcher, perhaps before their barrier fails); each collective is on disk when
        # it ends, so the file of a rank killed by SIGKILL has them too.
        done_ = [e["name"] for e in xs(merged, pid=pid, tid=0)]
        assert done_[:4] == ["allreduce #0", "allreduce #1", "allreduce #2",
                             "broadcast #3"], (name, done_)
        if name == "rank 1":
            assert len(done_) == 4
        for failed in done_[4:]:
            assert failed == "barrier #4"
    failed = [e for e in xs(merged, tid=0) if e["name"] == "barrier #4"]
    assert all("PeerLost" in e["args"]["error"] for e in failed), failed


@pytest.mark.processes
def test_timeline_cli_merges_files_of_a_run_without_launch(tmp_path: Path) -> None:
    trace = tmp_path / "run.json"

    async def work(g: p2pcoll.Group) -> None:
        await g.allreduce(np.ones(10), strategy="recursive_doubling")
        await g.send(np.arange(3), (g.rank + 1) % 2, tag=7) if g.rank == 0 else \
            await g.recv(0, tag=7)

    asyncio.run(run_ranks(2, work, timeline=trace))
    files = rank_files(trace)
    assert [f.name.split("-")[-1] for f in files] == ["rank0.json", "rank1.json"]
    done = subprocess.run([sys.executable, "-m", "p2pcoll", "timeline", str(trace)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "merged 2 rank files" in done.stdout, done.stderr
    merged = list(events(trace))
    names = Counter(e["name"].split(" #")[0] for e in xs(merged, tid=0))
    assert names == {"allreduce": 2, "send": 1, "recv": 1}
    sender = next(e for e in xs(merged, tid=0) if e["name"].startswith("send"))
    assert sender["args"]["tag"] == 7 and sender["args"]["peer"] == 1
    again = subprocess.run([sys.executable, "-m", "p2pcoll", "timeline", str(trace)],
                           capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and "no rank files for" in again.stderr


def test_two_groups_of_one_process_get_their_own_tracks(tmp_path: Path) -> None:
    trace = tmp_path / "t.json"

    async def main() -> None:
        for _ in range(2):  # a second group right after the first
            groups = await memory_groups(2, timeline=str(trace))
            await asyncio.gather(*(g.allreduce(np.ones(4)) for g in groups))
            await asyncio.gather(*(g.close() for g in groups))
            await asyncio.sleep(0.01)

    asyncio.run(main())
    # memory groups of one network share an id; two networks, two ids
    files = rank_files(trace)
    assert len(files) == 4, files
    assert merge(trace) == 4
    labels = sorted(e["args"]["name"] for e in events(trace) if e.get("name") == "process_name")
    assert len(labels) == 4 and all("(group " in label for label in labels), labels


def test_bad_timeline_paths_are_settings_errors(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "trace.json"
    with pytest.raises(p2pcoll.SettingsError, match=r"\$P2PCOLL_TIMELINE=.*does not exist"):
        p2pcoll.Settings.resolve({"P2PCOLL_TIMELINE": str(missing)})
    with pytest.raises(p2pcoll.SettingsError, match=r"timeline=.*does not exist"):
        p2pcoll.join(world_size=1, timeline=missing)
    with pytest.raises(p2pcoll.SettingsError, match="is not a file path"):
        p2pcoll.Settings.resolve({"P2PCOLL_TIMELINE": str(tmp_path) + "/.."})
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    if os.geteuid() != 0:  # root may write anywhere
        with pytest.raises(p2pcoll.SettingsError, match="not writable"):
            p2pcoll.Settings.resolve({"P2PCOLL_TIMELINE": str(locked / "t.json")})


def test_no_timeline_no_files_and_a_group_of_one_writes_one(tmp_path: Path) -> None:
    async def main(**kw: object) -> None:
        async with p2pcoll.join(world_size=1, **kw) as g:
            await g.allreduce(np.ones(3))

    asyncio.run(main())
    assert list(tmp_path.iterdir()) == []
    trace = tmp_path / "solo.json"
    asyncio.run(main(timeline=trace))
    (only,) = rank_files(trace)
    assert only.name.endswith("-rank0.json")
    recorded = list(events(only))
    assert [e["name"] for e in xs(recorded, tid=0)] == ["allreduce #0"]


def test_a_rank_file_cut_anywhere_still_merges(tmp_path: Path) -> None:
    trace = tmp_path / "cut.json"
    path = rank_file(trace, "abcdef0123", 0)
    lines = [json.dumps({"ph": "M", "name": "process_name", "pid": 9, "tid": 0,
                         "args": {"name": "rank 0", "group": "abcdef0123", "rank": 0}}),
             json.dumps({"ph": "X", "name": "allreduce #0", "pid": 9, "tid": 0, "ts": 1.0,
                         "dur": 2.0, "args": {"seq": 0}})]
    path.write_text("[\n" + ",\n".join(lines) + ",")  # a batch's separator, then death
    assert merge(trace) == 1
    (coll,) = xs(list(events(trace)), tid=0)
    assert coll["name"] == "allreduce #0" and coll["pid"] == 1
    bad = rank_file(trace, "abcdef0123", 1)
    bad.write_text("not json")
    with pytest.raises(ValueError, match="is not a p2pcoll timeline"):
        merge(trace, [bad])
