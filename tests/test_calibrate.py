"""``p2pcoll bench --calibrate``: a short real calibration through the command line (peer
processes over ipc and tcp), the file it writes (load_constants' format, plausible values,
other transports kept), a group that joins with it, the fit itself on known constants, the
inputs refused before any peer starts, and what a group does when its ranks were given
different cost-model files."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import p2pcoll
from p2pcoll.bench import calibrate, runner
from p2pcoll.cli import main
from p2pcoll.engine.costs import DEFAULT_CONSTANTS, Constants, CostModel, load_constants
from p2pcoll.registry import registry
from p2pcoll.rendezvous import RendezvousServer
from p2pcoll.testing import run_ranks

VARIABLE = "P2PCOLL_COST_MODEL"


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """One short calibration (3 iterations of 4K and 16M), run as a user runs it; the file
    and what the command printed."""
    path = tmp_path_factory.mktemp("calibrate") / "costs.json"
    env = {k: v for k, v in os.environ.items() if k not in (VARIABLE, "P2PCOLL_TRANSPORT")}
    done = subprocess.run(
        [sys.executable, "-m", "p2pcoll", "bench", "--calibrate", "--cost-model", str(path),
         "--iters", "3", "--warmup", "1", "--sizes", "4K,16M"],
        capture_output=True, text=True, timeout=120, env=env, check=False,
    )
    assert done.returncode == 0, f"calibration failed:\n{done.stdout}\n{done.stderr}"
    return path, done.stdout


@pytest.mark.processes
def test_the_calibration_writes_plausible_constants(calibrated: tuple[Path, str]) -> None:
    path, out = calibrated
    doc = json.loads(path.read_text())
    assert set(doc) == {"ipc", "tcp"}
    table = load_constants(path)
    for transport in ("ipc", "tcp"):
        c = table[transport]
        assert {"alpha", "beta", "gamma"} <= set(doc[transport])
        assert 1e-6 <= c.alpha <= 50e-3, c  # seconds per message
        assert 1e-12 <= c.beta <= 1e-7, c  # 1 TB/s .. 10 MB/s
        assert 1e-12 <= c.gamma <= 1e-7, c
        assert 0 <= c.overhead <= 50e-3, c
    assert table["ipc"].gamma == table["tcp"].gamma  # numpy's add, once
    assert "overhead" not in doc["tcp"]  # a tcp group's peers are on other hosts
    # What the user is told: the constants, the fit, every run, and the line to paste.
    for transport in ("ipc", "tcp"):
        assert f"{transport}: {table[transport].describe()}" in out
    assert out.count("fit: median error") == 2
    assert "recursive_doubling" in out and "     4K" in out and "    16M" in out
    assert out.rstrip().endswith(f"export {VARIABLE}={path}")


@pytest.mark.processes
async def test_a_group_uses_the_calibrated_file(calibrated: tuple[Path, str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    path, _ = calibrated
    monkeypatch.setenv(VARIABLE, str(path))

    async def costs(g: p2pcoll.Group) -> CostModel:
        return g._costs()

    for model in await run_ranks(2, costs, transport="ipc"):
        assert model.constants == load_constants(path)["ipc"]


async def test_auto_follows_the_constants_of_the_file(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A huge alpha makes auto take the strategy of fewest rounds (recursive doubling: lg p
    of them); free messages and dear bytes one that sends and reduces less."""
    x = np.ones(1024, np.float32)
    monkeypatch.setenv("P2PCOLL_SHM", "0")  # messages: the board would take this size

    async def run(g: p2pcoll.Group) -> tuple[str, dict[str, int]]:
        await g.allreduce(x)
        picked = registry.auto_name("allreduce", x.nbytes, g.world_size, g._costs())
        return picked, g.stats()["collectives_by_strategy"]["allreduce"]

    for constants, expected in (({"alpha": 1.0, "beta": 1e-12, "gamma": 1e-12},
                                 "recursive_doubling"),
                                ({"alpha": 1e-6, "beta": 1e-6, "gamma": 1e-6}, "rabenseifner")):
        path = tmp_path / f"{expected}.json"
        path.write_text(json.dumps({"ipc": {**constants, "overhead": 0}}))
        monkeypatch.setenv(VARIABLE, str(path))
        for picked, ran in await run_ranks(4, run, transport="ipc"):
            assert picked == expected and ran == {expected: 1}


def test_the_fit_finds_known_constants() -> None:
    """Times made from known constants give them back; times that no nonnegative
    overhead explains give overhead 0, not a negative one."""
    truth = Constants(alpha=300e-6, beta=0.5e-9, gamma=0.1e-9, overhead=200e-6,
                      repeat=DEFAULT_CONSTANTS["ipc"].repeat)  # a transport's, not fitted
    model = CostModel(replace(DEFAULT_CONSTANTS["ipc"], gamma=truth.gamma), cores=2)
    runs = [(2, "recursive_doubling", n) for n in (4096, 1 << 16, 1 << 20, 16 << 20)]
    runs += [(4, name, n) for name in ("recursive_doubling", "ring", "reduce_broadcast")
             for n in (4096, 1 << 16)]

    def samples(constants: Constants) -> list[calibrate.Sample]:
        exact = replace(model, constants=constants)
        return [calibrate.Sample(s, p, n, replace(exact, local=p).predict(s, n, p) or 0)
                for p, name, n in runs if (s := registry.get("allreduce", name))]

    result = calibrate.fit(samples(truth), model)
    assert result.fitted == ("alpha", "beta", "overhead")
    for field in ("alpha", "beta", "gamma", "overhead"):
        assert getattr(result.constants, field) == pytest.approx(getattr(truth, field))
    assert all(e == pytest.approx(1) for e in result.errors())
    # Two peers on two cores alone: no host term, so overhead is not fitted but kept.
    alone = calibrate.fit(samples(truth)[:4], model)
    assert alone.fitted == ("alpha", "beta")
    assert alone.constants.overhead == model.constants.overhead
    # Where the best unconstrained answer is negative, the constant is 0 and the others
    # the best given that: min (x - 1)^2 + (y + 1)^2 + (x + y)^2 over x, y >= 0.
    a, b = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]), np.array([1.0, -1.0, 0.0])
    assert np.linalg.lstsq(a, b, rcond=None)[0][1] < 0
    assert calibrate.nonnegative_least_squares(a, b) == pytest.approx([0.5, 0.0])


def test_a_new_calibration_keeps_what_it_did_not_measure(tmp_path: Path) -> None:
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"tcp": {"alpha": 1e-5, "beta": 1e-10},
                                "ipc": {"alpha": 1.0, "overhead": 7e-4}}))
    measured = Constants(alpha=4e-4, beta=3e-10, gamma=1e-10, overhead=0)
    fits = {"ipc": calibrate.Fit(measured, ("alpha", "beta"), (), ())}
    doc = calibrate.write(path, 1.234567e-10, fits, "--cost-model")
    assert doc == json.loads(path.read_text()) == {
        "tcp": {"alpha": 1e-5, "beta": 1e-10},
        "ipc": {"alpha": 4e-4, "beta": 3e-10, "gamma": 1.23e-10, "overhead": 7e-4},
    }
    assert [p.name for p in tmp_path.iterdir()] == ["costs.json"]  # no temporary left


# --- refused before any peer starts -------------------------------------------------------


@pytest.fixture
def no_peers(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any) -> Any:
        raise AssertionError("peers were started")

    monkeypatch.setattr(runner, "run", refuse)
    monkeypatch.delenv(VARIABLE, raising=False)
    monkeypatch.delenv("P2PCOLL_TRANSPORT", raising=False)


@pytest.mark.parametrize(("argv", "message"), [
    (["--strategy", "ring"], "--calibrate cannot be combined with --strategy"),
    (["--compare", "gloo"], "--calibrate cannot be combined with --compare"),
    (["-n", "4"], "--calibrate cannot be combined with -n/--world-size"),
    (["--json", "-"], "--calibrate cannot be combined with --json"),
    (["--transport", "inproc"], "--transport must be auto (ipc and tcp), ipc or tcp"),
    (["--cost-model", "{tmp}/missing/costs.json"], "the directory"),
    (["--cost-model", "{tmp}"], "is a directory, not a file"),
    (["--cost-model", "/proc/costs.json"], "cannot write to '/proc'"),
    (["--cost-model", "{tmp}/bad.json"], "--cost-model='{tmp}/bad.json': cannot read the cost"),
])
def test_bad_calibrations_are_usage_errors(
    argv: list[str], message: str, tmp_path: Path, no_peers: None,
    capsys: pytest.CaptureFixture[str],
) -> None:
    (tmp_path / "bad.json").write_text("not json")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert main(["bench", "--calibrate", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("p2pcoll bench: ") and message.replace("{tmp}", str(tmp_path)) in err
    assert (tmp_path / "bad.json").read_text() == "not json"  # never overwritten


def test_a_bad_cost_model_variable_is_a_usage_error(
    tmp_path: Path, no_peers: None, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    bad = tmp_path / "costs.json"
    bad.write_text('{"ipc": {"alpha": -1}}')
    monkeypatch.setenv(VARIABLE, str(bad))
    # --calibrate would write there: a file that is not a cost model is not replaced.
    assert main(["bench", "--calibrate"]) == 2
    assert f"${VARIABLE}='{bad}': ipc.alpha = -1 is not a number" in capsys.readouterr().err
    # A plain benchmark's peers would fail to join with it.
    assert main(["bench", "--sizes", "1K"]) == 2
    assert f"${VARIABLE}='{bad}'" in capsys.readouterr().err
    # --cost-model is only the file --calibrate writes.
    monkeypatch.delenv(VARIABLE)
    assert main(["bench", "--cost-model", str(bad)]) == 2
    assert "--cost-model names the file --calibrate writes" in capsys.readouterr().err


# --- ranks with different cost-model files --------------------------------------------------


async def test_ranks_with_different_cost_models_fail_with_a_mismatch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each rank reads its own ``$P2PCOLL_COST_MODEL``; when two files make auto pick
    different strategies, the first message of the collective carries the other
    strategy in its signature: every rank raises CollectiveMismatch naming both (no hang,
    no wrong result). Nothing checks the files at join: where they agree on the strategy
    for a size (here 8M), the collective works; the mismatch appears only at the sizes
    where the picks differ."""
    monkeypatch.setenv("P2PCOLL_SHM", "0")  # messages: the board would take 4K
    server = RendezvousServer("tcp://127.0.0.1:0")
    url = server.bind()
    joins = []
    for rank, constants in enumerate(({"alpha": 1.0, "beta": 1e-12, "gamma": 1e-12},
                                      {"alpha": 1e-9, "beta": 1e-9, "gamma": 1e-3})):
        path = tmp_path / f"rank{rank}.json"
        path.write_text(json.dumps({"ipc": {**constants, "overhead": 0}}))
        monkeypatch.setenv(VARIABLE, str(path))  # read by join(), once, as it is called
        joins.append(p2pcoll.join(url, world_size=2, rank=rank, transport="ipc", timeout=30,
                                  collective_timeout=10))

    async def run(join: Any) -> tuple[list[str], float, BaseException]:
        async with join as g:
            picks = [registry.auto_name("allreduce", n, 2, g._costs()) for n in (8 << 20, 4096)]
            agreed = await g.allreduce(np.ones(2 << 20, np.float32))  # 8M: both rabenseifner
            with pytest.raises(p2pcoll.CollectiveMismatch) as info:
                await g.allreduce(np.ones(1024, np.float32))  # 4K: they differ
            assert g.state == "broken"
            return picks, float(agreed[0]), info.value

    try:
        results = await asyncio.wait_for(asyncio.gather(*(run(j) for j in joins)), 30)
    finally:
        await server.aclose()
    assert [picks for picks, _, _ in results] == [["rabenseifner", "recursive_doubling"],
                                                  ["rabenseifner", "rabenseifner"]]
    for _, agreed, error in results:
        assert agreed == 2.0
        assert "strategy: rank" in str(error)
        assert "'recursive_doubling'" in str(error) and "'rabenseifner'" in str(error)
