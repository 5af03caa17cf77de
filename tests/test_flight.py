"""The flight recorder (p2pcoll.session.flight) over in-memory groups, and the analysis of
``p2pcoll flight`` (p2pcoll.flight) over records written here: no processes."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from p2pcoll import CollectiveMismatch, GroupBroken, P2PCollError, PeerLost, SettingsError
from p2pcoll.cli import main
from p2pcoll.flight import MAX_FILE_BYTES, Loaded, RankFile, analyse, load, report
from p2pcoll.session.flight import FORMAT, VERSION, Recorder
from p2pcoll.settings import Settings
from p2pcoll.testing import MemoryNetwork, memory_groups, run_virtual
from p2pcoll.types import OpKey

KEYS = ["seq", "collective", "strategy", "bytes", "dtype", "shapes", "state", "started",
        "ended", "waiting_for"]


def entry(seq: int, collective: str = "allreduce", state: str = "done", nbytes: int = 16,
          dtype: str = "float32", waiting: list[int] | None = None,
          shapes: list[list[int]] | None = None) -> dict[str, Any]:
    """An entry; without ``shapes`` as files written before shapes were recorded."""
    e = {"seq": seq, "collective": collective, "strategy": "ring", "bytes": nbytes,
         "dtype": dtype, "state": state, "started": 1.0 + seq,
         "ended": None if state == "running" else 1.5 + seq, "waiting_for": waiting or []}
    if shapes is not None:
        e["shapes"] = shapes
    return e


def write_rank(folder: Path, rank: int, record: list[dict[str, Any]], world: int = 3,
               group: str = "g") -> None:
    (folder / f"rank-{rank}.json").write_text(json.dumps(
        {"format": FORMAT, "version": VERSION, "rank": rank, "world_size": world,
         "group": group, "reason": "test", "written": 2.0, "record": record}))


# --- the analysis, pure ------------------------------------------------------------------


def test_the_first_collective_the_ranks_differ_in_is_named(tmp_path: Path) -> None:
    for r in range(3):
        mine = ("broadcast", 0, "") if r == 1 else ("allreduce", 16, "float32")
        write_rank(tmp_path, r, [entry(0), entry(1), entry(2, mine[0], "failed", mine[1],
                                                          mine[2], [] if r == 1 else [1])])
    a = analyse(load(str(tmp_path)))
    assert a is not None
    assert a.first_difference == 2
    assert a.at_difference == {0: "allreduce 16 bytes float32 (failed)",
                               1: "broadcast (failed)",
                               2: "allreduce 16 bytes float32 (failed)"}
    assert a.waited_for == [1] and a.missing == [] and a.bad == {}
    text = report(str(tmp_path), a)
    assert "first difference: collective #2" in text and "everyone waits for rank 1" in text


def test_a_difference_in_bytes_or_dtype_counts(tmp_path: Path) -> None:
    write_rank(tmp_path, 0, [entry(0), entry(1, nbytes=32)], world=2)
    write_rank(tmp_path, 1, [entry(0), entry(1, nbytes=16)], world=2)
    a = analyse(load(str(tmp_path)))
    assert a is not None and a.first_difference == 1
    for r in range(2):
        write_rank(tmp_path, r, [entry(0, dtype="float32" if r else "float64")], world=2)
    a = analyse(load(str(tmp_path)))
    assert a is not None and a.first_difference == 0


def test_equal_bytes_in_other_shapes_differ_and_the_shapes_are_shown(tmp_path: Path) -> None:
    write_rank(tmp_path, 0, [entry(0, shapes=[[4]]), entry(1, nbytes=128, shapes=[[4, 8]])],
               world=2)
    write_rank(tmp_path, 1, [entry(0, shapes=[[4]]), entry(1, nbytes=128, shapes=[[8, 4]])],
               world=2)
    a = analyse(load(str(tmp_path)))
    assert a is not None and a.first_difference == 1
    assert a.at_difference == {0: "allreduce 128 bytes float32 shape [4, 8] (done)",
                               1: "allreduce 128 bytes float32 shape [8, 4] (done)"}
    # A pytree whose leaves are cut otherwise: the same bytes, other shapes; many leaves
    # are listed up to a bound.
    leaves = [[1]] * 9
    write_rank(tmp_path, 0, [entry(0, nbytes=40, shapes=[[1]] * 10)], world=2)
    write_rank(tmp_path, 1, [entry(0, nbytes=40, shapes=[*leaves, []])], world=2)
    a = analyse(load(str(tmp_path)))
    assert a is not None and a.first_difference == 0
    assert a.at_difference[0].endswith("shapes [1] [1] [1] [1] ... (10 leaves) (done)")


def test_an_alltoall_s_own_sizes_are_no_difference_but_its_dtypes_are(tmp_path: Path
                                                                     ) -> None:
    # alltoallv: each rank sends parts of its own lengths, so bytes and shapes differ by
    # rank in a call that matches; the dtypes must agree.
    write_rank(tmp_path, 0, [entry(0, "alltoall", nbytes=24, shapes=[[1, 2], [2, 2]])],
               world=2)
    write_rank(tmp_path, 1, [entry(0, "alltoall", nbytes=8, shapes=[[0, 2], [1, 2]])],
               world=2)
    a = analyse(load(str(tmp_path)))
    assert a is not None and a.first_difference is None
    write_rank(tmp_path, 1, [entry(0, "alltoall", nbytes=8, dtype="float64",
                                   shapes=[[0, 2], [1, 2]])], world=2)
    a = analyse(load(str(tmp_path)))
    assert a is not None and a.first_difference == 0


def test_a_file_without_shapes_compares_by_bytes_and_dtypes(tmp_path: Path) -> None:
    write_rank(tmp_path, 0, [entry(0, shapes=[[4]]), entry(1, shapes=[[2, 2]])], world=2)
    write_rank(tmp_path, 1, [entry(0), entry(1)], world=2)  # written before shapes were
    a = analyse(load(str(tmp_path)))
    assert a is not None and a.first_difference is None and a.bad == {}
    write_rank(tmp_path, 1, [entry(0, shapes=[[4]]), entry(1, shapes=[[-2]])], world=2)
    loaded = load(str(tmp_path))
    assert "entry 1" in loaded.bad["rank-1.json"]


def test_a_rank_one_collective_behind_has_not_started_it(tmp_path: Path) -> None:
    write_rank(tmp_path, 0, [entry(4), entry(5, state="running", waiting=[2])])
    write_rank(tmp_path, 1, [entry(4), entry(5, state="running", waiting=[0, 2])])
    write_rank(tmp_path, 2, [entry(3), entry(4)])
    a = analyse(load(str(tmp_path)))
    assert a is not None
    assert a.first_difference == 5
    assert a.at_difference[2] == "not started (its last: #4)"
    assert a.waited_for == [2]
    assert a.waits[1] == [("allreduce #5 (running)", [0, 2])]


def test_rings_that_hold_different_spans_compare_what_all_hold(tmp_path: Path) -> None:
    write_rank(tmp_path, 0, [entry(s) for s in range(0, 10)], world=2)
    write_rank(tmp_path, 1, [entry(s) for s in range(6, 10)], world=2)
    a = analyse(load(str(tmp_path)))
    assert a is not None and a.first_difference is None
    assert "the ranks agree" in report(str(tmp_path), a)


def test_a_stopped_rank_is_missing_and_waited_for(tmp_path: Path) -> None:
    for r in (0, 2, 3):
        write_rank(tmp_path, r, [entry(0), entry(1, state="failed", waiting=[1])], world=4)
    a = analyse(load(str(tmp_path)))
    assert a is not None
    assert a.missing == [1] and a.waited_for == [1] and a.first_difference is None
    text = report(str(tmp_path), a)
    assert "missing: rank 1" in text and "everyone waits for rank 1" in text


def test_missing_truncated_and_foreign_files_are_named_and_the_rest_analysed(
        tmp_path: Path) -> None:
    for r in (0, 1):
        write_rank(tmp_path, r, [entry(0), entry(1, state="running", waiting=[4])], world=6)
    whole = (tmp_path / "rank-0.json").read_text()
    (tmp_path / "rank-2.json").write_text(whole.replace('"rank":0', '"rank":2')[:40])
    (tmp_path / "rank-3.json").write_text(json.dumps({"hello": "world"}))
    write_rank(tmp_path, 5, [entry(0)], world=6, group="another")
    (tmp_path / "notes.txt").write_text("not a record")
    loaded = load(str(tmp_path))
    assert sorted(loaded.bad) == ["rank-2.json", "rank-3.json"]
    assert "truncated" in loaded.bad["rank-2.json"]
    assert "foreign" in loaded.bad["rank-3.json"]
    a = analyse(loaded)
    assert a is not None
    assert a.ranks == [0, 1] and a.missing == [2, 3, 4, 5]
    assert "of group 'another'" in a.bad["rank-5.json"]
    assert a.waited_for == [4]
    text = report(str(tmp_path), a)
    for name in ("rank-2.json", "rank-3.json", "rank-5.json"):
        assert f"left out: {name}" in text


@pytest.mark.parametrize("document, why", [
    ({"format": FORMAT, "rank": 0, "world_size": 2, "group": "g", "record": [{"seq": 0}]},
     "entry 0"),
    ({"format": FORMAT, "rank": 1, "world_size": 2, "group": "g", "record": []},
     "rank 1's record"),
    ({"format": FORMAT, "rank": 0, "world_size": "2", "group": "g", "record": []},
     "'world_size'"),
    ([1, 2, 3], "not a p2pcoll flight record"),
])
def test_a_file_that_is_not_a_rank_s_record_is_foreign(tmp_path: Path, document: object,
                                                        why: str) -> None:
    (tmp_path / "rank-0.json").write_text(json.dumps(document))
    loaded = load(str(tmp_path))
    assert why in loaded.bad["rank-0.json"] and "foreign" in loaded.bad["rank-0.json"]
    assert analyse(loaded) is None


def test_a_file_over_the_bound_is_not_read(tmp_path: Path) -> None:
    with open(tmp_path / "rank-0.json", "wb") as f:
        f.truncate(MAX_FILE_BYTES + 1)  # sparse: no disk used
    assert "larger than" in load(str(tmp_path)).bad["rank-0.json"]


def test_the_command_exits_0_when_it_could_analyse(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    write_rank(tmp_path, 0, [entry(0, state="failed", waiting=[1])], world=2)
    (tmp_path / "rank-1.json").write_text("{")
    assert main(["flight", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "everyone waits for rank 1" in out and "left out: rank-1.json: truncated" in out
    (tmp_path / "rank-0.json").unlink()
    assert main(["flight", str(tmp_path)]) == 2
    assert "no usable rank-R.json" in capsys.readouterr().err
    assert main(["flight", str(tmp_path / "nowhere")]) == 2


# --- the recorder, over in-memory groups ------------------------------------------------------


def test_the_record_lists_each_call_oldest_first_with_the_keys_named() -> None:
    async def go() -> None:
        groups = await memory_groups(2)
        x = np.arange(6, dtype=np.float32)
        for _ in range(2):
            await asyncio.gather(*(g.allreduce(x) for g in groups))
        await asyncio.gather(groups[0].broadcast(x.astype(np.int64), root=0),
                             groups[1].broadcast(None, root=0))
        await asyncio.gather(groups[0].send(x, 1, tag=3), groups[1].recv(0, tag=3))
        records = [g.flight_record() for g in groups]
        for g in groups:
            await g.close()
        for record in records:
            assert [list(e) for e in record] == [KEYS] * 4
            assert [(e["seq"], e["collective"], e["state"]) for e in record[:3]] == [
                (0, "allreduce", "done"), (1, "allreduce", "done"), (2, "broadcast", "done")]
            assert all(e["ended"] >= e["started"] and e["waiting_for"] == [] for e in record)
            assert record[0]["bytes"] == 24 and record[0]["dtype"] == "float32"
            assert record[2]["bytes"] == 48 and record[2]["dtype"] == "int64"
            assert record[0]["shapes"] == [[6]] and record[2]["shapes"] == [[6]]
            assert record[0]["strategy"] not in ("", "auto")
        assert records[0][3]["collective"] == "send" and records[1][3]["collective"] == "recv"
        assert records[1][2]["bytes"] == 48  # a receiver learns its layout: recorded at the end

    run_virtual(go())


def test_the_ring_keeps_the_last_n_and_0_turns_it_off() -> None:
    async def go(size: int) -> list[dict[str, Any]]:
        groups = await memory_groups(2, flight_record=size)
        for _ in range(7):
            await asyncio.gather(*(g.allreduce(np.ones(3)) for g in groups))
        record = groups[0].flight_record()
        for g in groups:
            await g.close()
        return record

    assert [e["seq"] for e in run_virtual(go(3))] == [4, 5, 6]
    assert run_virtual(go(0)) == []


def test_a_running_call_says_whom_it_still_waits_for() -> None:
    async def go() -> None:
        groups = await memory_groups(3)
        x = np.ones(4)
        started = [asyncio.create_task(g.allreduce(x)) for g in groups[:2]]
        await asyncio.sleep(0.1)  # virtual: ranks 0 and 1 are waiting for rank 2 by now
        files = {}
        for g in groups:
            record = g.flight_record()
            files[g.rank] = RankFile(g.rank, 3, "g", "", record)
        for r in (0, 1):
            last = files[r].record[-1]
            assert last["state"] == "running" and last["ended"] is None
            assert last["waiting_for"] and r not in last["waiting_for"]
        assert files[2].record == []
        # A ring's rank may wait for its neighbour: the waits lead to rank 2.
        a = analyse(Loaded(files))
        assert a is not None and a.waited_for == [2] and a.first_difference == 0
        assert a.at_difference[2] == "not started"
        await asyncio.gather(groups[2].allreduce(x), *started)
        assert [e["state"] for g in groups for e in g.flight_record()] == ["done"] * 3
        for g in groups:
            await g.close()

    run_virtual(go())


def test_a_failure_is_written_and_the_command_finds_the_mismatch(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    async def go() -> list[BaseException | None]:
        groups = await memory_groups(3, collective_timeout=5, flight_dir=str(tmp_path))
        x = np.ones(4, dtype=np.float32)
        await asyncio.gather(*(g.allreduce(x) for g in groups))

        async def call(g: Any) -> None:
            if g.rank == 1:
                await g.broadcast(x, root=0)
            else:
                await g.allreduce(x)
        results = await asyncio.gather(*(call(g) for g in groups), return_exceptions=True)
        while len(list(tmp_path.glob("rank-*.json"))) < 3:  # written on a worker thread
            await asyncio.sleep(0.01)
        failed = groups[0].flight_record()[-1]
        assert failed["state"] == "failed" and failed["waiting_for"] == [1]
        for g in groups:
            await g.close()
        return results

    results = run_virtual(go())
    assert all(isinstance(r, CollectiveMismatch) for r in results)
    document = json.loads((tmp_path / "rank-2.json").read_text())
    assert document["rank"] == 2 and document["world_size"] == 3
    assert "allreduce #1 failed: CollectiveMismatch" in document["reason"]
    assert main(["flight", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "first difference: collective #1" in out
    assert "rank 1: broadcast" in out
    assert "rank 0: allreduce 16 bytes float32 shape [4] (failed)" in out
    assert "everyone waits for rank 1" in out
    assert not list(tmp_path.glob("*.tmp"))


def test_a_call_in_other_shapes_is_found_by_the_command(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    async def go() -> list[BaseException | None]:
        groups = await memory_groups(2, collective_timeout=5, flight_dir=str(tmp_path))
        tree = {"w": np.ones((2, 3), np.float32), "b": np.ones(2, np.float32)}
        await asyncio.gather(*(g.allreduce(tree) for g in groups))
        record = groups[0].flight_record()
        assert record[0]["shapes"] == [[2], [2, 3]]  # leaves in the pytree's order
        # The same bytes and dtype on both ranks, in shapes (4, 8) and (8, 4).
        shapes = {0: (4, 8), 1: (8, 4)}
        results = await asyncio.gather(
            *(g.allreduce(np.ones(shapes[g.rank], np.float32)) for g in groups),
            return_exceptions=True)
        while len(list(tmp_path.glob("rank-*.json"))) < 2:  # written on a worker thread
            await asyncio.sleep(0.01)
        for g in groups:
            await g.close()
        return results

    results = run_virtual(go())
    assert all(isinstance(r, CollectiveMismatch) for r in results)
    document = json.loads((tmp_path / "rank-1.json").read_text())
    assert document["record"][-1]["shapes"] == [[8, 4]]
    assert main(["flight", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "first difference: collective #1" in out
    assert "rank 0: allreduce 128 bytes float32 shape [4, 8] (failed)" in out
    assert "rank 1: allreduce 128 bytes float32 shape [8, 4] (failed)" in out


def test_shapes_of_a_receiver_and_of_an_alltoall_are_those_it_holds() -> None:
    async def go() -> None:
        groups = await memory_groups(2)
        x = np.arange(12, dtype=np.float32).reshape(3, 4)
        await asyncio.gather(groups[0].broadcast(x, root=0), groups[1].broadcast(None, root=0))
        await asyncio.gather(groups[0].send(x, 1, tag=1), groups[1].recv(0, tag=1))
        parts = {0: [np.ones((1, 2)), np.ones((3, 2))], 1: [np.ones((0, 2)), np.ones((2, 2))]}
        await asyncio.gather(*(g.alltoall(parts[g.rank]) for g in groups))
        records = [[e["shapes"] for e in g.flight_record()] for g in groups]
        for g in groups:
            await g.close()
        assert records[0][:2] == records[1][:2] == [[[3, 4]], [[3, 4]]]
        assert records[0][-1] == [[1, 2], [3, 2]] and records[1][-1] == [[0, 2], [2, 2]]

    run_virtual(go())


def test_a_frozen_rank_is_named_by_the_survivors_records(tmp_path: Path) -> None:
    async def go() -> None:
        network = MemoryNetwork()
        groups = await memory_groups(3, network=network, heartbeat_timeout=1,
                                     flight_dir=str(tmp_path))
        network.freeze(1)
        survivors = await asyncio.gather(*(g.allreduce(np.ones(2)) for g in (groups[0],
                                                                            groups[2])),
                                         return_exceptions=True)
        assert all(isinstance(e, PeerLost) and e.rank == 1 for e in survivors)
        while not all((tmp_path / f"rank-{r}.json").exists() for r in (0, 2)):
            await asyncio.sleep(0.01)
        for g in (groups[0], groups[2]):
            await g.close()

    run_virtual(go())
    a = analyse(load(str(tmp_path)))
    assert a is not None
    assert a.ranks == [0, 2] and a.missing == [1] and a.waited_for == [1]


def test_a_group_broken_between_calls_is_written_on_its_next_call(tmp_path: Path) -> None:
    async def go() -> None:
        groups = await memory_groups(2, flight_dir=str(tmp_path))
        await asyncio.gather(*(g.allreduce(np.ones(2)) for g in groups))
        # Rank 0's broadcast is done once sent; rank 1 called allreduce, fails, aborts.
        await groups[0].broadcast(np.ones(2), root=0)
        with pytest.raises(CollectiveMismatch):
            await groups[1].allreduce(np.ones(2))
        async with asyncio.timeout(10):
            while groups[0].state.value != "broken":
                await asyncio.sleep(0.01)
        assert not (tmp_path / "rank-0.json").exists()
        with pytest.raises(P2PCollError):
            await groups[0].allreduce(np.ones(2))
        while not (tmp_path / "rank-0.json").exists():
            await asyncio.sleep(0.01)
        for g in groups:
            await g.close()

    run_virtual(go())
    document = json.loads((tmp_path / "rank-0.json").read_text())
    assert document["reason"] == "the group is broken: GroupBroken"
    assert [e["state"] for e in document["record"]] == ["done", "done"]


# --- settings ----------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["-1", "lots", "1000001", "2.5"])
def test_a_bad_record_size_is_refused_naming_the_variable(value: str) -> None:
    with pytest.raises(SettingsError, match=r"\$P2PCOLL_FLIGHT_RECORD"):
        Settings.resolve({"P2PCOLL_FLIGHT_RECORD": value})
    with pytest.raises(SettingsError, match="flight_record="):
        Settings.resolve({}, flight_record=-1)


def test_the_flight_dir_must_be_an_existing_directory(tmp_path: Path) -> None:
    assert Settings.resolve({}).flight_record == 2000
    assert Settings.resolve({"P2PCOLL_FLIGHT_RECORD": "0"}).flight_record == 0
    assert Settings.resolve({"P2PCOLL_FLIGHT_DIR": str(tmp_path)}).flight_dir == str(tmp_path)
    with pytest.raises(SettingsError, match=r"\$P2PCOLL_FLIGHT_DIR"):
        Settings.resolve({"P2PCOLL_FLIGHT_DIR": str(tmp_path / "nowhere")})
    with pytest.raises(SettingsError, match="flight_dir="):
        Settings.resolve({}, flight_dir=tmp_path / "nowhere")


def test_the_ring_keeps_the_last_calls_that_ended_and_every_running_one() -> None:
    running: list[tuple[OpKey, object, float]] = []
    recorder = Recorder(2, 0, 2, "g", lambda key: [1], lambda key: [],
                        running=lambda: running)
    what = ("allreduce", "ring", 8, "float32", ((2,),))
    # call 0 runs on while calls 1, 2 and 3 end: it is listed, whatever the ring keeps
    running.append((OpKey(0), ("recv", "auto", 0, "", ()), 1.0))
    for n in (1, 2, 3):
        recorder.record(OpKey(n), what, 1.0 + n, 1.5 + n, "board" if n == 3 else "ring")
    record = recorder.snapshot()
    assert [(e["seq"], e["state"], e["strategy"], e["waiting_for"]) for e in record] == [
        (0, "running", "auto", [1]), (2, "done", "ring", []), (3, "done", "board", [])]
    assert record[0]["ended"] is None and record[2]["ended"] > record[2]["started"]
    running.clear()  # it ends, its bytes learned: recorded in place of the oldest
    recorder.record(OpKey(0), ("recv", "auto", 16, "int64", ((1, 2),)), 1.0, 9.0, "ring")
    assert [(e["seq"], e["strategy"], e["bytes"], e["dtype"], e["shapes"])
            for e in recorder.snapshot()] == [(0, "ring", 16, "int64", [[1, 2]]),
                                               (3, "board", 8, "float32", [[2]])]


def test_a_row_taken_again_forgets_the_failure_it_held() -> None:
    recorder = Recorder(1, 0, 2, "g", lambda key: [], lambda key: [1])
    recorder.record(OpKey(0), ("allreduce", "board", 8, "float32", ((2,),)), 1.0, 2.0,
                    error=GroupBroken("broken"))
    [entry] = recorder.snapshot()
    assert (entry["seq"], entry["state"], entry["waiting_for"]) == (0, "failed", [1])
    recorder.record(OpKey(1), ("allreduce", "board", 8, "float32", ((2,),)), 3.0, 4.0)
    [entry] = recorder.snapshot()
    assert (entry["seq"], entry["state"], entry["waiting_for"]) == (1, "done", [])


def test_the_rows_hold_nothing_the_garbage_collector_keeps_following() -> None:
    """What keeps the record cheap: once collected, no row kept is tracked by the garbage
    collector (an OpKey or an object per row would be, and every later collection would
    walk 2,000 of them)."""
    import gc

    async def go() -> None:
        groups = await memory_groups(2, flight_record=50)
        for n in range(60):
            x = np.ones((2, 3), np.float32)
            await asyncio.gather(*(g.allreduce(x if n % 2 else x[0]) for g in groups))
        recorder = groups[0].session.flight
        assert recorder is not None and len(recorder.calls) == 50
        for _ in range(4):  # a collection may untrack a row's nested tuples one level a time
            gc.collect()
        assert [row for row in recorder.calls if gc.is_tracked(row)] == []
        assert [e["shapes"] for e in groups[0].flight_record()[-2:]] == [[[3]], [[2, 3]]]
        for g in groups:
            await g.close()

    run_virtual(go())
