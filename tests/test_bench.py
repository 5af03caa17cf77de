"""Smoke tests of ``p2pcoll bench``: real peer processes, tiny sizes, a table and JSON out;
the side-by-side comparison with Gloo (torch is installed in CI) and the plot; the package
``p2pcoll.bench`` is loaded only by that command, and its workers run as modules."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from p2pcoll import available_strategies
from p2pcoll.bench import bus_factor, configure_parser, data_bytes, main, parse_sizes
from p2pcoll.bench.load import cpu_load

ROW_FIELDS = {
    "size", "count", "dtype", "strategy", "chosen", "time_us", "min_us", "p10_us", "p90_us", "p99_us",
    "algbw_gbps", "busbw_gbps", "pipelined_us", "library", "rss_peak_bytes", "cpu_us",
}


def run_bench(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "p2pcoll.bench", *args],
        capture_output=True, text=True, timeout=90, check=False,
    )
    assert done.returncode == 0, f"bench failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
    return done.stdout


def table_rows(text: str) -> list[list[str]]:
    return [line.split() for line in text.splitlines() if line.strip() and not line.startswith("#")]


def test_parse_sizes_and_factors() -> None:
    assert parse_sizes("4K,64K, 1M,2G,100") == [4096, 65536, 1 << 20, 2 << 30, 100]
    assert parse_sizes("1KiB,3MB") == [1024, 3 << 20]
    assert bus_factor("allreduce", 4) == 1.5
    assert bus_factor("allgather", 4) == bus_factor("reduce_scatter", 4) == 0.75
    assert bus_factor("broadcast", 4) == bus_factor("reduce", 4) == 1.0
    assert data_bytes("allgather", 100, 4) == 400 and data_bytes("allreduce", 100, 4) == 100


def test_bad_sizes_are_usage_errors() -> None:
    for text, says in (("4K,4X", "'4X' is not a byte count"), (" , ", "no sizes given")):
        with pytest.raises(argparse.ArgumentTypeError, match=says):
            parse_sizes(text)


def test_import_p2pcoll_does_not_load_the_bench() -> None:
    code = ("import sys, p2pcoll, p2pcoll.cli\n"
            "assert p2pcoll.cli.main(['strategies']) == 0\n"
            "assert 'p2pcoll.bench' not in sys.modules, 'p2pcoll.bench was imported'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=30, check=False)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("module", ["p2pcoll.bench", "p2pcoll.bench.worker",
                                    "p2pcoll.bench.gloo", "p2pcoll.bench.mpi"])
def test_modules_run_with_python_m(module: str) -> None:
    done = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True,
                          text=True, timeout=30, check=False)
    assert done.returncode == 0 and done.stderr == ""  # no runpy warning either
    assert done.stdout.startswith(f"usage: python -m {module} ")


@pytest.mark.processes
def test_allreduce_every_strategy_table_and_json(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    text = run_bench("-n", "2", "--strategy", "all", "--sizes", "1K,8K", "--iters", "3",
                     "--warmup", "1", "--pipelined", "2", "--json", str(out))

    header = " ".join(line for line in text.splitlines() if line.startswith("#"))
    for column in ("size", "count", "type", "strategy", "time", "cpu", "p10-p90", "p99",
                   "algbw", "busbw", "pipelined"):
        assert column in header
    strategies = available_strategies()["allreduce"]
    rows = table_rows(text)
    assert [(r[0], r[3]) for r in rows] == [(s, name) for name in strategies
                                             for s in ("1K", "8K")]
    for r in rows:
        assert r[1] == str(int(r[0][:-1]) * 1024 // 4) and r[2] == "float32"
        time_us, cpu_us, min_us = float(r[4]), float(r[5]), float(r[6])
        p10, p90 = (float(v) for v in r[7].split("-"))
        p99 = float(r[8])
        algbw, busbw, pipelined = float(r[9]), float(r[10]), float(r[11])
        assert 0 < min_us <= p10 <= time_us <= p90 <= p99
        assert cpu_us > 0  # a call runs some Python, at least
        # algbw = S / time (GB = 1e9 bytes), within the rounding of the printed time (to
        # 0.1 us) and algbw (to 4 decimals); busbw = algbw as 2(p-1)/p = 1 at p = 2.
        expected = int(r[0][:-1]) * 1024 / time_us / 1e3
        assert abs(algbw - expected) <= 5e-5 + expected * 1e-3, (algbw, expected)
        assert busbw == algbw
        assert pipelined > 0
        assert 10 < int(r[12]) < 1000  # peak RSS of a peer, MiB

    doc = json.loads(out.read_text())
    assert doc["config"]["world_size"] == 2 and doc["config"]["strategies"] == strategies
    assert len(doc["rows"]) == len(rows)
    for row, cells in zip(doc["rows"], rows, strict=True):
        assert ROW_FIELDS <= row.keys()
        assert row["strategy"] == cells[3] and row["iters"] == 3
        assert row["time_us"] == pytest.approx(float(cells[4]), rel=1e-3, abs=0.051)
        assert row["cpu_us"] == pytest.approx(float(cells[5]), rel=1e-3, abs=0.051)
        assert row["algbw_gbps"] == pytest.approx(row["size"] / row["time_us"] / 1e3)
        assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"])


@pytest.mark.processes
def test_allgather_three_peers_auto() -> None:
    text = run_bench("--collective", "allgather", "-n", "3", "--sizes", "4K", "--iters", "3",
                     "--warmup", "0", "--json", "-")
    doc = json.loads(text)
    (row,) = doc["rows"]
    assert row["strategy"] == "auto" and row["chosen"] in available_strategies()["allgather"]
    # nccl-tests counts the gathered bytes: 3 parts of 4 KiB; busbw = algbw * 2/3.
    assert row["algbw_gbps"] == pytest.approx(3 * 4096 / row["time_us"] / 1e3)
    assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"] * 2 / 3)


def test_unknown_strategy_is_refused_before_starting_peers() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "p2pcoll.bench", "--strategy", "nope", "--sizes", "1K"],
        capture_output=True, text=True, timeout=30, check=False,
    )
    assert done.returncode == 2
    assert "no allreduce strategy named 'nope'" in done.stderr and "ring" in done.stderr


BENCH = "pip install 'p2pcoll[bench]'"


def parse(*argv: str) -> argparse.Namespace:
    # The way `p2pcoll bench` parses its options.
    parser = argparse.ArgumentParser()
    configure_parser(parser)
    return parser.parse_args(argv)


def test_transport_defaults_to_the_environment_which_is_checked(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.delenv("P2PCOLL_TRANSPORT", raising=False)
    assert parse().transport == "auto"
    monkeypatch.setenv("P2PCOLL_TRANSPORT", " tcp ")
    assert parse().transport == "tcp"
    monkeypatch.setenv("P2PCOLL_TRANSPORT", "bogus")
    assert parse("--transport", "ipc").transport == "ipc"  # the variable is not needed
    with pytest.raises(SystemExit) as exc:
        parse()
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "$P2PCOLL_TRANSPORT='bogus' is not allowed" in err and "auto, tcp, ipc" in err


def test_main_inproc_through_configure_parser(capsys: pytest.CaptureFixture[str]) -> None:
    # inproc peers are tasks in this process.
    args = parse("--collective", "reduce_scatter", "-n", "3", "--sizes", "96K",
                 "--iters", "3", "--warmup", "1", "--transport", "inproc")
    assert main(args) == 0
    rows = table_rows(capsys.readouterr().out)
    assert len(rows) == 1 and rows[0][:3] == ["96K", str(96 * 1024 // 4), "float32"]
    assert rows[0][3].startswith("auto:")


@pytest.mark.processes
def test_compare_gloo_side_by_side(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    text = run_bench("-n", "2", "--strategy", "ring,recursive_doubling", "--sizes", "1K,8K",
                     "--iters", "2", "--warmup", "1", "--pipelined", "2", "--compare", "gloo",
                     "--json", str(out))

    doc = json.loads(out.read_text())
    gloo = doc["compare"]["gloo"]
    assert [(r["library"], r["size"], r["iters"]) for r in gloo] == [
        ("gloo", 1024, 2), ("gloo", 8192, 2)]
    assert all(r["time_us"] > 0 and r["busbw_gbps"] > 0 and r["rss_peak_bytes"] > 0
               for r in gloo)
    ratios = doc["ratios"]["gloo"]
    assert [(r["strategy"], r["size"]) for r in ratios] == [
        (name, size) for name in ("ring", "recursive_doubling") for size in (1024, 8192)]
    for pair, mine in zip(ratios, doc["rows"], strict=True):
        theirs = gloo[0 if pair["size"] == 1024 else 1]
        assert pair["time_ratio"] == pytest.approx(mine["time_us"] / theirs["time_us"])
        assert pair["busbw_ratio"] == pytest.approx(mine["busbw_gbps"] / theirs["busbw_gbps"])

    # The table: Gloo's rows as a block of the main table, then p2pcoll next to Gloo with
    # the ratio per row.
    main_table, ratio_table = text.split("# p2pcoll vs gloo")
    ratio_table = ratio_table.split("\n", 1)[1]  # past the title line
    assert [(r[0], r[3]) for r in table_rows(main_table)][-2:] == [("1K", "gloo"), ("8K", "gloo")]
    header = [line for line in ratio_table.splitlines() if line.startswith("#")]
    assert "gloo time" in header[0] and "gloo busbw" in header[0] and "ratio" in header[0]
    rows = table_rows(ratio_table)
    assert len(rows) == len(ratios)
    for cells, pair in zip(rows, ratios, strict=True):
        assert cells[1] == pair["strategy"]
        assert float(cells[4].rstrip("x")) == pytest.approx(pair["time_ratio"], abs=0.006)
        assert float(cells[5]) == pytest.approx(pair["cpu_us"], abs=0.051)
        assert float(cells[9].rstrip("x")) == pytest.approx(pair["busbw_ratio"], abs=0.006)


@pytest.mark.slow  # matplotlib, and a real bench of every allreduce strategy
def test_plot_writes_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from matplotlib.image import imread

    path = tmp_path / "busbw.png"
    args = parse("-n", "2", "--strategy", "all", "--sizes", "1K,4K,16K", "--iters", "2",
                 "--warmup", "0", "--pipelined", "0", "--transport", "inproc",
                 "--plot", str(path))
    assert main(args) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size < 80_000  # small enough to commit
    image = imread(path)
    assert image.shape[0] >= 300 and image.shape[1] >= 600
    assert float(np.std(image)) > 0.05  # not a blank canvas
    assert len(table_rows(capsys.readouterr().out)) == 3 * len(available_strategies()["allreduce"])


@pytest.mark.parametrize(("option", "module", "says", "install"), [
    (("--compare", "gloo"), "torch", "--compare gloo needs torch", BENCH),
    (("--plot", "x.png"), "matplotlib", "--plot needs matplotlib", BENCH),
    (("--compare", "mpi"), "mpi4py", "--compare mpi needs mpi4py", "pip install 'p2pcoll[mpi]'"),
])
def test_missing_optional_dependency_is_a_clear_error(
    option: tuple[str, str], module: str, says: str, install: str,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # as if it were not installed
    assert main(parse(*option, "--sizes", "1K", "--transport", "inproc")) == 2
    err = capsys.readouterr().err
    assert says in err and install in err


def _state(pid: int) -> str | None:
    """A process's state letter (R running, S sleeping, Z zombie), None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


def _cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def _until(condition: Callable[[], bool], what: str, limit: float = 60.0) -> None:
    # A deadline against a hang, not a timed assertion: the machine may be slow.
    deadline = time.monotonic() + limit
    while not condition():
        assert time.monotonic() < deadline, f"still not {what} after {limit:g} s"
        time.sleep(0.01)


@pytest.mark.processes
def test_load_runs_cpu_bound_processes_and_stops_them() -> None:
    with cpu_load(2) as pids:
        assert len(set(pids)) == 2
        for pid in pids:
            _until(lambda pid=pid: _cpu_ticks(pid) > 5, f"busy: pid {pid}")  # type: ignore[misc]
    assert [_state(pid) for pid in pids] == [None, None]  # stopped and reaped
    with cpu_load(0) as none:
        assert none == []


@pytest.mark.processes
def test_load_goes_when_the_benchmark_is_killed() -> None:
    code = ("import os, sys\n"
            "from p2pcoll.bench.load import cpu_load\n"
            "with cpu_load(1) as pids:\n"
            "    print(pids[0], flush=True)\n"
            "    os._exit(0)  # no clean-up: as if killed\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=True)
    pid = int(done.stdout)
    _until(lambda: _state(pid) in (None, "Z"), f"gone: load pid {pid}")


def test_load_in_the_table_and_refused_by_calibrate(capsys: pytest.CaptureFixture[str]) -> None:
    args = parse("-n", "2", "--sizes", "1K", "--iters", "2", "--warmup", "0",
                 "--pipelined", "0", "--transport", "inproc", "--load", "1")
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "beside 1 CPU-bound process (--load)" in text.splitlines()[0]
    assert main(parse("--calibrate", "--load", "1")) == 2
    assert "--calibrate cannot be combined with --load" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse("--load", "-1")


def test_the_mpirun_beside_this_python_comes_before_path(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    # A system Open MPI first on PATH (another version than the wheel mpi4py was built
    # against) ran --compare mpi's peers 30-100x slower: the venv's own is taken first.
    from p2pcoll.bench.runner import mpirun
    venv, system = tmp_path / "venv-bin", tmp_path / "usr-bin"
    for folder in (venv, system):
        folder.mkdir()
        (folder / "mpirun").write_text("#!/bin/sh\n")
        (folder / "mpirun").chmod(0o755)
    monkeypatch.setenv("PATH", str(system))
    monkeypatch.setattr("sys.executable", str(venv / "python"))
    assert mpirun() == str(venv / "mpirun")
    (venv / "mpirun").unlink()
    assert mpirun() == str(system / "mpirun")
