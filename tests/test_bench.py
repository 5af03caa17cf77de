"""Smoke test of ``p2pcoll bench``: real peer processes, tiny sizes, a table and JSON out."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from p2pcoll import available_strategies
from p2pcoll.bench import bus_factor, configure_parser, data_bytes, main, parse_sizes

ROW_FIELDS = {
    "size", "count", "dtype", "strategy", "chosen", "time_us", "min_us", "p10_us", "p90_us",
    "algbw_gbps", "busbw_gbps", "pipelined_us",
}


def run_bench(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "p2pcoll.bench", *args],
        capture_output=True, text=True, timeout=90,
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


def test_allreduce_every_strategy_table_and_json(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    text = run_bench("-n", "2", "--strategy", "all", "--sizes", "1K,8K", "--iters", "3",
                     "--warmup", "1", "--pipelined", "2", "--json", str(out))

    header = " ".join(line for line in text.splitlines() if line.startswith("#"))
    for column in ("size", "count", "type", "strategy", "time", "p10-p90", "algbw", "busbw",
                   "pipelined"):
        assert column in header
    strategies = available_strategies()["allreduce"]
    rows = table_rows(text)
    assert [(r[0], r[3]) for r in rows] == [(s, name) for name in strategies
                                             for s in ("1K", "8K")]
    for r in rows:
        assert r[1] == str(int(r[0][:-1]) * 1024 // 4) and r[2] == "float32"
        time_us, min_us = float(r[4]), float(r[5])
        p10, p90 = (float(v) for v in r[6].split("-"))
        algbw, busbw, pipelined = float(r[7]), float(r[8]), float(r[9])
        assert 0 < min_us <= p10 <= time_us <= p90
        assert algbw >= 0 and busbw == algbw  # 2(p-1)/p = 1 at p = 2
        assert pipelined > 0

    doc = json.loads(out.read_text())
    assert doc["config"]["world_size"] == 2 and doc["config"]["strategies"] == strategies
    assert len(doc["rows"]) == len(rows)
    for row, cells in zip(doc["rows"], rows, strict=True):
        assert ROW_FIELDS <= row.keys()
        assert row["strategy"] == cells[3] and row["iters"] == 3
        assert row["time_us"] == pytest.approx(float(cells[4]), rel=1e-3, abs=0.051)
        assert row["algbw_gbps"] == pytest.approx(row["size"] / row["time_us"] / 1e3)
        assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"])


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
        capture_output=True, text=True, timeout=30,
    )
    assert done.returncode == 2
    assert "no allreduce strategy named 'nope'" in done.stderr and "ring" in done.stderr


def test_main_inproc_through_configure_parser(capsys: pytest.CaptureFixture[str]) -> None:
    # The way `p2pcoll bench` calls it; inproc peers are tasks in this process.
    parser = argparse.ArgumentParser()
    configure_parser(parser)
    args = parser.parse_args(["--collective", "reduce_scatter", "-n", "3", "--sizes", "96K",
                              "--iters", "3", "--warmup", "1", "--transport", "inproc"])
    assert main(args) == 0
    rows = table_rows(capsys.readouterr().out)
    assert len(rows) == 1 and rows[0][:3] == ["96K", str(96 * 1024 // 4), "float32"]
    assert rows[0][3].startswith("auto:")
