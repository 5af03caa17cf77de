"""``p2pcoll launch``: real processes started, watched, prefixed, signalled and stopped."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import p2pcoll
from p2pcoll.launch import launch

pytestmark = pytest.mark.processes

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "examples" / "allreduce_demo.py"
RUN_TIMEOUT = 60  # seconds for one launch; far more than any of them needs


def run_launch(*args: str, timeout: float = RUN_TIMEOUT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "p2pcoll", "launch", *args],
        capture_output=True, text=True, timeout=timeout, cwd=ROOT,
    )


def by_rank(output: str) -> dict[int, list[str]]:
    """Output lines grouped by their ``[rank] `` prefix; fails on a line without one."""
    lines: dict[int, list[str]] = {}
    for line in output.splitlines():
        m = re.fullmatch(r"\[(\d+)\] (.*)", line)
        assert m is not None, f"line without a rank prefix: {line!r}"
        lines.setdefault(int(m.group(1)), []).append(m.group(2))
    return lines


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting to be reaped counts as dead)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_dead(pids: list[int], timeout: float = 5.0) -> list[int]:
    """The pids still alive after waiting up to ``timeout`` seconds for them to die."""
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def wait_for_files(paths: list[Path], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() and p.read_text().endswith("\n") for p in paths):
        assert time.monotonic() < deadline, f"children never wrote {paths}"
        time.sleep(0.02)


# --- the demo and real collectives across processes -----------------------------------------


def test_demo_on_three_processes() -> None:
    proc = run_launch("-n", "3", "--", sys.executable, str(DEMO))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = by_rank(proc.stdout)
    assert sorted(lines) == [0, 1, 2]
    for r in range(3):
        assert lines[r][0].startswith(f"rank {r} of 3 joined at tcp://")
    strategies = p2pcoll.available_strategies()
    checks = [line for line in lines[0] if line.endswith(": ok")]
    assert len(checks) == 2 * len(strategies["broadcast"]) + 4 * len(strategies["allreduce"])
    for name in strategies["allreduce"]:
        assert f"allreduce {name} sum float32[1000]: ok" in checks
        assert f"allreduce {name} avg pytree(4 arrays): ok" in checks
    for name in strategies["broadcast"]:
        assert f"broadcast {name} pytree(4 arrays): ok" in checks
    # The results, and the stats as one short line, not Group.stats()'s whole dict.
    assert any(line.startswith("sum of the ranks' arrays: [") for line in lines[0])
    assert any(re.fullmatch(r"stats: \d+ collectives, \d+ messages sent \(\d+ KiB\), 0 dropped",
                            line) for line in lines[0])
    assert max(len(line) for line in proc.stdout.splitlines()) <= 100
    assert lines[0][-1] == "every check passed on all 3 ranks"
    assert "MISMATCH" not in proc.stdout + proc.stderr


COLLECTIVES_SCRIPT = """
import asyncio, json
import numpy as np
import p2pcoll

async def main():
    async with p2pcoll.join(collective_timeout=30) as g:
        gathered = await g.allgather(np.arange(5, dtype=np.int64) + 10 * g.rank)
        x = np.linspace(0.0, 1.0, 1001) * (g.rank + 1)
        sums = {name: (await g.allreduce(x, strategy=name)).tolist()
                for name in p2pcoll.available_strategies()["allreduce"]}
        print(json.dumps({"rank": g.rank, "size": g.world_size,
                          "allgather": [a.tolist() for a in gathered], "allreduce": sums}))

asyncio.run(main())
"""


def test_allgather_and_allreduce_across_four_processes() -> None:
    proc = run_launch("-n", "4", "--", sys.executable, "-c", COLLECTIVES_SCRIPT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = {r: json.loads(lines[-1]) for r, lines in by_rank(proc.stdout).items()}
    assert sorted(results) == [0, 1, 2, 3]
    want_gather = [(np.arange(5) + 10 * r).tolist() for r in range(4)]
    want_sum = sum(np.linspace(0.0, 1.0, 1001) * (r + 1) for r in range(4))
    names = p2pcoll.available_strategies()["allreduce"]
    for r, res in results.items():
        assert (res["rank"], res["size"]) == (r, 4)
        assert res["allgather"] == want_gather
        assert sorted(res["allreduce"]) == names
        for name in names:
            np.testing.assert_allclose(res["allreduce"][name], want_sum, rtol=1e-12)
            assert res["allreduce"][name] == results[0]["allreduce"][name]  # same bits


# --- environment --------------------------------------------------------------------------


VARS = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
        "P2PCOLL_RENDEZVOUS", "PYTHONUNBUFFERED"]
PRINT_ENV = f"import json, os; print(json.dumps({{k: os.environ.get(k) for k in {VARS!r}}}))"


@pytest.mark.parametrize("given", [None, "tcp://127.0.0.1:29533"])
def test_environment_of_each_rank(given: str | None) -> None:
    args = ["-n", "3"] + (["--rendezvous", given] if given else [])
    proc = run_launch(*args, "--", sys.executable, "-c", PRINT_ENV)
    assert proc.returncode == 0, proc.stderr
    envs = {r: json.loads(lines[0]) for r, lines in by_rank(proc.stdout).items()}
    assert sorted(envs) == [0, 1, 2]
    port = envs[0]["MASTER_PORT"]
    assert port.isdigit() and 0 < int(port) < 65536
    if given:
        assert port == "29533"
    for r, env in envs.items():
        assert env == {
            "RANK": str(r), "WORLD_SIZE": "3", "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "3",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
            "P2PCOLL_RENDEZVOUS": f"tcp://127.0.0.1:{port}", "PYTHONUNBUFFERED": "1",
        }


def test_launch_function_in_process(capfd: pytest.CaptureFixture[str]) -> None:
    code = "import os; print(os.environ['GREETING'], os.environ['RANK'])"
    assert launch(2, [sys.executable, "-c", code], extra_env={"GREETING": "hi"}) == 0
    assert sorted(capfd.readouterr().out.splitlines()) == ["[0] hi 0", "[1] hi 1"]

    assert launch(1, [sys.executable, "-c", "raise SystemExit(5)"]) == 5
    assert "p2pcoll launch: rank 0 exited with code 5\n" in capfd.readouterr().err

    assert launch(2, [sys.executable, "-c", "print('plain')"], prefix_output=False) == 0
    assert capfd.readouterr().out.splitlines() == ["plain", "plain"]

    with pytest.raises(ValueError, match="RANK"):
        launch(2, ["true"], extra_env={"RANK": "1"})
    with pytest.raises(ValueError):
        launch(0, ["true"])
    with pytest.raises(p2pcoll.RendezvousError):
        launch(1, ["true"], rendezvous="http://127.0.0.1:1")
    assert launch(1, ["/nonexistent/program"]) == 127
    assert "cannot run '/nonexistent/program'" in capfd.readouterr().err


# --- failures and exit codes ----------------------------------------------------------------


FAIL_ONE = """
import os, pathlib, signal, sys, time
rank, tmp = int(os.environ["RANK"]), pathlib.Path(sys.argv[1])
if rank == 2:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # only SIGKILL stops this one
(tmp / f"pid{rank}").write_text(f"{os.getpid()}\\n")
if rank == 1:
    while not (tmp / "pid2").exists():
        time.sleep(0.01)
    sys.exit(3)
time.sleep(60)
"""


def test_failing_rank_stops_the_others_and_gives_its_exit_code(tmp_path: Path) -> None:
    start = time.monotonic()
    proc = run_launch("-n", "3", "--grace", "1", "--",
                      sys.executable, "-c", FAIL_ONE, str(tmp_path))
    elapsed = time.monotonic() - start
    assert proc.returncode == 3, proc.stderr
    assert elapsed < 15, f"the sleeping ranks were not stopped quickly ({elapsed:.1f}s)"
    assert "p2pcoll launch: rank 1 exited with code 3; stopping the other 2" in proc.stderr
    pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(3)]
    assert wait_dead(pids, timeout=0.5) == []  # rank 2 ignored SIGTERM: SIGKILL got it


def test_death_by_signal_gives_128_plus_signum() -> None:
    code = ("import os, signal; "
            "os.environ['RANK'] == '1' and os.kill(os.getpid(), signal.SIGKILL)")
    proc = run_launch("-n", "2", "--", sys.executable, "-c", code)
    assert proc.returncode == 128 + signal.SIGKILL
    assert "rank 1 was killed by SIGKILL (exit code 137)" in proc.stderr


# --- signals and orphans ---------------------------------------------------------------------


SLEEPER = """
import os, pathlib, subprocess, sys, time
tmp, rank = pathlib.Path(sys.argv[1]), os.environ["RANK"]
grandchild = subprocess.Popen(["sleep", "60"])
(tmp / f"pids{rank}").write_text(f"{os.getpid()} {grandchild.pid}\\n")
time.sleep(60)
"""


def start_sleepers(tmp_path: Path, n: int) -> tuple[subprocess.Popen[bytes], list[int]]:
    """A launcher running ``n`` ranks that each start a grandchild, and all their pids."""
    launcher = subprocess.Popen(
        [sys.executable, "-m", "p2pcoll", "launch", "-n", str(n), "--grace", "2", "--",
         sys.executable, "-c", SLEEPER, str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT,
    )
    files = [tmp_path / f"pids{r}" for r in range(n)]
    try:
        wait_for_files(files)
    except BaseException:
        launcher.kill()
        launcher.wait()
        raise
    pids = [int(p) for f in files for p in f.read_text().split()]
    assert all(alive(p) for p in pids)
    return launcher, pids


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_is_forwarded_and_nothing_is_left(tmp_path: Path, sig: signal.Signals) -> None:
    launcher, pids = start_sleepers(tmp_path, 2)
    start = time.monotonic()
    launcher.send_signal(sig)
    try:
        code = launcher.wait(timeout=15)
    finally:
        launcher.kill()
        _, err = launcher.communicate()
    assert code == 128 + sig
    assert time.monotonic() - start < 5  # the ranks obeyed the signal, no grace needed
    assert f"got {sig.name}; passing it on to every rank" in err.decode()
    assert wait_dead(pids, timeout=1) == []  # ranks and their grandchildren


def test_children_die_with_a_killed_launcher(tmp_path: Path) -> None:
    launcher, pids = start_sleepers(tmp_path, 2)
    launcher.kill()  # SIGKILL: the launcher cannot pass anything on
    launcher.communicate()
    ranks = pids[0::2]
    assert wait_dead(ranks) == []  # PR_SET_PDEATHSIG
    # What the ranks started is not the launcher's business any more: clean it up here.
    for grandchild in pids[1::2]:
        if alive(grandchild):
            os.kill(grandchild, signal.SIGKILL)


def test_a_bad_strategy_variable_is_one_line_per_rank() -> None:
    # The README's promise: a bad P2PCOLL_* setting under launch is one line, no traceback.
    proc = subprocess.run(
        [sys.executable, "-m", "p2pcoll", "launch", "-n", "2", "--", sys.executable, str(DEMO)],
        capture_output=True, text=True, timeout=RUN_TIMEOUT, cwd=ROOT,
        env={**os.environ, "P2PCOLL_ALLREDUCE": "rign"})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    said = [line for line in proc.stderr.splitlines() if not line.startswith("p2pcoll launch:")]
    assert said, proc.stderr
    for line in said:
        assert re.fullmatch(r"\[(\d)\] rank \1: SettingsError: \$P2PCOLL_ALLREDUCE='rign' is "
                            r"not allowed: no allreduce strategy named 'rign' \(did you mean "
                            r"'ring'\?\); available: .*", line), line
