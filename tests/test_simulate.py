"""``p2pcoll simulate``: units, the table, the crossovers, the plot, and clear errors."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from p2pcoll.bench.simulate import parse_rate, parse_size, parse_time
from p2pcoll.cli import main
from p2pcoll.engine.costs import Constants, CostModel
from p2pcoll.registry import registry


@pytest.mark.parametrize(("text", "value"), [
    ("4096", 4096), ("4K", 4096), ("4KB", 4096), ("4KiB", 4096), ("100MB", 100 << 20),
    ("100M", 100 << 20), ("1.5G", 3 << 29), (" 2 m ", 2 << 20), ("0", 0), ("1e3", 1000),
])
def test_sizes(text: str, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize(("text", "value"), [
    ("20us", 20e-6), ("20µs", 20e-6), ("0.5ms", 0.5e-3), ("2e-5s", 2e-5), ("100ns", 1e-7),
    ("1s", 1.0),
])
def test_times(text: str, value: float) -> None:
    assert parse_time(text) == pytest.approx(value)


@pytest.mark.parametrize(("text", "value"), [
    ("10Gbit", 1.25e9), ("10Gbit/s", 1.25e9), ("10Gbps", 1.25e9), ("10Gb/s", 1.25e9),
    ("1GB/s", 1e9), ("1.25GB/s", 1.25e9), ("800MiB/s", 800 * 2**20), ("100Mbit", 12.5e6),
    ("5GB", 5e9),
])
def test_rates(text: str, value: float) -> None:
    assert parse_rate(text) == pytest.approx(value)


@pytest.mark.parametrize(("parse", "text", "message"), [
    (parse_size, "1.5Q", "not a size"), (parse_size, "0.5", "whole number of bytes"),
    (parse_size, "-1K", "not a size"),
    (parse_time, "20", "a unit is required"), (parse_time, "20 parsecs", "not a time"),
    (parse_rate, "10GHz", "not a rate"), (parse_rate, "fast", "not a rate"),
    (parse_rate, "0Gbit", "above 0"),
])
def test_bad_values_say_what_is_expected(parse: object, text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse(text)  # type: ignore[operator]


def table(out: str) -> dict[str, float]:
    """{strategy: predicted seconds} from the table."""
    units = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
    rows = {}
    for m in re.finditer(r"^(\w+) +([\d.e+]+) (s|ms|us|ns) +[\d.]+x", out, re.MULTILINE):
        rows[m.group(1)] = float(m.group(2)) * units[m.group(3)]
    return rows


def test_the_issue_example(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    png = tmp_path / "out.png"
    argv = ["simulate", "--collective", "allreduce", "--world-size", "1024", "--size", "100MB",
            "--latency", "20us", "--bandwidth", "10Gbit", "--plot", str(png)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "allreduce, 1024 ranks, 100M (104857600 B)" in out
    assert "alpha 20 us/message, beta 0.8 ns/B (1.25 GB/s)" in out
    times = table(out)
    assert {"ring", "recursive_doubling", "rabenseifner", "reduce_broadcast"} <= set(times)
    best = re.search(r"^best: (\w+)", out, re.MULTILINE)
    assert best is not None and times[best.group(1)] == min(times.values())
    assert best.group(1) == "rabenseifner"  # bandwidth-optimal in 2 lg p rounds
    # Latency-bound small sizes go to recursive doubling, then Rabenseifner takes over.
    cross = re.search(r"^crossovers over 1K\.\.1G: (.*)$", out, re.MULTILINE)
    assert cross is not None and cross.group(1).startswith("recursive_doubling 1K..")
    assert "; rabenseifner " in cross.group(1)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_crossover_is_where_the_best_changes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "-n", "2", "--latency", "100us", "--bandwidth", "1GB/s",
                 "--gamma", "1GB/s"]) == 0
    out = capsys.readouterr().out
    m = re.search(r"recursive_doubling 1K\.\.([\d.]+)(K|M); rabenseifner", out)
    assert m is not None
    # p = 2: recursive doubling alpha + n(beta + gamma), Rabenseifner 2 alpha + n beta +
    # n/2 gamma: equal where n gamma / 2 = alpha, n = 2 * 100us * 1 GB/s = 200 KB.
    edge = float(m.group(1)) * {"K": 1 << 10, "M": 1 << 20}[m.group(2)]
    assert edge == pytest.approx(200e3, rel=0.01)
    model = CostModel(Constants(100e-6, 1e-9, 1e-9))
    assert registry.auto_name("allreduce", 199_000, 2, model) == "recursive_doubling"
    assert registry.auto_name("allreduce", 201_000, 2, model) == "rabenseifner"


def test_other_collectives_and_the_transports_constants(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["simulate", "--collective", "broadcast", "-n", "16", "--size", "64M",
                 "--transport", "tcp"]) == 0
    out = capsys.readouterr().out
    assert {"binomial", "pipeline", "root", "scatter_allgather"} <= set(table(out))
    assert "(tcp constants where not given)" in out


def test_simulated_ranks_share_no_memory(capsys: pytest.CaptureFixture[str]) -> None:
    """A host each: the root's p-1 sends of one piece are priced in full even with ipc's
    constants (whose repeat is 0: the rings of one host)."""
    assert main(["simulate", "--collective", "broadcast", "-n", "8", "--size", "4M",
                 "--latency", "100us", "--bandwidth", "1GB/s"]) == 0
    root = table(capsys.readouterr().out)["root"]
    assert root == pytest.approx(7 * (100e-6 + (4 << 20) / 1e9), rel=1e-3)


def test_a_cost_model_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "costs.json"
    path.write_text('{"ipc": {"alpha": 1e-3}}')
    assert main(["simulate", "--cost-model", str(path)]) == 0
    assert "alpha 1 ms/message" in capsys.readouterr().out
    path.write_text('{"ipc": {"alpha": "fast"}}')
    assert main(["simulate", "--cost-model", str(path)]) == 2
    assert "ipc.alpha = 'fast' is not a number" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "message"), [
    (["--size", "lots"], "'lots' is not a size"),
    (["--latency", "20"], "a unit is required"),
    (["--bandwidth", "10Gflops"], "not a rate"),
    (["--world-size", "0"], "at least 1"),
    (["--sweep", "1G..1K"], "TO must be larger"),
    (["--sweep", "1K"], "expected FROM..TO"),
])
def test_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("p2pcoll simulate: ") and message in err


def test_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: p2pcoll simulate ") and "--bandwidth" in out
